"""GPU-marked: the batch-1 decode GEMV (triton_kernels/gemv.py) compiled at real projection sizes against
F.linear (cuBLAS), fused weights bitwise equal to their parts, inside a CUDA graph, and `decode_gemv="auto"` on a
patched CUDA model (bound, served by the captured decode, logits close to cuBLAS's, tokens equal on a tiny model).

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_decode_gemv.py`.
"""
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from quest_hf import QuestCache, patch_model, release_cache, unpatch_model
from quest_hf.bench import random_llama
from triton_kernels._common import pdl_available
from triton_kernels.gemv import GemvLaunch, gemv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize("N,K", [(4096, 4096), (12288, 4096), (4096, 11008), (1024, 4096), (28672, 4096),
                                 (32000, 4096), (1000, 1000)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_matches_cublas_at_real_sizes(N, K, dtype):
    g = torch.Generator(DEV).manual_seed(N + K)
    w = (torch.randn(N, K, device=DEV, generator=g) / K**0.5).to(dtype)
    x = torch.randn(1, 1, K, device=DEV, generator=g).to(dtype)
    b = torch.randn(N, device=DEV, generator=g).to(dtype)
    out = torch.full((1, 1, N), float("nan"), device=DEV, dtype=dtype)
    got = gemv(x, w, b, out=out)
    assert not got.isnan().any()
    want = F.linear(x.float(), w.float(), b.float())
    ulp = dict(zip((torch.float16, torch.bfloat16), (2**-10, 2**-7)))[dtype]
    err = (got.float() - want).abs() / want.abs().clamp_min(1.0)
    assert err.max().item() <= ulp  # within one rounding step of the fp32 product (rounded once to dtype)


def test_gemv_fused_weight_equals_its_parts_and_replays_in_a_graph():
    g = torch.Generator(DEV).manual_seed(1)
    parts = [(torch.randn(n, 4096, device=DEV, generator=g) / 64).half() for n in (4096, 1024, 1024)]
    x = torch.randn(1, 4096, device=DEV, generator=g).half()
    fused = gemv(x, torch.cat(parts))
    assert torch.equal(fused, torch.cat([gemv(x, w) for w in parts], -1))
    out = torch.empty(1, 6144, device=DEV, dtype=torch.half)
    w = torch.cat(parts)
    gemv(x, w, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, w, out=out)
    out.zero_()
    x.copy_(torch.randn(1, 4096, device=DEV, generator=g).half())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, w))


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_available(torch.device(DEV)),
                    reason="needs a GPU and Triton with programmatic dependent launch")
def test_gemv_dependent_launch_waits_for_the_kernel_that_writes_x():
    # A chain where each GEMV's input is the output of the kernel just before it (another GEMV, or an elementwise
    # kernel), captured and replayed: a launch that read x before its writer finished would read the last replay's
    # (or the zeroed) values. Outputs with and without the dependent launch equal bitwise, step by step.
    g = torch.Generator(DEV).manual_seed(5)
    ws = [(torch.randn(4096, 4096, device=DEV, generator=g) / 64).half() for _ in range(6)]
    x0 = torch.randn(1, 4096, device=DEV, generator=g).half()

    def chain(launch, outs):
        x = x0
        for i, w in enumerate(ws):
            x = gemv(x, w, out=outs[i], launch=launch)
            if i % 2:
                x = torch.tanh(x)  # a torch kernel between two GEMVs: the writer of the next x
        return x

    runs = {}
    for pdl in (False, True):
        launch = GemvLaunch(pdl=pdl)
        outs = [torch.empty(1, 4096, device=DEV, dtype=torch.half) for _ in ws]
        want = chain(launch, outs).clone()
        steps = [o.clone() for o in outs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            last = chain(launch, outs)
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(last, want)
        assert all(torch.equal(a, b) for a, b in zip(outs, steps))
        runs[pdl] = steps
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


def test_decode_gemv_auto_on_a_cuda_model_serves_the_captured_decode():
    torch.manual_seed(0)
    model = random_llama("tiny", torch.float16, torch.device(DEV), 4096)
    ids = torch.randint(2, 1000, (1, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(3))
    outs = {}
    for on in (False, "unfused", "auto"):
        patch_model(model, budget=64, page_size=16, decode_gemv="auto" if on else False,
                    fuse_projections=False if on == "unfused" else "auto")
        assert (model._quest_state.fused is not None) == (on == "auto")
        record = model._quest_state.gemv
        assert (record is not None) == bool(on)
        if record is not None:
            assert len(record.bound) == 7 * len(model.model.layers) and not record.skipped
        cache = QuestCache.from_model(model, max_length=ids.shape[1] + 24)
        outs[on] = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                                  do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert cache.decode_path == "captured"
        if record is not None:
            assert record.calls > 0  # the capture ran the projections' forwards through the GEMV
        release_cache(model)
        unpatch_model(model)
    # Fused over the GEMV: bitwise what the GEMV gives unfused (prefill by the separate matmuls, decode by one GEMV).
    assert torch.equal(torch.stack(outs["auto"].logits), torch.stack(outs["unfused"].logits))
    assert torch.equal(outs[False].sequences, outs["auto"].sequences)
    torch.testing.assert_close(torch.stack(outs["auto"].logits), torch.stack(outs[False].logits), atol=5e-2, rtol=1e-2)
