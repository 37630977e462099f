#!/usr/bin/env python
"""Write GemvLaunch's default block_n / block_k / num_warps / num_stages into triton_kernels/gemv.py (round 24, call 5:
the device's copy of the tree takes a swept setting before its GPU tests and generate() run, and the same edit is
then committed here)."""
import re
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[3] / "triton_kernels" / "gemv.py"
text = path.read_text()
for item in sys.argv[1:]:
    name, value = item.split("=")
    text, n = re.subn(rf"^(    {name}: int = )\d+$", rf"\g<1>{int(value)}", text, flags=re.M)
    if n != 1:
        raise SystemExit(f"GemvLaunch.{name} not found once in {path}")
path.write_text(text)
print(f"{path}: GemvLaunch defaults {' '.join(sys.argv[1:])}")
