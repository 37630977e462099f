"""The one testing helper: per-dtype tolerances that reject NaN, NaN-filled fresh outputs, the device under test."""
import os

import torch

# Kernels compile on a GPU (the GPU-marked tests); elsewhere they run under TRITON_INTERPRET=1 on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (atol, rtol) on outputs in the given dtype; the kernels do fp32 math, so this is output rounding plus, for
# attention, the probabilities cast to the K/V dtype before the P.V product.
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (2e-2, 2e-2)}


def assert_close(actual, expected, dtype=None, tol=None):
    """`actual` equals `expected` within the dtype's tolerance (`tol`: another table); NaN never passes."""
    dtype = dtype or expected.dtype
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert not actual.isnan().any(), "NaN in the output (an unwritten slot, or a NaN the reference does not have)"
    atol, rtol = (tol or TOL)[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False)


def nan_empty(real_empty):
    """A `torch.empty` whose float tensors start as NaN (integers as 0x5A), so that a slot a kernel does not
    write fails the test: `monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))`."""
    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0x5A)
    return empty
