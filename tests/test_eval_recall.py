"""quest_hf.eval.recall: selection recall per layer, on hand-made sets, tiny random models and SmolLM2."""

import pytest
import torch

from quest_hf.cache import QuestLayer
from quest_hf.config import QuestConfig
from quest_hf.eval.passkey import make_case
from quest_hf.eval.recall import (
    find_token_positions,
    measure_recall,
    oracle_token_sets,
    page_token_sets,
    top_recall,
    true_top_tokens,
)
from quest_hf.selectors import SELECTORS

from .conftest import one_thread, tiny_model


def test_page_token_sets_expand_pages_and_mask_unused_invalid_and_window():
    ids = torch.tensor([[[0, 2, -1], [1, -1, -1]]], dtype=torch.int32)  # [B=1, H_kv=2, K=3], page_size 4
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, 1] = False
    sets = page_token_sets(ids, seq_len=10, page_size=4, valid=valid)
    assert sets.shape == (1, 2, 10)
    assert sets[0, 0].nonzero().flatten().tolist() == [0, 2, 3, 8, 9]  # page 2 is partial, slot 1 padding
    assert sets[0, 1].nonzero().flatten().tolist() == [4, 5, 6, 7]
    windowed = page_token_sets(ids, seq_len=10, page_size=4, valid=valid, window_start=3)
    assert windowed[0, 0].nonzero().flatten().tolist() == [3, 8, 9]


def test_page_token_sets_are_what_sparse_attention_reads(single_thread):
    """Attention restricted to `page_token_sets` equals the sparse decode attention over the same page ids."""
    import triton_kernels as tk

    torch.manual_seed(1)
    B, H, G, L, D, S = 2, 2, 3, 45, 16, 4
    keys, vals = torch.randn(B, H, 48, D), torch.randn(B, H, 48, D)
    valid = torch.ones(B, 48, dtype=torch.bool)
    valid[0, :6] = False
    q = torch.randn(B, H * G, D)
    ids = torch.tensor([[[0, 3, 11, -1], [2, 5, -1, -1]], [[1, 11, 7, 4], [0, -1, -1, -1]]], dtype=torch.int32)
    for ws in (0, 10):
        sets = page_token_sets(ids, L, S, valid, ws)
        logits = torch.einsum("bhgd,bhnd->bhgn", q.reshape(B, H, G, D), keys[:, :, :L]) * D ** -0.5
        w = torch.softmax(logits.masked_fill(~sets[:, :, None], float("-inf")), -1).nan_to_num(0.0)
        expected = torch.einsum("bhgn,bhnd->bhgd", w, vals[:, :, :L]).reshape(B, H * G, D)
        out = tk.sparse_decode_attention_ref(q, keys, vals, ids, valid, L, S, D ** -0.5, ws)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_top_recall_counts_each_query_head_against_its_kv_head():
    sets = torch.zeros(1, 2, 8, dtype=torch.bool)
    sets[0, 0, :4] = True  # KV head 0 reads 0..3, KV head 1 reads 4..7
    sets[0, 1, 4:] = True
    top = torch.tensor([[[[0, 1], [0, 5]], [[4, 5], [1, 2]]]])  # [B, H_kv=2, G=2, k=2]
    assert top_recall(sets, top).tolist() == [[1.0, 0.5, 1.0, 0.0]]


@pytest.mark.parametrize("budget,window", [(8, 0), (20, 0), (8, 12)], ids=["b8", "b20", "b8-window"])
def test_oracle_token_sets_follow_oracle_attention(budget, window, single_thread):
    """Attention restricted to `oracle_token_sets` is what the oracle policy computes."""
    torch.manual_seed(0)
    B, H, G, L, D = 2, 2, 3, 37, 16
    layer = QuestLayer(QuestConfig(budget=budget, page_size=4, policy="oracle", backend="torch"))
    keys, vals = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    layer.update(keys, vals)
    layer.valid[1, :5] = False  # padding in one row
    q = torch.randn(B, H * G, D)
    sets = oracle_token_sets(q, layer.keys[:, :, :L], layer.valid, budget, window)
    assert 0 < int(sets.sum(-1).min()) and int(sets.sum(-1).max()) <= G * budget
    logits = torch.einsum("bhgd,bhnd->bhgn", q.reshape(B, H, G, D), keys) * D ** -0.5
    w = torch.softmax(logits.masked_fill(~sets[:, :, None], float("-inf")), -1)
    expected = torch.einsum("bhgn,bhnd->bhgd", w, vals).reshape(B, H * G, D)
    layer.pos.fill_(L)
    size = L - window if window else 0  # the sliding window whose first slot is `window`
    got = SELECTORS["oracle"].attend(layer, q, D ** -0.5, size, lambda ids: None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # ... and each query head's true top tokens (ranked among the tokens it may see) lie in its group's set
    top = true_top_tokens(q, layer.keys[:, :, :L], layer.valid, min(budget, 5), window)
    assert top_recall(sets, top).min() == 1.0
    assert not sets[1, :, :5].any() and not sets[..., :window].any()


@pytest.fixture(scope="module")
def tiny_recall():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=4)  # GQA group 3
    ids = torch.randint(2, 97, (1, 230), generator=torch.Generator().manual_seed(3))
    needle = [100, 101, 102]
    with one_thread():
        return measure_recall(model, ids[:, :200], ids[:, 200:], budgets=(16, 32, 256), page_size=4, dense_layers=1,
                              needle=needle)


