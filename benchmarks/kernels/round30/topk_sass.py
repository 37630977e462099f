"""Compile the lean Top-K (one row a program, the 32K decode's 2053-page rows: a 2048-key tile and a 16-key tail) for
sm_90 without a GPU; report its registers and static SASS, and the instructions of the radix-pass loop.

Triton's bundled ptxas and cuobjdump do the work, so this runs on a CPU-only machine. Run it from the repository root:
`PYTHONPATH=. python benchmarks/kernels/round30/topk_sass.py [num_warps]`. The figures come from the local triton,
which may be a newer version than the device's.
"""
import inspect
import re
import sys

import triton

from quest_hf.bench import sm90_report, top_ops
from triton_kernels.topk import _topk_pages_kernel


def main(warps: int = 4):
    sig = {name: "i32" for name in inspect.signature(_topk_pages_kernel.fn).parameters}
    sig.update(s_ptr="*fp32", out_ptr="*i32", due_ptr="*i32")
    consts = dict(GROUP=1, GROUP_PAD=1, BLOCK_P=2048, SINGLE_TILE=True, MASK_REST=False, RANK_BITS=16, HAS_DUE=False,
                  TAIL=16, LEAN=True, ONE_REDUCE=True)
    r = sm90_report(_topk_pages_kernel, sig, consts, warps)
    ins = r["sass"]
    print(f"triton {triton.__version__}, sm_90, lean Top-K, 2053 pages (2048 + 16-key tail), {warps} warps: "
          f"{r['registers'] or '?'} registers, {len(ins)} static instructions")
    # The first backward branch closes the rank search's radix loop.
    for addr, text in ins:
        m = re.search(r"BRA (?:P\d, )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            body = [t for a, t in ins if start <= a <= addr]
            ops = {}
            for t in body:
                w = t.split()
                op = (w[1] if w[0].startswith("@") else w[0]).split(".")[0]
                ops[op] = ops.get(op, 0) + 1
            print(f"radix pass (0x{start:x}-0x{addr:x}): {len(body)} instructions ({top_ops(ops, 8)})")
            break


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
