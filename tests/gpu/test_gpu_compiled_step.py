"""GPU-marked: `QuestConfig(compile_step=True)` on CUDA, the uncaptured step compiled whole (quest_hf/compiled.py).

The traced form puts the Triton kernels in inductor's graph (they failed to compile there once: inductor types a
Python float fp64, tests/test_kernel_float_args.py); the op form calls the eager step from the graph. Both must give
the eager step's tokens, from inductor's C++ wrapper (the CUDA default) and from its Python one. Skipped without
CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu`.
"""
import pytest
import torch

from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.bench import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
NEW = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = random_llama("tiny-mistral", torch.float16, torch.device(DEV), 4096)  # GQA 4/2, sliding window 128
    yield m
    unpatch_model(m)
    torch._dynamo.reset()


def _generate(model, ids, mask, hook=None, **options):
    patch_model(model, budget=64, page_size=16, compile_decode=False, **options)
    cache = QuestCache.from_model(model)
    seen = []
    if hook:
        cache.selection_hooks.append(lambda i, q, page_ids: seen.append(i))
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, return_dict_in_generate=True, output_scores=True)
    return out, cache, seen


@pytest.mark.parametrize("hook,wrapper", [(False, "auto"), (True, "auto"), (False, "python")],
                         ids=["traced", "op-with-hook", "traced-python-wrapper"])
def test_compiled_step_on_cuda_gives_the_eager_tokens(model, hook, wrapper):
    g = torch.Generator(DEV).manual_seed(4)
    ids = torch.randint(2, 1000, (2, 400), device=DEV, generator=g)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    torch._dynamo.reset()
    eager, c_e, seen_e = _generate(model, ids, mask, hook, cuda_graph=False, compile_step=False)
    comp, c_c, seen_c = _generate(model, ids, mask, hook, cuda_graph=False, compile_wrapper=wrapper)  # compiled
    step = model._quest_state.compiled_step
    assert step.failed is None, step.failed
    assert step.wrapper == ("cpp" if wrapper == "auto" else "python")  # the CUDA default: inductor's C++ wrapper
    assert c_e.decode_path == "eager: cuda_graph=False"
    assert c_c.decode_path == "compiled, uncaptured: cuda_graph=False"
    assert step.calls >= NEW - 1 and step.traced_calls == (0 if hook else step.calls)
    assert torch.equal(eager.sequences, comp.sequences)
    for a, b in zip(eager.scores, comp.scores):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert seen_e == seen_c and (len(seen_c) > 0) == hook


def test_capacity_is_exact_and_one_graph_serves_other_lengths(model):
    """The default on CUDA (compile_capacity "auto": exact): the uncaptured compiled cache holds what generate()
    needs, as the captured one does, and prompts of three lengths (pages in one power-of-two Top-K tile) run one
    traced graph with the eager tokens; compile_capacity="bucket" rounds up instead."""
    from torch._dynamo.utils import counters

    from quest_hf.compiled import bucket

    g = torch.Generator(DEV).manual_seed(5)
    prompts = [torch.randint(2, 1000, (1, n), device=DEV, generator=g) for n in (1100, 1500, 1900)]
    eager = [_generate(model, ids, torch.ones_like(ids), cuda_graph=False, compile_step=False)[0] for ids in prompts]
    patch_model(model, budget=64, page_size=16, compile_decode=False)  # captured
    captured = model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True).past_key_values
    assert captured.decode_path == "captured"
    torch._dynamo.reset()
    patch_model(model, budget=64, page_size=16, compile_decode=False, cuda_graph=False)
    assert model._quest_state.config.capacity_mode("cuda") == "exact"
    graphs = None
    for ids, want in zip(prompts, eager):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, return_dict_in_generate=True)
        cache = out.past_key_values  # generate()'s own: it knows the max length
        assert cache.decode_path == "compiled, uncaptured: cuda_graph=False"
        n = ids.shape[1]
        assert cache.layers[0].capacity == -(-(n + NEW) // 16) * 16 + 16  # page-rounded max length + the spare page
        if n == 1100:
            assert cache.layers[0].capacity == captured.layers[0].capacity
        assert torch.equal(out.sequences, want.sequences)
        graphs = graphs or counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, f"recompiled for a prompt of {n} tokens"
    step = model._quest_state.compiled_step
    assert step.failed is None and step.traced_calls == step.calls >= 3 * (NEW - 1)
    _, bucketed, _ = _generate(model, prompts[-1], torch.ones_like(prompts[-1]), cuda_graph=False,
                               compile_capacity="bucket")
    b = bucketed.layers[0].capacity - 16
    assert b == bucket(b) > 1900 + NEW