def test_recall_is_one_and_labelled_dense_when_the_budget_covers_the_context(tiny_recall):
    assert tiny_recall["layers"] == [1, 2, 3] and tiny_recall["steps"] == 30
    for policy in ("quest", "streaming", "oracle"):
        r = tiny_recall["results"][policy][256]
        assert r["dense"] == [1.0, 1.0, 1.0], policy
        assert r["recall"] == [1.0, 1.0, 1.0] and r["needle_any"] == [1.0, 1.0, 1.0]
        assert r["mean_recall"] == 1.0


def test_oracle_recall_bounds_quest_on_the_same_steps(tiny_recall):
    for budget in (16, 32):
        quest, oracle = tiny_recall["results"]["quest"][budget], tiny_recall["results"]["oracle"][budget]
        assert quest["dense"] == [0.0, 0.0, 0.0]  # every step selected pages
        assert all(o >= q for o, q in zip(oracle["recall"], quest["recall"]))
        assert oracle["recall"] == [1.0, 1.0, 1.0]  # top-10 of a head is inside its own top-budget
        assert quest["mean_recall"] < 0.99  # the selection is lossy here, so the comparison means something
    streaming = tiny_recall["results"]["streaming"][16]
    assert streaming["mean_recall"] < tiny_recall["results"]["quest"][16]["mean_recall"]
    assert streaming["needle_any"] == [0.0, 0.0, 0.0]  # mid-context tokens: neither sink nor recent pages
    # a bigger budget reads a superset for the query-agnostic policy
    assert all(a <= b for a, b in zip(streaming["recall"], tiny_recall["results"]["streaming"][32]["recall"]))


def test_find_token_positions_locates_the_passkey_digits(smollm2):
    _, tok = smollm2
    case = make_case(tok, 600, 0.5, seed=7)
    ids = case.prefix[0].tolist()
    pos = find_token_positions(tok, ids, case.key)
    assert tok.decode([ids[i] for i in pos]).replace(" ", "") == case.key * 2  # "{key}. Remember it. {key} is"
    assert 0.3 < pos[0] / len(ids) < 0.7
    with pytest.raises(ValueError, match="does not occur as whole tokens"):
        find_token_positions(tok, ids, "31415926")


def test_smollm2_streaming_loses_a_mid_context_needle_that_the_oracle_keeps(smollm2):
    """~1K-token passkey prompt, needle at depth 0.5, budget 64: only the query-aware selections can reach it."""
    model, tok = smollm2
    case = make_case(tok, 1000, 0.5, seed=0)
    needle = find_token_positions(tok, case.prefix[0].tolist(), case.key)
    r = measure_recall(model, case.prefix, case.tail, budgets=(64,), needle=needle)["results"]
    quest, oracle, streaming = r["quest"][64], r["oracle"][64], r["streaming"][64]
    assert streaming["needle_any"] == [0.0] * 28
    assert all(v in (0.0, None) for v in streaming["needle_top"])
    attended = [i for i, v in enumerate(oracle["needle_top"]) if v is not None]
    assert len(attended) >= 5  # several layers look at the digits while decoding the question
    assert all(oracle["needle_top"][i] == 1.0 for i in attended)
    assert oracle["mean_needle_any"] > 0.2
    assert all(o >= q for o, q in zip(oracle["recall"], quest["recall"]))
    assert 0.5 < quest["mean_recall"] < 1.0 and quest["mean_recall"] > streaming["mean_recall"]
