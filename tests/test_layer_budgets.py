"""Per-layer settings (QuestConfig.layer_budgets / dense): validation, exactness at covering budgets, each layer
reading its own budget on the decode path and in the bytes accounting."""
import pytest
import torch

from quest_hf import QuestCache, QuestConfig, describe_patch, patch_model
from quest_hf.eval.accounting import dense_bytes, model_step_bytes, step_bytes
from quest_hf.patch import cache_arg_name

from .conftest import left_padded_batch, one_thread, tiny_model


def test_config_validates_per_layer_settings():
    cfg = QuestConfig(budget=64, layer_budgets=[32, 64, 128, 256], dense=[3, 0])
    assert cfg.layer_budgets == (32, 64, 128, 256) and cfg.dense == (0, 3)  # lists normalised: hashable
    hash(cfg)
    assert [cfg.is_dense(i) for i in range(4)] == [True, False, False, True]
    assert [cfg.for_layer(i).budget for i in range(4)] == [32, 64, 128, 256]
    assert QuestConfig(dense_layers=2).is_dense(1) and not QuestConfig(dense_layers=2).is_dense(2)
    assert not QuestConfig(dense=()).is_dense(0)  # dense overrides dense_layers
    uneven = QuestConfig(budget=64, layer_budgets=(64, 40))  # whole pages: the selector's rule, checked when bound
    with pytest.raises(ValueError, match=r"layer_budgets\[1\]=40 must be a multiple of page_size=16"):
        QuestCache(uneven, 2)
    with pytest.raises(ValueError, match=r"layer_budgets\[1\]=40 must be a multiple of page_size=16"):
        patch_model(tiny_model("llama", layers=2), config=uneven)
    QuestCache(QuestConfig(budget=64, layer_budgets=(64, 40), policy="oracle"), 2)  # the oracle counts tokens
    with pytest.raises(ValueError, match="at least 2 pages"):
        QuestConfig(budget=64, layer_budgets=(16, 64))
    with pytest.raises(TypeError, match="tuple of ints"):
        QuestConfig(layer_budgets=(64.0,))
    with pytest.raises(ValueError, match="distinct layer indices"):
        QuestConfig(dense=(1, 1))
    with pytest.raises(ValueError, match="one budget per layer"):
        cfg.check_layers(5)


def test_patch_model_checks_the_layer_count():
    model = tiny_model("llama", heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="layer_budgets has 3 entries for a model of 4 layers"):
        patch_model(model, config=QuestConfig(budget=32, layer_budgets=(32, 32, 32)))
    with pytest.raises(ValueError, match="dense names layer 4, but the model has layers 0-3"):
        patch_model(model, config=QuestConfig(budget=32, dense=(4,)))
    with pytest.raises(ValueError, match="one budget per layer"):
        QuestCache(QuestConfig(budget=32, layer_budgets=(32, 32)), 4)


@pytest.mark.parametrize("dense", [None, (), (1, 3)], ids=["first-2", "none", "1-and-3"])
def test_covering_layer_budgets_give_the_unpatched_tokens(dense):
    model = tiny_model("llama", heads=6, kv_heads=2)
    ids, mask = left_padded_batch()
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with one_thread():
        ref = model.generate(ids, attention_mask=mask, **kw)
        # Every layer's budget covers prompt + new tokens (48 + 10): each decodes exactly, whatever its budget.
        patch_model(model, config=QuestConfig(budget=64, layer_budgets=(64, 256, 128, 80), dense=dense))
        out = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert [layer.config.budget for layer in out.past_key_values.layers] == [64, 256, 128, 80]


def test_each_layer_reads_its_own_budget():
    model = tiny_model("llama", heads=6, kv_heads=2)  # GQA group 3
    ids, mask = left_padded_batch(lengths=(150, 131))
    budgets = (256, 32, 64, 96)
    cfg = QuestConfig(budget=64, page_size=16, layer_budgets=budgets, dense=(0,), gqa_mode="max")
    patch_model(model, config=cfg)
    print(describe_patch(model))
    cache = QuestCache.from_model(model)
    seen = {}
    cache.selection_hooks.append(lambda i, q, page_ids: seen.setdefault(i, []).append(page_ids.clone()))
    with one_thread():
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **{cache_arg_name(model): cache})
    assert set(seen) == {1, 2, 3}  # layer 0 is listed dense
    for i, steps in seen.items():
        for page_ids in steps:  # "max": one choice per KV head, exactly budget // page_size pages
            assert ((page_ids >= 0).sum(-1) == budgets[i] // 16).all(), (i, page_ids)
    # Bytes: the dense layer reads everything, each sparse layer its own budget's pages.
    L, H, D, elt = 160, 2, 16, 4
    pages = {i: 2 * (budgets[i] // 16) for i in (1, 2, 3)}
    want = dense_bytes(L, H, D, elt) + sum(step_bytes("quest", L, H, D, elt, 16, pages[i], budgets[i], 3)
                                           for i in (1, 2, 3))
    assert model_step_bytes(cfg, 4, L, H, D, elt, group=3) == want
    assert model_step_bytes(cfg, 4, L, H, D, elt, group=3, pages_read=pages) == want
    union = QuestConfig(budget=64, layer_budgets=budgets, dense=(0,))  # union: up to group x budget a KV head
    assert model_step_bytes(union, 4, L, H, D, elt, group=3) == dense_bytes(L, H, D, elt) + sum(
        step_bytes("quest", L, H, D, elt, 16, 2 * min(10, 3 * budgets[i] // 16), budgets[i], 3) for i in (1, 2, 3))
    flat = QuestConfig(budget=64, dense_layers=1, gqa_mode="max")
    assert model_step_bytes(flat, 4, L, H, D, elt, group=3) == dense_bytes(L, H, D, elt) + 3 * step_bytes(
        "quest", L, H, D, elt, 16, 2 * 4, 64, 3)


def test_copy_under_per_layer_config_gives_each_layer_its_budget():
    cache = QuestCache(QuestConfig(budget=64), 3)
    new = cache.copy(QuestConfig(budget=64, layer_budgets=(32, 64, 128)))
    assert [layer.config.budget for layer in new.layers] == [32, 64, 128]
    with pytest.raises(ValueError, match="one budget per layer"):
        cache.copy(QuestConfig(budget=64, layer_budgets=(32, 64)))
