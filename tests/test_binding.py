"""One binding record (quest_hf/binding.py): unpatch undoes every replacement, copies are patched models of their
own, and settings that cannot work are refused when they are given, not at the first generate()."""
import copy
import io
import logging

import pytest
import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.utils import DeferredStopCheck
from transformers.masking_utils import AttentionMaskInterface

from quest_hf import QuestCache, QuestConfig, patch_model, patched, unpatch_model
from quest_hf.binding import MISSING, Bindings, holders
from quest_hf.fuse import rotary_route
from quest_hf.patch import cache_arg_name

from .conftest import left_padded_batch, tiny_model

GEN = dict(max_new_tokens=6, do_sample=False)


def _perturbed(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("k_proj.weight"):
                p.mul_(-1.5)
    return model


def _all_patched_models_unpatched():
    """Tests patch many models and drop them patched; what they hold is released here for the process-wide checks."""
    import gc

    from quest_hf import binding

    gc.collect()
    for key, (record, _) in list(binding._held.items()):
        del binding._held[key]
        record.restore()


@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager", "compile-decode"])
def test_deepcopy_is_an_independent_patched_model(compile_decode, single_thread):
    ids, mask = left_padded_batch(lengths=(70, 51))
    model = patch_model(tiny_model("llama", heads=8, kv_heads=2), budget=32, compile_decode=compile_decode)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    twin = copy.deepcopy(model)
    assert twin._quest_state is not model._quest_state and twin.generate.__self__ is twin
    assert twin.model.layers[1].self_attn._quest_state is twin._quest_state
    _perturbed(twin)
    # The copy's outputs follow its own weights: the same as a model built and patched with those weights.
    alone = patch_model(_perturbed(tiny_model("llama", heads=8, kv_heads=2)), budget=32, compile_decode=compile_decode)
    want = alone.generate(ids, attention_mask=mask, **GEN)
    got = twin.generate(ids, attention_mask=mask, **GEN, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want) and not torch.equal(want, ref)
    assert isinstance(got.past_key_values, QuestCache)  # decoded by the copy's patch, not a bare model
    assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)  # the original is untouched
    if compile_decode:
        assert {id(m) for m in twin._quest_state.compiled_modules}.isdisjoint(map(id, model._quest_state.compiled_modules))
        assert all(m.forward.__self__ is m for m in twin._quest_state.compiled_modules)
    # Unpatching the copy leaves the original patched, and the copy a plain model with the class's methods.
    unpatch_model(twin)
    assert "generate" not in vars(twin) and "forward" not in vars(twin) and twin.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) or hasattr(m, "_quest_state") for m in twin.modules())
    assert not twin.model._forward_pre_hooks and not twin.model._forward_hooks
    assert model.model._forward_pre_hooks and model.model._forward_hooks  # the original keeps its own
    plain = twin.generate(ids, attention_mask=mask, **GEN, return_dict_in_generate=True)
    assert not isinstance(plain.past_key_values, QuestCache)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)
    unpatch_model(model)


def test_pickled_model_is_a_patched_model_of_its_own(single_thread):
    ids, mask = left_padded_batch(lengths=(70, 51))
    model = patch_model(tiny_model("qwen3"), budget=32)  # the defaults: compile_decode, a rotary routing held
    ref = model.generate(ids, attention_mask=mask, **GEN)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._quest_state is not model._quest_state and loaded.forward.__self__ is loaded
    assert torch.equal(loaded.generate(ids, attention_mask=mask, **GEN), ref)
    held = holders("patch")
    unpatch_model(model)
    assert holders("patch") == held - 1 and AttentionInterface._global_mapping.get("quest") is not None
    assert torch.equal(loaded.generate(ids, attention_mask=mask, **GEN), ref)  # still patched, still registered
    unpatch_model(loaded)


def test_process_wide_replacements_go_with_the_last_unpatch():
    _all_patched_models_unpatched()
    original = vars(DeferredStopCheck)["is_supported"]
    assert "quest" not in AttentionInterface._global_mapping and "quest" not in AttentionMaskInterface._global_mapping
    a, b = tiny_model("llama"), tiny_model("mistral")
    patch_model(a, budget=32)
    patched_check = vars(DeferredStopCheck)["is_supported"]
    assert patched_check is not original and holders("patch") == 1
    patch_model(b, budget=32)
    assert holders("patch") == 2 and vars(DeferredStopCheck)["is_supported"] is patched_check
    unpatch_model(a)
    assert "quest" in AttentionInterface._global_mapping and holders("patch") == 1
    unpatch_model(b)
    assert vars(DeferredStopCheck)["is_supported"] is original and holders("patch") == 0
    assert "quest" not in AttentionInterface._global_mapping and "quest" not in AttentionMaskInterface._global_mapping
    modeling = type(a.model.layers[0].self_attn).__module__
    assert holders("rotary", modeling) == 0 and rotary_route(__import__(modeling, fromlist=["x"])) is None
    unpatch_model(a)  # a second unpatch is a no-op


