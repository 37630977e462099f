"""Round 17 diagnosis: bench_fused_step's 7B B=1 32K row under a StepLaunch (argv: launches), stage by stage
(check, a one-step graph, the 20-step chained graph, the profiler's eager calls), printing after each; a Python
traceback of every thread if it stalls (faulthandler)."""
import faulthandler
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_fused_step as bf  # noqa: E402
import bench_kernels as bk  # noqa: E402

from quest_hf.bench import kernel_durations, rotating, time_graph, time_graph_chain  # noqa: E402
from triton_kernels import fused_step as fs  # noqa: E402

faulthandler.dump_traceback_later(int(sys.argv[2]) if len(sys.argv) > 2 else 20, exit=True)
launch = fs.StepLaunch(launches=int(sys.argv[1]))
n_sets = 4
layers = [bk.make_layer(1, 32, 32768, 128, torch.float16, seed, 0) for seed in range(n_sets)]
qs = [torch.randn(1, 32, 128, device="cuda", dtype=torch.float16) for _ in range(n_sets)]
steps = [bk.Step(layers[i], qs[i], 128, "union") for i in range(n_sets)]
fused = [bf.Fused(s, launch) for s in steps]
print("check", bf.check(steps[0], fused[0]), flush=True)
print("graph one step", time_graph(fused), flush=True)
print("chain", time_graph_chain(fused, bk.CHAIN), flush=True)
print("durations", kernel_durations(rotating(fused)), flush=True)
