"""The batch-1 decode GEMV: the kernel against F.linear (interpreter on CPU), fused weights bitwise equal to their
parts, and `QuestConfig(decode_gemv=...)` binding, serving and unbinding a model's projections."""
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from quest_hf import QuestConfig, patch_model, unpatch_model
from quest_hf.decode_gemv import ATTN, MLP, GemvLinear
from triton_kernels.gemv import GemvLaunch, gemv, gemv_ref, gemv_takes

from .conftest import tiny_model
from .test_fuse_projections import COMPILE_ON_CPU


def _rows(N, K, dtype, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).to(dtype) / K**0.5
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("N,K,dtype,bias", [(37, 100, torch.float32, False), (64, 256, torch.float32, True),
                                            (13, 2048 + 48, torch.float32, True), (40, 96, torch.float16, False),
                                            (24, 160, torch.bfloat16, True)])
def test_gemv_matches_linear(N, K, dtype, bias):
    x, w, b = _rows(N, K, dtype, seed=N + K, bias=bias)
    out = torch.full((1, 1, N), float("nan"), dtype=dtype)  # NaN-poisoned: every output must be written
    got = gemv(x, w, b, out=out, launch=GemvLaunch(block_k=64))
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got is out and not got.isnan().any()
    tol = dict(float32=1e-5, float16=2e-3, bfloat16=1.6e-2)[str(dtype).split(".")[1]]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(gemv_ref(x, w, b).float(), want, rtol=tol, atol=tol)


def test_gemv_reads_a_strided_row():
    x, w, _ = _rows(20, 64, torch.float32, seed=3)
    wide = torch.randn(1, 128)
    wide[:, ::2] = x.view(1, 64)
    got = gemv(wide[:, ::2], w)  # the row with stride 2 along K
    torch.testing.assert_close(got, F.linear(x.view(1, 64), w), rtol=1e-5, atol=1e-5)


def test_gemv_of_a_concatenated_weight_equals_its_parts_bitwise():
    # One program's row sum does not depend on N (fixed launch settings): fused q/k/v or gate/up outputs are those
    # of the separate projections, bit for bit.
    x, w1, b1 = _rows(24, 300, torch.float32, seed=5, bias=True)
    _, w2, b2 = _rows(9, 300, torch.float32, seed=6, bias=True)
    _, w3, b3 = _rows(40, 300, torch.float32, seed=7, bias=True)
    launch = GemvLaunch(block_k=128)
    fused = gemv(x, torch.cat([w1, w2, w3]), torch.cat([b1, b2, b3]), launch=launch)
    parts = torch.cat([gemv(x, w, b, launch=launch) for w, b in ((w1, b1), (w2, b2), (w3, b3))], -1)
    assert torch.equal(fused, parts)


def test_gemv_refuses_what_it_cannot_serve():
    x, w, b = _rows(8, 32, torch.float32)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 32), w)
    with pytest.raises(TypeError, match="must match the weight"):
        gemv(x.half(), w)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gemv(x, torch.randn(32, 8).t())
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, torch.randn(9))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(1, 8))
    assert gemv_takes(x, w) and not gemv_takes(torch.randn(2, 32), w) and not gemv_takes(x.double(), w.double())
    with torch.enable_grad():
        assert not gemv_takes(x, w.requires_grad_())


def _gen(model, ids, n=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)