def test_bindings_restore_in_reverse_and_survive_deepcopy():
    class Thing:
        value = "class"

    thing = Thing()
    record = Bindings()
    record.set(thing, "value", "first")
    record.set(thing, "value", "second")
    record.set(Thing, "other", 1)
    child = record.child()
    child.set(thing, "extra", 3)
    assert (thing.value, Thing.other, thing.extra) == ("second", 1, 3)
    child.restore()
    assert not hasattr(thing, "extra")
    thing2, record2 = copy.deepcopy((thing, record))
    record.restore()
    assert "value" not in vars(thing) and thing.value == "class" and not hasattr(Thing, "other")
    assert thing2.value == "second" and copy.deepcopy(MISSING) is MISSING
    Thing.other = 1
    record2.restore()
    assert "value" not in vars(thing2)


def test_unpatch_inside_patched_is_kept_on_exit():
    model = tiny_model("llama")
    with patched(model, budget=32):
        unpatch_model(model)
    assert "_quest_state" not in vars(model) and model.config._attn_implementation == "sdpa"
    patch_model(model, budget=64, compile_decode=False)
    with patched(model, budget=32):
        assert model._quest_state.config.budget == 32 and model._quest_state.compiled is not None
    assert model._quest_state.config.budget == 64 and model._quest_state.compiled is None
    with patched(model, budget=32):
        unpatch_model(model)
    assert "_quest_state" not in vars(model)


@pytest.mark.parametrize("settings, error, match", [
    pytest.param(dict(budget=None), TypeError, r"budget must be an int, got NoneType None; leave it out for the "
                                               r"default 2048", id="budget-none"),
    pytest.param(dict(page_size=None), TypeError, "page_size must be an int.*default 16", id="page-size-none"),
    pytest.param(dict(compile_backend=""), TypeError, "compile_backend must name a torch.compile backend",
                 id="compile-backend"),
    pytest.param(dict(_defer_devices="cuda"), TypeError, r"_defer_devices must be a tuple of device types",
                 id="defer-devices"),
])
def test_settings_that_cannot_work_are_refused_on_creation(settings, error, match):
    with pytest.raises(error, match=match):
        QuestConfig(**settings)
    with pytest.raises(error, match=match):
        patch_model(tiny_model("llama"), **settings)


@pytest.mark.parametrize("settings, match", [
    pytest.param(dict(budget=33), r"budget=33 is not a multiple of page_size=16: policy 'quest' chooses whole pages "
                                  r"and would read 2 pages \(32 tokens\) a head; use budget=32 or budget=48",
                 id="budget-33"),
    pytest.param(dict(budget=100, page_size=32), "use budget=96 or budget=128", id="budget-100-page-32"),
])
def test_whole_page_budgets_are_refused_where_the_config_is_bound(settings, match):
    # Whole pages are the selector's rule (the oracle counts tokens): QuestConfig builds, binding it refuses.
    cfg = QuestConfig(**settings)
    with pytest.raises(ValueError, match=match):
        patch_model(tiny_model("llama"), **settings)
    with pytest.raises(ValueError, match=match):
        patch_model(tiny_model("llama"), config=cfg)
    with pytest.raises(ValueError, match=match):
        QuestCache(cfg, 2)


def test_oracle_budget_counts_tokens():
    cfg = QuestConfig(budget=33, policy="oracle")
    assert cfg.budget == 33
    assert QuestCache(cfg, 2).layers[0].config.budget == 33  # the oracle's selector counts tokens: bound as given


def test_dense_layers_covering_every_layer_is_said_once(caplog):
    model = tiny_model("llama", layers=3)
    with caplog.at_level(logging.WARNING, logger="quest_hf"):
        patch_model(model, budget=32, dense_layers=3)
    assert "dense_layers=3 covers all 3 layers of this model: every layer decodes dense" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quest_hf"):
        patch_model(model, budget=32, dense_layers=2)
    assert "covers all" not in caplog.text
    unpatch_model(model)


