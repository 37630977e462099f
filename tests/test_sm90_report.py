"""`quest_hf.bench.sm90_report`: a Triton kernel compiled for sm_90 on a machine without a GPU (the offline register /
SASS reports of benchmarks/kernels/round28/score_regs.py and round30/topk_sass.py).

The compile runs in a fresh process (`run_fresh`): in a full run (triton 3.8.0), a kernel that an earlier test ran
under the interpreter left triton's code generator failing on `tl.arange` ("'ir.value' object has no attribute
'dtype'"), while the same test passed alone. A user's offline report runs in a process of its own too."""
import json
import os

import pytest

from .conftest import run_fresh

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from quest_hf.bench import top_ops  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "ptxas")), reason="triton ships no ptxas here")


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2.0, mask=o < n)


def _main():
    from quest_hf.bench import sm90_report

    sig = dict(x_ptr="*fp32", y_ptr="*fp32", n="i32")
    r = sm90_report(_scale_kernel, sig, dict(BLOCK=1024), num_warps=4)
    aligned = sm90_report(_scale_kernel, sig, dict(BLOCK=1024), num_warps=4, divisible=("x_ptr", "y_ptr", "n"))
    print(json.dumps(dict(r, aligned=aligned)))


def test_reports_registers_sass_and_opcodes():
    r = run_fresh("tests.test_sm90_report", timeout=300)
    assert isinstance(r["registers"], int) and r["registers"] > 0
    assert r["spilled"] == 0 and r["shared"] == 0
    texts = [t for _, t in r["sass"]]
    assert any("LDG" in t for t in texts) and any("STG" in t for t in texts)
    addrs = [a for a, _ in r["sass"]]
    assert addrs == sorted(addrs) and addrs[0] == 0 and all(b - a == 16 for a, b in zip(addrs, addrs[1:]))
    assert sum(r["ops"].values()) == len(r["sass"]) and r["ops"].get("FMUL", 0) + r["ops"].get("FADD", 0) >= 1
    assert top_ops(r["ops"], 2).count(",") == 1
    # What the JIT knows of a launch's arguments (16-divisible pointers and sizes) vectorizes the loads: 128-bit
    # loads only with it.
    def loads(rep):  # opcodes of the loads, predicates ("@!P0") dropped
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in rep["sass"]]
        return [op for op in ops if op.startswith("LDG")]

    loads = dict(plain=loads(r), aligned=loads(r["aligned"]))
    assert "LDG.E.128" in loads["aligned"] and "LDG.E.128" not in loads["plain"]
    assert len(loads["aligned"]) < len(loads["plain"])