def test_decode_gemv_serves_one_sequence_decode_and_unbinds(single_thread):
    model = tiny_model("llama")
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    patch_model(model, budget=32, dense_layers=1)  # "auto" on CPU: not bound
    assert model._quest_state.gemv is None and QuestConfig().decode_gemv == "auto"
    plain = _gen(model, ids)
    patch_model(model, budget=32, dense_layers=1, decode_gemv=True, fuse_projections=False)
    record = model._quest_state.gemv
    n = model.config.num_hidden_layers
    assert len(record.bound) == n * (len(ATTN) + len(MLP)) and not record.skipped
    out = _gen(model, ids)
    assert record.calls == 5 * n * 7  # the 5 decode steps after the first token's prefill, 7 projections a layer
    assert torch.equal(out.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(plain.logits), rtol=1e-4, atol=1e-4)
    # A batch of two rows keeps cuBLAS (F.linear): nothing more served.
    model.generate(ids.expand(2, -1), attention_mask=torch.ones(2, 40, dtype=torch.long), max_new_tokens=3)
    assert record.calls == 5 * n * 7
    unpatch_model(model)
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_decode_gemv_fused_equals_unfused_bitwise_and_traces_compiled(single_thread):
    model = tiny_model("qwen2")  # q/k/v biases
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(4))
    patch_model(model, budget=32, dense_layers=1, decode_gemv=True, fuse_projections=False)
    unfused = _gen(model, ids)
    patch_model(model, budget=32, dense_layers=1, decode_gemv=True, fuse_projections=True)
    state = model._quest_state
    assert state.fused.qkv and state.fused.gate_up and state.gemv is not None
    before = state.gemv.calls  # the record stays while the GEMV stays bound (140 from the unfused run)
    fused = _gen(model, ids)
    assert torch.equal(fused.sequences, unfused.sequences)
    n = model.config.num_hidden_layers
    assert state.gemv.calls - before == 5 * n * 4  # a layer: q/k/v in one call, o, gate/up in one, down
    assert torch.equal(torch.stack(fused.logits), torch.stack(unfused.logits))
    patch_model(model, budget=32, dense_layers=1, decode_gemv=True, fuse_projections=True, **COMPILE_ON_CPU)
    compiled = _gen(model, ids)
    assert not model._quest_state.compiled.failed
    assert torch.equal(torch.stack(compiled.logits), torch.stack(unfused.logits))
    patch_model(model, budget=32, dense_layers=1, decode_gemv=False, fuse_projections=True)  # unbinds under fusion
    assert model._quest_state.gemv is None and model._quest_state.fused.qkv
    assert not any(type(m) is GemvLinear for m in model.modules())
    unpatch_model(model)


def test_one_compiled_mlp_serves_every_layer_and_model_under_the_gemv(single_thread):
    # compile_decode compiles one function per MLP class (or the fused gate/up function) for every layer. The GEMV's
    # binding on each projection must not make dynamo guard on anything a layer or a model owns alone: with such a
    # guard each layer compiled anew and, past dynamo's recompile limit (8), the rest of the layers ran eagerly.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    from transformers.models.llama.modeling_llama import LlamaMLP

    from quest_hf.fuse_proj import gate_up_forward

    layers = torch._dynamo.config.recompile_limit + 2
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    for fuse, fn in ((False, LlamaMLP.forward), (True, gate_up_forward)):
        torch._dynamo.reset()
        for _ in range(2):  # two models: two GEMV records
            model = tiny_model("llama", layers=layers)
            patch_model(model, budget=32, dense_layers=1, decode_gemv=True, fuse_projections=fuse, **COMPILE_ON_CPU)
            before = model._quest_state.gemv.calls
            _gen(model, ids, n=3)
            mlps = [m for m in model._quest_state.compiled.modules if isinstance(m, LlamaMLP)]
            assert len(mlps) == layers and all(m._quest_compiled_calls == 2 for m in mlps)
            # Counted: only the attention's eager projections (q/k/v/o, or the fused q/k/v and o), none of the MLP's.
            assert model._quest_state.gemv.calls - before == 2 * layers * (2 if fuse else 4)
            assert len(entries(fn.__code__)) == 1, f"fuse_projections={fuse}: {len(entries(fn.__code__))} graphs"
            unpatch_model(model)


def test_decode_gemv_config_is_true_false_or_auto():
    for bad in (1, "on", None):
        with pytest.raises(ValueError, match="decode_gemv must be True, False or 'auto'"):
            QuestConfig(decode_gemv=bad)


def test_set_gemv_launch_replaces_the_default_every_call_reads(monkeypatch):
    # bench_e2e's --gemv-launch: gemv() without launch= reads the module's GEMV_LAUNCH at each call; bad names refused.
    from quest_hf.bench import set_gemv_launch
    from triton_kernels import gemv as gemv_mod

    monkeypatch.setattr(gemv_mod, "GEMV_LAUNCH", gemv_mod.GEMV_LAUNCH)
    assert gemv_mod.GEMV_LAUNCH.pdl
    launch = set_gemv_launch(["pdl=False", "BLOCK_N=8"])
    assert gemv_mod.GEMV_LAUNCH is launch and not launch.pdl and launch.block_n == 8
    for bad in (["pdll=False"], ["pdl"]):
        with pytest.raises(SystemExit, match="GemvLaunch fields as NAME=VALUE"):
            set_gemv_launch(bad)
