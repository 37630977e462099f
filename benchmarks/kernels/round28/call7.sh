#!/bin/bash
# Round 28, device call 7 (written for the next session; not run in round 28): call6.sh's A/B for the 8-bit codes'
# tensor-core score with the parts of q' stacked as rows (two products, not six): score_mma8_rows.patch. Compiled
# offline for sm_90 (score_regs.py, triton 3.8 here): 128 registers, no spills, 8 KB shared memory, 1456 SASS
# instructions, against call 6's form (255 registers, 36 bytes spilled, 16 KB, 2992) and the elementwise int8 form
# (186, 0, 128 B, 4096). Ran in round 29 (outputs in round29/out/); the patch is in the library since 3cc7fa3, so it
# applies only to trees before that commit.
NAME=call7 PATCH=benchmarks/kernels/round28/score_mma8_rows.patch bash "$(dirname "$0")/call6.sh"
