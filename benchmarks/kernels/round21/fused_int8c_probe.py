"""Round 21 probe: where the patched fused step (int8_channel bounds) parts from the separate kernels' scores, with
the decode GEMV on and off (tests/gpu/test_gpu_fused_step.py's mha-auto-int8c model and prompt)."""
import sys

import torch

sys.path.insert(0, ".")
from tests.gpu.test_gpu_fused_step import DEV, _generate, _model  # noqa: E402

model = _model(4, "llama")
ids = torch.randint(2, 1000, (1, 3000), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
for gemv in (True, False) if "--ties-only" not in sys.argv else ():
    sep, _ = _generate(model, ids, False, bounds="int8_channel", fused_step=False, decode_gemv=gemv)
    for cuda_graph in (False, "auto"):
        fused, kernels = _generate(model, ids, cuda_graph, bounds="int8_channel", decode_gemv=gemv)
        diffs = [(a - b).abs().max().item() for a, b in zip(sep.scores, fused.scores)]
        first = next((i for i, d in enumerate(diffs) if d > 5e-3), None)
        print(f"decode_gemv={gemv} cuda_graph={cuda_graph}: tokens equal {torch.equal(sep.sequences, fused.sequences)}"
              f"; first step over 5e-3: {first}; max diffs {[round(d, 4) for d in diffs]}; {kernels[0]}")

# At the same inputs: in the fused run (eager steps, a selection hook), the separate kernels' choice and the scores of
# any page the two choices do not share, against the K-th score (a near-tie when the gap is at rounding level).
from quest_hf import QuestCache, patch_model  # noqa: E402

patch_model(model, budget=256, page_size=16, cuda_graph=False, compile_step=False, bounds="int8_channel")
cache = QuestCache.from_model(model)
seen = {"steps": 0, "differ": []}


def hook(i, q, ids):
    layer = cache.layers[i]
    sep_ids = layer.selector.select(layer, q, 0)
    seen["steps"] += 1
    for h in range(ids.shape[1]):
        a, b = set(ids[0, h].tolist()) - {-1}, set(sep_ids[0, h].tolist()) - {-1}
        if a != b:
            cfg, ops = layer.config, layer.ops
            s = ops.score_pages(q, layer.kmin8, layer.kmax8, layer.keys.shape[2], cfg.page_size, 0, "none",
                                pos=layer.pos, window=0, rows=layer.rows, scale=layer.kscale, chan=layer.kchan)
            row = s[0, h].float()
            kth = row.topk(cfg.num_pages + 1).values[-1].item()
            seen["differ"].append((seen["steps"], i, h, {p: row[p].item() for p in a ^ b}, kth))


cache.selection_hooks.append(hook)
model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24, do_sample=False)
print(f"hook calls {seen['steps']}; kernels {cache.layers[2].step_kernels}; "
      f"heads choosing otherwise: {len(seen['differ'])}")
for step, i, h, scores, kth in seen["differ"][:8]:
    print(f"  call {step} layer {i} head {h}: pages only one side chose {scores}; K-th score {kth}")
