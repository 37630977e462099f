"""The sparse decode step against a brute force written from the paper's rules (loops, no shared code)."""
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, QuestLayer, patch_model, unpatch_model
from quest_hf.attention import quest_attention_forward
from quest_hf.eval.ppl import fork_cache
from quest_hf.selectors import SELECTORS, QuestSelector, StreamingSelector, check_config, register_selector

from .conftest import left_padded_batch, tiny_model


def _filled_cache(cfg, B, H, D, lengths, extra_tokens, seed=0, num_layers=3):
    """A QuestCache whose layers hold a left-padded prefill (`lengths` real tokens per row) + decode appends."""
    g = torch.Generator().manual_seed(seed)
    cache = QuestCache(cfg, num_layers=num_layers)
    T = max(lengths)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    for layer in cache.layers:
        cache.begin_step(mask, T)
        layer.update(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g))
        for i in range(extra_tokens):
            cache.begin_step(torch.ones(B, T + i + 1), 1)
            layer.update(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
    return cache


def _brute_force(layer, q, cfg, scale, window_start):
    """Chosen page sets per (b, kv head) and attention outputs, straight from the rules."""
    B, Hq, D = q.shape
    H = layer.keys.shape[1]
    G, S, L, K = Hq // H, cfg.page_size, layer.seq_len, cfg.num_pages
    P = math.ceil(L / S)
    chosen, out = {}, torch.zeros(B, Hq, D)
    for b in range(B):
        for h in range(H):
            bounds = torch.full((G, P), float("-inf"))
            for p in range(P):
                slots = [t for t in range(p * S, min((p + 1) * S, L)) if layer.valid[b, t]]
                if not slots or p * S + S <= window_start and p != P - 1:
                    continue
                keys = layer.keys[b, h, slots].float()
                for g in range(G):
                    qq = q[b, h * G + g].float()
                    bounds[g, p] = torch.maximum(qq * keys.min(0).values, qq * keys.max(0).values).sum()
            rows = {"union": bounds, "max": bounds.max(0, keepdim=True).values,
                    "sum": bounds.sum(0, keepdim=True)}[cfg.gqa_mode]
            pages = {P - 1}
            for row in rows:
                order = [p for p in sorted(range(P - 1), key=lambda p: -row[p]) if row[p] > float("-inf")]
                pages |= set(order[: K - 1])
            chosen[b, h] = pages
            slots = [t for p in pages for t in range(p * S, min(p * S + S, L))
                     if layer.valid[b, t] and t >= window_start]
            keys, vals = layer.keys[b, h, slots].float(), layer.values[b, h, slots].float()
            for g in range(G):
                w = torch.softmax(keys @ q[b, h * G + g].float() * scale, 0)
                out[b, h * G + g] = w @ vals
    return chosen, out


CASES = [
    pytest.param(1, 2, 16, "union", 0, id="mha-union"),
    pytest.param(3, 2, 16, "union", 0, id="gqa3-union"),
    pytest.param(4, 1, 16, "union", 0, id="gqa4-union"),
    pytest.param(4, 2, 16, "max", 0, id="gqa4-max"),
    pytest.param(3, 2, 8, "sum", 0, id="gqa3-sum-page8"),
    pytest.param(2, 2, 16, "union", 70, id="gqa2-window70"),
]


@pytest.mark.parametrize("G, H, S, mode, window", CASES)
def test_sparse_step_matches_brute_force(G, H, S, mode, window):
    cfg = QuestConfig(budget=3 * S, page_size=S, gqa_mode=mode)
    B, D = 3, 16
    lengths = (150, 117, 61)  # ragged: row 2 starts with 89 padding slots, i.e. whole padding pages
    cache = _filled_cache(cfg, B, H, D, lengths, extra_tokens=7, seed=G * 10 + H)
    layer = cache.layers[2]
    q = torch.randn(B, H * G, 1, D, generator=torch.Generator().manual_seed(5))
    seen = []
    cache.selection_hooks.append(lambda i, qq, ids: seen.append(ids))
    module = SimpleNamespace(layer_idx=2, num_key_value_groups=G, _quest_state=SimpleNamespace(cache=cache))
    scale = D ** -0.5
    out, _ = quest_attention_forward(module, q, None, None, None, scaling=scale, sliding_window=window or None)
    window_start = max(0, layer.seq_len - window) if window else 0
    chosen, ref = _brute_force(layer, q[:, :, 0], cfg, scale, window_start)
    (ids,) = seen
    for (b, h), pages in chosen.items():
        got = [int(p) for p in ids[b, h] if p >= 0]
        assert len(got) == len(set(got)) and set(got) == pages, (b, h)
        assert (ids[b, h][len(got):] == -1).all()
    pad_pages = (157 - 61) // S  # row 2's leading pages hold padding only
    assert not ((ids[2] >= 0) & (ids[2] < pad_pages)).any()
    torch.testing.assert_close(out[:, 0], ref, atol=1e-5, rtol=1e-5)


def test_metadata_equals_recomputation_after_prefill_and_appends():
    cfg = QuestConfig(budget=64, page_size=16)
    B, H, D = 2, 3, 8
    cache = _filled_cache(cfg, B, H, D, lengths=(37, 20), extra_tokens=300, num_layers=1)  # grows past 256
    layer = cache.layers[0]
    L, S = layer.seq_len, cfg.page_size
    assert L == 337 and layer.capacity >= L and layer.capacity % S == 0
    for b in range(B):
        for p in range(layer.capacity // S):
            slots = [t for t in range(p * S, min(p * S + S, L)) if layer.valid[b, t]]
            if slots:
                keys = layer.keys[b, :, slots]
                torch.testing.assert_close(layer.kmin[b, :, p], keys.amin(1), atol=0, rtol=0)
                torch.testing.assert_close(layer.kmax[b, :, p], keys.amax(1), atol=0, rtol=0)
            else:
                assert (layer.kmin[b, :, p] == float("inf")).all() and (layer.kmax[b, :, p] == float("-inf")).all()
    assert not layer.valid[1, :17].any() and layer.valid[1, 17:L].all() and not layer.valid[:, L:].any()


def test_crop_rebuilds_the_boundary_page():
    cfg = QuestConfig(budget=64, page_size=16)
    cache = _filled_cache(cfg, 1, 2, 8, lengths=(50,), extra_tokens=0, num_layers=1)
    layer = cache.layers[0]
    keys = layer.keys[:, :, :50].clone()
    cache.crop(-13)
    assert layer.seq_len == 37
    torch.testing.assert_close(layer.kmin[0, :, 2], keys[0, :, 32:37].amin(1), atol=0, rtol=0)
    assert (layer.kmax[0, :, 3] == float("-inf")).all() and not layer.valid[0, 37:].any()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), D=st.sampled_from([4, 16, 64]),
       spread=st.floats(0.01, 100.0), outlier=st.floats(0.0, 50.0))
