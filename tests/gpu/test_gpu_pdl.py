"""GPU-marked: dependent launches through the whole captured decode step (Hopper or newer): inductor's compiled
norms / MLPs / rotary (`quest_hf.fuse.inductor_pdl`), the append and the scoring launch wait, resident, for the
kernel before them instead of being launched after it. Same logits bitwise as the step with no dependent launch at
all (QUEST_HF_PDL=0), fp16 and bf16, MHA and GQA, with key-dtype and 8-bit bounds.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_pdl.py`.
"""
import pytest
import torch

from quest_hf import QuestCache, patch_model, release_cache, unpatch_model
from quest_hf.bench import MODEL_SHAPES, random_llama
from quest_hf.fuse import inductor_pdl
from triton_kernels._common import pdl_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


# MHA runs the three-launch step (fused_step=True: also without dependent launches, so both runs take it); the tiny
# GQA shape runs the separate kernels of the union.
@pytest.mark.parametrize("dtype,heads,kv_heads,bounds", [(torch.float16, 4, 4, "key_dtype"),
                                                         (torch.bfloat16, 4, 2, "int8_channel")])
def test_dependent_launches_replay_the_plain_logits(dtype, heads, kv_heads, bounds, monkeypatch):
    if not pdl_available(torch.device(DEV)):
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    shape = f"tiny-{heads}-{kv_heads}"
    monkeypatch.setitem(MODEL_SHAPES, shape, dict(MODEL_SHAPES["tiny"], num_attention_heads=heads,
                                                  num_key_value_heads=kv_heads))
    torch.manual_seed(0)
    model = random_llama(shape, dtype, torch.device(DEV), 4096)
    ids = torch.randint(2, 1000, (1, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(5))
    outs = {}
    for on in (False, True):
        # Each run compiles its decode functions afresh: in a process that ran other shapes before (the whole GPU
        # suite), dynamo's recompile limit (8 a function) was reached by one run's rotary and not the other's, which
        # then ran it eagerly, rounded otherwise (round 27: both cases failed so, with "hit config.recompile_limit").
        torch._dynamo.reset()
        monkeypatch.setenv("QUEST_HF_PDL", "1" if on else "0")
        assert pdl_available(torch.device(DEV)) is on
        patch_model(model, budget=64, page_size=16, bounds=bounds, fused_step=True if heads == kv_heads else "auto")
        cache = QuestCache.from_model(model, max_length=ids.shape[1] + 24)
        outs[on] = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                                  do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert cache.decode_path == "captured"
        compiled = model._quest_state.compiled
        assert not compiled.failed and compiled.pdl is (on and inductor_pdl(torch.device(DEV)))
        kernels = {layer.step_kernels for layer in cache.layers if getattr(layer, "step_kernels", None)}
        assert kernels and all(k.startswith("fused") for k in kernels) is (heads == kv_heads), kernels
        release_cache(model)
        unpatch_model(model)
    assert torch.equal(torch.stack(outs[True].logits), torch.stack(outs[False].logits))
    assert torch.equal(outs[True].sequences, outs[False].sequences)
