"""benchmarks/probes/profile_generate.py's split of a decode step, on a hand-made trace whose answer is known."""
import importlib.util
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "profile_generate.py"


def _probe():
    spec = importlib.util.spec_from_file_location("profile_generate", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(late_every: int):
    # 6 steps 110 us apart: a replay of two kernels (50 + 40 us, graph launch `100 + s`), then one argmax launched
    # outside the graph (3 us at +95); the host launches replay s at t - 50 (ahead of the previous replay's end at
    # t - 20) or, for s a multiple of `late_every`, at t - 15 (after it: late).
    ev, t = [], 0
    for s in range(6):
        late = s % late_every == 0
        ev.append(dict(cat="cuda_runtime", name="cudaGraphLaunch", ts=t - 15 if late else t - 50, dur=1,
                       args=dict(correlation=100 + s)))
        ev += [dict(cat="kernel", name="gemm", ts=t, dur=50, args=dict(correlation=100 + s)),
               dict(cat="kernel", name="attn", ts=t + 50, dur=40, args=dict(correlation=100 + s)),
               dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=t + 60, dur=1, args=dict(correlation=200 + s)),
               dict(cat="kernel", name="argmax", ts=t + 95, dur=3, args=dict(correlation=200 + s))]
        t += 110
    return dict(traceEvents=ev)


def test_a_step_splits_into_its_replay_the_work_outside_it_and_idle():
    res = _probe().split_steps(_trace(late_every=2))
    m = res["median"]
    assert (m["graph_us"], m["kernels_us"], m["outside_us"], m["idle_us"], m["step_us"]) == (90, 90, 3, 17, 110)
    assert m["n_outside"] == 1 and res["outside_by_name"] == {"argmax": 3.0}
    # the steps from replay 2 on are kept (replays 3, 4, 5 as the next ones): of those only replay 4 comes late
    assert res["steps"] == 3 and res["late_steps"] == 1
    assert _probe().split_steps(_trace(late_every=7))["late_steps"] == 0
