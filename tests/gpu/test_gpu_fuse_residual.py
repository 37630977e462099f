"""GPU-marked: QuestConfig.fuse_residual under inductor inside the captured decode step: the same logits bitwise as
the unfused step (the sum rounded as HF rounds it before the norm reads it), and two kernels a layer fewer in the
replayed graph.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_fuse_residual.py`.
"""
import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from quest_hf import QuestCache, patch_model, release_cache, unpatch_model
from quest_hf.bench import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _replay_kernels(model) -> collections.Counter:
    """Kernel names of one replay of the model's captured decode step."""
    graph = model._quest_state.graph.graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_residual_adds_replay_the_unfused_logits_with_fewer_kernels(dtype):
    torch.manual_seed(0)
    model = random_llama("tiny", dtype, torch.device(DEV), 4096)
    ids = torch.randint(2, 1000, (1, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(3))
    outs, kernels = {}, {}
    for on in (False, True):
        patch_model(model, budget=64, page_size=16, fuse_residual=on)
        cache = QuestCache.from_model(model, max_length=ids.shape[1] + 24)
        outs[on] = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                                  do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert cache.decode_path == "captured"
        compiled = model._quest_state.compiled
        layers = len(model.model.layers)
        if on:
            assert compiled.residual == {i: "fused" for i in range(layers)} and not compiled.failed
            assert compiled.residual_hits >= layers  # the capture took every handed-on norm output
        kernels[on] = _replay_kernels(model)
        release_cache(model)
        unpatch_model(model)
    assert torch.equal(torch.stack(outs[True].logits), torch.stack(outs[False].logits))
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    fewer = sum(kernels[False].values()) - sum(kernels[True].values())
    assert fewer == 2 * layers, (fewer, kernels[False] - kernels[True], kernels[True] - kernels[False])
