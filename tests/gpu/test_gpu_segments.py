"""GPU-marked tests of the decode step captured per device segment (quest_hf/graph.py SegmentGraph): a model on
one GPU split into two segments (`_force_segments`) against the one-graph captured step and the eager step
(greedy, per-layer budgets, seeded sampling, beams, a sliding window past its window, hooks, growth, a kept
cache), and a real device_map over two GPUs against one GPU (skipped with fewer than two).

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_segments.py`.
"""
import pytest
import torch

from quest_hf import QuestCache, patch_model, release_cache, unpatch_model
from quest_hf.bench import random_llama
from quest_hf.graph import SegmentGraph
from quest_hf.patch import _force_segments

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
SPLIT = "captured: 2 segments (cuda:0 layers 0-1, cuda:0 layers 2-3)"


def _sharpen(model):
    with torch.no_grad():  # sharpen attention so that selection matters
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {"llama": _sharpen(random_llama("tiny", torch.float16, torch.device(DEV), 4096)),
            "mistral": _sharpen(random_llama("tiny-mistral", torch.float16, torch.device(DEV), 4096))}


def _run(model, ids, mode, options=None, **kw):
    """generate() under `mode`: "eager" (cuda_graph=False), "graph" (one captured graph), "segments" (two captured
    segments on one GPU). Returns (output, cache, hook calls, (graphs captured, graphs replayed) in this call)."""
    patch_model(model, **(options or dict(budget=64, page_size=16)), cuda_graph=False if mode == "eager" else "auto",
                compile_step=False)
    _force_segments(model, (2,) if mode == "segments" else None)
    graph = model._quest_state.graph
    before = graph.captures, graph.replays
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + kw.get("max_new_tokens", 24))
    seen = []
    cache.selection_hooks.append(lambda i, q, page_ids: seen.append((i, q.clone(), page_ids.clone())))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         return_dict_in_generate=True, output_scores=True, **kw)
    if model._quest_state.graph is not graph:  # the call made its runner
        graph, before = model._quest_state.graph, (0, 0)
    return out, cache, seen, (graph.captures - before[0], graph.replays - before[1])


