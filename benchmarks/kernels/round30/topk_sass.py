"""Compile the lean Top-K (one row a program, the 32K decode's 2053-page rows: a 2048-key tile and a 16-key tail) for
sm_90 without a GPU; report its registers and static SASS, and the instructions of the radix-pass loop.

Triton's bundled ptxas and cuobjdump do the work, so this runs on a CPU-only machine. Run it from the repository root:
`PYTHONPATH=. python benchmarks/kernels/round30/topk_sass.py [num_warps]`. The figures come from the local triton,
which may be a newer version than the device's.
"""
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_kernels.topk import _topk_pages_kernel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def main(warps: int = 4):
    sig = {name: "i32" for name in inspect.signature(_topk_pages_kernel.fn).parameters}
    sig.update(s_ptr="*fp32", out_ptr="*i32", due_ptr="*i32")
    consts = dict(GROUP=1, GROUP_PAD=1, BLOCK_P=2048, SINGLE_TILE=True, MASK_REST=False, RANK_BITS=16, HAS_DUE=False,
                  TAIL=16, LEAN=True, ONE_REDUCE=True)
    sig |= {c: "constexpr" for c in consts}
    k = triton.compile(ASTSource(fn=_topk_pages_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        open(cubin, "wb").write(k.asm["cubin"])
        log = subprocess.run([f"{BIN}/ptxas", "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    regs = re.findall(r"Used (\d+) registers", log)
    print(f"triton {triton.__version__}, sm_90, lean Top-K, 2053 pages (2048 + 16-key tail), {warps} warps: "
          f"{regs[0] if regs else '?'} registers, {len(ins)} static instructions")
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
            top = ", ".join(f"{o} {n}" for o, n in sorted(ops.items(), key=lambda x: -x[1])[:8])
            print(f"radix pass (0x{start:x}-0x{addr:x}): {len(body)} instructions ({top})")
            break


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
