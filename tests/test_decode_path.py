"""The one decode path: a fixed-capacity paged layer, one fixed-shape step for eager and captured decoding.

On CPU the step runs eagerly; what capture adds (quest_hf/graph.py) is tested on the GPU (tests/gpu/).
"""
import sys

import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, QuestLayer, patch_model
from quest_hf.cache import GROWTH_TOKENS
from quest_hf.selectors import SELECTORS, QuestSelector, captured_policies, policy_names, register_selector

from .conftest import left_padded_batch, tiny_model


def _gen(model, ids, mask, n=12, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, **kw)


def _paper_rule_hook(model, chosen):
    """A selection hook checking each sparse selection against the paper's rule on the exact length: scores of
    the `ceil(L / S)` written pages, the last (current) one forced, Top-K per query head, union per KV group."""
    cfg = model._quest_state.config

    def hook(layer_idx, q, ids):
        layer = cache_of[0].layers[layer_idx]
        L, S = layer.seq_len, cfg.page_size
        G = q.shape[1] // layer.kmin.shape[1]
        ref = tk.topk_pages_ref(tk.score_pages_ref(q, layer.kmin, layer.kmax, L, S), cfg.num_pages, G)
        got = [set(r.tolist()) - {-1} for r in ids.flatten(0, 1)]
        want = [set(r.tolist()) - {-1} for r in ref.flatten(0, 1)]
        assert got == want
        chosen.append(sum(len(g) for g in got))

    cache_of = []
    return hook, cache_of


