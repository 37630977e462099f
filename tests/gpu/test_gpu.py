"""GPU-marked tests: the compiled Triton kernels at real sizes against their twins, and the captured decode step
against the same step run eagerly (greedy, seeded sampling, beams, a sliding window, hooks, growth, a kept cache).

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu`.
"""
import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, patch_model, release_cache, unpatch_model
from quest_hf.bench import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def test_kernels_are_compiled_not_interpreted():
    # A test module that switched the interpreter on at import would put every later Triton compile under it,
    # torch.compile's kernels included, and the captured-vs-eager comparisons below would compare other code.
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1"


def _layer(B, H, D, L, C, S=16, dtype=torch.float16, seed=0):
    """Paged storage of L random tokens in a capacity of C slots (empty pages +-inf, invalid slots False)."""
    g = torch.Generator(DEV).manual_seed(seed)
    keys = torch.zeros(B, H, C, D, dtype=dtype, device=DEV)
    values = torch.zeros_like(keys)
    kmin = torch.full((B, H, C // S, D), float("inf"), dtype=dtype, device=DEV)
    kmax = torch.full_like(kmin, float("-inf"))
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    k = torch.randn(B, H, L, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, H, L, D, generator=g, device=DEV).to(dtype)
    tk.append_kv(keys, values, kmin, kmax, valid, k, v, None, 0)
    return keys, values, kmin, kmax, valid


@pytest.mark.parametrize("B, Hq, H, L, window", [
    pytest.param(1, 32, 8, 32768 + 5, 0, id="llama3-8b-32K"),
    pytest.param(1, 32, 32, 32768 + 5, 0, id="llama2-7b-32K"),
    pytest.param(8, 32, 32, 8192 + 3, 0, id="llama2-7b-B8-8K-fused-merge"),
    pytest.param(1, 32, 8, 32768 + 5, 8192, id="mistral-window8K"),
])
def test_compiled_kernels_match_their_twins_at_real_sizes(B, Hq, H, L, window):
    D, S, K = 128, 16, 128
    C = -(-(L + 64) // S) * S + S
    keys, values, kmin, kmax, valid = _layer(B, H, D, L, C)
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.float16)
    pos = torch.tensor(L, device=DEV)
    s = tk.score_pages(q, kmin, kmax, C, S, 0, "none", pos=pos, window=window)
    s_ref = tk.score_pages_ref(q, kmin, kmax, C, S, 0, "none", pos=pos, window=window)
    fin = torch.isfinite(s_ref)
    assert torch.equal(fin, torch.isfinite(s)) and torch.equal(s_ref[~fin], s[~fin])
    torch.testing.assert_close(s[fin], s_ref[fin], atol=1e-2, rtol=1e-3)
    ids = tk.topk_pages(s, K + 1, Hq // H)
    ref_ids = tk.topk_pages_ref(s, K + 1, Hq // H)
    assert [set(r.tolist()) for r in ids.flatten(0, 1)] == [set(r.tolist()) for r in ref_ids.flatten(0, 1)]
    out = torch.full((B, Hq, D), float("nan"), device=DEV, dtype=torch.float16)
    out = tk.sparse_decode_attention(q, keys, values, ids, valid, C, S, D ** -0.5, 0, pos=pos if window else None,
                                     window=window)
    ref = tk.sparse_decode_attention_ref(q, keys, values, ids, valid, C, S, D ** -0.5, 0,
                                         pos=pos if window else None, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


ATTN_PATHS = {
    "merge-kernel": dict(fuse_merge_max_splits=0),
    "fused-merge": dict(fuse_merge_max_splits=1 << 30),
    "64-token-tiles-4-warps": dict(block_n=64, num_warps=4, num_stages=2, fuse_merge_max_splits=0),
}


@pytest.mark.parametrize("path", list(ATTN_PATHS))
@pytest.mark.parametrize("B, Hq, H, L, K, extras", [
    pytest.param(1, 32, 32, 32768 + 5, 129, "", id="llama2-7b-32K"),
    pytest.param(1, 32, 8, 32768 + 5, 513, "", id="llama3-8b-32K-union-ids"),
    pytest.param(8, 32, 32, 8192 + 3, 129, "", id="llama2-7b-B8-8K"),
    pytest.param(2, 16, 8, 8192 + 3, 129, "softcap-sinks-rows", id="G2-softcap-sinks-rows"),
])
def test_attention_paths_match_their_twin_at_real_sizes(path, B, Hq, H, L, K, extras):
    """The compiled attention under several launches (merge kernel or last split merging, tile shapes) against the
    twin: random page lists with -1 holes, padding slots, soft-cap, sinks and a beam page table."""
    D, S = 128, 16
    C = -(-(L + 64) // S) * S + S
    keys, values, _, _, valid = _layer(B, H, D, L, C)
    valid[:, 100:140] = False  # padding inside a page run
    g = torch.Generator(DEV).manual_seed(K)
    P = -(-L // S)
    ids = torch.stack([torch.randperm(P, device=DEV, generator=g)[:K].sort().values for _ in range(B * H)])
    ids = ids.view(B, H, K).to(torch.int32)
    ids[:, :, 3::17] = -1
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.float16, generator=g) * 2
    kw = {}
    if extras:
        kw = dict(softcap=30.0, sinks=torch.linspace(-1.0, 3.0, Hq, device=DEV),
                  rows=torch.randint(0, B, (B, C // S), device=DEV, dtype=torch.int32, generator=g))
    launch = tk.sparse_attention.AttentionLaunch(**ATTN_PATHS[path])
    out = tk.sparse_decode_attention(q, keys, values, ids, valid, L, S, D ** -0.5, 0, launch=launch, **kw)
    ref = tk.sparse_decode_attention_ref(q, keys, values, ids, valid, L, S, D ** -0.5, 0, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    llama = random_llama("tiny", torch.float16, torch.device(DEV), 4096)
    mistral = random_llama("tiny-mistral", torch.float16, torch.device(DEV), 4096)
    for m in (llama, mistral):  # sharpen attention so that selection matters
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8.0)
    return {"llama": llama, "mistral": mistral}


def _run(model, ids, cuda_graph, options=None, **kw):
    # compile_step=False: with cuda_graph=False the reference is the eager step (by default it would compile)
    patch_model(model, **(options or dict(budget=64, page_size=16)), cuda_graph=cuda_graph, compile_step=False)
    graph = model._quest_state.graph
    before = graph.captures, graph.replays  # counted over the model's life
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + kw.get("max_new_tokens", 24))
    seen = []
    cache.selection_hooks.append(lambda i, q, page_ids: seen.append((i, q.clone(), page_ids.clone())))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         return_dict_in_generate=True, output_scores=True, **kw)
    return out, cache, seen, (graph.captures - before[0], graph.replays - before[1])


@pytest.mark.parametrize("family, kw", [
    pytest.param("llama", dict(do_sample=False), id="greedy"),
    pytest.param("llama", dict(do_sample=False, options=dict(budget=64, layer_budgets=(32, 128, 64, 32), dense=(1,))),
                 id="per-layer-budgets"),
    pytest.param("llama", dict(do_sample=False, options=dict(budget=64, layer_budgets=(128, 32, 64, 96), dense=())),
                 id="per-layer-budgets-no-dense"),
    pytest.param("llama", dict(do_sample=True, top_k=20), id="sampling-seeded"),
    pytest.param("llama", dict(do_sample=False, num_beams=3), id="beams3"),
    pytest.param("mistral", dict(do_sample=False), id="sliding-window-past-it"),
    pytest.param("llama", dict(do_sample=False, options=dict(budget=64, page_size=16, policy="qcode_topp")),
                 id="top-p-codes"),
    pytest.param("llama", dict(do_sample=False, options=dict(budget=64, page_size=16, policy="qcode1_topp")),
                 id="top-p-codes-1bit"),
])
def test_captured_step_gives_the_eager_steps_tokens(models, family, kw):
    model = models[family]
    ids = torch.randint(2, 1000, (2, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    kw = dict(max_new_tokens=24, **kw)
    results = {}
    for cuda_graph in (False, "auto"):
        torch.manual_seed(7)
        results[cuda_graph] = _run(model, ids, cuda_graph, **kw)
    (eager, c_e, seen_e, _), (capt, c_c, seen_c, (captures, replays)) = results[False], results["auto"]
    assert c_e.decode_path == "eager: cuda_graph=False" and c_c.decode_path == "captured"
    assert captures == 1 and replays >= 20  # step 1 eager, step 2 captured, then replays
    # Both runs compiled the same modules (a failed compile runs eagerly in one mode only: other rounding).
    compiled = model._quest_state.compiled
    assert compiled is not None and compiled.modules and not compiled.failed, compiled.failed
    assert torch.equal(eager.sequences, capt.sequences)
    for a, b in zip(eager.scores, capt.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    # Hooks fire in both modes, on the same layers with the same page ids (recorded inside the graph).
    assert len(seen_e) == len(seen_c) > 0
    for (i, q, p), (j, r, o) in zip(seen_e, seen_c):
        assert i == j and torch.equal(p, o)
        torch.testing.assert_close(q, r, atol=1e-3, rtol=1e-3)


def test_hand_driven_loop_past_its_capacity_recaptures_and_matches_eager(models):
    model = models["llama"]
    ids = torch.randint(2, 1000, (1, 200), device=DEV, generator=torch.Generator(DEV).manual_seed(2))

    def loop(cuda_graph, steps=300):
        patch_model(model, budget=64, cuda_graph=cuda_graph, compile_step=False)
        before = model._quest_state.graph.captures
        cache = QuestCache.from_model(model)  # 200 + one growth step (256): grows once inside the loop
        out = model(input_ids=ids, past_key_values=cache)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(steps):
            out = model(input_ids=tokens[-1][:, None], past_key_values=cache)
            tokens.append(out.logits[:, -1].argmax(-1))
        return torch.stack(tokens, 1), cache, model._quest_state.graph.captures - before

    eager, c_e, _ = loop(False)
    capt, c_c, captures = loop("auto")
    assert torch.equal(eager, capt) and c_c.layers[0].allocations == 2 and captures == 2
    assert c_c.decode_path == "captured"


def test_kept_cache_is_reused_and_gives_a_fresh_caches_tokens(models):
    model = models["llama"]
    g = torch.Generator(DEV).manual_seed(3)
    a = torch.randint(2, 1000, (2, 400), device=DEV, generator=g)
    b = torch.randint(2, 1000, (2, 400), device=DEV, generator=g)
    patch_model(model, budget=64)
    model.generate(a, attention_mask=torch.ones_like(a), max_new_tokens=16, do_sample=False)
    kept = model._quest_state.kept
    assert kept is not None and kept.decode_path == "captured"
    captures = model._quest_state.graph.captures
    out = model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False)
    assert model._quest_state.kept is kept and kept.reused and model._quest_state.graph.captures == captures
    release_cache(model)
    ref = model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)


def test_fused_projections_captured_give_the_unfused_tokens(models):
    """`fuse_projections=True` on the captured path: one q/k/v and one gate/up matmul a layer (cuBLAS), the same
    greedy tokens as the separate projections, and the logits close."""
    model = models["llama"]
    ids = torch.randint(2, 1000, (2, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(3))
    outs = {}
    for fuse in (False, True):
        patch_model(model, budget=64, page_size=16, fuse_projections=fuse)
        n = len(model.model.layers)
        if fuse:
            assert model._quest_state.fused.qkv == list(range(n)) and model._quest_state.fused.gate_up == list(range(n))
        cache = QuestCache.from_model(model, max_length=ids.shape[1] + 24)
        outs[fuse] = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                                    do_sample=False, return_dict_in_generate=True, output_scores=True)
        assert cache.decode_path == "captured"
        release_cache(model)
        unpatch_model(model)
    assert torch.equal(outs[False].sequences, outs[True].sequences)
    torch.testing.assert_close(torch.stack(outs[True].scores), torch.stack(outs[False].scores), atol=5e-2, rtol=1e-2)
