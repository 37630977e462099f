"""Compile the score kernel for sm_90 without a GPU and count what each 8-bit form issues per byte of bounds it reads.

Run from the repository root: `PYTHONPATH=. python benchmarks/kernels/round34/score_issue.py`. Each variant is compiled
as a launch specializes it (unit strides constant, pointers and the other strides divisible by 16), then
`quest_hf.bench.sm90_report` gives its SASS. The kernel has no loop, so SASS instructions x warps is what one program
issues; over the bytes of bounds it reads that is warp-instructions a byte. A GPU issues at most one warp-instruction a
cycle a scheduler: 4 a cycle an SM. At the clock and bandwidth named below (nominal figures, not measured) the
`budget` column is what it can issue per byte while streaming at full bandwidth; a kernel near or over it is bound by
issue, not bytes. Conversions of data (I2F / F2F; not the I2F.RP of integer divisions) issue on a quarter-rate
pipe and are counted apart. Figures of the local
triton (may be newer than a device's).
"""
import inspect

import triton

from quest_hf.bench import sm90_report
from triton_kernels.score import _score_pages_kernel

UNIT = dict(stride_qd=1, stride_nd=1, stride_xd=1, stride_op=1, stride_sp=1, stride_cd=1)
DIVISIBLE = ("q_ptr", "kmin_ptr", "kmax_ptr", "out_ptr", "pos_ptr", "scale_ptr", "chan_ptr", "stride_qb", "stride_qh",
             "stride_nb", "stride_nh", "stride_np", "stride_xb", "stride_xh", "stride_xp", "stride_ob", "stride_oh",
             "stride_sb", "stride_sh", "stride_ch")
# (SMs, clock GHz, bandwidth TB/s): nominal
GPUS = {"H100 SXM": (132, 1.98, 3.35), "H200": (132, 1.98, 4.8)}


def signature(bounds_ty):
    sig = {n: "i32" for n in inspect.signature(_score_pages_kernel.fn).parameters if n not in UNIT}
    sig.update(q_ptr="*fp16", out_ptr="*fp32", scale_ptr="*fp32", chan_ptr="*fp32", kmin_ptr=bounds_ty,
               kmax_ptr=bounds_ty, pos_ptr="*i64", rows_ptr="*i32", due_ptr="*i32")
    for n in ("G", "D", "BLOCK_D", "BLOCK_P", "REDUCE", "HAS_POS", "HAS_ROWS", "USE_SCALE", "HAS_DUE", "USE_CHAN",
              "MMA", "G_MMA", "PAGE", "WORDS"):
        sig.pop(n, None)
    return sig


def row(name, codes, G, mma, words=0, block_p=32, warps=4):
    g_mma = max(16, 4 * triton.next_power_of_2(G)) if mma >= 3 else max(16, triton.next_power_of_2(G))
    consts = dict(G=G, D=128, BLOCK_D=128, BLOCK_P=block_p, REDUCE=0, HAS_POS=True, HAS_ROWS=False, USE_SCALE=codes,
                  HAS_DUE=False, USE_CHAN=codes, MMA=mma, G_MMA=g_mma, PAGE=16, WORDS=words, **UNIT)
    r = sm90_report(_score_pages_kernel, signature("*i8" if codes else "*fp16"), consts, warps, divisible=DIVISIBLE)
    n = len(r["sass"])
    # conversions of data: I2F / F2F, not the I2F.RP of the integer divisions' reciprocal
    ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in r["sass"]]
    conv = sum(op.startswith(("I2F", "F2F")) and op != "I2F.RP" for op in ops)
    per_byte = n * warps / (block_p * 128 * 2 * (1 if codes else 2))
    budgets = "  ".join(f"{per_byte / (sm * 4 * ghz * 1e9 / (tbs * 1e12)):.2f}" for sm, ghz, tbs in GPUS.values())
    print(f"| {name} | {block_p} | {warps} | {r['registers']} | {n} | {conv} | {per_byte:.3f} | {budgets} |",
          flush=True)


if __name__ == "__main__":
    budgets = ", ".join(f"{k} {sm * 4 * ghz * 1e9 / (tbs * 1e12):.3f}" for k, (sm, ghz, tbs) in GPUS.items())
    print(f"triton {triton.__version__}, sm_90, D=128. Issue budget, warp-instructions a byte at full bandwidth: "
          f"{budgets}")
    print("| form | pages a program | warps | registers | SASS a thread | I2F/F2F (data) | warp-instr / byte | "
          "of budget (H100 SXM, H200) |\n|---|---|---|---|---|---|---|---|")
    for bp, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8)):
        row("MHA fp16 bounds (elementwise)", False, 1, 0, block_p=bp, warps=w)
        row("MHA fp16 bounds, packed_bounds", False, 1, 0, words=2, block_p=bp, warps=w)
        row("MHA int8_channel, bytes (elementwise)", True, 1, 0, block_p=bp, warps=w)
        row("MHA int8_channel, packed_codes", True, 1, 0, words=1, block_p=bp, warps=w)
        row("GQA-4 fp16 bounds (mma)", False, 4, 1, block_p=bp, warps=w)
        row("GQA-4 int8_channel (mma8)", True, 4, 3, block_p=bp, warps=w)
        row("GQA-4 int8_channel (mma8, trunc_parts)", True, 4, 5, block_p=bp, warps=w)
