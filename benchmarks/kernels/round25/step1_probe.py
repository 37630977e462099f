"""Round 25 probe: where round 21's int8_channel step (the first decode step's logits 0.64 apart between the separate
kernels and the fused step, the decode GEMV on) begins. Each run (separate kernels, fused step; eager steps) records
through a selection hook, at every sparse layer's decode step, the query it scored with and the pages it chose; the
two runs are compared call by call: the query's largest difference and the pages chosen by one run only (the
current page, listed differently by the two, left out), with their scores (separate score kernel, each run's own
query) and each run's K-th score.

    python benchmarks/kernels/round25/step1_probe.py                          # a CUDA device
    TRITON_INTERPRET=1 python benchmarks/kernels/round25/step1_probe.py --cpu  # the kernels interpreted on CPU (slow)
"""
import sys

import torch

sys.path.insert(0, ".")
import tests.gpu.test_gpu_fused_step as fused_tests  # noqa: E402
from quest_hf import QuestCache, patch_model  # noqa: E402

CPU = "--cpu" in sys.argv
if CPU:  # the same model on CPU, Triton's interpreter running the kernels; 3 tokens, the GEMV on only
    fused_tests.DEV = "cpu"
DEV, _model = fused_tests.DEV, fused_tests._model

model = _model(4, "llama")
ids = torch.randint(2, 1000, (1, 3000), device=DEV, generator=torch.Generator(DEV).manual_seed(1))


def run(fused, gemv):
    patch_model(model, budget=256, page_size=16, cuda_graph=False, compile_step=False, bounds="int8_channel",
                fused_step=fused, backend="triton", decode_gemv=gemv)
    cache = QuestCache.from_model(model)
    calls = []

    def hook(i, q, chosen):
        layer = cache.layers[i]
        pos, S = int(layer.pos.item()), layer.config.page_size  # the current token's page, whether or not pos moved on
        cur = {-1, (pos - 1) // S, pos // S}
        cfg, ops = layer.config, layer.ops
        scores = ops.score_pages(q, layer.kmin8, layer.kmax8, layer.keys.shape[2], S, 0, "none", pos=layer.pos,
                                 window=0, rows=layer.rows, scale=layer.kscale, chan=layer.kchan)[0].float()
        kth = scores.topk(cfg.num_pages + 1, dim=-1).values[:, -1]  # each head's K-th score (the current page: +inf)
        calls.append((i, q.detach().float().clone(), [set(r.tolist()) - cur for r in chosen[0]], pos, scores, kth))

    cache.selection_hooks.append(hook)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=3 if CPU else 6, do_sample=False, return_dict_in_generate=True,
                         output_scores=True)
    return calls, out


for gemv in (True,) if CPU else (True, False):
    (a, oa), (b, ob) = run(False, gemv), run(True, gemv)
    print(f"decode_gemv={gemv}: hook calls {len(a)} / {len(b)}; logit max diff per step "
          f"{[round((x - y).abs().max().item(), 4) for x, y in zip(oa.scores, ob.scores)]}")
    for n, ((ia, qa, pa, ca, sa, ka), (ib, qb, pb, cb, sb, kb)) in enumerate(zip(a, b)):
        # A head choosing otherwise: the pages only one run chose, each with its score in both runs, and each run's
        # K-th score (a near-tie when they sit within rounding of it).
        only = [(h, {p: (round(sa[h, p].item(), 4), round(sb[h, p].item(), 4)) for p in x ^ y},
                 (round(ka[h].item(), 4), round(kb[h].item(), 4))) for h, (x, y) in enumerate(zip(pa, pb)) if x != y]
        print(f"  call {n} layer {ia}/{ib} position {ca}/{cb}: q max diff {(qa - qb).abs().max().item():.3g}; "
              f"heads choosing otherwise {only[:4]}")
