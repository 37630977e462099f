"""Temporary probe: phase costs, registers and settings of the one-launch step (H200)."""
import itertools
import sys

import torch

import scripts.bench_kernels as bk
import triton_kernels as tk
from triton_kernels import quest_step as fm

bk.TIMER = "clean"
cases = []
for shape, mode, L in (("llama2-7b", "union", 32768), ("llama2-7b", "union", 131072), ("llama3-8b", "max", 32768),
                       ("llama3-8b", "union", 32768)):
    H_q, H_kv, D = bk.SHAPES[shape]
    sets = [bk.Step(bk.make_layer(1, H_kv, L, D, torch.float16, s), torch.randn(1, H_q, D, device="cuda",
                                                                                    dtype=torch.float16), 128, mode)
            for s in range(2)]
    cases.append((f"{shape}/{mode}/{L}", sets))
for name, st in cases:
    print(name, "four-launch graph", round(bk.graph_time(st, "full"), 1), "score", round(bk.graph_time(st, "score"), 1),
          "topk", round(bk.graph_time(st, "topk"), 1), "attn", round(bk.graph_time(st, "attn"), 1), flush=True)
space = [dict(CHUNK_P=c, PROGRAMS_PER_SM=p, SPLIT_TOKENS=t, SPIN_LOAD=sl)
         for c, p, t, sl in ((64, 3, 64, False), (128, 3, 64, False), (32, 3, 64, False), (64, 2, 64, False),
                             (64, 4, 64, False), (64, 3, 128, False), (64, 3, 64, True), (256, 3, 128, False))]
for cfg in space:
    for k, v in cfg.items():
        setattr(fm, k, v)
    row = []
    for name, st in cases:
        times = []
        for ph in (1, 2, 3):
            fm._PHASES = ph
            fm.clear_workspaces()
            times.append(round(bk.graph_time(st, "fused"), 1))
        fm._PHASES = 3
        fm.clear_workspaces()
        row.append(f"{name} {times}")
    print(cfg, "regs", fm.LAST_LAUNCH.n_regs, "spills", fm.LAST_LAUNCH.n_spills, " | ".join(row), flush=True)
