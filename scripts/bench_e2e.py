#!/usr/bin/env python
"""End-to-end decode speed in plain `generate()`: HF dense paths vs Quest, same model, same inputs, same run.

Random-weight models built from configs (speed does not depend on the values): Llama-2-7B shape (MHA),
Llama-3-8B shape (GQA, 8 KV heads), and a tiny one for a CPU smoke run (`--shapes tiny`). For each
prompt length and batch: prefill time, per-token decode latency and tokens/s over `--new-tokens`
(a streamer's timestamps in one generate call after a warm-up one), and peak memory, for
  dense       HF DynamicCache + SDPA (generate's default)
  static      HF static cache + generate's automatic compile (CUDA graphs)
  static_defer  the same with transformers' DeferredStopCheck forced on CUDA (it runs only on mps): what a
              one-step-late stop check alone gives HF's dense path
  quest       patch_model(budget, cuda_graph=False): the fixed-shape step uncaptured, with the defaults: on CUDA
              the whole one-token forward compiles as one torch.compile graph (compile_step="auto"; the warm-up
              call pays the compile; compile_capacity "auto": exact on CUDA; compile_wrapper "auto": inductor's C++
              wrapper on CUDA), on CPU it runs eagerly
  quest_exact / quest_bucket  the same with compile_capacity="exact" (the cache allocates exactly, the compiled graph
              holds a symbolic capacity) / "bucket" (static shapes, the capacity rounded up to a compile bucket)
  quest_pywrap  the same with compile_wrapper="python": inductor's Python wrapper launches the step's kernels
  quest_uncompiled  the same with compile_step=False: the step run eagerly (Triton kernels; norms, MLPs and rotary
              through torch.compile, each called eagerly)
  quest_eager patch_model(budget, cuda_graph=False, compile_step=False, compile_decode=False): nothing compiled
  quest_step  patch_model(budget, cuda_graph=False, compile_step=True): the compiled step on every device (CPU too)
  quest_graph patch_model(budget, compile_decode=False): the decode step replayed as a CUDA graph, eager norms/MLPs
  quest_graph_c  patch_model(budget): the defaults (captured, norms and MLPs through torch.compile)
  quest_graph_c_sync  the same with defer_stop_check=False (transformers' per-token stop check)
With `--beams N` every method runs beam search (HF's streamer cannot follow beams: per-token times then come
from whole calls, (t(new tokens) - t(1 token)) / (new tokens - 1)).
Every quest method runs with QuestConfig's defaults otherwise: on CUDA the stop check is deferred.
A quest method may name another policy, page size and bounds: `quest_graph_c:qcode1_2s/32`, `quest_graph_c:quest/16/int8`;
a 4th field `fused` adds fuse_projections=True (`quest_graph_c:quest/16/key_dtype/fused`), `sep` sets fused_step=False
(the separate score / Top-K / attention kernels), `step` fused_step=True (the three-launch step wherever it can
run), `unfused` sets fuse_projections=False (the default "auto" fuses where the decode GEMV is bound), `cublas`
sets decode_gemv=False (cuBLAS's GEMVs), `nores` sets fuse_residual=False (HF's decoder-layer forward: its residual
adds as kernels of their own), joined by '+' (`.../fused+cublas`); the row's same_as_unfused compares its tokens
with the same method's run without that field, when that ran first.
`--calibrated FILE` adds one captured row (the defaults otherwise) per config of a `scripts/calibrate.py` result:
per-layer budgets and dense layers as calibrated, named `calibrated:<file stem>=<budget>`.
The greedy tokens of the captured paths are compared with those of quest (same budget, same policy): `same_as_quest`.
On CUDA each row also gives its byte floor: the least bytes its decode step reads (`quest_hf.bench.decode_floor_bytes`:
the weights once, plus the K/V the path attends: all of it for HF, dense layers + page metadata + `budget` tokens per
KV head for Quest) at the copy bandwidth measured at the start of the run (`copy_gb_s`), and the step's fraction of it.
Where `nvidia-smi` answers, each row also keeps the GPU's SM / memory clocks, power draw and limit, temperature and
active clock-limiting reasons just before and just after its `generate()` (`gpu_before` / `gpu_after`,
`quest_hf.bench.gpu_state`; listed under the table), so that a row that differs between two machines shows whether
their clocks did.

    python scripts/bench_e2e.py --shapes llama2-7b --lengths 8192 32768 --budgets 2048
    python scripts/bench_e2e.py --shapes tiny --lengths 512 --new-tokens 8 --device cpu   # smoke
    python scripts/bench_e2e.py --shapes llama2-7b --lengths 16384 --beams 3 --methods dense static quest_graph_c
    python scripts/bench_e2e.py --shapes mistral-7b --lengths 32768 --methods dense static quest_graph_c
    python scripts/bench_e2e.py --shapes llama2-7b --lengths 32768 --budgets 2048 \
        --methods static quest_graph_c quest:qcode1_2s/32 quest_graph_c:qcode1_2s/32
    python scripts/bench_e2e.py --shapes smollm2 --lengths 8192 --budgets 256 512 1024 --methods static \
        quest_graph_c --calibrated benchmarks/accuracy/calibrate_error_kd_smollm2.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from quest_hf import patch_model, unpatch_model
from quest_hf.bench import MODEL_SHAPES as SHAPES
from quest_hf.bench import (
    Clock,
    copy_bandwidth,
    decode_floor_bytes,
    environment,
    gpu_state,
    gpu_state_line,
    results_dir,
    set_gemv_launch,
    set_topk_launch,
    time_calls,
)
from quest_hf.bench import random_llama as build

METHODS = ("dense", "static", "static_defer", "quest", "quest_exact", "quest_bucket", "quest_pywrap", "quest_uncompiled",
           "quest_eager", "quest_step", "quest_graph", "quest_graph_c", "quest_graph_c_sync")


WARMUP: dict = {}  # the last measure()'s warm-up call, s


def measure(model, ids, new_tokens, device, deferred: bool, **kw):
    """(prefill s, median and mean per-token decode s, first 4 intervals s, peak bytes, new tokens): one warm-up call (compiles the
    static path), then one timed call of the same shapes; per-token times come from the streamer's timestamps.
    With a deferred stop check the first token reaches the streamer one step late: one step is taken off."""
    run = lambda clock: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,  # noqa
                                       min_new_tokens=new_tokens, do_sample=False, streamer=clock, **kw)
    t0 = time.perf_counter()
    run(Clock(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    WARMUP["s"] = time.perf_counter() - t0  # the warm-up call: what a first generate() costs (compiles included)
    clock = Clock(device)
    out = run(clock)
    intervals = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
    steps = sorted(intervals)
    median, mean = steps[len(steps) // 2], sum(steps) / len(steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    prefill = clock.t[1] - clock.t[0] - (median if deferred else 0.0)
    # The first intervals show per-call costs (a captured path's eager first step and its capture).
    return prefill, median, mean, intervals[:4], peak, out[:, ids.shape[1]:]


@contextlib.contextmanager
def hf_deferred_stop(enabled: bool):
    """Force transformers' DeferredStopCheck on CUDA for any cache (transformers' own condition otherwise)."""
    from transformers.generation.utils import DeferredStopCheck

    original = DeferredStopCheck.__dict__["is_supported"]
    if enabled:
        DeferredStopCheck.is_supported = staticmethod(
            lambda device, cache, cache_is_returned, is_assistant=False: device.type == "cuda" and not is_assistant
            and (cache is None or cache.is_croppable or not cache_is_returned))
    try:
        yield
    finally:
        DeferredStopCheck.is_supported = original


def measure_whole(model, ids, new_tokens, device, **kw):
    """Like `measure`, from whole generate() calls (beam search: no streamer): per-token time is
    (t(new_tokens) - t(1)) / (new_tokens - 1), each the median of 3 calls after a warm-up."""
    def call(n):
        t = []
        for _ in range(4):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t.append(time.perf_counter() - t0)
        return sorted(t[1:])[1], out

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    one, _ = call(1)
    full, out = call(new_tokens)
    step = (full - one) / (new_tokens - 1)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return one, step, step, [], peak, out[:, ids.shape[1]:]


def replay_ms(model, ids, new_tokens, device) -> float:
    """GPU time of one captured Quest decode step (graph replay alone, quest_hf.bench's timer, median of 20):
    the floor of quest_graph's per-token latency once generate's own host work is taken out."""
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False)
    state = model._quest_state
    cache, graph = state.kept, state.graph.graph
    if cache is None or graph is None:
        return float("nan")

    def reset():
        for layer in cache.layers:
            layer.pos.fill_(ids.shape[1])  # rewrite the same slot each time: the cache never fills up

    with torch.cuda.device(device):
        return time_calls(graph.replay, before=reset, warmup=1, iters=20) * 1e-3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama2-7b", "llama3-8b"], choices=list(SHAPES))
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--methods", nargs="+", default=["dense", "static", "quest", "quest_graph", "quest_graph_c"],
                   help=f"{', '.join(METHODS)}; a quest method may name a policy and page "
                        "size: quest_graph_c:qcode1_2s/32 (default policy quest, page 16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--beams", type=int, default=1, help="num_beams of every generate() call (1: greedy)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calibrated", nargs="+", default=[], metavar="JSON",
                   help="calibration results (scripts/calibrate.py): one captured row per config in each")
    p.add_argument("--calibrated-budgets", type=int, nargs="+", default=None, help="only these of their configs")
    p.add_argument("--out", default=None, help="JSON path; a .md beside it (default results/bench_e2e/e2e.json)")
    p.add_argument("--topk-launch", nargs="*", default=[], metavar="NAME=VALUE",
                   help="TopKLaunch fields in force for every Quest row (e.g. tail_tile=64; default: the library's)")
    p.add_argument("--gemv-launch", nargs="*", default=[], metavar="NAME=VALUE",
                   help="GemvLaunch fields of the decode GEMV for every Quest row (e.g. pdl=False; default: the library's)")
    args = p.parse_args(argv)
    if args.topk_launch:
        print(f"Top-K launch: {set_topk_launch(args.topk_launch)}", flush=True)
    if args.gemv_launch:
        print(f"GEMV launch: {set_gemv_launch(args.gemv_launch)}", flush=True)
    args.out = args.out or str(results_dir("bench_e2e") / "e2e.json")
    for m in args.methods:
        base, _, policy = m.partition(":")
        if base not in METHODS:
            p.error(f"unknown method {m!r}")
        if policy and not base.startswith("quest"):
            p.error(f"{m!r}: only quest methods take a policy")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # The byte floor of each row: its decode step's least bytes (decode_floor_bytes) at this run's copy bandwidth.
    args.bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    rows = []
    for shape in args.shapes:
        torch.manual_seed(0)  # the same random weights in every run: tokens_sha1 compares runs of separate processes
        model = build(shape, dtype, device, max(args.lengths) + args.new_tokens)
        for L in args.lengths:
            for B in args.batches:
                ids = torch.randint(1, model.config.vocab_size, (B, L), device=device,
                                    generator=torch.Generator(device).manual_seed(L))
                # In the order given: a slow method (static's compile at 64K) can go last and be cut short.
                runs = [(m, b, None) for m in args.methods for b in (args.budgets if m.startswith("quest") else [None])]
                runs += calibrated_runs(args.calibrated, args.calibrated_budgets)
                tokens = {}
                for full, budget, config in runs:
                    method, _, policy = full.partition(":")
                    policy, _, page = policy.partition("/")
                    page, _, bounds = page.partition("/")
                    bounds, _, extra = bounds.partition("/")
                    flags = set(extra.split("+")) - {""}
                    if config is None and not flags <= {"fused", "unfused", "sep", "step", "cublas", "nores"}:
                        raise SystemExit(f"{full!r}: the method's 4th field joins by '+' 'fused' / 'unfused' "
                                         "(fuse_projections True / False), 'sep' / 'step' (fused_step False / True), 'cublas' "
                                         "(decode_gemv=False) and 'nores' (fuse_residual=False)")
                    if config is not None:
                        method = "quest_graph_c"
                    kw = dict(num_beams=args.beams) if args.beams > 1 else {}
                    if method in ("static", "static_defer"):
                        kw.update(cache_implementation="static")
                    elif method == "dense":
                        kw.update(disable_compile=True)
                    graph = method.startswith("quest_graph")
                    if config is not None:
                        patch_model(model, config=config)
                    elif method.startswith("quest"):
                        patch_model(model, budget=budget, cuda_graph="auto" if graph else False,
                                    compile_decode=method not in ("quest_graph", "quest_eager"),
                                    compile_step={"quest_step": True, "quest_uncompiled": False,
                                                  "quest_eager": False}.get(method, "auto"),
                                    defer_stop_check=method != "quest_graph_c_sync",
                                    compile_capacity={"quest_exact": "exact", "quest_bucket": "bucket"}.get(method, "auto"),
                                    compile_wrapper="python" if method == "quest_pywrap" else "auto",
                                    policy=policy or "quest", page_size=int(page or 16), bounds=bounds or "key_dtype",
                                    fuse_projections=True if "fused" in flags else (
                                        False if "unfused" in flags else "auto"),
                                    fused_step=False if "sep" in flags else (True if "step" in flags else "auto"),
                                    decode_gemv=False if "cublas" in flags else "auto",
                                    fuse_residual="nores" not in flags)
                    deferred = device.type == "cuda" and (
                        method == "static_defer" or (method.startswith("quest") and method != "quest_graph_c_sync"))
                    before = gpu_state(device)
                    try:
                        with hf_deferred_stop(method == "static_defer"):
                            how = measure if args.beams == 1 else measure_whole
                            prefill, step, mean, first, peak, out = how(model, ids, args.new_tokens, device,
                                                                        **({} if args.beams > 1 else dict(deferred=deferred)), **kw)
                        err = None
                    except Exception as e:  # a method that fails is reported, not hidden
                        prefill = step = mean = peak = float("nan")
                        first = []
                        out, err = None, f"{type(e).__name__}: {e}"[:300]
                    after = gpu_state(device)  # right after the timed steps: the clocks they ran at, or close
                    tokens[(full, budget)] = out
                    same = None
                    replay = replay_ms(model, ids, args.new_tokens, device) if (
                        graph and err is None and device.type == "cuda") else None
                    growing = "quest" + full[len(method):]  # the same policy, uncaptured (cuda_graph=False)
                    first_diff = None
                    if graph and config is None and out is not None and tokens.get((growing, budget)) is not None:
                        ref = tokens[(growing, budget)]
                        same = bool(torch.equal(out, ref))
                        if not same and out.shape == ref.shape:  # the first new token that differs
                            first_diff = int((out != ref).any(0).nonzero()[0])
                    same_unfused = first_diff_unfused = None
                    if config is None and extra and out is not None:  # against the method without it
                        plain = full[:-len("/" + extra)]
                        plain = plain.removesuffix("/key_dtype").removesuffix(":quest/16")
                        for name in (plain, full[:-len("/" + extra)]):
                            ref = tokens.get((name, budget))
                            if ref is not None:
                                same_unfused = bool(torch.equal(out, ref))
                                if not same_unfused and out.shape == ref.shape:  # the first new token that differs
                                    first_diff_unfused = int((out != ref).any(0).nonzero()[0])
                                break
                    if method.startswith("quest") and out is not None:
                        # no local name for the kept cache: it would stay alive into the next row's peak memory
                        decode_path = model._quest_state.decode_path
                        step_kernels = model._quest_state.step_kernels  # fused_step: which kernels ran, and why
                    else:
                        decode_path = step_kernels = None
                    warmup_s = WARMUP.pop("s", None)
                    row = dict(shape=shape, length=L, batch=B, beams=args.beams, method=full, budget=budget,
                               config=None if config is None else config_summary(config),
                               decode_path=decode_path, step_kernels=step_kernels, prefill_s=prefill, warmup_s=warmup_s,
                               step_ms=step * 1e3, step_mean_ms=mean * 1e3, stop_check_deferred=deferred,
                               first_steps_ms=[round(t * 1e3, 2) for t in first],
                               tokens_per_s=B / step if step == step else float("nan"),
                               peak_gib=peak / 2**30, same_as_quest=same, first_diff=first_diff,
                               same_as_unfused=same_unfused, first_diff_unfused=first_diff_unfused,
                               graph_replay_ms=replay, error=err, gpu_before=before, gpu_after=after,
                               # the greedy tokens' digest: compares runs of separate processes
                               tokens_sha1=None if out is None else hashlib.sha1(out.cpu().numpy().tobytes()).hexdigest())
                    if method in ("quest_graph_c", "quest_graph_c_sync"):  # proof that the compiled modules ran, and how often dynamo compiled
                        from torch._dynamo.utils import counters
                        row["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
                        compiled = model._quest_state.compiled
                        row["compiled_calls"] = sum(m._quest_compiled_calls for m in compiled.modules)
                        row["compiled_rotary_calls"] = compiled.rotary_calls
                        row["compile_failed"] = sorted(compiled.failed)
                    step_state = getattr(getattr(model, "_quest_state", None), "compiled_step", None)
                    if method.startswith("quest") and not graph and step_state is not None:
                        # the compiled uncaptured step: how many steps it ran (traced) and how often dynamo compiled
                        from torch._dynamo.utils import counters
                        row.update(step_calls=step_state.calls, step_traced_calls=step_state.traced_calls,
                                   step_failed=step_state.failed, step_wrapper=step_state.wrapper,
                                   dynamo_unique_graphs=counters["stats"]["unique_graphs"])
                    quest_cfg = config if config is not None else (
                        model._quest_state.config if method.startswith("quest") else None)
                    row["floor_bytes"] = decode_floor_bytes(model, L, B * args.beams, quest_cfg)
                    row["floor_ms"] = row["floor_bytes"] / args.bandwidth * 1e3 if args.bandwidth else None
                    rows.append(row)
                    if method.startswith("quest"):
                        unpatch_model(model)
                    print(json.dumps(row), flush=True)
                    write(args, rows)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(write(args, rows))


def calibrated_runs(paths, budgets):
    """(name, budget, QuestConfig) per config of each calibration result file (`scripts/calibrate.py --out`)."""
    from quest_hf import QuestConfig

    runs = []
    for path in paths:
        with open(path) as f:
            configs = json.load(f)["configs"]
        for b, entry in configs.items():
            if budgets is None or int(b) in budgets:
                runs.append((f"calibrated:{Path(path).stem}={b}", int(b), QuestConfig(**entry["config"])))
    return runs


def config_summary(config) -> dict:
    """What a calibrated row ran: per-layer budgets, dense layers, bounds, policy."""
    return dict(policy=config.policy, page_size=config.page_size, bounds=config.bounds, dense=config.dense,
                dense_layers=config.dense_layers, layer_budgets=config.layer_budgets)


def write(args, rows) -> str:
    """Table + JSON of the rows so far (written after every row: a run cut short keeps what it measured)."""
    device = torch.device(args.device)
    best_dense = {}
    for r in rows:
        if r["method"] in ("dense", "static") and r["step_ms"] == r["step_ms"]:  # HF as shipped
            k = (r["shape"], r["length"], r["batch"])
            best_dense[k] = min(best_dense.get(k, float("inf")), r["step_ms"])
    lines = ["| shape | L | B | method | budget | prefill s | ms/token | mean ms | tok/s | x fastest dense HF | peak GiB | tokens = quest | GPU ms/step (replay) | byte floor ms | of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = best_dense.get((r["shape"], r["length"], r["batch"]))
        ratio = ref / r["step_ms"] if ref and r["step_ms"] == r["step_ms"] else float("nan")
        lines.append(f"| {r['shape']} | {r['length']} | {r['batch']} | {r['method']} | {r['budget'] or '-'} | "
                     f"{r['prefill_s']:.3f} | {r['step_ms']:.2f} | {r.get('step_mean_ms', float('nan')):.2f} | "
                     f"{r['tokens_per_s']:.1f} | {ratio:.2f} | "
                     f"{r['peak_gib']:.1f} | {'' if r['same_as_quest'] is None else r['same_as_quest']} | "
                     f"{'' if r['graph_replay_ms'] is None else format(r['graph_replay_ms'], '.2f')} | "
                     + (f"{r['floor_ms']:.2f} | {r['floor_ms'] / r['step_ms']:.0%} |" if r.get("floor_ms") else " | |")
                     + (f" {r['error']}" if r["error"] else "")
                     + ("" if r.get("same_as_unfused") is None else f" tokens = unfused: {r['same_as_unfused']}"))
    states = [f"- {r['method']}{'' if r['budget'] is None else ' ' + str(r['budget'])}: before "
              f"{gpu_state_line(r.get('gpu_before')) or '-'}; after {gpu_state_line(r.get('gpu_after')) or '-'}"
              for r in rows if r.get("gpu_before") or r.get("gpu_after")]
    if states:  # nvidia-smi's clocks and power around each row: machines that differ show it here
        lines += ["", "GPU state around each row (nvidia-smi):", *states]
    kernels = [f"- {r['method']}{'' if r['budget'] is None else ' ' + str(r['budget'])}: {r['step_kernels']}"
               for r in rows if r.get("step_kernels")]
    if kernels:  # QuestConfig.fused_step: the three-launch step or the separate kernels, and why
        lines += ["", "Sparse layers' decode kernels (step_kernels):", *kernels]
    md = "\n".join(lines)
    meta = dict(date=datetime.date.today().isoformat(), command="python scripts/bench_e2e.py " + " ".join(sys.argv[1:]),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                machine=environment(device)["machine"],  # the host CPU too: HF's host-synced steps depend on it
                torch=torch.__version__, transformers=transformers.__version__, dtype=args.dtype,
                new_tokens=args.new_tokens, topk_launch=" ".join(args.topk_launch) or "default",
                gemv_launch=" ".join(args.gemv_launch) or "default",
                copy_gb_s=None if args.bandwidth is None else round(args.bandwidth / 1e9, 1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    out.with_suffix(".md").write_text("# End-to-end decode\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items())
                                      + "\n\n" + md + "\n")
    return md


if __name__ == "__main__":
    main()
