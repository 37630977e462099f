"""Round 17 diagnosis: one `quest_step` (launches from argv) eager, then in a 3-replay graph, at 7B B=1 32K
shapes; prints whether it finished and matched the separate kernels. Run each case under `timeout`."""
import sys

import torch

import triton_kernels as tk
from triton_kernels import fused_step as fs

launches, L, H, G = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
graph = len(sys.argv) > 5 and sys.argv[5] == "graph"
S, D, k = 16, 128, 128
torch.manual_seed(0)
kc = torch.randn(1, H, L, D, device="cuda", dtype=torch.float16)
vc = torch.randn_like(kc)
kmin = kc.view(1, H, L // S, S, D).amin(3).contiguous()
kmax = kc.view(1, H, L // S, S, D).amax(3).contiguous()
valid = torch.ones(1, L, dtype=torch.bool, device="cuda")
q = torch.randn(1, H * G, D, device="cuda", dtype=torch.float16)
reduce = "none" if G == 1 else "max"
ids_ref = tk.topk_pages(tk.score_pages(q, kmin, kmax, L, S, 0, reduce), k, 1)
ws = fs.step_workspace(1, H, "cuda")
launch = fs.StepLaunch(launches=launches)
args = (q, kmin, kmax, kc, vc, valid, L, S, k, D ** -0.5, reduce)
out, ids = fs.quest_step(*args, workspace=ws, launch=launch)
torch.cuda.synchronize()
print("eager", launches, L, H, G, "overlapped", fs.quest_step.overlapped, "ids_equal", torch.equal(ids, ids_ref),
      "ws0", bool((ws == 0).all()), flush=True)
if graph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, ids = fs.quest_step(*args, workspace=ws, launch=launch)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    print("graph", "ids_equal", torch.equal(ids, ids_ref), "ws0", bool((ws == 0).all()), flush=True)