@pytest.mark.parametrize("heads, kv_heads, budget", [
    pytest.param(8, 2, 32, id="gqa4"),
    pytest.param(6, 2, 48, id="gqa3"),
    pytest.param(4, 4, 32, id="mha"),
])
def test_fixed_shape_selection_is_the_papers_rule_on_the_exact_length(heads, kv_heads, budget, single_thread):
    # The step scores every page of the allocation (unwritten ones empty, the spare page forced) with the position
    # on the device; the pages it reads are exactly those of the rule applied to the written pages.
    model = tiny_model("llama", heads=heads, kv_heads=kv_heads)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=budget, dense_layers=1)
    chosen = []
    hook, cache_of = _paper_rule_hook(model, chosen)
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + 12)
    cache_of.append(cache)
    cache.selection_hooks.append(hook)
    out = _gen(model, ids, mask, past_key_values=cache)
    assert len(chosen) == 11 * 3 and min(chosen) > 0  # 11 decode steps x 3 sparse layers, each checked
    assert out.past_key_values is cache and cache.decode_path.startswith("eager")
    layer = cache.layers[-1]
    n = ids.shape[1] + 11
    assert type(layer) is QuestLayer and layer.seq_len == n and int(layer.pos) == n
    # Sized once for prompt + new tokens (pages), plus the spare page; nothing past the filled slots is valid.
    assert layer.max_tokens == -(-(ids.shape[1] + 12) // 16) * 16 and layer.keys.shape[2] == layer.capacity == layer.max_tokens + 16
    assert layer.allocations == 1 and not layer.valid[:, n:].any() and layer.valid[:, :n].any()


def test_hand_driven_loop_grows_past_its_capacity_and_stays_within_one_growth_step(single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32)
    steps = GROWTH_TOKENS + 40  # past the first allocation (prompt + one growth step)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False)
    cache = QuestCache.from_model(model)
    pos = lambda m: (m.cumsum(-1) - 1).clamp_min(0)  # noqa: E731 - generate()'s positions for left padding
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos(mask), past_key_values=cache)
    layer = cache.layers[0]
    first = layer.max_tokens
    assert first == -(-(ids.shape[1] + GROWTH_TOKENS) // 16) * 16
    tokens, m = [out.logits[:, -1].argmax(-1)], mask
    for _ in range(steps):
        m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
        out = model(input_ids=tokens[-1][:, None], attention_mask=m, position_ids=pos(m)[:, -1:], past_key_values=cache)
        tokens.append(out.logits[:, -1].argmax(-1))
    assert torch.equal(ref[:, ids.shape[1]:], torch.stack(tokens, 1))
    n = ids.shape[1] + steps
    assert layer.allocations == 2 and layer.max_tokens > first and layer.seq_len == n == int(layer.pos)
    # Memory: HF's DynamicCache would hold n tokens; this holds at most one growth step more (+ the spare page).
    assert layer.max_tokens <= -(-(n + max(n // 8, GROWTH_TOKENS)) // 16) * 16


def test_beams_and_sampling_run_the_same_step(single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    patch_model(model, budget=1024)  # covers the context: exactly the unpatched beams
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(ref, out.sequences) and type(out.past_key_values.layers[0]) is QuestLayer
    patch_model(model, budget=32)  # sparse beams: hooks fire on every sparse layer of every step
    cache = QuestCache.from_model(model)
    seen = []
    cache.selection_hooks.append(lambda i, q, page_ids: seen.append((i, page_ids.shape[0])))
    model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, past_key_values=cache)
    assert len(seen) == 4 * 2 and {b for _, b in seen} == {6}  # 4 decode steps x 2 sparse layers, 2 x 3 beams


class _HostLengths(QuestSelector):
    """A user's selector that reads host lengths: its steps cannot be captured."""
    captured = False


def test_cuda_graph_true_is_refused_where_it_cannot_capture():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True cannot capture.*not on one CUDA device.*'auto' or False"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3)
    register_selector("host_lengths", _HostLengths())
    try:
        cfg = QuestConfig(cuda_graph=True, policy="host_lengths")  # the selector's rule: checked where it is bound
        with pytest.raises(ValueError, match="cuda_graph=True captures the policies quest.*host lengths"):
            QuestCache(cfg, 2)
        with pytest.raises(ValueError, match="cuda_graph=True captures the policies quest.*host lengths"):
            patch_model(tiny_model("llama"), config=cfg)
    finally:
        SELECTORS.pop("host_lengths")
    for policy in ("streaming", "oracle", "qcode_topp", "qcode1_topp"):  # every built-in policy is captured
        QuestCache(QuestConfig(cuda_graph=True, policy=policy), 2)
    assert set(captured_policies()) == set(policy_names())


def test_auto_on_cpu_says_the_step_runs_eagerly():
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert out.past_key_values.decode_path == "eager: the model is not on one CUDA device (cpu)"
    patch_model(model, budget=32, cuda_graph=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert out.past_key_values.decode_path == "eager: cuda_graph=False"


@pytest.mark.parametrize("window, budget", [pytest.param(40, 32, id="window-over-budget"),
                                            pytest.param(24, 32, id="window-in-budget")])
def test_sliding_window_past_the_window(window, budget, single_thread):
    model = tiny_model("mistral", sliding_window=window)
    ids, mask = left_padded_batch(lengths=(90, 71))
    ref = _gen(model, ids, mask, n=10)
    patch_model(model, budget=4096)  # covers the context: every layer dense over its window
    out = _gen(model, ids, mask, n=10)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    patch_model(model, budget=budget)
    seen = []
    cache = QuestCache.from_model(model)
    cache.selection_hooks.append(lambda i, q, ids_: seen.append(ids_.clone()))
    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, past_key_values=cache)
    if window <= budget:
        assert seen == []  # the window fits the budget: dense over it, nothing selected
        return
    assert seen
    L0 = ids.shape[1]
    for step, page_ids in enumerate(seen[:: 2]):  # 2 sparse layers a step
        first_page = max(0, L0 + 1 + step - window) // 16
        real = page_ids[page_ids >= 0]
        assert (real >= first_page).all()  # no page wholly before the window is read


# The compile settings a CPU test varies: dynamo's "eager" backend on CPU inputs checks the plumbing.
ON_CPU = dict(compile_backend="eager", _compile_devices=("cuda", "cpu"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compile_decode_wraps_norms_and_mlps_for_decode_only(family):
    # On CUDA the wrapped modules run inductor; here the same wrapping runs dynamo's "eager" backend on CPU,
    # which checks the plumbing: one-token steps go through torch.compile, prefill does not, outputs equal.
    from quest_hf import unpatch_model
    from quest_hf.binding import holders
    from quest_hf.fuse import rotary_route

    model = tiny_model(family, heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=6)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    users = lambda: holders("rotary", modeling.__name__)  # noqa: E731 - other patched models may share it
    before = users()
    original_rotary = modeling.apply_rotary_pos_emb  # the global as it is (a routed one if another model holds it)
    patch_model(model, budget=32, **ON_CPU)  # compile_decode=True is the default
    assert users() == before + 1
    compiled = model._quest_state.compiled
    assert compiled.backend == "eager" and compiled.rotary == modeling.__name__
    wrapped = compiled.modules
    names = {type(m).__name__ for m in wrapped}
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)  # + q/k norms
    assert len(wrapped) == norms + layers and any(n.endswith("MLP") for n in names)
    assert rotary_route(modeling) is not None
    fused = _gen(model, ids, mask, n=6)
    assert compiled.rotary_calls == 5 * layers and not compiled.failed
    assert torch.equal(plain.sequences, fused.sequences)
    for a, b in zip(plain.scores, fused.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    mlp = next(m for m in wrapped if type(m).__name__.endswith("MLP"))
    assert mlp._quest_compiled_calls == 5  # the 5 decode steps; the prefill ran eagerly
    patch_model(model, budget=32, compile_decode=False, **ON_CPU)  # re-configuring unwraps
    assert "forward" not in mlp.__dict__ and not model._quest_state.compiled_modules
    assert users() == before and (before > 0 or (modeling.apply_rotary_pos_emb is original_rotary
                                                 and rotary_route(modeling) is None))
    patch_model(model, budget=32, compile_decode=True)  # the default backend: CUDA inputs only, as shipped
    assert model._quest_state.compiled.backend == "inductor" and users() == before + 1
    _gen(model, ids, mask, n=2)
    assert all(m._quest_compiled_calls == 0 for m in model._quest_state.compiled.modules)  # CPU: never compiled
    unpatch_model(model)
    assert all("forward" not in m.__dict__ for m in wrapped) and users() == before
    assert before > 0 or (modeling.apply_rotary_pos_emb is original_rotary and rotary_route(modeling) is None)


def test_compile_decode_launches_inductor_kernels_dependently_where_pdl_is(monkeypatch):
    # Where our kernels launch dependently (Hopper+, quest_hf.fuse.inductor_pdl), the compiled norms, MLPs and rotary
    # ask inductor for dependent launches too (`triton.enable_pdl`), beside their own options; elsewhere they do not
    # ask, and `compiled.pdl` says which ran. Dynamo's "eager" backend stands in for inductor on CPU.
    from quest_hf import fuse, unpatch_model

    real, seen = torch.compile, []

    def fake_compile(fn, backend="inductor", options=None, **kw):
        seen.append((backend, dict(options or {})))
        return real(fn, backend="eager", **kw)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fuse, "_compiled", {})
    assert fuse.inductor_pdl(torch.device("cpu")) is False
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(40, 33))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=4)
    for pdl in (False, True):
        monkeypatch.setattr(fuse, "inductor_pdl", lambda device, on=pdl: on)
        seen.clear()
        patch_model(model, budget=32, _compile_devices=("cuda", "cpu"))  # the default backend: inductor
        out = _gen(model, ids, mask, n=4)
        assert torch.equal(plain.sequences, out.sequences)
        assert {"LlamaRMSNorm", "LlamaMLP"} <= {type(m).__name__ for m in model._quest_state.compiled.modules}
        assert seen and all(backend == "inductor" for backend, _ in seen)
        assert all(options.get("triton.enable_pdl", False) is pdl for _, options in seen)
        assert model._quest_state.compiled.pdl is pdl
        unpatch_model(model)  # the setting is read once a patch (DecodeCompile.pdl_devices)
    assert any(options.get("emulate_precision_casts") for _, options in seen)  # the residual add's option kept


def test_inductor_pdl_follows_our_kernels_and_its_own_switch(monkeypatch):
    # inductor's dependent launches go with our kernels' (pdl_available) and an inductor that has the option;
    # QUEST_HF_INDUCTOR_PDL=0 turns off inductor's alone (QUEST_HF_PDL=0, read by pdl_available, turns off both).
    import triton_kernels._common as common
    from quest_hf import fuse

    monkeypatch.setattr(fuse, "_inductor_has_pdl", lambda: True)
    for ours in (False, True):
        monkeypatch.setattr(common, "pdl_available", lambda device, on=ours: on)
        monkeypatch.delenv("QUEST_HF_INDUCTOR_PDL", raising=False)
        assert fuse.inductor_pdl(torch.device("cuda")) is ours
        monkeypatch.setenv("QUEST_HF_INDUCTOR_PDL", "0")
        assert fuse.inductor_pdl(torch.device("cuda")) is False


def test_compile_decode_failure_is_logged_and_runs_eagerly(caplog):
    from quest_hf import unpatch_model

    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(40, 33))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=4)
    patch_model(model, budget=32, compile_backend="no_such_backend", _compile_devices=("cuda", "cpu"))
    with caplog.at_level("WARNING"):
        broken = _gen(model, ids, mask, n=4)
    assert torch.equal(plain.sequences, broken.sequences)
    failed = model._quest_state.compiled.failed  # this model's: another model's compiles are not affected
    assert {"LlamaRMSNorm", "LlamaMLP"} <= set(failed) and any(k.endswith("apply_rotary_pos_emb") for k in failed)
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


@pytest.fixture
def captured_on_cpu(monkeypatch):
    """Decode steps take the captured path's bookkeeping on CPU (kept cache, decode_path), run eagerly."""
    from quest_hf import graph, patch

    monkeypatch.setattr(patch, "capture_refusal", lambda model, config: None)
    monkeypatch.setattr(graph.DecodeGraph, "step", lambda self, forward, eager, *a: eager())


def test_generate_keeps_its_captured_cache_for_the_next_call_of_the_same_shapes(captured_on_cpu, single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    ids2, mask2 = left_padded_batch(lengths=(64, 90), seed=2)  # same width, other tokens and padding
    patch_model(model, budget=32)
    model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    kept = model._quest_state.kept
    assert isinstance(kept, QuestCache) and not kept.reused
    # Same settings and batch, capacity 80 + 17 -> the same 112 slots: the kept cache is reset and reused. The
    # first call filled slots up to 100; this one ends at 95, so page 6 would keep stale bounds if not reset.
    ids2, mask2 = ids2[:, 10:], mask2[:, 10:]
    out = model.generate(ids2, attention_mask=mask2, max_new_tokens=17, do_sample=False)
    assert model._quest_state.kept is kept and kept.reused
    patch_model(model, budget=32)  # re-configuring drops it: the reference starts fresh
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


@pytest.mark.parametrize("policy, page_size, backend, n", [
    pytest.param("qcode1_2s", 16, "torch", 40, id="qcode1_2s"),  # 90 -> 129 tokens: 3 pages completed in decode
    pytest.param("qcode2s", 32, "torch", 40, id="qcode2s-page32"),
    pytest.param("qcode", 16, "torch", 40, id="qcode"),
    pytest.param("qcode1_2s", 16, "triton", 8, id="qcode1_2s-triton"),  # interpreted: one page completed
])
def test_code_selectors_encode_the_pages_decode_completes(policy, page_size, backend, n, single_thread):
    # Codes of the pages that decode completes are encoded at the device position: every complete page's codes
    # equal an encoding from scratch of the final keys.
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=2 * page_size, page_size=page_size, policy=policy, backend=backend)
    out = _gen(model, ids, mask, n=n)
    layer = out.past_key_values.layers[-1]
    sel = layer.selector
    codes = layer.side[sel.key]
    full = layer.seq_len // page_size
    fresh = torch.zeros_like(codes)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, fresh, 0, full, sel.bits)
    assert full * page_size > ids.shape[1] and torch.equal(codes[:, :, :full * page_size], fresh[:, :, :full * page_size])


