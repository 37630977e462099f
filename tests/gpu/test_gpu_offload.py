"""GPU-marked tests of QuestConfig(offload="cpu"): the kernels reading and writing page-locked host memory at real
sizes against their twins, offloaded vs resident decode at 32K (tokens and logits equal, the captured path taken),
and a context whose resident cache would not fit under a memory cap.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_offload.py`.
"""
import pytest
import torch

import triton_kernels.offload as tko
from quest_hf import QuestCache, patch_model, prefill, unpatch_model
from quest_hf.bench import random_llama
from quest_hf.offload import _register
from quest_hf.patch import cache_arg_name

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _host(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of `t` (registered as the offloaded cache registers its K/V)."""
    return _register(t.cpu().contiguous().clone())


@pytest.mark.parametrize("B, H, C, D, K, R", [
    pytest.param(1, 8, 32768 + 16, 128, 516, 1032, id="llama3-8b-32K"),
    pytest.param(2, 4, 4096 + 16, 64, 37, 40, id="batch2-odd"),
])
def test_fetch_pages_reads_pinned_host(B, H, C, D, K, R, S=16):
    g = torch.Generator(DEV).manual_seed(0)
    host_k = torch.randn(B, H, C, D, generator=g, device=DEV).half()
    host_v = torch.randn(B, H, C, D, generator=g, device=DEV).half()
    tail_k, tail_v = host_k[:, :, :S].clone(), host_v[:, :, :S].clone()
    valid = torch.rand(B, C, generator=g, device=DEV) > 0.1
    pos = torch.tensor(C - S - 5, device=DEV)
    ids = torch.stack([torch.randperm(C // S - 1, generator=g, device=DEV)[:K] for _ in range(B * H)]).view(B, H, K)
    ids = ids.int()
    ids[:, :, 0] = (int(pos) - 1) // S
    slots = torch.stack([torch.randperm(R, generator=g, device=DEV)[:K] for _ in range(B * H)]).view(B, H, K).int()
    fetch = torch.rand(B, H, K, generator=g, device=DEV) > 0.3
    fetch[:, :, 0] = True
    pool = lambda dev: (torch.full((B * H, 1, (R + 1) * S, D), 3.0, dtype=torch.half, device=dev),  # noqa: E731
                        torch.full((B * H, 1, (R + 1) * S, D), 3.0, dtype=torch.half, device=dev),
                        torch.zeros(B * H, (R + 1) * S, dtype=torch.bool, device=dev))
    got, want = pool(DEV), pool("cpu")
    hk, hv = _host(host_k), _host(host_v)
    tko.fetch_pages(hk, hv, tail_k, tail_v, valid, ids, slots, fetch, *got, pos, S, 0)
    cpu = [t.cpu() for t in (tail_k, tail_v, valid, ids, slots, fetch)]
    tko.fetch_pages_ref(hk, hv, *cpu, *want, pos.cpu(), S, 0)
    torch.cuda.synchronize()
    n = R * S  # the scratch page is left out (the reference scatters what it does not copy there)
    assert torch.equal(got[0][:, :, :n].cpu(), want[0][:, :, :n])
    assert torch.equal(got[1][:, :, :n].cpu(), want[1][:, :, :n])
    assert torch.equal(got[2][:, :n].cpu(), want[2][:, :n])


@pytest.mark.parametrize("B, H, P, K, R", [
    pytest.param(1, 8, 8193, 516, 1032, id="llama3-8b-128K-default-pool"),
    pytest.param(1, 8, 8193, 516, 516, id="pool-one-step"),
    pytest.param(2, 4, 700, 37, 4128, id="large-pool"),
])
def test_assign_slots_kernel_matches_ref(B, H, P, K, R, S=16):
    # The compiled one-program-a-row LRU (sort of 2^k int64 keys) against the tensor-op reference, 12 steps.
    g = torch.Generator().manual_seed(0)
    make = lambda dev: [torch.full((B, H, P + 1), -1, dtype=torch.int32, device=dev),  # noqa: E731
                        torch.full((B, H, R + 1), -1, dtype=torch.int32, device=dev),
                        torch.full((B, H, R + 1), -1, dtype=torch.long, device=dev),
                        torch.zeros(4, dtype=torch.long, device=dev)]
    dev_t, ref_t = make(DEV), make("cpu")
    for step in range(12):
        pos = 16 * (P - 2) - 40 + step
        base = torch.randperm(P - 1, generator=g)[: K + K // 2]
        ids = torch.stack([base[torch.randperm(len(base), generator=g)[:K]] for _ in range(B * H)]).view(B, H, K)
        ids = ids.int().sort(-1).values
        want = tko.assign_slots_ref(ids, *ref_t[:3], torch.tensor(pos), S, ref_t[3])
        got = tko.assign_slots(ids.to(DEV), *dev_t[:3], torch.tensor(pos, device=DEV), S, dev_t[3])
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b), step
        for i, (a, b) in enumerate(zip(dev_t, ref_t)):
            a, b = (a[..., :-1], b[..., :-1]) if i < 3 else (a, b)
            assert torch.equal(a.cpu(), b), (step, i)


def test_write_token_to_pinned_host(S=16):
    g = torch.Generator(DEV).manual_seed(1)
    host = [_host(torch.zeros(2, 8, 4096, 128, dtype=torch.half)) for _ in range(2)]
    tail = [torch.zeros(2, 8, S, 128, dtype=torch.half, device=DEV) for _ in range(2)]
    k, v = (torch.randn(2, 8, 1, 128, generator=g, device=DEV).half() for _ in range(2))
    tko.write_token_at(*host, *tail, k, v, torch.tensor(1234, device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(host[0][:, :, 1234], k[:, :, 0].cpu()) and torch.equal(host[1][:, :, 1234], v[:, :, 0].cpu())
    assert torch.equal(tail[0][:, :, 1234 % S], k[:, :, 0]) and torch.equal(tail[1][:, :, 1234 % S], v[:, :, 0])
    assert int(host[0][:, :, :1234].abs().sum()) == 0  # nothing else written


def _decode(model, ids, new_tokens, **cfg):
    patch_model(model, **cfg)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out, out.past_key_values


@pytest.mark.parametrize("pages", [pytest.param(None, id="default-pool"), pytest.param(2 * 129, id="pool-one-step")])
def test_offloaded_equals_resident_32k_captured(pages):
    # GQA 4/2 heads of 64, 4 layers (2 dense), random weights, 32K prompt, budget 2048: every sparse step chooses
    # 2 x 129 pages per KV head, so a pool of one step's selection evicts at every step.
    model = random_llama("tiny", torch.float16, DEV, 32768 + 64)
    ids = torch.randint(1, model.config.vocab_size, (1, 32768), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    try:
        ref, ref_cache = _decode(model, ids, 32, budget=2048)
        out, cache = _decode(model, ids, 32, budget=2048, offload="cpu", offload_pages=pages)
    finally:
        unpatch_model(model)
    assert ref_cache.decode_path == "captured" and cache.decode_path == "captured"
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
    st = cache.offload_stats
    assert st["offloaded_layers"] == 2 and st["steps"] == 31 and st["misses"] > 0
    assert cache.layers[2].keys.device.type == "cpu" and cache.layers[2].keys._page_locked
    assert cache.layers[0].keys.device.type == "cuda"  # dense layers stay on the GPU


def test_memory_stays_under_cap():
    # 16 layers x 8 KV heads of 128: 64 KiB of K/V a token, 4 GiB at 64K tokens. Under a cap of the weights + 1.5 GiB
    # the resident cache cannot fit; offloaded (2 dense layers resident, 0.5 GiB), prefilled in chunks, it runs and
    # gives the resident cache's tokens (run without the cap afterwards).
    from transformers import LlamaConfig, LlamaForCausalLM

    L, new = 65536, 16
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=L + 64,
                      attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg).half().eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 32000, (1, L), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    # The cap counts from what this process already holds (the weights, and whatever earlier GPU tests in the same
    # pytest process left reserved), so the test measures this model's cache only.
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_reserved() + int(1.5 * 2**30)
    resident_kv = 16 * L * 8 * 128 * 2 * 2
    assert resident_kv > int(1.5 * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    tokens = {}
    try:
        for offload in ("cpu", None):
            patch_model(model, budget=2048, offload=offload)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.set_per_process_memory_fraction(cap / total if offload else 1.0)
            cache, _ = prefill(model, ids[:, :-1], chunk=8192, max_length=L + new)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, **{cache_arg_name(model): cache})
            tokens[offload] = out[:, L:]
            if offload:
                peak = torch.cuda.max_memory_allocated()
                assert peak < cap, f"peak {peak / 2**30:.2f} GiB over the cap {cap / 2**30:.2f} GiB"
                assert cache.decode_path == "captured"
                assert cache.prefill_mode.startswith("blockwise")
            del cache
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        unpatch_model(model)
    assert torch.equal(tokens["cpu"], tokens[None])


def test_refused_with_torch_backend_on_cuda():
    model = random_llama("tiny", torch.float16, DEV, 512)
    patch_model(model, budget=64, offload="cpu", backend="torch")
    ids = torch.ones(1, 300, dtype=torch.long, device=DEV)
    try:
        with pytest.raises(ValueError, match="reads host pages with the Triton kernels"):
            model(ids, **{cache_arg_name(model): QuestCache.from_model(model)})
    finally:
        unpatch_model(model)
