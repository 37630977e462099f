"""Kernels that take a Python float compile when that float is typed fp64.

torch.compile (inductor) passes a Python float argument of a user Triton kernel as fp64 where Triton's own launcher
passes fp32; the attention kernel then promoted its running max to fp64 inside the page loop and failed to compile
(`Loop-carried variable m_i ... fp32 ... fp64`: the traced `compile_step` on the H200). Each kernel casts its float
arguments to fp32 first. Checked here without a GPU: each kernel is compiled for sm90 (Triton's CUDA backend needs no
device) with its floats typed fp64, and fp32 as Triton types them, in a subprocess (the tests' process runs Triton's
interpreter, which compiles nothing).
"""
import inspect
import json

import pytest

from .conftest import run_fresh

POINTERS = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "out_ptr": "*fp16", "ids_ptr": "*i32",
            "valid_ptr": "*u8", "cnt_ptr": "*i32", "rows_ptr": "*i32", "pos_ptr": "*i32"}
ATTENTION = dict(G=4, G_PAD=16, D=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, USE_FP32_DOT=False, FUSE_MERGE=True,
                 BLOCK_S=16, HAS_WINDOW_POS=False, USE_SINKS=False, HAS_ROWS=True)
CASES = [("sparse_attention", "_sparse_attn_split_kernel", ["qk_scale", "softcap_log2"], dict(ATTENTION, USE_SOFTCAP=s))
         for s in (False, True)] + [("topk", "_top_p_mask_kernel", ["top_p"], dict(BLOCK_P=256))]


def _compile_sm90(module, kernel, floats, float_type, constexprs):
    """The kernel's TTIR, compiled for sm90 with `floats` typed `float_type`, or the compile error's last line."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"triton_kernels.{module}"), kernel)
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "*fp32") if n.endswith("_ptr")
           else float_type if n in floats else "i32" for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        return {"ttir": triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {str(e)[-800:]}"}


def _main():
    out = [dict(case=[m, k, c.get("USE_SOFTCAP")], float_type=t, **_compile_sm90(m, k, f, t, c))
           for m, k, f, c in CASES for t in ("fp32", "fp64")]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton's CUDA backend is not installed")
    return run_fresh("tests.test_kernel_float_args")


def test_float_arguments_typed_fp64_compile_to_fp32_math(compiled):
    assert len(compiled) == 2 * len(CASES)
    for r in compiled:
        assert "error" not in r, r
        # Nothing is computed in fp64: the argument itself is the only f64 value (the fp64 case's signature).
        f64 = [ln for ln in r["ttir"].splitlines() if "f64" in ln and "tt.func" not in ln and "arith.truncf" not in ln]
        assert not f64, (r["case"], r["float_type"], f64[:5])
