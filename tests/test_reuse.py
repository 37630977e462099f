"""Selection reuse (QuestConfig(reselect_every=k)): pages chosen every k decode steps on the device, reused in
between with the pages started since; k=1 is today's step exactly. Captured vs eager: tests/gpu/test_gpu_bounds_reuse.py."""
import os

import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, QuestLayer, patch_model
from quest_hf.eval.accounting import step_bytes

from .conftest import left_padded_batch, tiny_model

triton_ok = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                               reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def _gen(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          **kw)


def test_reuse_every_step_is_todays_step_exactly(single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    kw = dict(max_new_tokens=12)
    patch_model(model, budget=32, dense_layers=1)
    plain = _gen(model, ids, mask, **kw)
    patch_model(model, budget=32, dense_layers=1, reselect_every=1)
    one = _gen(model, ids, mask, **kw)
    assert torch.equal(plain.sequences, one.sequences)
    for a, b in zip(plain.scores, one.scores):
        assert torch.equal(a, b)  # bit for bit: k=1 keeps no state and runs no extra op
    assert all(not layer.reuse for layer in one.past_key_values.layers)
    patch_model(model, budget=32, dense_layers=1, reselect_every=4)  # and reuse does change a small budget's tokens
    four = _gen(model, ids, mask, **kw)
    assert any(not torch.equal(a, b) for a, b in zip(plain.scores, four.scores))


@triton_ok
@pytest.mark.parametrize("B, H, K, every, S", [
    pytest.param(1, 1, 1, 2, 16, id="K1-k2"),
    pytest.param(2, 3, 7, 4, 4, id="k4-S4"),
    pytest.param(3, 2, 33, 9, 4, id="k9-S4-two-new-pages"),
    pytest.param(1, 8, 130, 16, 16, id="K130-k16"),
])
def test_reuse_kernel_matches_its_twin_over_an_interval(B, H, K, every, S, monkeypatch):
    from .testing import nan_empty

    g = torch.Generator().manual_seed(K)
    state = [torch.full((B, H, K), -1, dtype=torch.int32), torch.tensor(0), torch.tensor(0),
             torch.tensor(1, dtype=torch.int32)]
    mine = [t.clone() for t in state]
    ticket = torch.zeros((), dtype=torch.int32)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))  # an output slot the kernel skips reads 0x5A...
    for t in range(2 * every + 1):
        pos = torch.tensor(5 * S + 3 + t)
        c0 = (int(pos) - 1) // S
        # A fresh selection as Top-K returns it: distinct pages <= the current one, the spare page last, then -1.
        n = int(torch.randint(1, min(K, c0 + 1) + 1, (), generator=g))
        rows = [sorted(torch.randperm(c0 + 1, generator=g)[: n - 1].tolist()) + [10 * S] + [-1] * (K - n)
                for _ in range(B * H)]
        fresh = torch.tensor(rows, dtype=torch.int32).reshape(B, H, K)
        want = tk.reuse_pages_ref(fresh, *state, pos, S, every)
        got = tk.reuse_pages(fresh, *mine, pos, S, every, ticket)
        assert torch.equal(got, want) and int(ticket) == 0, f"step {t}"
        assert all(torch.equal(a, b) for a, b in zip(mine, state))
    assert int(state[2]) == 2 * every + 1 and int(state[3]) == int((2 * every + 1) % every == 0)


def _fresh(layer, q):
    """The selection without reuse at this step: the plain rule over the allocation, through the page table."""
    cfg = layer.config
    G = q.shape[1] // layer.kmin.shape[1]
    s = tk.score_pages_ref(q, layer.kmin, layer.kmax, layer.keys.shape[2], cfg.page_size, pos=layer.pos,
                           rows=layer.rows)
    return tk.topk_pages_ref(s, cfg.num_pages + 1, G)


def _sets(ids):
    return [set(r.tolist()) - {-1} for r in ids.flatten(0, 1)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_ok)])
@pytest.mark.parametrize("every, S", [pytest.param(4, 4, id="k4-S4"), pytest.param(3, 8, id="k3-S8"),
                                      pytest.param(8, 4, id="k8-S4-two-new-pages")])
