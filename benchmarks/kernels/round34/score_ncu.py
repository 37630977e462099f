"""The score kernel under Nsight Compute: is the 8-bit score bound by instruction issue or by DRAM?

Runs `score_pages` once per score launch at two rows, after warming every launch up (compiles), between
`cudaProfilerStart` / `cudaProfilerStop`, so that `ncu --profile-from-start off` records exactly one launch each, in
the order printed. Run on the device:

    ncu --profile-from-start off --metrics $METRICS python benchmarks/kernels/round34/score_ncu.py

with METRICS as `call1.sh` sets them (duration, DRAM throughput, issue-active, warp-instructions executed, warps
active, registers).

Rows: Llama-2-7B B=1 128K (MHA, 8197 pages; the word paths apply) with `int8_channel` codes and with fp16 bounds, and
Llama-3-8B B=8 32K (GQA groups of 4, 2053 pages; "mma8") with codes, of random keys. Launches: the default,
`packed_codes` + `trunc_parts` + `packed_bounds`, and those at 64 and 128 pages a program. Without CUDA
(`TRITON_INTERPRET=1`) it runs tiny shapes and checks every launch against the default's scores, with no profiler
calls.
"""
import torch

import triton_kernels as tk
from triton_kernels.bounds8 import channel_scales_of_bounds, empty_bounds8
from triton_kernels.score import ScoreLaunch

LAUNCHES = {
    "default": ScoreLaunch(),
    "opts": ScoreLaunch(packed_codes=True, trunc_parts=True, packed_bounds=True),
    "p64opts": ScoreLaunch(block_p=64, packed_codes=True, trunc_parts=True, packed_bounds=True),
    "p128opts": ScoreLaunch(block_p=128, packed_codes=True, trunc_parts=True, packed_bounds=True),
}


def inputs(B, Hq, H, P, codes, dev, D=128, S=16):
    g = torch.Generator(dev).manual_seed(0)
    keys = torch.randn(B, H, P, S, D, generator=g, device=dev, dtype=torch.float16)
    kmin, kmax = keys.amin(3), keys.amax(3)
    del keys
    q = torch.randn(B, Hq, D, generator=g, device=dev, dtype=torch.float16)
    if not codes:  # fp16 bounds
        return q, kmin, kmax, None, None, P * S
    chan = channel_scales_of_bounds(kmin, kmax, P)
    lo8, hi8, sc = empty_bounds8(B, H, P, D, dev)
    tk.quantize_bounds(kmin, kmax, lo8, hi8, sc, chan=chan)
    return q, lo8, hi8, sc, chan, P * S


def main():
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    rows = {"7b-b1-128k": (1, 32, 32, 8197, True), "8b-b8-32k": (8, 32, 8, 2053, True),
            "7b-b1-128k-fp16": (1, 32, 32, 8197, False)} if cuda else \
        {"mha-tiny": (1, 2, 2, 37, True), "gqa-tiny": (2, 8, 2, 21, True), "mha-tiny-fp16": (1, 2, 2, 37, False)}
    runs = []
    for row, shape in rows.items():
        q, lo8, hi8, sc, chan, C = inputs(*shape, dev)
        want = None
        for name, launch in LAUNCHES.items():
            s = tk.score_pages(q, lo8, hi8, C, 16, scale=sc, chan=chan, launch=launch)  # compile / warm up
            if want is None:
                want = s
            fin = want.isfinite()
            assert torch.equal(fin, s.isfinite()) and torch.allclose(s[fin], want[fin], rtol=1e-4, atol=1e-3), name
            runs.append((row, name, launch, (q, lo8, hi8, sc, chan, C)))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for row, name, launch, (q, lo8, hi8, sc, chan, C) in runs:
        tk.score_pages(q, lo8, hi8, C, 16, scale=sc, chan=chan, launch=launch)
        print(f"profiled: {row} {name} (word form: {tk.score.word_form(q, lo8, hi8, sc, chan, launch)}, "
              f"form {tk.score_form(q, lo8, sc, launch)})", flush=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
