"""cuda_graph=True: the fixed-shape decode step gives what the growing cache gives (CPU runs it uncaptured)."""
import sys

import pytest
import torch

from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.static import StaticQuestLayer

from .conftest import left_padded_batch, tiny_model


def _gen(model, ids, mask, n=12):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("heads, kv_heads, mode, budget", [
    pytest.param(8, 2, "union", 32, id="gqa4-union-sparse"),
    pytest.param(6, 2, "max", 48, id="gqa3-max-sparse"),
    pytest.param(4, 4, "union", 32, id="mha-sparse"),
    pytest.param(8, 2, "union", 1024, id="gqa4-covering"),
])
def test_static_step_matches_growing_cache(heads, kv_heads, mode, budget, single_thread):
    model = tiny_model("llama", heads=heads, kv_heads=kv_heads)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=budget, gqa_mode=mode)
    grow = _gen(model, ids, mask)
    patch_model(model, budget=budget, gqa_mode=mode, cuda_graph=True)
    static = _gen(model, ids, mask)
    cache = static.past_key_values
    assert all(isinstance(layer, StaticQuestLayer) for layer in cache.layers)
    assert torch.equal(grow.sequences, static.sequences)
    for a, b in zip(grow.scores, static.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    layer = cache.layers[-1]
    n = ids.shape[1] + 11
    assert layer.seq_len == n and int(layer.pos) == n and layer.max_length == -(-(ids.shape[1] + 12) // 16) * 16
    assert layer.capacity == layer.max_length + 16 and not layer.valid[:, layer.max_length:].any()
    # Memory is flat: nothing grew past the allocation made at prefill.
    assert layer.keys.shape[2] == layer.capacity


def test_static_cache_grows_when_continued_past_its_length():
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, cuda_graph=False)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    patch_model(model, budget=32, cuda_graph=True)
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + 2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, past_key_values=cache)
    assert torch.equal(ref, out)
    assert cache.layers[0].max_length >= ids.shape[1] + 29 and int(cache.layers[0].pos) == ids.shape[1] + 29


def test_beams_with_cuda_graph():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32, cuda_graph=True)
    with pytest.raises(ValueError, match="does not support beam search"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="needs a static capacity"):
        QuestCache(QuestConfig(cuda_graph=True), num_layers=2)
    patch_model(model, budget=32)  # "auto": beam search keeps the growing cache
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, return_dict_in_generate=True)
    assert not isinstance(out.past_key_values.layers[0], StaticQuestLayer)


def test_auto_on_cpu_keeps_the_growing_cache():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert out.past_key_values.graph is None


def test_static_sliding_window_is_refused_clearly():
    model = tiny_model("mistral", sliding_window=24)
    patch_model(model, budget=32, cuda_graph=True)
    ids, mask = left_padded_batch()
    with pytest.raises(NotImplementedError, match="sliding-window"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)


def test_cuda_graph_needs_a_captured_policy():
    for policy in ("oracle", "streaming", "qcode_topp"):
        with pytest.raises(ValueError, match="cuda_graph=True runs the policies quest, qcode"):
            QuestConfig(cuda_graph=True, policy=policy)
    QuestConfig(cuda_graph=True, policy="qcode1_2s", page_size=32)