def test_cache_goes_by_the_name_this_transformers_expects(recwarn):
    model = patch_model(tiny_model("llama"), budget=32, compile_decode=False)
    ids, mask = left_padded_batch()
    name = cache_arg_name(model)
    other = "past_key_values" if name == "cache" else "cache"
    if name == "cache":  # >= 5.24: past_key_values= is forwarded as cache=, with no FutureWarning from our code
        cache = QuestCache.from_model(model)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        assert cache.get_seq_length() == ids.shape[1]
        cache = QuestCache.from_model(model)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
        assert cache.get_seq_length() == out.shape[1] - 1
        assert not [w for w in recwarn if "past_key_values" in str(w.message)]
        with pytest.raises(TypeError, match="got both cache= and past_key_values="):
            model(input_ids=ids, cache=QuestCache.from_model(model), past_key_values=QuestCache.from_model(model))
    else:  # 5.17 would ignore cache= and decode with no cache
        for call in (lambda c: model(input_ids=ids, attention_mask=mask, cache=c),
                     lambda c: model.generate(ids, attention_mask=mask, cache=c, **GEN),
                     lambda c: model.model(input_ids=ids, attention_mask=mask, cache=c)):
            cache = QuestCache.from_model(model)
            with pytest.raises(TypeError, match=r"names the cache argument past_key_values=; it would ignore cache="):
                call(cache)
            assert cache.get_seq_length() == 0
    cache = QuestCache.from_model(model)
    model(input_ids=ids, attention_mask=mask, **{name: cache})
    assert cache.get_seq_length() == ids.shape[1]
    assert other != name


def test_cache_implementation_static_runs_as_the_quest_cache():
    model = patch_model(tiny_model("llama"), budget=32, compile_decode=False)
    ids, mask = left_padded_batch()
    ref = model.generate(ids, attention_mask=mask, **GEN)
    for kw in (dict(cache_implementation="static"), dict(cache_implementation="dynamic"),
               dict(generation_config=GenerationConfig(cache_implementation="static", **GEN))):
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **({**GEN, **kw}
                             if "generation_config" not in kw else kw))
        assert torch.equal(out.sequences, ref) and isinstance(out.past_key_values, QuestCache)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' asks transformers for its own cache.*"
                                         "leave cache_implementation out"):
        model.generate(ids, attention_mask=mask, cache_implementation="offloaded", **GEN)
    model.generation_config.cache_implementation = "hybrid"  # a model's own default: the QuestCache serves
    assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)


@pytest.mark.parametrize("where", ["generate", "forward"])
def test_output_attentions_is_refused(where):
    model = patch_model(tiny_model("llama", attn_implementation="eager"), budget=32)
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="output_attentions=True: a model patched with quest-hf computes no attention "
                                         "weights"):
        if where == "generate":
            model.generate(ids, attention_mask=mask, output_attentions=True, return_dict_in_generate=True, **GEN)
        else:
            model(input_ids=ids, attention_mask=mask, output_attentions=True)
    unpatch_model(model)
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True)  # unpatched: eager returns them
    assert len(out.attentions) == 4 and out.attentions[0].shape[-1] == ids.shape[1]


def test_transformers_below_the_supported_range_is_refused_at_import():
    from quest_hf.versions import check_transformers

    with pytest.raises(ImportError, match=r"quest-hf needs transformers >= 5.17 .*found transformers 4.57.1: pip "
                                          r"install -U 'transformers>=5.17,<6'"):
        check_transformers("4.57.1")
    check_transformers("5.17.0")
    check_transformers("5.24.0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deepcopy_of_a_captured_cuda_model_captures_its_own_graph():
    # The defaults on CUDA: captured decode, compile_decode (inductor), the kept cache and graph, which a copy
    # must not share (it would replay the original's graph, reading the original's weights).
    from quest_hf.bench import random_llama

    torch.manual_seed(0)
    model = patch_model(random_llama("tiny", torch.float16, torch.device("cuda"), 1024), budget=64)
    ids = torch.randint(2, 1000, (1, 300), device="cuda")
    kw = dict(max_new_tokens=16, do_sample=False)
    ref = model.generate(ids, **kw)
    state = model._quest_state
    assert state.kept is not None and state.graph.captures == 1 and state.compiled.modules
    twin = copy.deepcopy(model)
    assert twin._quest_state.kept is None and twin._quest_state.graph.graph is None
    assert torch.equal(twin.generate(ids, **kw), ref) and twin._quest_state.graph.captures == 1
    _perturbed(twin)
    twin_out = twin.generate(ids, **kw)  # a kept cache, but the weights changed: its own graph replays them
    assert not torch.equal(twin_out, ref) and torch.equal(model.generate(ids, **kw), ref)
    unpatch_model(twin)
    unpatch_model(model)
    assert "forward" not in vars(model) and "forward" not in vars(twin)
