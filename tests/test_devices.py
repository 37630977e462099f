"""Placement: cache layers follow the device and dtype of the keys they receive; accelerate device_maps."""
import pytest
import torch

from quest_hf import QuestCache, patch_model

from .conftest import left_padded_batch, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_layers_follow_dtype_and_device_of_keys(dtype):
    model = tiny_model("llama", heads=8, kv_heads=2).to(dtype)
    patch_model(model, budget=32)
    ids, mask = left_padded_batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.kmin, layer.kmax):
            assert t.dtype == dtype and t.device.type == "cpu"
        assert layer.valid.dtype == torch.bool


def test_accelerate_dispatch_hooks_patch_and_generate_the_same_tokens():
    # accelerate's per-module dispatch hooks around a patched model (every module on the CPU here: a model spread
    # over devices needs several GPUs, which CI does not have; see scripts/bench_multigpu.py).
    from accelerate import dispatch_model

    ids, mask = left_padded_batch(lengths=(90, 71))
    ref_model = tiny_model("llama", heads=8, kv_heads=2)
    patch_model(ref_model, budget=32)
    ref = ref_model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)

    model = tiny_model("llama", heads=8, kv_heads=2)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "cpu" for i in range(model.config.num_hidden_layers)}
    model = dispatch_model(model, device_map=device_map)
    assert getattr(model, "hf_device_map", None) is not None
    patch_model(model, budget=32)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(ref, out)


def test_cache_refuses_a_new_batch_shape():
    model = tiny_model("llama")
    patch_model(model, budget=32)
    cache = QuestCache.from_model(model)
    ids, mask = left_padded_batch()
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    with pytest.raises(ValueError, match="use a new QuestCache for a new batch"):
        model(input_ids=ids[:1, :1], attention_mask=mask[:1], past_key_values=cache)
