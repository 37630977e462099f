"""`QuestConfig(fused_step=...)`: a patched model's decode step through the three-launch `quest_step` instead of
the separate kernels, same pages, same tokens; which kernels ran is on each layer (`layer.step_kernels`).
At real sizes, captured: tests/gpu/test_gpu_fused_step.py."""
import os

import pytest
import torch

from quest_hf import QuestCache, QuestConfig, patch_model

from .conftest import tiny_model
from .testing import DEVICE as DEV

triton_ok = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                               reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def test_fused_step_setting_is_checked():
    with pytest.raises(ValueError, match="fused_step must be True, False or 'auto'"):
        QuestConfig(fused_step="yes")
    assert QuestConfig().fused_step == "auto"
    cache = QuestCache(QuestConfig(), 4)
    assert cache.step_kernels is None  # no decode step yet
    for layer in cache.layers[1:]:
        layer.step_kernels = "fused: three launches chained by PDL"
    assert cache.step_kernels == "fused: three launches chained by PDL (layers 1-3)"
    cache.layers[2].step_kernels = "separate: QuestConfig(fused_step=False)"  # the summary follows a change
    assert cache.step_kernels == ("fused: three launches chained by PDL (layers 1,3); "
                                  "separate: QuestConfig(fused_step=False) (layers 2)")


def _run(model, ids, **kw):
    patch_model(model, budget=16, page_size=4, dense_layers=1, backend="triton", cuda_graph=False,
                compile_step=False, **kw)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out, [layer.step_kernels for layer in out.past_key_values.layers]


@triton_ok
def test_fused_step_decodes_the_separate_kernels_tokens(single_thread):
    model = tiny_model("llama", heads=4, kv_heads=4, layers=3).to(DEV)  # with a GPU the compiled kernels
    ids = torch.randint(2, 97, (1, 70), generator=torch.Generator().manual_seed(3)).to(DEV)
    sep, sep_kernels = _run(model, ids, fused_step=False)
    fused, fused_kernels = _run(model, ids, fused_step=True)
    assert sep_kernels == [None, "separate: QuestConfig(fused_step=False)", "separate: QuestConfig(fused_step=False)"]
    assert all(k is not None and k.startswith("fused: three launches") for k in fused_kernels[1:])
    # The cache's summary, and the model's copy of it (what a generate() that keeps its cache leaves to read).
    assert sep.past_key_values.step_kernels == "separate: QuestConfig(fused_step=False) (layers 1-2)"
    assert fused.past_key_values.step_kernels == f"{fused_kernels[1]} (layers 1-2)"
    assert model._quest_state.step_kernels == fused.past_key_values.step_kernels
    assert torch.equal(sep.sequences, fused.sequences)
    for a, b in zip(sep.scores, fused.scores):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    if not torch.cuda.is_available():  # the interpreter has no PDL: "auto" says so and keeps the separate kernels
        auto, auto_kernels = _run(model, ids)
        assert auto_kernels[1] == "separate: fused_step='auto' needs programmatic dependent launch (Hopper or newer)"
        assert torch.equal(auto.sequences, sep.sequences)
    # "auto" keeps 8-bit bounds on the separate kernels (before asking for PDL, so this holds on any device).
    _, int8_kernels = _run(model, ids, bounds="int8_channel")
    assert int8_kernels[1:] == ["separate: fused_step='auto' takes key-dtype bounds only (slower with 8-bit bounds "
                                "at 128K on an H100)"] * 2


@triton_ok
def test_fused_step_declines_what_it_cannot_run_and_says_why(single_thread):
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2).to(DEV)
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(4)).to(DEV)
    _, kernels = _run(model, ids, fused_step=True)
    assert kernels[1] == "separate: the GQA union (one score row a query head) runs as separate kernels"
    _, kernels = _run(model, ids, fused_step=True, gqa_mode="max")
    assert kernels[1].startswith("fused: three launches")
    out, kernels = _run(model, ids, fused_step=True, gqa_mode="max", reselect_every=2)
    assert kernels[1] == "separate: reselect_every > 1 (the reuse kernels)"
    assert out.past_key_values.step_kernels == "separate: reselect_every > 1 (the reuse kernels) (layers 1)"
    assert model._quest_state.step_kernels == out.past_key_values.step_kernels
