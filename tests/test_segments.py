"""Decode steps per device segment (quest_hf/graph.py SegmentGraph), on CPU: the plan, the layer interception and
its static inputs run uncaptured (`_force_segments(..., capture=False)`), the captured path's bookkeeping under a
stand-in for torch.cuda's graph API, refusals, unpatch, and accelerate's hooks in both orders. The captured
segments themselves (one GPU split in two, two GPUs under a device_map): tests/gpu/test_gpu_segments.py."""

import pytest
import torch

from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.graph import Segment, SegmentGraph, describe_segments, plan_segments
from quest_hf.patch import _force_segments, cache_arg_name, capture_refusal

from .conftest import left_padded_batch, tiny_model

CPU = torch.device("cpu")
TWO = "2 segments (cpu layers 0-1, cpu layers 2-3)"


def _gen(model, ids, mask, **kw):
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True) | kw
    return model.generate(ids, attention_mask=mask, **kw)


def _assert_same(ref, out, atol=2e-4):
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores, strict=True):
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b))
        torch.testing.assert_close(a[fin], b[fin], atol=atol, rtol=1e-4 if atol else 0)


def test_plan_splits_at_device_changes_and_where_asked():
    model = tiny_model("llama")
    assert plan_segments(model) == [Segment(CPU, [0, 1, 2, 3])]
    assert describe_segments(plan_segments(model, (2,))) == TWO
    assert describe_segments(plan_segments(model, (1, 3))) == \
        "3 segments (cpu layer 0, cpu layers 1-2, cpu layer 3)"
    for bad in ((0,), (4,), (2.0,)):
        with pytest.raises(ValueError, match="split_at takes layer indices in 1..3"):
            plan_segments(model, bad)
    patch_model(model, budget=32)
    with pytest.raises(ValueError, match="split_at takes layer indices"):
        _force_segments(model, (4,))
    model.model.layers[1].mlp.to("meta")  # one layer over two devices: no segment can hold it
    with pytest.raises(ValueError, match="decoder layer 1 has its parameters on cpu, meta"):
        plan_segments(model)
    assert capture_refusal(model, model._quest_state.config) == "the model is not on one CUDA device (cpu, meta)"


FAMILIES = [
    pytest.param("llama", dict(heads=4, kv_heads=4), id="llama-mha"),
    pytest.param("llama", dict(heads=8, kv_heads=2), id="llama-gqa4"),
    pytest.param("mistral", dict(sliding_window=48), id="mistral-window48-past-it"),
]


@pytest.mark.parametrize("family, extra", FAMILIES)
def test_uncaptured_segments_give_the_eager_paths_tokens_and_logits(family, extra, single_thread):
    model = tiny_model(family, **extra)
    ids, mask = left_padded_batch(lengths=(90, 71))  # batch 2, left-padded, past the window
    ref = _gen(model, ids, mask)
    patch_model(model, budget=32)  # sparse: selection matters
    seen_e, seen_s = [], []
    eager_cache = QuestCache.from_model(model)
    eager_cache.selection_hooks.append(lambda i, q, p: seen_e.append((i, q.clone(), p.clone())))
    eager = _gen(model, ids, mask, **{cache_arg_name(model): eager_cache})
    assert eager.past_key_values.decode_path == "eager: the model is not on one CUDA device (cpu)"

    _force_segments(model, (2,), capture=False)
    # A layer before the last of its segment hands its input on (the segment's last layer runs them all).
    handed_on = []
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: handed_on.append(out is a[0]))
    cache = QuestCache.from_model(model)
    cache.selection_hooks.append(lambda i, q, p: seen_s.append((i, q.clone(), p.clone())))
    seg = _gen(model, ids, mask, **{cache_arg_name(model): cache})
    handle.remove()
    graph = model._quest_state.graph
    assert isinstance(graph, SegmentGraph) and cache.decode_path == f"uncaptured segments: {TWO}"
    assert graph.steps == 10 and handed_on == [False] * 2 + [True] * 10  # prefill and the observed step run as HF's
    _assert_same(eager, seg, atol=0)  # the same ops on copies of the same tensors
    assert [i for i, *_ in seen_e] == [i for i, *_ in seen_s] and seen_e
    for (_, q, p), (_, r, o) in zip(seen_e, seen_s, strict=True):
        assert torch.equal(p, o) and torch.equal(q, r)
    assert [layer.seq_len for layer in cache.layers] == [ids.shape[1] + 11] * 4

    patch_model(model, budget=256)  # covers the context: the unpatched model's tokens
    _assert_same(ref, _gen(model, ids, mask))
    unpatch_model(model)
    for layer in model.model.layers:
        assert "forward" not in vars(layer) and not hasattr(layer, "_quest_state")
    _assert_same(ref, _gen(model, ids, mask), atol=0)


def test_segments_refuse_a_decoder_that_does_not_chain_its_layers(single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32)
    eager = _gen(model, ids, mask)
    _force_segments(model, (2,), capture=False)
    model.model.layers[0].register_forward_hook(lambda m, a, out: out.clone())  # what layer 1 gets is not layer 0's
    out = _gen(model, ids, mask)
    assert out.past_key_values.decode_path == "eager: decoder layer 1 is not called on layer 0's output"
    _assert_same(eager, out, atol=0)


def test_the_config_asking_for_hidden_states_runs_segments_eagerly(single_thread):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32)
    _force_segments(model, (2,), capture=False)
    model.config.output_hidden_states = True
    out = _gen(model, ids, mask, max_new_tokens=3)
    assert out.past_key_values.decode_path == \
        "eager: the captured step does not take output_hidden_states (config)"


