"""Shape/dtype checks shared by every launcher and reference (see `_contract.md`), and Triton plumbing."""
import functools
import os

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache(k_cache, v_cache, kmin, kmax, valid):
    """Validate one layer's paged storage; return `(B, H_kv, C, D)`."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [B, H_kv, C, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, H, C, D = k_cache.shape
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"K/V must share one dtype among {KV_DTYPES}, got {k_cache.dtype} and {v_cache.dtype}")
    if kmin.shape != kmax.shape or kmin.dim() != 4 or kmin.shape[:2] != (B, H) or kmin.shape[3] != D:
        raise ValueError(f"kmin/kmax must be [B={B}, H_kv={H}, P, D={D}], got {tuple(kmin.shape)} and {tuple(kmax.shape)}")
    P = kmin.shape[2]
    if P == 0 or C % P or (C // P) & (C // P - 1):
        raise ValueError(f"capacity {C} must be a whole number of power-of-two pages, got {P} pages")
    if kmin.dtype != k_cache.dtype or kmax.dtype != k_cache.dtype:
        raise TypeError(f"kmin/kmax must have the keys' dtype {k_cache.dtype}, got {kmin.dtype}/{kmax.dtype}")
    if valid.shape != (B, C) or valid.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"valid must be a bool [B={B}, C={C}] tensor (or its uint8 view), got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    return B, H, C, D


def as_u8(mask):
    """A bool mask as the kernels read it (uint8); a uint8 view made by the caller is taken as is (quest_hf.compiled's
    traced step makes them outside its graph: inductor cannot view a bool tensor as uint8)."""
    return mask if mask.dtype == torch.uint8 else mask.view(torch.uint8)


def check_query(q, num_kv_heads: int, head_dim: int, batch: int):
    """Validate a decode query `[B, H_q, D]`; return the GQA group size `H_q // H_kv`."""
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B={batch}, H_q, D={head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"{q.shape[1]} query heads cannot be grouped over {num_kv_heads} KV heads")
    return q.shape[1] // num_kv_heads


def check_due(due, device):
    """Selection reuse's device flag (`score_pages(due=)`, `topk_pages(due=)`): one integer or bool element on
    `device`, or None."""
    if due is not None and (due.numel() != 1 or due.device != device or due.is_floating_point()):
        raise ValueError(f"due must be one integer or bool tensor on {device}, got {due.dtype} {tuple(due.shape)} "
                         f"on {due.device}")


def due_arg(due, fallback):
    """What a kernel's `due_ptr` receives: the flag (a bool one viewed as uint8), or `fallback` (never read)."""
    if due is None:
        return fallback
    return due.view(torch.uint8) if due.dtype == torch.bool else due


def check_out(out, shape, dtype, device, name="out"):
    """A caller's output buffer (`out=`): exactly `shape` and `dtype` on `device` (any strides), or None."""
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device):
        raise ValueError(f"{name} must be {dtype} {tuple(shape)} on {device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")


# Triton is optional: the references above must import (and run) where it is missing. The stub keeps the
# kernels' `tl.constexpr` annotations and `@triton.jit` decorators valid at import; launchers call
# `require_triton()` before touching them.
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    import types

    triton = types.SimpleNamespace(jit=lambda fn=None, **kw: fn if fn is not None else (lambda f: f),
                                   cdiv=lambda a, b: -(-a // b),
                                   next_power_of_2=lambda n: 1 << max(0, int(n) - 1).bit_length())
    tl = types.SimpleNamespace(constexpr=lambda value=None: value)
    HAS_TRITON = False
else:
    HAS_TRITON = True


def require_triton():
    if not HAS_TRITON:
        raise RuntimeError("the triton package is not installed: use the *_ref functions (backend='torch')")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints (`triton.cdiv` is a constexpr function in newer Triton: ~6 us a call from Python,
    a quarter of an attention launch's host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1). By comparisons only: under torch.compile with a symbolic capacity
    (quest_hf.compiled) each is a range guard, so the result is a plain int and the graph stays valid for every size
    up to that power of two (`int(n)` or `bit_length` would specialize the graph to the exact size)."""
    p = 1
    while p < n:
        p *= 2
    return p


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill; the interpreter (CPU) gets a small fixed number so tests cover several splits."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sms(index: int) -> int:
    # Read once per device, not on every launch (host time of an uncaptured decode step).
    return torch.cuda.get_device_properties(index).multi_processor_count


def pdl_available(device: torch.device) -> bool:
    """Whether a launch on `device` can be programmatically dependent on the one before it (Hopper or newer, a
    Triton that takes `launch_pdl`; never under the interpreter; QUEST_HF_PDL=0 turns it off). Never for a kernel
    launched inside a `torch.compile` trace (`QuestConfig(compile_step=True)`): inductor's launcher of a traced
    Triton kernel cannot analyse its `griddepcontrol` instructions (round 26: the compiled step failed or gave other
    logits with the append launched dependently)."""
    if (not HAS_TRITON or device.type != "cuda" or interpreting() or os.environ.get("QUEST_HF_PDL", "1") == "0"
            or torch.compiler.is_compiling()):
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_device(index: int) -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return torch.cuda.get_device_capability(index)[0] >= 9 and "launch_pdl" in fields and hasattr(tl.extra.cuda,
                                                                                                   "gdc_launch_dependents")


@triton.jit
def due_flag(due_ptr, HAS_DUE: tl.constexpr):
    """Selection reuse's device flag as a kernel reads it (`if due_flag(due_ptr, HAS_DUE) != 0:` around the
    kernel's work; 0: this step reuses its stored pages, the program returns having read only the flag). Without
    HAS_DUE it is the constant 1 and the compiled kernel has no branch and no load (its TTIR checked on triton
    3.6 and 3.9)."""
    if HAS_DUE:
        return tl.load(due_ptr).to(tl.int32)
    else:
        return 1