def test_generate_reaches_the_captured_step_and_an_unknown_argument_is_named(fake_cuda_graph):
    # generate() hands forward more than the step's tensors (logits_to_keep, position_ids): every decode step but
    # the first must still reach the graph (seen on an H200: a missing name sent every step down the eager path).
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    graph = model._quest_state.graph
    assert graph.captures == 1 and graph.replays == 6  # steps 2..7: one capture, then replays
    assert model._quest_state.kept.decode_path == "captured"
    cache = QuestCache.from_model(model)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    model(input_ids=ids[:, -1:], past_key_values=cache, output_hidden_states=True)
    assert cache.decode_path == "eager: the captured step does not take output_hidden_states"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_beam_reorder_shares_full_pages_through_the_page_table(backend, monkeypatch, single_thread):
    # quest's kernels read pages through `layer.rows`: a reorder copies only the partial page. The result must be
    # the physical reorder's (every buffer permuted) token for token and, once the table is applied, byte for byte.
    from quest_hf.selectors import QuestSelector

    model = tiny_model("llama", heads=8, kv_heads=2, layers=3 if backend == "torch" else 2)
    ids, mask = left_padded_batch(lengths=(61, 40) if backend == "torch" else (41, 30))  # the interpreter is slow
    new = 21 if backend == "torch" else 6
    kw = dict(max_new_tokens=new, num_beams=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    patch_model(model, budget=32, page_size=8, dense_layers=1, backend=backend)
    paged = model.generate(ids, attention_mask=mask, **kw)
    monkeypatch.setattr(QuestSelector, "paged_reorder", False)
    copied = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(paged.sequences, copied.sequences)
    for a, b in zip(paged.scores, copied.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for lp, lc in zip(paged.past_key_values.layers, copied.past_key_values.layers):
        assert lp.rows is not None and lc.rows is None
        assert (lp.rows != torch.arange(6, dtype=torch.int32)[:, None]).any()  # pages are shared, not copied
        lp._materialize()
        n = lp.seq_len
        assert lp.rows is None and n == lc.seq_len
        assert torch.equal(lp.keys[:, :, :n], lc.keys[:, :, :n]) and torch.equal(lp.valid[:, :n], lc.valid[:, :n])
        P = -(-n // 8)
        assert torch.equal(lp.kmin[:, :, :P], lc.kmin[:, :, :P]) and torch.equal(lp.kmax[:, :, :P], lc.kmax[:, :, :P])