def test_bound_never_underestimates_a_page(seed, n, D, spread, outlier):
    """Quest's page score is >= q.k for every valid key of the page (the bound of arXiv 2406.10774)."""
    g = torch.Generator().manual_seed(seed)
    S, C = 8, 48
    keys = torch.randn(1, 1, n, D, generator=g) * spread
    keys[..., 0] += outlier  # outlier channels are what loosen the bound on real models
    q = torch.randn(1, 1, D, generator=g) * spread
    kc, vc = torch.zeros(1, 1, C, D), torch.zeros(1, 1, C, D)
    kmin, kmax = torch.full((1, 1, C // S, D), float("inf")), torch.full((1, 1, C // S, D), float("-inf"))
    valid = torch.zeros(1, C, dtype=torch.bool)
    tk.append_kv_ref(kc, vc, kmin, kmax, valid, keys, keys, None, 0)
    scores = tk.score_pages_ref(q, kmin, kmax, n, S)[0, 0]
    dots = (keys[0, 0] @ q[0, 0]).double()
    for p in range(math.ceil(n / S) - 1):  # the last page is forced to +inf
        best = dots[p * S:(p + 1) * S].max()
        assert scores[p] >= best - 1e-4 * (1 + best.abs()), (p, float(scores[p]), float(best))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(budget=0), ValueError, "budget must be a positive"),
    (dict(budget=-5), ValueError, "budget must be a positive"),
    (dict(budget=16, page_size=16), ValueError, "smaller than 2 pages.*budget >= 32"),
    (dict(page_size=0), ValueError, "power of two"),
    (dict(page_size=-16), ValueError, "power of two"),
    (dict(page_size=12), ValueError, "power of two"),
    (dict(budget=2048.0), TypeError, "must be an int"),
    (dict(gqa_mode="mean"), ValueError, "unknown gqa_mode 'mean'; choose one of union, max, sum"),
    (dict(backend="cuda"), ValueError, "unknown backend 'cuda'; choose one of auto, torch, triton"),
    (dict(policy=""), ValueError, "policy must name a selector"),
    (dict(policy=None), TypeError, "policy must name a selector"),
    (dict(dense_layers=-1), ValueError, "dense_layers must be >= 0"),
], ids=["budget0", "budget-neg", "budget-1page", "page0", "page-neg", "page12", "budget-float",
        "mode", "backend", "policy-empty", "policy-none", "dense-neg"])