def _assert_same_run(a, b):
    (out_a, _, seen_a, _), (out_b, _, seen_b, _) = a, b
    assert torch.equal(out_a.sequences, out_b.sequences)
    for x, y in zip(out_a.scores, out_b.scores, strict=True):
        torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)
    assert len(seen_a) == len(seen_b) > 0
    for (i, q, p), (j, r, o) in zip(seen_a, seen_b, strict=True):
        assert i == j and torch.equal(p, o)
        torch.testing.assert_close(q, r, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("family, kw", [
    pytest.param("llama", dict(do_sample=False), id="greedy"),
    pytest.param("llama", dict(do_sample=False, options=dict(budget=64, layer_budgets=(32, 128, 64, 32), dense=(1,))),
                 id="per-layer-budgets"),
    pytest.param("llama", dict(do_sample=True, top_k=20), id="sampling-seeded"),
    pytest.param("llama", dict(do_sample=False, num_beams=3), id="beams3"),
    pytest.param("mistral", dict(do_sample=False), id="sliding-window-past-it"),
])
def test_two_captured_segments_give_the_one_graph_and_eager_tokens(models, family, kw):
    model = models[family]
    ids = torch.randint(2, 1000, (2, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    kw = dict(max_new_tokens=24, **kw)
    results = {}
    for mode in ("eager", "graph", "segments"):
        torch.manual_seed(7)
        results[mode] = _run(model, ids, mode, **kw)
    eager, graph, segments = results["eager"], results["graph"], results["segments"]
    assert eager[1].decode_path == "eager: cuda_graph=False" and graph[1].decode_path == "captured"
    assert segments[1].decode_path == SPLIT and isinstance(model._quest_state.graph, SegmentGraph)
    captures, replays = segments[3]
    # 23 decode steps: the first observed, the second captures both segments, every later one replays both.
    assert captures == 2 and replays >= 40 and replays % 2 == 0, (captures, replays)
    assert graph[3][0] == 1
    compiled = model._quest_state.compiled
    assert compiled is not None and compiled.modules and not compiled.failed, compiled.failed
    _assert_same_run(graph, segments)
    _assert_same_run(eager, segments)
    cache = segments[1]
    assert [layer.seq_len for layer in cache.layers] == [ids.shape[1] + 23] * 4  # host lengths, per segment
    assert all(int(layer.pos) == layer.seq_len for layer in cache.layers)  # ... equal to the device's


def test_hand_driven_loop_past_its_capacity_recaptures_both_segments(models):
    model = models["llama"]
    ids = torch.randint(2, 1000, (1, 200), device=DEV, generator=torch.Generator(DEV).manual_seed(2))

    def loop(mode, steps=300):
        patch_model(model, budget=64, cuda_graph=False if mode == "eager" else "auto", compile_step=False)
        _force_segments(model, (2,) if mode == "segments" else None)
        graph = model._quest_state.graph
        before = graph.captures
        cache = QuestCache.from_model(model)  # 200 + one growth step (256): grows once inside the loop
        out = model(input_ids=ids, past_key_values=cache)
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(steps):
            out = model(input_ids=tokens[-1][:, None], past_key_values=cache)
            tokens.append(out.logits[:, -1].argmax(-1))
        if model._quest_state.graph is not graph:
            graph, before = model._quest_state.graph, 0
        return torch.stack(tokens, 1), cache, graph.captures - before

    eager, _, _ = loop("eager")
    capt, cache, captures = loop("segments")
    assert torch.equal(eager, capt) and cache.layers[0].allocations == 2
    assert cache.decode_path == SPLIT and captures == 4  # two segments, captured before and after growth


def test_kept_cache_replays_both_segments_from_its_first_step(models):
    model = models["llama"]
    g = torch.Generator(DEV).manual_seed(3)
    a = torch.randint(2, 1000, (2, 400), device=DEV, generator=g)
    b = torch.randint(2, 1000, (2, 400), device=DEV, generator=g)
    patch_model(model, budget=64)
    _force_segments(model, (2,))
    model.generate(a, attention_mask=torch.ones_like(a), max_new_tokens=16, do_sample=False)
    kept = model._quest_state.kept
    assert kept is not None and kept.decode_path == SPLIT
    captures = model._quest_state.graph.captures
    out = model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False)
    assert model._quest_state.kept is kept and kept.reused and model._quest_state.graph.captures == captures
    release_cache(model)
    ref = model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)
    _force_segments(model, None)
    assert torch.equal(ref, model.generate(b, attention_mask=torch.ones_like(b), max_new_tokens=16, do_sample=False))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("shape, kw", [
    pytest.param("tiny", dict(do_sample=False), id="greedy"),
    pytest.param("tiny", dict(do_sample=True, top_k=20), id="sampling-seeded"),
    pytest.param("tiny", dict(do_sample=False, num_beams=3), id="beams3"),
    pytest.param("tiny-mistral", dict(do_sample=False), id="sliding-window-past-it"),
])
def test_device_map_over_two_gpus_gives_one_gpus_tokens_captured_per_gpu(shape, kw):
    from accelerate import dispatch_model

    torch.manual_seed(0)
    model = _sharpen(random_llama(shape, torch.float16, torch.device("cuda", 0), 4096))
    ids = torch.randint(2, 1000, (2, 300), device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(1))
    kw = dict(max_new_tokens=24, **kw)
    torch.manual_seed(7)
    one = _run(model, ids, "graph", **kw)
    assert one[1].decode_path == "captured"
    unpatch_model(model)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = dispatch_model(model, device_map=device_map)
    results = {}
    for mode in ("eager", "graph"):  # "graph" under a device_map: captured per device segment
        torch.manual_seed(7)
        results[mode] = _run(model, ids, mode, **kw)
    eager, spread = results["eager"], results["graph"]
    cache = spread[1]
    assert cache.decode_path == "captured: 2 segments (cuda:0 layers 0-1, cuda:1 layers 2-3)"
    assert [str(layer.keys.device) for layer in cache.layers] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    captures, replays = spread[3]
    assert captures == 2 and replays >= 40, (captures, replays)
    _assert_same_run(one, spread)
    _assert_same_run(eager, spread)
    assert [layer.seq_len for layer in cache.layers] == [ids.shape[1] + 23] * 4
    unpatch_model(model)
    assert all("_quest_state" not in vars(m) for m in model.modules())
    assert all(vars(layer)["forward"].__name__ != "_layer_forward" for layer in model.model.layers)