@pytest.mark.parametrize("policy, page_size, backend, n", [
    pytest.param("qcode1_2s", 16, "torch", 40, id="qcode1_2s"),  # 90 -> 129 tokens: 3 pages completed in decode
    pytest.param("qcode2s", 32, "torch", 40, id="qcode2s-page32"),
    pytest.param("qcode", 16, "torch", 40, id="qcode"),
    pytest.param("qcode1_2s", 16, "triton", 8, id="qcode1_2s-triton"),  # interpreted: one page completed
])
def test_code_selectors_static_step_matches_growing_cache(policy, page_size, backend, n, single_thread):
    # The captured step's code selectors: codes of the pages that decode completes are encoded at the device
    # position; selection over the whole capacity gives the growing cache's pages (and tokens).
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90, 71))
    kw = dict(budget=2 * page_size, page_size=page_size, policy=policy, backend=backend)
    patch_model(model, **kw, cuda_graph=False)
    grow = _gen(model, ids, mask, n=n)
    patch_model(model, **kw, cuda_graph=True)
    static = _gen(model, ids, mask, n=n)
    assert all(isinstance(layer, StaticQuestLayer) for layer in static.past_key_values.layers)
    assert torch.equal(grow.sequences, static.sequences)
    for a, b in zip(grow.scores, static.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Every complete page's codes equal an encoding from scratch of the final keys.
    import triton_kernels as tk

    layer = static.past_key_values.layers[-1]
    sel = layer._selector
    codes = layer.side[sel.key]
    full = layer.seq_len // page_size
    fresh = torch.zeros_like(codes)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, fresh, 0, full, sel.bits)
    assert full * page_size > ids.shape[1] and torch.equal(codes[:, :, :full * page_size], fresh[:, :, :full * page_size])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compile_decode_wraps_norms_and_mlps_for_decode_only(family, monkeypatch):
    # On CUDA the wrapped modules run inductor; here the same wrapping runs dynamo's "eager" backend on CPU,
    # which checks the plumbing: one-token steps go through torch.compile, prefill does not, outputs equal.
    from quest_hf import fuse, unpatch_model

    monkeypatch.setattr(fuse, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse, "BACKEND", "eager")
    model = tiny_model(family, heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32, cuda_graph=True, compile_decode=False)
    plain = _gen(model, ids, mask, n=6)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    users = lambda: fuse._rotary_users.get(modeling, [None, 0])[1]  # noqa: E731 - other patched models may share it
    before = users()
    patch_model(model, budget=32, cuda_graph=True)  # compile_decode=True is the default
    assert users() == before + 1
    wrapped = [m for m in model._quest_state.compiled_modules if isinstance(m, torch.nn.Module)]
    names = {type(m).__name__ for m in wrapped}
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)  # + q/k norms
    assert len(wrapped) == norms + layers and any(n.endswith("MLP") for n in names)
    original_rotary = modeling.apply_rotary_pos_emb.quest_original
    calls = modeling.apply_rotary_pos_emb.compiled_calls
    fused = _gen(model, ids, mask, n=6)
    assert modeling.apply_rotary_pos_emb.compiled_calls - calls == 5 * layers
    assert torch.equal(plain.sequences, fused.sequences)
    for a, b in zip(plain.scores, fused.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    mlp = next(m for m in wrapped if type(m).__name__.endswith("MLP"))
    assert mlp._quest_compiled_calls == 5  # the 5 decode steps; the prefill ran eagerly
    patch_model(model, budget=32, compile_decode=False)  # re-configuring unwraps
    assert "forward" not in mlp.__dict__ and not model._quest_state.compiled_modules
    assert users() == before and (before > 0 or modeling.apply_rotary_pos_emb is original_rotary)
    patch_model(model, budget=32, compile_decode=True)
    unpatch_model(model)
    assert all("forward" not in m.__dict__ for m in wrapped) and users() == before
    assert before > 0 or modeling.apply_rotary_pos_emb is original_rotary


def test_compile_decode_failure_is_logged_and_runs_eagerly(monkeypatch, caplog):
    from quest_hf import fuse, unpatch_model

    monkeypatch.setattr(fuse, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse, "BACKEND", "no_such_backend")
    monkeypatch.setattr(fuse, "FAILED", {})
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(40, 33))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=4)
    patch_model(model, budget=32)
    with caplog.at_level("WARNING"):
        broken = _gen(model, ids, mask, n=4)
    assert torch.equal(plain.sequences, broken.sequences)
    assert {"LlamaRMSNorm", "LlamaMLP"} <= set(fuse.FAILED) and any(k.endswith("apply_rotary_pos_emb") for k in fuse.FAILED)
    assert "torch.compile of LlamaMLP failed" in caplog.text
    assert all(getattr(m, "_quest_compiled_calls", 0) == 0 for m in model._quest_state.compiled_modules)
    unpatch_model(model)


def test_patched_context_puts_the_previous_compile_setting_back():
    from quest_hf import patched, unpatch_model

    model = tiny_model("llama")
    patch_model(model, budget=32, compile_decode=False)
    with patched(model, budget=64):  # compile_decode=True by default inside
        assert model._quest_state.compiled_modules
    assert not model._quest_state.compiled_modules and "forward" not in model.model.norm.__dict__
    unpatch_model(model)


def test_generate_keeps_its_static_cache_for_the_next_call_of_the_same_shapes(single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    ids2, mask2 = left_padded_batch(lengths=(64, 90), seed=2)  # same width, other tokens and padding
    patch_model(model, budget=32, cuda_graph=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    kept = model._quest_state.kept
    assert isinstance(kept, QuestCache) and not kept.reused
    # Same settings and batch, capacity 80 + 17 -> the same 112 slots: the kept cache is reset and reused. The
    # first call filled slots up to 100; this one ends at 95, so page 6 would keep stale bounds if not reset.
    ids2, mask2 = ids2[:, 10:], mask2[:, 10:]
    out = model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    assert model._quest_state.kept is kept and kept.reused
    patch_model(model, budget=32, cuda_graph=True)  # re-configuring drops it: the reference starts fresh
    assert model._quest_state.kept is None
    ref = model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    assert torch.equal(out, ref)  # nothing of the first call's prompt leaked into the second
    fresh = model._quest_state.kept
    assert fresh is not kept and not fresh.reused
    for a, b in zip(kept.layers, fresh.layers):  # and the state is the fresh cache's, stale slots included
        n = b.seq_len
        assert a.seq_len == n and int(a.pos) == int(b.pos) == n and torch.equal(a.keys[:, :, :n], b.keys[:, :, :n])
        assert torch.equal(a.kmin, b.kmin) and torch.equal(a.kmax, b.kmax) and torch.equal(a.valid, b.valid)
    # A capacity it does not cover, or one it covers with more than 1/8 to spare: a new cache.
    model.generate(ids2, attention_mask=mask2, max_new_tokens=40, do_sample=False)
    assert not model._quest_state.kept.reused
    model.generate(ids2[:, 40:], attention_mask=mask2[:, 40:], max_new_tokens=17, do_sample=False)
    assert not model._quest_state.kept.reused
    # A cache handed to the caller is never kept (the next call would reset it under them).
    out = model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False, return_dict_in_generate=True)
    assert model._quest_state.kept is None
    model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    assert model._quest_state.kept is not out.past_key_values
    # A call over the caller's own cache drops the kept one first (two caches of a long prompt may not fit).
    assert model._quest_state.kept is not None
    own = QuestCache.from_model(model, max_length=ids2.shape[1] + 17)
    model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False, past_key_values=own)
    assert model._quest_state.kept is None
    model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    from quest_hf import release_cache, unpatch_model

    assert release_cache(model)._quest_state.kept is None
    model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    state = model._quest_state
    unpatch_model(model)
    assert state.kept is None
