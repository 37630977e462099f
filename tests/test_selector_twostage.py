"""The two-stage code selectors "qcode2s" / "qcode1_2s": Quest's bound picks candidates, codes re-rank them."""
import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.eval.accounting import step_bytes
from quest_hf.patch import cache_arg_name
from quest_hf.selectors import SELECTORS
from quest_hf.selectors_qcode import TwoStageCodeSelector, candidate_code_scores

from .conftest import left_padded_batch, tiny_model


@pytest.mark.parametrize("bits", [1, 2])
def test_candidate_scores_equal_full_code_scores_at_the_candidates(bits):
    g = torch.Generator().manual_seed(bits)
    B, H, G, D, S, L, ws = 2, 2, 3, 64, 16, 333, 50
    C = -(-L // S) * S + S
    kc, vc = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    kmin = torch.full((B, H, C // S, D), float("inf"))
    kmax, valid = -kmin.clone(), torch.zeros(B, C, dtype=torch.bool)
    vnew = torch.ones(B, L, dtype=torch.bool)
    vnew[1, :40] = False  # left padding: row 1's first pages are (partly) empty
    tk.append_kv_ref(kc, vc, kmin, kmax, valid, kc[:, :, :L].clone(), vc[:, :, :L].clone(), vnew, 0)
    codes = torch.zeros(B, H, C, D * bits // 8, dtype=torch.uint8)
    tk.encode_codes_ref(kc, kmin, kmax, codes, 0, L // S, bits)
    q = torch.randn(B, H * G, D, generator=g)
    full = tk.code_scores_ref(q, kc, kmin, kmax, codes, valid, L, S, ws, bits, "max")
    P = full.shape[-1]
    cand = torch.stack([torch.randperm(P - 1, generator=g)[:7] for _ in range(B * H * G)]).reshape(B, H * G, 7)
    cand = cand.int()
    cand[0, 0, 3] = -1
    got = candidate_code_scores(q, kc, kmin, kmax, codes, valid, cand, L, S, ws, bits)
    want = torch.where(cand >= 0, full.gather(-1, cand.clamp(min=0).long()), float("-inf"))
    fin = want.isfinite()
    assert (~fin).any() and torch.equal(fin, got.isfinite())  # window/padding pages are -inf in both
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-5)


def test_registered_and_validated():
    assert isinstance(SELECTORS["qcode2s"], TwoStageCodeSelector) and SELECTORS["qcode2s"].bits == 2
    assert SELECTORS["qcode1_2s"].bits == 1 and SELECTORS["qcode1_2s"].candidates == 8
    with pytest.raises(ValueError, match="candidates"):
        TwoStageCodeSelector(candidates=0)


def test_bytes_read_codes_of_candidates_only():
    args = (8192, 3, 64, 2, 16, 12.0, 64, 3)  # L, kv heads, D, fp16, page size, pages read, budget, group
    quest, one_stage, two_stage = (step_bytes(p, *args) for p in ("quest", "qcode1", "qcode1_2s"))
    # 3 heads x 8 x 4 pages = 96 pages of codes a KV head, 1 bit x 64 channels: 8 bytes a token.
    assert two_stage - quest == 3 * 96 * 16 * 8
    assert quest < two_stage < one_stage


def test_same_tokens_as_one_stage_codes_when_the_candidates_cover_every_page(single_thread):
    # Budget 32 = 2 pages: 8 x 2 = 16 candidate pages cover the ~6-page context, so the second stage ranks
    # every page like "qcode" (2 bits) does: same greedy tokens, while the selection is sparse (2 of 6 pages).
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    out, chosen = {}, []
    for policy in ("qcode", "qcode2s"):
        patch_model(model, config=QuestConfig(budget=32, backend="torch", policy=policy, cuda_graph=False))
        cache = QuestCache.from_model(model)
        cache.selection_hooks.append(lambda i, q, ids: chosen.append(((ids >= 0).sum(-1).max().item(), ids.shape)))
        out[policy] = model.generate(input_ids=ids, attention_mask=mask, **{cache_arg_name(model): cache}, **kw)
    assert torch.equal(out["qcode"], out["qcode2s"])
    # Sparse: at most 5 of the 6-7 pages a KV head (4 query heads x 1 page each + the shared current page).
    assert chosen and all(n <= 5 < -(-(90 + 1) // 16) for n, _ in chosen)


def test_budget_covering_the_context_is_dense(single_thread):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    patch_model(model, config=QuestConfig(budget=256, backend="torch", policy="qcode1_2s"))
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kw), ref)


def test_triton_backend_says_the_candidate_scoring_is_pytorch(single_thread, caplog):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, config=QuestConfig(budget=32, backend="triton", policy="qcode2s", cuda_graph=False))
    with caplog.at_level("WARNING"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "score their candidate pages with PyTorch ops" in caplog.text
