"""Does a change leave the default Top-K kernels' machine code as it was? Compiles `triton_kernels/topk.py`'s kernels
and another version's (a file path, e.g. `git show REV:triton_kernels/topk.py > /tmp/topk_old.py`) to PTX for sm_90
with no GPU (triton's own ptxas), at the default paths' settings (the new `TAIL` constexpr at 0), and counts the
instructions that differ once register numbers, labels and debug data are set aside.

    python benchmarks/probes/ptx_same_topk.py /tmp/topk_old.py
"""
import difflib
import importlib.util
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_kernels import topk as new

TARGET = GPUTarget("cuda", 90, 32)
CASES = [  # kernel, constexprs, warps: the captured 32K rows (MHA, union of 4 with mask_rest), pass 1, pass 2, tiled
    ("_topk_pages_kernel", dict(GROUP=1, GROUP_PAD=1, BLOCK_P=4096, SINGLE_TILE=True, MASK_REST=False, RANK_BITS=16,
                                HAS_DUE=False), 8),
    ("_topk_pages_kernel", dict(GROUP=4, GROUP_PAD=4, BLOCK_P=2048, SINGLE_TILE=True, MASK_REST=True, RANK_BITS=16,
                                HAS_DUE=False), 8),
    ("_topk_thresholds_kernel", dict(BLOCK_P=4096, SINGLE_TILE=True, RANK_BITS=16, HAS_DUE=True), 8),
    ("_topk_union_kernel", dict(GROUP=4, GROUP_PAD=4, BLOCK_P=4096, SINGLE_TILE=True, HAS_DUE=False), 8),
    ("_topk_pages_kernel", dict(GROUP=4, GROUP_PAD=4, BLOCK_P=8192, SINGLE_TILE=False, MASK_REST=False, RANK_BITS=16,
                                HAS_DUE=False), 16),
]


def code(mod, name, consts, warps):
    """The kernel's PTX instructions, register numbers and labels normalized, labels and data lines dropped."""
    fn = getattr(mod, name)
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else "*fp32" if n == "s_ptr" else "*i32" if n.endswith("_ptr") else "i32"
           for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()})
    ptx = triton.compile(src, target=TARGET, options=dict(num_warps=warps)).asm["ptx"]
    lines = [re.sub(r"%[a-z]+\d+", "%R", re.sub(r"\$L__\w+", "L", re.sub(r"//.*", "", ln))).strip()
             for ln in ptx.splitlines()]
    return [ln for ln in lines if ln and ln != "L:" and not ln.startswith((".loc", ".file", ".b8", ".b16", ".b32",
                                                                          ".b64"))]


def main():
    spec = importlib.util.spec_from_file_location("triton_kernels.topk_other", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    print(f"triton {triton.__version__}, sm_90 PTX; {sys.argv[1]} against triton_kernels/topk.py")
    for name, consts, warps in CASES:
        a, b = code(old, name, consts, warps), code(new, name, dict(consts, TAIL=0), warps)
        diff = [ln for ln in difflib.unified_diff(a, b, lineterm="", n=0)
                if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        print(f"{name} {consts}: {len(a)} vs {len(b)} lines, {len(diff)} differ")


if __name__ == "__main__":
    main()
