"""The 1-bit top-p code selector "qcode1_topp" (QCodeSelector(bits=1, top_p=0.9), quest_hf/selectors.py)."""
import torch

from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.eval.accounting import step_bytes
from quest_hf.patch import cache_arg_name
from quest_hf.selectors import SELECTORS, QCodeSelector, policy_names

from .conftest import left_padded_batch, tiny_model


def test_registered_and_accepted():
    assert "qcode1_topp" in policy_names()
    sel = SELECTORS["qcode1_topp"]
    assert isinstance(sel, QCodeSelector) and sel.bits == 1 and sel.top_p == 0.9
    assert QuestConfig(policy="qcode1_topp").policy == "qcode1_topp"


def test_bytes_count_one_bit_codes():
    """Same accounting as qcode1 (1 bit per key channel and token), half of qcode_topp's code bytes."""
    args = (4096, 3, 64, 2, 16, 40.0, 64, 3)  # L, kv heads, D, fp16, page size, pages read, budget, group
    assert step_bytes("qcode1_topp", *args) == step_bytes("qcode1", *args)
    assert step_bytes("qcode_topp", *args) - step_bytes("qcode1_topp", *args) == 4096 * 64 // 8 * 3


def test_generates_dense_greedy_tokens_when_budget_covers_context(single_thread):
    """Budget 256 covers the left-padded 45-token prompt + 8 new tokens: exactly dense's greedy tokens."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    patch_model(model, config=QuestConfig(budget=256, page_size=16, backend="torch", policy="qcode1_topp"))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


def test_sparse_decode_selects_at_most_budget_pages_with_current(single_thread):
    model = tiny_model("llama", heads=6, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, config=QuestConfig(budget=32, page_size=16, dense_layers=1, backend="torch", policy="qcode1_topp"))
    cache = QuestCache.from_model(model)
    seen = []
    cache.selection_hooks.append(lambda layer, q, page_ids: seen.append(page_ids.clone()))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             **{cache_arg_name(model): cache})
    assert out.shape == (2, ids.shape[1] + 6) and seen
    for step, page_ids in enumerate(seen):
        assert page_ids.dtype == torch.int32 and page_ids.shape[:2] == (2, 2)
        assert page_ids.shape[-1] <= 3 * 2  # union over a group of 3 query heads, 2 pages each
        current = (ids.shape[1] + step // 3) // 16  # slot of the token being decoded; 3 sparse layers per step
        assert (page_ids == current).any(-1).all()
