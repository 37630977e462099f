"""The two-stage code selectors "qcode2s" / "qcode1_2s": Quest's bound picks candidates, codes re-rank them."""
import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.eval.accounting import step_bytes
from quest_hf.patch import cache_arg_name
from quest_hf.selectors import SELECTORS, TwoStageCodeSelector

from .conftest import left_padded_batch, tiny_model


def _filled(bits, B=2, H=2, G=3, D=64, S=16, L=333, seed=0):
    g = torch.Generator().manual_seed(seed + bits)
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
    return q, kc, kmin, kmax, codes, valid, L, S, g


def _lists(B, Hq, P, N, g):
    """Distinct page ids per query head (as Top-K gives), with -1 padding and the current page listed once."""
    pages = torch.stack([torch.randperm(P, generator=g)[:N] for _ in range(B * Hq)]).reshape(B, Hq, N).int()
    pages[0, 0, 3] = -1
    pages[1, 2, :] = -1  # a head with no candidate: only its current page remains
    return pages


@pytest.mark.parametrize("mode", ["max", "lse"])
@pytest.mark.parametrize("bits", [1, 2])
def test_listed_scores_equal_full_code_scores_at_the_listed_pages(bits, mode):
    q, kc, kmin, kmax, codes, valid, L, S, g = _filled(bits)
    ws = 50
    args = (q, kc, kmin, kmax, codes, valid, L, S, ws, bits, mode, 0.125)
    full = tk.code_scores_ref(*args)
    B, Hq, P = full.shape
    pages = _lists(B, Hq, P, 7, g)
    got = tk.code_scores_ref(*args, pages)
    listed = torch.zeros(B, Hq, P + 1, dtype=torch.bool).scatter_(-1, torch.where(pages >= 0, pages, P).long(), True)
    listed = listed[..., :P]
    listed[..., P - 1] = True  # the current page is always scored
    want = full.masked_fill(~listed, float("-inf"))
    fin = want.isfinite()
    assert (~fin & listed).any() and fin.any()  # window/padding pages among the listed: -inf in both
    assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin])
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("S", [16, 32])
@pytest.mark.parametrize("variant", ["words", "bytes"])
@pytest.mark.parametrize("mode", ["max", "lse"])
@pytest.mark.parametrize("bits", [1, 2])
def test_listed_scores_kernel_matches_reference(bits, mode, variant, S):
    q, kc, kmin, kmax, codes, valid, L, S, g = _filled(bits, seed=7, S=S)
    args = (q.half(), kc.half(), kmin.half(), kmax.half(), codes, valid, L, S, 20, bits, mode, 0.125)
    P = -(-L // S)
    pages = _lists(2, 6, P, 9, g)  # 9 ids: a partial last block; the current page is among some lists
    ref = tk.code_scores_ref(*args, pages)
    mine = tk.code_scores(*args, pages, launch=tk.key_codes.CodeScoreLaunch(variant=variant, block_p=4))
    fin = ref.isfinite()
    assert torch.equal(fin, mine.isfinite()) and torch.equal(ref[~fin], mine[~fin])
    torch.testing.assert_close(mine[fin], ref[fin], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fn", ["code_scores_ref", "code_scores"])
def test_listed_scores_write_into_out_only_at_listed_and_current_pages(fn):
    q, kc, kmin, kmax, codes, valid, L, S, g = _filled(2, seed=3)
    args = (q, kc, kmin, kmax, codes, valid, L, S, 0, 2, "max", 1.0)
    P = -(-L // S)
    pages = _lists(2, 6, P, 5, g)
    fresh = getattr(tk, fn)(*args, pages)
    out = torch.full_like(fresh, 7.0)
    assert getattr(tk, fn)(*args, pages, out) is out
    listed = torch.zeros_like(out, dtype=torch.bool).scatter_(-1, pages.clamp(min=0).long(), pages >= 0)
    listed[..., P - 1] = True
    assert torch.equal(out[listed], fresh[listed]) and (out[~listed] == 7.0).all()
    with pytest.raises(ValueError, match="out must be fp32"):
        getattr(tk, fn)(*args, pages, out[..., :-1])
    with pytest.raises(ValueError, match="only for scores of listed pages"):
        getattr(tk, fn)(*args, None, out)


@pytest.mark.parametrize("variant", ["words", "bytes"])
@pytest.mark.parametrize("listed", [False, True], ids=["all-pages", "listed"])
def test_device_position_page_scores_inf(listed, variant):
    """pos= (the captured step's write position) forces page (pos - 1) // S to +inf, wherever it is scored,
    and changes nothing else; kernel and reference agree."""
    q, kc, kmin, kmax, codes, valid, L, S, g = _filled(2, seed=5)
    args = (q.half(), kc.half(), kmin.half(), kmax.half(), codes, valid, L, S, 0, 2, "max", 1.0)
    P = -(-L // S)
    cur = 9  # a complete page: its code estimate is finite without pos=
    pages = None
    if listed:
        pages = _lists(2, 6, P, 9, g)
        pages[0, 1, 0], pages[1, 4, 2] = cur, cur
        pages[0, 2] = torch.where(pages[0, 2] == cur, -1, pages[0, 2])  # a head that does not list it
    pos = torch.tensor(cur * S + 5)
    want = tk.code_scores_ref(*args, pages)
    at = want[..., cur].clone()
    assert at.isfinite().any()
    forced = torch.ones_like(at, dtype=torch.bool) if pages is None else (pages == cur).any(-1)
    want[..., cur] = torch.where(forced, float("inf"), at)
    for fn, kw in (("code_scores_ref", {}), ("code_scores", {"launch": tk.key_codes.CodeScoreLaunch(variant=variant)})):
        got = getattr(tk, fn)(*args, pages, pos=pos, **kw)
        fin = want.isfinite()
        assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin]), fn
        torch.testing.assert_close(got[fin], want[fin], atol=1e-3, rtol=1e-4)
    if listed:  # lse with pos= scores whole rows only (top-p's captured scores: test_selector_qcode.py)
        with pytest.raises(ValueError, match="pos= with mode='lse' scores whole rows"):
            tk.code_scores_ref(*args[:-2], "lse", 1.0, pages, pos=pos)
    with pytest.raises(ValueError, match="one integer tensor"):
        tk.code_scores(*args, pages, pos=torch.tensor([1.0]))


def test_page_list_must_be_int32_per_query_head():
    q, kc, kmin, kmax, codes, valid, L, S, _ = _filled(2)
    with pytest.raises(ValueError, match="pages must be int32"):
        tk.code_scores_ref(q, kc, kmin, kmax, codes, valid, L, S, 0, 2, "max", 1.0, torch.zeros(2, 6, 3))
    with pytest.raises(ValueError, match="pages must be int32"):
        tk.code_scores_ref(q, kc, kmin, kmax, codes, valid, L, S, 0, 2, "max", 1.0,
                           torch.zeros(2, 2, 3, dtype=torch.int32))


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


def test_triton_backend_runs_the_listed_kernel_and_equals_torch(single_thread, monkeypatch):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    calls = []
    import dataclasses

    from quest_hf import ops

    kernel = ops.TRITON.code_scores  # the backend record the layers resolve to (quest_hf.ops.resolve_backend)
    spy = dataclasses.replace(ops.TRITON, code_scores=lambda *a, **k: calls.append(a[-1] is not None) or kernel(*a, **k))
    monkeypatch.setattr(ops, "TRITON", spy)
    out = {}
    for backend in ("torch", "triton"):
        patch_model(model, config=QuestConfig(budget=32, backend=backend, policy="qcode2s", cuda_graph=False))
        out[backend] = model.generate(input_ids=ids, attention_mask=mask, output_scores=True,
                                      return_dict_in_generate=True, **kw)
    assert calls and all(calls)  # the triton backend scored its candidates with the kernel, page lists given
    assert torch.equal(out["torch"].sequences, out["triton"].sequences)
    for a, b in zip(out["torch"].scores, out["triton"].scores):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)


def test_bytes_per_step_come_from_the_registered_selector():
    # Accounting asks the policy's selector (no second table of policy facts): re-registering the two-stage
    # selector with fewer candidates (scripts/passkey.py --candidates) lowers its bytes by exactly their codes.
    from quest_hf.eval.accounting import step_bytes
    from quest_hf.selectors import register_selector

    L, H, D, elt, S, budget, group, pages = 8192, 3, 64, 2, 32, 128, 3, 12.0
    meta = -(-L // S) * H * 2 * D * elt
    kv = pages * S * 2 * D * elt

    def codes(cand):  # 1-bit codes of at most group x candidates x budget tokens per KV head
        return -(-min(-(-L // S), group * cand * (budget // S)) * S * D // 8) * H

    assert step_bytes("qcode1_2s", L, H, D, elt, S, pages, budget, group) == meta + codes(8) + kv
    original = SELECTORS["qcode1_2s"]
    try:
        register_selector("qcode1_2s", TwoStageCodeSelector(bits=1, candidates=4))
        assert step_bytes("qcode1_2s", L, H, D, elt, S, pages, budget, group) == meta + codes(4) + kv
    finally:
        register_selector("qcode1_2s", original)
    assert step_bytes("quest", L, H, D, elt, S, pages, budget, group) == meta + kv
    assert step_bytes("quest", 100, H, D, elt, S, pages, budget, group) == 100 * H * 2 * D * elt  # fits: dense