def test_bad_config_says_what_to_do(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        QuestConfig(**kwargs)


UNKNOWN = (r"unknown policy 'not_registered_yet'; choose one of quest, streaming, oracle, qcode, .*qcode1_2s \(or "
           r"register yours first: quest_hf.selectors.register_selector\(name, selector\)\)")


def test_an_unregistered_policy_builds_and_is_refused_where_bound():
    # QuestConfig never reads the selector registry: the name is checked where the config is bound.
    cfg = QuestConfig(budget=32, policy="not_registered_yet")
    assert cfg.policy == "not_registered_yet" and cfg == QuestConfig(budget=32, policy="not_registered_yet")
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match=UNKNOWN):
        patch_model(model, config=cfg)
    with pytest.raises(ValueError, match=UNKNOWN):
        patch_model(model, budget=32, policy="not_registered_yet")
    assert "_quest_state" not in vars(model)  # refused before anything was replaced
    with pytest.raises(ValueError, match=UNKNOWN):
        QuestCache(cfg, 2)
    with pytest.raises(ValueError, match=UNKNOWN):
        QuestLayer(cfg)
    with pytest.raises(ValueError, match=UNKNOWN):
        QuestCache(QuestConfig(budget=32), 2).copy(cfg)
    with pytest.raises(ValueError, match=UNKNOWN):
        fork_cache(QuestCache(QuestConfig(budget=32), 2), cfg)
    with pytest.raises(ValueError, match=UNKNOWN):
        check_config(cfg)


def test_registering_after_building_the_config_makes_the_same_config_usable():
    settings = dict(budget=32, policy="not_registered_yet", bounds="int8", reselect_every=2)
    cfg = QuestConfig(**settings)
    before = hash(cfg)
    with pytest.raises(ValueError, match=UNKNOWN):
        QuestCache(cfg, 2)
    model = tiny_model("llama", heads=6, kv_heads=2, layers=4)
    ids, mask = left_padded_batch()
    kw = dict(max_new_tokens=8, do_sample=False)
    patch_model(model, config=QuestConfig(**dict(settings, policy="quest")))
    ref = model.generate(ids, attention_mask=mask, **kw)
    register_selector("not_registered_yet", QuestSelector())
    try:
        assert hash(cfg) == before and cfg == QuestConfig(**settings)  # a value: registration changes nothing in it
        assert {QuestConfig(**settings): "same key"}[cfg] == "same key"
        assert isinstance(QuestCache(cfg, 2).layers[1].selector, QuestSelector)
        patch_model(model, config=cfg)
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), ref)  # quest's selector under a new name
        # The checks follow whatever the name resolves to when bound: a selector without reuse refuses the same config.
        register_selector("not_registered_yet", StreamingSelector())
        with pytest.raises(ValueError, match="bounds='int8' is read by policy 'quest' only; policy "
                                             "'not_registered_yet' reads the key-dtype bounds"):
            QuestCache(cfg, 2)
        assert hash(cfg) == before
    finally:
        SELECTORS.pop("not_registered_yet", None)
        unpatch_model(model)


@pytest.mark.parametrize("settings, match", [
    (dict(policy="h2o"), "unknown policy 'h2o'; choose one of quest, streaming, oracle"),
    (dict(budget=40), r"budget=40 is not a multiple of page_size=16: policy 'quest' chooses whole pages .*use "
                      r"budget=32 or budget=48"),
    (dict(budget=64, layer_budgets=(64, 40)), r"layer_budgets\[1\]=40 must be a multiple of page_size=16 .*use 32"),
    (dict(bounds="int8", policy="streaming"), "bounds='int8' is read by policy 'quest' only; policy 'streaming' reads "
                                              "the key-dtype bounds: use bounds='key_dtype' or policy='quest'"),
    (dict(reselect_every=3, policy="qcode"), "reselect_every=3 is supported by policy 'quest' only, got policy "
                                             "'qcode'; use reselect_every=1 or policy='quest'"),
], ids=["unknown-policy", "budget-pages", "layer-budget-pages", "int8-bounds", "reuse"])
def test_selector_checks_fire_where_the_config_is_bound(settings, match):
    cfg = QuestConfig(**settings)  # each is the selector's rule: the config itself builds
    model = patch_model(tiny_model("llama", layers=2), budget=32)
    with pytest.raises(ValueError, match=match):
        patch_model(model, config=cfg)
    assert model._quest_state.config == QuestConfig(budget=32)  # a refused re-configuration keeps the settings
    with pytest.raises(ValueError, match=match):
        patch_model(tiny_model("llama", layers=2), config=cfg)
    with pytest.raises(ValueError, match=match):
        QuestCache(cfg, 2)
    filled = QuestCache(QuestConfig(budget=64), 2)
    with pytest.raises(ValueError, match=match):
        filled.copy(cfg)
    with pytest.raises(ValueError, match=match):
        fork_cache(filled, cfg)


def test_config_is_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        QuestConfig().budget = 4