def _hook_layers(model):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    for layer in model.model.layers:  # what dispatch_model attaches to each block of a device_map
        add_hook_to_module(layer, AlignDevicesHook(execution_device=CPU, io_same_device=False))


@pytest.mark.parametrize("order", ["patch-after-dispatch", "dispatch-after-patch"])
def test_segments_compose_with_accelerate_hooks_and_unpatch_leaves_them(order, single_thread):
    from accelerate.hooks import remove_hook_from_module

    ids, mask = left_padded_batch(lengths=(90, 71))
    model = tiny_model("llama", heads=8, kv_heads=2)
    ref = _gen(model, ids, mask)
    patch_model(model, budget=32)
    eager = _gen(model, ids, mask)
    unpatch_model(model)
    layers = model.model.layers
    if order == "patch-after-dispatch":
        _hook_layers(model)
        wrappers = [vars(layer)["forward"] for layer in layers]
        patch_model(model, budget=32)
        _force_segments(model, (2,), capture=False)
        out = _gen(model, ids, mask)
        assert all(vars(layer)["forward"].previous is w for layer, w in zip(layers, wrappers, strict=True))
    else:
        patch_model(model, budget=32)
        _force_segments(model, (2,), capture=False)
        _gen(model, ids, mask, max_new_tokens=3)  # the layers are intercepted; then accelerate wraps them
        _hook_layers(model)
        wrappers = [vars(layer)["forward"] for layer in layers]
        assert all(layer._old_forward.__func__.__name__ == "_layer_forward" for layer in layers)
        out = _gen(model, ids, mask)
    assert out.past_key_values.decode_path == f"uncaptured segments: {TWO}"
    assert model._quest_state.graph.steps >= 10
    _assert_same(eager, out, atol=0)
    unpatch_model(model)
    for layer, w in zip(layers, wrappers, strict=True):
        assert vars(layer)["forward"] is w and layer._hf_hook is not None  # accelerate's wrapper stays
        assert not hasattr(layer, "_quest_state") and layer._old_forward.__func__ is type(layer).forward
    _assert_same(ref, _gen(model, ids, mask), atol=0)
    for layer in layers:
        remove_hook_from_module(layer)
    _assert_same(ref, _gen(model, ids, mask), atol=0)


def test_captured_segments_bookkeeping(fake_cuda_graph, single_thread):
    # Replays compute nothing here: only what the host does is checked (counts, lengths, hooks, the kept cache).
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32)
    _force_segments(model, (2,))
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + 8)
    seen = []
    cache.selection_hooks.append(lambda i, q, p: seen.append(i))
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **{cache_arg_name(model): cache})
    graph = model._quest_state.graph
    assert cache.decode_path == f"captured: {TWO}"
    # 7 decode steps: 1 observed, 1 captured (2 graphs) and replayed, 5 replayed: 2 graphs each.
    assert (graph.captures, graph.replays, graph.steps) == (2, 12, 6)
    assert [layer.seq_len for layer in cache.layers] == [ids.shape[1] + 7] * 4
    assert seen == [2, 3] * 7  # layers 0-1 dense; the replays call the hooks with the recorded tensors
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    kept = model._quest_state.kept
    assert kept is not None and kept.decode_path == f"captured: {TWO}"
    captures = graph.captures
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert model._quest_state.kept is kept and kept.reused and graph.captures == captures  # replayed from step 1
    _force_segments(model, None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values.decode_path == "captured"  # one device, no split: the one-graph path


def test_a_copy_of_an_intercepted_model_runs_its_own_segments(single_thread):
    import copy
    import pickle

    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32)
    _force_segments(model, (2,), capture=False)
    ref = _gen(model, ids, mask, max_new_tokens=6)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        out = _gen(twin, ids, mask, max_new_tokens=6)
        assert out.past_key_values.decode_path == f"uncaptured segments: {TWO}"
        assert twin._quest_state.graph is not model._quest_state.graph and twin._quest_state.graph.steps == 4
        assert all(vars(layer)["forward"].__self__ is layer for layer in twin.model.layers)
        _assert_same(ref, out, atol=0)
        unpatch_model(twin)
        assert all("forward" not in vars(layer) for layer in twin.model.layers)
    assert all(vars(layer)["forward"].__self__ is layer for layer in model.model.layers)  # the original keeps its


def _family_param(family):
    from .family_models import missing_reason

    reason = missing_reason(family)
    return pytest.param(family, id=family, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


def _families():
    from .family_models import FAMILIES

    return [_family_param(f) for f in FAMILIES]


@pytest.mark.parametrize("family", _families())
def test_every_family_runs_its_decoder_per_segment(family, single_thread):
    # Each decoder loop as its family writes it (per-type rotary and masks, MoE blocks, soft-caps, sinks): the
    # observed step finds a chain it can replay, and the segments give the eager step's tokens and logits.
    from .family_models import left_padded, tiny_family_model

    model = tiny_family_model(family)
    ids, mask = left_padded(lengths=(40, 33))
    patch_model(model, budget=8, page_size=4, dense_layers=0)
    eager = _gen(model, ids, mask, max_new_tokens=6)
    _force_segments(model, (1, 3), capture=False)
    out = _gen(model, ids, mask, max_new_tokens=6)
    assert out.past_key_values.decode_path == \
        "uncaptured segments: 3 segments (cpu layer 0, cpu layers 1-2, cpu layer 3)"
    assert model._quest_state.graph.steps == 4
    _assert_same(eager, out, atol=0)
    unpatch_model(model)
