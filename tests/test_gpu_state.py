"""`quest_hf.bench.gpu_state`: the clocks / power record that bench_e2e keeps beside each row (CPU: a fake nvidia-smi)."""
import os
import stat
import subprocess
import sys
import types

import pytest
import torch

from quest_hf import bench

FAKE = """#!/bin/sh
# Answers like nvidia-smi for one GPU; the newer clock-reasons field name is unknown to it (an older driver).
case "$*" in
  *clocks_event_reasons*) echo 'Field "clocks_event_reasons.active" is not a valid field to query.'; exit 2 ;;
  *clocks_throttle_reasons*) echo "0x0000000000000004" ;;
  *) echo "1755 MHz, 1980 MHz, 3201 MHz, 412.30 W, 700.00 W, 51" ;;
esac
echo "$*" >> "$(dirname "$0")/calls.txt"
"""


def _fake_cuda(monkeypatch, tmp_path, script):
    path = tmp_path / "nvidia-smi"
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="1234abcd-0000-1111-2222-333344445555"))


def test_no_state_off_cuda():
    assert bench.gpu_state("cpu") is None
    assert bench.gpu_state_line(None) == ""


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_state_parsed_and_the_older_reasons_field_taken(monkeypatch, tmp_path):
    _fake_cuda(monkeypatch, tmp_path, FAKE)
    state = bench.gpu_state("cuda:0")
    assert state == {"clocks.sm": "1755 MHz", "clocks.max.sm": "1980 MHz", "clocks.mem": "3201 MHz",
                     "power.draw": "412.30 W", "power.limit": "700.00 W", "temperature.gpu": "51",
                     "clocks_reasons": "0x0000000000000004"}
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    # the device is named by its UUID (as nvidia-smi numbers GPUs, which CUDA_VISIBLE_DEVICES may not)
    assert all(c.startswith("-i GPU-1234abcd-0000-1111-2222-333344445555 ") for c in calls)
    line = bench.gpu_state_line(state)
    assert line == "SM 1755 MHz/1980 MHz, mem 3201 MHz, 412.30 W of 700.00 W, 51 C, reasons 0x0000000000000004"


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_failing_query_is_reported_not_raised(monkeypatch, tmp_path):
    _fake_cuda(monkeypatch, tmp_path, "#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    state = bench.gpu_state("cuda")
    assert set(state) == {"error"} and "No devices were found" in state["error"]
    assert bench.gpu_state_line(state).startswith("nvidia-smi: RuntimeError: No devices were found")


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_short_answer_is_an_error(monkeypatch, tmp_path):
    # fewer values than fields asked for (a driver that drops one) must not shift the others into wrong names
    _fake_cuda(monkeypatch, tmp_path, "#!/bin/sh\necho '1755 MHz, 1980 MHz'\n")
    assert "error" in bench.gpu_state("cuda")


def test_bench_e2e_writes_the_states(tmp_path):
    # a CPU run of the script: no nvidia-smi state on CPU, so no section; then the writer with states given
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, "scripts/bench_e2e.py", "--shapes", "tiny", "--lengths", "64", "--budgets", "32",
                    "--methods", "dense", "--new-tokens", "3", "--dtype", "float32", "--device", "cpu",
                    "--out", str(out)], check=True, capture_output=True, text=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    md = out.with_suffix(".md").read_text()
    assert "| tiny | 64 | 1 | dense |" in md and "GPU state" not in md
    import json
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["gpu_before"] is None and rows[0]["gpu_after"] is None


def test_bench_e2e_md_lists_each_rows_state(tmp_path):
    import importlib.util
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_e2e_script", os.path.join(root, "scripts", "bench_e2e.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fast = {"clocks.sm": "1980 MHz", "clocks.max.sm": "1980 MHz", "clocks.mem": "3201 MHz", "power.draw": "500 W",
            "power.limit": "700 W", "temperature.gpu": "50"}
    slow = dict(fast, **{"clocks.sm": "1410 MHz", "clocks_reasons": "0x4"})
    row = dict(shape="tiny", length=64, batch=1, method="static", budget=None, prefill_s=0.1, step_ms=12.0,
               step_mean_ms=12.5, tokens_per_s=83.0, peak_gib=1.0, same_as_quest=None, graph_replay_ms=None,
               error=None, floor_ms=None, gpu_before=fast, gpu_after=slow)
    args = types.SimpleNamespace(device="cpu", dtype="float16", new_tokens=3, topk_launch=[], gemv_launch=[],
                                 bandwidth=None, out=str(tmp_path / "e2e.json"))
    md = mod.write(args, [row])
    assert "GPU state around each row (nvidia-smi):" in md
    assert ("- static: before SM 1980 MHz/1980 MHz, mem 3201 MHz, 500 W of 700 W, 50 C; "
            "after SM 1410 MHz/1980 MHz, mem 3201 MHz, 500 W of 700 W, 50 C, reasons 0x4") in md
    assert json.loads((tmp_path / "e2e.json").read_text())["rows"][0]["gpu_after"]["clocks.sm"] == "1410 MHz"
