"""quest_hf/recompile.py: compiled functions that take more shapes than dynamo's recompile limit, on CPU with a
counting backend (each graph it receives is one compile; a shape run uncompiled reaches it never)."""
import functools
import logging

import pytest
import torch

from quest_hf import patch_model
from quest_hf.recompile import Compiled, fresh_copy, limit_hit

from .conftest import left_padded_batch, tiny_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        yield
    torch._dynamo.reset()


def _counting_backend(seen):
    def backend(gm, example_inputs):
        seen.append(tuple(tuple(t.shape) for t in example_inputs if torch.is_tensor(t)))
        return gm.forward
    return backend


def _affine(x, k=2.0):
    return x * k + 1


def test_fresh_copies_take_the_shapes_past_the_limit(caplog):
    seen = []
    fn = Compiled(_affine, "affine", backend=_counting_backend(seen), dynamic=False)
    with caplog.at_level(logging.WARNING, logger="quest_hf"):
        for n in range(1, 7):
            x = torch.arange(float(n))
            torch.testing.assert_close(fn(x), x * 2 + 1, rtol=0, atol=0)
    assert len(seen) == 6 and sorted(s[0] for s in seen) == [(n,) for n in range(1, 7)]  # every shape compiled
    assert fn.copies == 2  # shapes 1-2 in the function, 3-4 and 5-6 in two copies
    assert sum("reached dynamo's recompile limit" in r.getMessage() for r in caplog.records) == 2
    assert _affine.__code__ is fn.fn.__code__  # the function itself is left as it was
    for n in (1, 2):  # shapes compiled before a copy came compile again in the newest copy (no error)
        torch.testing.assert_close(fn(torch.arange(float(n))), torch.arange(float(n)) * 2 + 1)


def test_past_max_copies_the_limit_error_propagates():
    fn = Compiled(_affine, "affine", backend="eager", dynamic=False, max_copies=1)
    for n in range(1, 5):
        fn(torch.ones(n))
    with pytest.raises(Exception) as info:
        fn(torch.ones(5))
    assert limit_hit(info.value) and fn.copies == 1
    assert not limit_hit(ValueError("other"))
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = info.value
    assert limit_hit(wrapped)


def test_fresh_copy_keeps_defaults_closure_and_binding():
    scale = 3.0

    def closure(x, *, shift=1.0):
        return x * scale + shift

    copy = fresh_copy(closure)
    assert copy.__code__ is not closure.__code__ and copy(2.0) == closure(2.0) == 7.0 and copy(2.0, shift=0) == 6.0
    assert fresh_copy(_affine)(1.0) == 3.0 and fresh_copy(_affine).__name__ == "_affine"
    lin = torch.nn.Linear(2, 2)
    bound = fresh_copy(lin.forward)
    assert bound.__self__ is lin and bound.__func__.__code__ is not type(lin).forward.__code__
    x = torch.ones(1, 2)
    assert torch.equal(bound(x), lin(x))
    assert fresh_copy(lin) is None and fresh_copy(functools.partial(_affine, k=1.0)) is None  # not functions


def _breaks(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def test_prefer_compiles_a_graph_break_in_pieces_and_true_refuses_it():
    seen = []
    fn = Compiled(_breaks, "breaks", fullgraph="prefer", backend=_counting_backend(seen), dynamic=False)
    x = torch.arange(3.0)
    assert torch.equal(fn(x), (x + 1) * 2)
    assert fn.graph_break and not fn.fullgraph and len(seen) == 2  # the two pieces
    strict = Compiled(_breaks, "breaks", backend="eager", dynamic=False)
    with pytest.raises(Exception) as info:
        strict(x)
    assert not limit_hit(info.value) and strict.graph_break is None
    with pytest.raises(ValueError, match="fullgraph must be True or 'prefer'"):
        Compiled(_affine, "affine", fullgraph=False)


def limit_hit_text(failed) -> bool:
    return failed is not None and ("fullgraph=True" in failed or "RecompileLimit" in failed or "CacheLimit" in failed)


def _generate(model, lengths, n=4):
    ids, mask = left_padded_batch(lengths=lengths)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, return_dict_in_generate=True)


BATCHES = ((90,), (60, 75), (50, 97, 40))


def test_compiled_step_takes_more_batch_sizes_than_the_limit(monkeypatch):
    """Each batch size is a new shape of the one compiled step; with the limit at 2 the third raised
    FailOnRecompileLimitHit out of generate() before. Past the copies allowed, steps run eagerly and say so."""
    from quest_hf import recompile

    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    eager = [_generate(model, b).sequences for b in BATCHES]
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True, compile_backend="eager")
    for b, want in zip(BATCHES, eager):
        out = _generate(model, b)
        assert torch.equal(out.sequences, want)
        assert out.past_key_values.decode_path.startswith("compiled, uncaptured")
    step = model._quest_state.compiled_step
    assert step.failed is None and step.copies >= 1 and step.traced_calls == step.calls == 3 * 3

    torch._dynamo.reset()
    monkeypatch.setattr(recompile, "MAX_COPIES", 0)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True, compile_backend="eager")
    outs = [_generate(model, b) for b in BATCHES]
    for out, want in zip(outs, eager):
        assert torch.equal(out.sequences, want)  # the eager steps give the same tokens
    step = model._quest_state.compiled_step
    assert step.copies == 0 and limit_hit_text(step.failed)
    paths = [out.past_key_values.decode_path for out in outs]
    assert paths[0].startswith("compiled, uncaptured")
    assert all(p.startswith("eager: ") and "compiling the step failed" in p for p in paths[1:]), paths


def test_compile_decode_modules_take_more_batch_sizes_than_the_limit(monkeypatch):
    """The norms / MLPs / rotary compile once per class for every model and shape: past the limit, copies."""
    from quest_hf import fuse

    monkeypatch.setattr(fuse, "_compiled", {})
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_decode=False)
    eager = [_generate(model, b).sequences for b in BATCHES]
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_backend="eager",
                _compile_devices=("cuda", "cpu"))
    for b, want in zip(BATCHES, eager):
        assert torch.equal(_generate(model, b).sequences, want)
    compiled = model._quest_state.compiled
    assert not compiled.failed and compiled.rotary_calls == 3 * 3 * 3  # 3 layers, 3 decode steps, 3 batches
    copies = {key[0].__qualname__: fn.copies for key, fn in fuse._compiled.items()}
    assert copies and all(n >= 1 for n in copies.values()), copies
    assert all(fn.graph_break is None for fn in fuse._compiled.values())  # Llama's norms, MLPs, rotary: one graph