def test_hand_driven_steps_attend_the_stored_selection_plus_the_pages_started_since(every, S, backend):
    # A layer driven by hand through growth, a beam reorder and a crop: each step's pages are computed here from
    # the plain rule (on a due step) or from the last due step's selection and the page positions (in between).
    g = torch.Generator().manual_seed(every * S)
    B, H, G, D = 2, 2, 2, 16
    cfg = QuestConfig(budget=3 * S, page_size=S, reselect_every=every, backend=backend)
    layer = QuestLayer(cfg, capacity=6 * S)
    layer.update(torch.randn(B, H, 3 * S + 1, D, generator=g), torch.randn(B, H, 3 * S + 1, D, generator=g))
    stored, c0, counter, allocations = None, None, 0, layer.allocations
    steps = 7 * S + every
    for t in range(steps):
        k = torch.randn(B, H, 1, D, generator=g) * (1 + t % 3)
        layer.update(k, torch.randn(B, H, 1, D, generator=g))
        if layer.allocations != allocations:  # growth: chosen afresh
            counter, allocations = 0, layer.allocations
        if t == steps // 2:  # beams mid-interval: each sequence reuses the selection of the one it continues
            beam = torch.tensor([1, 1])
            layer.reorder_cache(beam)
            stored = stored[beam] if stored is not None else None
            allocations = layer.allocations  # the first reorder makes the page table: not a growth
        if t == steps // 2 + 2:  # crop: chosen afresh at the next step
            layer.crop(-2)
            layer.update(torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g))
            counter = 0
        q = torch.randn(B, H * G, D, generator=g)
        fresh = _fresh(layer, q)
        got = layer.selector.select(layer, q, 0)
        cur = (int(layer.pos) - 1) // S
        if counter % every == 0:
            stored, c0 = fresh, cur
            want = _sets(fresh)
        else:
            want = [s | set(range(c0 + 1, cur + 1)) for s in _sets(stored)]
        counter += 1
        assert _sets(got) == want, f"step {t}"
        for r in got.flatten(0, 1).tolist():  # the contract: ascending valid ids, then -1; no page twice
            n = sum(x >= 0 for x in r)
            assert r[:n] == sorted(set(r[:n])) and all(x == -1 for x in r[n:])
    assert layer.allocations > 1  # the loop grew the layer
    layer.reset()
    assert int(layer.reuse["step"]) == 0


@pytest.mark.parametrize("every", [2, 5])
@pytest.mark.parametrize("beams", [1, 3])
def test_covering_budget_with_reuse_gives_the_unpatched_tokens(every, beams, single_thread):
    # Every written page is chosen at a due step and every later one is added: a page read twice (or one missed)
    # would change the logits. The allocation is far larger than the budget, so every step selects.
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(45, 38))
    kw = dict(max_new_tokens=21, num_beams=beams)
    ref = _gen(model, ids, mask, **kw)
    patch_model(model, budget=128, page_size=4, dense_layers=0, reselect_every=every, backend="torch")
    cache = QuestCache.from_model(model, max_length=400)
    out = _gen(model, ids, mask, past_key_values=cache, **kw)
    assert int(cache.layers[0].reuse["step"]) == 20  # every decode step went through the reuse path
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_reuse_with_int8_bounds_and_a_sliding_window_runs(single_thread):
    model = tiny_model("mistral", heads=8, kv_heads=2, sliding_window=48)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, dense_layers=1, reselect_every=3, bounds="int8")
    cache = QuestCache.from_model(model)
    seen = []
    cache.selection_hooks.append(lambda i, q, page_ids: seen.append(page_ids))
    out = _gen(model, ids, mask, max_new_tokens=10, past_key_values=cache)
    assert out.sequences.shape[1] == ids.shape[1] + 10 and len(seen) == 9 * 3
    for p in seen:  # the hooks see the contract too: no page twice in a KV head's row
        for r in p.flatten(0, 1).tolist():
            v = [x for x in r if x >= 0]
            assert len(v) == len(set(v))


def test_config_validates_reselect_every():
    assert QuestConfig().reselect_every == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="reselect_every must be an int >= 1"):
            QuestConfig(reselect_every=bad)
    cfg = QuestConfig(reselect_every=4, policy="streaming")  # the selector's rule: checked where the config is bound
    with pytest.raises(ValueError, match="reselect_every=4 is supported by policy 'quest' only, got policy 'streaming'"):
        QuestCache(cfg, 2)
    with pytest.raises(ValueError, match="supported by policy 'quest' only"):
        patch_model(tiny_model("llama"), config=cfg)


def test_accounting_amortises_the_metadata_over_the_interval():
    L, H, D, S, elt = 8192, 8, 128, 16, 2
    every = step_bytes("quest", L, H, D, elt, S, pages_read=100, budget=512)
    fourth = step_bytes("quest", L, H, D, elt, S, pages_read=100, budget=512, reselect_every=4)
    kv = 100 * S * 2 * D * elt
    assert fourth - kv == pytest.approx((every - kv) / 4)
