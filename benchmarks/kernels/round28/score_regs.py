"""Compile the score kernel for sm_90 without a GPU and report each form's registers, spills, shared memory and SASS.

Triton's bundled ptxas and cuobjdump do the work, so this runs on a CPU-only machine. Run it from the repository root:
`PYTHONPATH=. python benchmarks/kernels/round28/score_regs.py`. The Llama-3-8B group shape is used: G=4, D=128,
BLOCK_P=32, 4 warps, no reduce. The 8-bit tensor-core forms (MMA 3) exist only on a tree with one of this round's
patches applied (`score_mma8.patch`, `score_mma8_rows.patch`). The figures come from the local triton, which may be
a newer version than the device's.
"""
import inspect

import triton

from quest_hf.bench import sm90_report, top_ops
from triton_kernels.score import _score_pages_kernel


def signature(bounds_ty: str) -> dict:
    sig = {name: "i32" for name in inspect.signature(_score_pages_kernel.fn).parameters}
    sig.update(q_ptr="*fp16", out_ptr="*fp32", scale_ptr="*fp32", chan_ptr="*fp32", kmin_ptr=bounds_ty,
               kmax_ptr=bounds_ty, pos_ptr="*i64", rows_ptr="*i32", due_ptr="*i32")
    return sig


def build(name: str, bounds_ty: str, mma: int, codes: bool, G: int = 4, block_p: int = 32, warps: int = 4):
    g_mma = max(16, 4 * triton.next_power_of_2(G)) if mma >= 3 else max(16, triton.next_power_of_2(G))
    consts = dict(G=G, D=128, BLOCK_D=128, BLOCK_P=block_p, REDUCE=0, HAS_POS=True, HAS_ROWS=False,
                  USE_SCALE=codes, HAS_DUE=False, USE_CHAN=codes, MMA=mma, G_MMA=g_mma, PAGE=16)
    r = sm90_report(_score_pages_kernel, signature(bounds_ty), consts, warps)
    print(f"{name}: {r['registers'] or '?'} registers, {r['spilled'] if r['spilled'] is not None else '?'} bytes "
          f"spilled, {r['shared']} B shared, {len(r['sass'])} SASS instructions ({top_ops(r['ops'])})", flush=True)


if __name__ == "__main__":
    print(f"triton {triton.__version__}, sm_90, Llama-3-8B group (G=4, D=128), BLOCK_P=32, 4 warps")
    build("fp16 bounds, tensor-core form (MMA 1)", "*fp16", 1, False)
    build("fp16 bounds, elementwise", "*fp16", 0, False)
    build("int8_channel codes, elementwise", "*i8", 0, True)
    try:
        build("int8_channel codes, tensor-core form (MMA 3)", "*i8", 3, True)
    except Exception as e:  # a tree without the patch: no MMA 3 branch
        print(f"int8_channel codes, tensor-core form: not built on this tree ({type(e).__name__})")
