"""QuestConfig(fuse_projections=True): one matmul for q/k/v and one for gate/up, same tokens, no weight copied."""
import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from quest_hf import QuestConfig, patch_model, unpatch_model
from quest_hf import fuse as fuse_mod
from quest_hf.fuse_proj import gate_up_forward

from .conftest import left_padded_batch, tiny_model

# compile_decode on CPU inputs with dynamo's "eager" backend: the traced plumbing of the fused MLP, no codegen.
COMPILE_ON_CPU = dict(_compile_devices=("cpu",), compile_backend="eager")
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _gen(model, ids, mask, n=5):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def _linears(model):
    for layer in model.model.layers:
        for owner, names in GROUPS:
            yield [getattr(getattr(layer, owner), n) for n in names]


def _storages(group, what="weight"):
    return {getattr(m, what).untyped_storage().data_ptr() for m in group}


def _param_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_generate_equals_unfused(family, single_thread):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    patch_model(model, budget=32, dense_layers=1)
    plain = _gen(model, ids, mask)
    patch_model(model, budget=32, dense_layers=1, fuse_projections=True)  # default compile_decode: CPU compiles none
    fused = model._quest_state.fused
    layers = list(range(model.config.num_hidden_layers))
    assert fused.qkv == layers and fused.gate_up == layers and not fused.skipped
    assert torch.equal(_gen(model, ids, mask), plain)
    patch_model(model, budget=32, dense_layers=1, fuse_projections=True, **COMPILE_ON_CPU)
    assert torch.equal(_gen(model, ids, mask), plain)
    compiled = model._quest_state.compiled
    assert not compiled.failed
    mlps = [m for m in compiled.modules if type(m).__name__.endswith("MLP")]
    assert len(mlps) == len(layers) and all(m._quest_compiled_calls == 4 for m in mlps)  # the 4 decode steps
    assert (gate_up_forward, "eager", False) in fuse_mod._compiled  # dynamo traced the fused MLP, not the class's forward
    unpatch_model(model)
    assert all(len(_storages(g)) == len(g) for g in _linears(model))


def test_fused_logits_and_the_exact_fallback(single_thread):
    model = tiny_model("qwen2")  # q/k/v with biases
    ids, mask = left_padded_batch()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        patch_model(model, budget=32, compile_decode=False, fuse_projections=True)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference, atol=1e-5, rtol=1e-5)
        attn = model.model.layers[1].self_attn
        x, y = torch.randn(2, 3, model.config.hidden_size), torch.randn(2, 3, model.config.hidden_size)
        q = attn.q_proj(x)  # the group's one matmul; k and v kept for calls on this x
        torch.testing.assert_close(q, F.linear(x, attn.q_proj.weight, attn.q_proj.bias), atol=1e-6, rtol=1e-6)
        assert torch.equal(attn.k_proj(y), F.linear(y, attn.k_proj.weight, attn.k_proj.bias))  # another input: its own
        torch.testing.assert_close(attn.v_proj(x), F.linear(x, attn.v_proj.weight, attn.v_proj.bias),
                                   atol=1e-6, rtol=1e-6)
        x.add_(1)  # changed in place since q_proj saw it: k is computed anew, not taken from before
        torch.testing.assert_close(attn.k_proj(x), F.linear(x, attn.k_proj.weight, attn.k_proj.bias),
                                   atol=1e-6, rtol=1e-6)
        # A hook on gate_proj (which the fused MLP skips) sends the MLP back to its own forward.
        seen = []
        mlp = model.model.layers[0].mlp
        handle = mlp.gate_proj.register_forward_hook(lambda *a: seen.append(1))
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference, atol=1e-5, rtol=1e-5)
        assert seen
        handle.remove()
    # Grad enabled (weights require grad): every projection runs its own weight, gradients reach it.
    loss = model(ids, attention_mask=mask).logits.sum()
    loss.backward()
    assert all(m.weight.grad is not None for g in _linears(model) for m in g)
    unpatch_model(model)


def test_gate_up_forward_product_in_place_unless_autograd_records_it(single_thread):
    # The product goes into act_fn's output (no extra up-sized buffer at a long prefill's peak); an input that
    # requires grad gets a fresh product, so an activation whose backward reads its output still differentiates.
    torch.manual_seed(0)
    mlp = tiny_model("llama").model.layers[0].mlp
    weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    sizes = [mlp.gate_proj.out_features, mlp.up_proj.out_features]
    x = torch.randn(2, 5, mlp.gate_proj.in_features)
    with torch.no_grad():
        want = mlp.down_proj(mlp.act_fn(F.linear(x, weight[:sizes[0]])) * F.linear(x, weight[sizes[0]:]))
        assert torch.equal(gate_up_forward(mlp, x, weight, None, sizes), want)
    mlp.act_fn = torch.nn.Sigmoid()  # backward from its output: an in-place product would break it
    xg = x.clone().requires_grad_()
    gate_up_forward(mlp, xg, weight, None, sizes).sum().backward()
    ref = x.clone().requires_grad_()
    mlp.down_proj(torch.sigmoid(F.linear(ref, weight[:sizes[0]])) * F.linear(ref, weight[sizes[0]:])).sum().backward()
    torch.testing.assert_close(xg.grad, ref.grad)


def test_no_weight_copied_and_unpatch_gives_each_its_own(single_thread):
    model = tiny_model("qwen2")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    total = _param_bytes(model)
    ids, mask = left_padded_batch(lengths=(30, 24))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=3)
    for fuse in (True, False, True):  # re-patching fuses and unfuses in place
        patch_model(model, budget=32, compile_decode=False, fuse_projections=fuse)
        assert (model._quest_state.fused is not None) == fuse
        for g in _linears(model):
            assert len(_storages(g)) == (1 if fuse else len(g))
            if g[0].bias is not None:
                assert len(_storages(g, "bias")) == (1 if fuse else len(g))  # qwen2's q/k/v biases fuse too
        assert _param_bytes(model) == total
        assert dict(model.named_parameters()) == params  # the same Parameter objects, views or not
        assert torch.equal(_gen(model, ids, mask, n=3), plain)
    unpatch_model(model)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in original.items()) and _param_bytes(model) == total
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)  # save_pretrained's condition
    assert all(t.is_contiguous() for t in state.values())
    assert all("forward" not in vars(m) for g in _linears(model) for m in g)
    assert all("forward" not in vars(layer.mlp) and "_quest_fused" not in vars(layer.mlp)
               for layer in model.model.layers)


def test_unfit_layers_stay_unfused_and_broken_views_fall_back(single_thread):
    import transformers as tf

    class OtherMLP(tf.models.qwen2.modeling_qwen2.Qwen2MLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model = tiny_model("qwen2")
    layers = model.model.layers
    layers[0].self_attn.v_proj.bias = None  # biases on q/k only
    layers[2].mlp.__class__ = OtherMLP
    ids, mask = left_padded_batch(lengths=(30, 24))
    patch_model(model, budget=32, compile_decode=False)
    plain = _gen(model, ids, mask, n=3)
    patch_model(model, config=QuestConfig(budget=32, fuse_projections=True, **COMPILE_ON_CPU))
    fused = model._quest_state.fused
    assert fused.qkv == [1, 2, 3] and fused.gate_up == [0, 1, 3]
    assert set(fused.skipped) == {"layer 0 q/k/v", "layer 2 gate/up"} and "OtherMLP" in fused.skipped["layer 2 gate/up"]
    assert torch.equal(_gen(model, ids, mask, n=3), plain) and not model._quest_state.compiled.failed
    # A copy's weights are its own tensors (no views of the copied fused weight): it runs unfused, same tokens.
    twin = copy.deepcopy(model)
    assert torch.equal(_gen(twin, ids, mask, n=3), plain)
    assert not twin.model.layers[1].mlp._quest_fused.intact()
    # model.double() replaces every weight's data: the views are gone, each projection runs its own weight.
    model.double()
    assert not layers[1].mlp._quest_fused.intact()
    with torch.no_grad():  # no cache: a QuestCache stores fp16/bf16/fp32 keys only
        out = model(ids, attention_mask=mask, use_cache=False).logits
    unpatch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids, attention_mask=mask, use_cache=False).logits, atol=1e-10,
                                   rtol=1e-10)


def test_fuse_projections_is_auto_by_default_and_follows_the_gemv():
    assert QuestConfig().fuse_projections == "auto"
    with pytest.raises(ValueError, match="fuse_projections must be True, False or 'auto'"):
        QuestConfig(fuse_projections=1)
    model = tiny_model("llama")
    patch_model(model, budget=32)  # CPU: no decode GEMV, so "auto" fuses nothing
    assert model._quest_state.gemv is None and model._quest_state.fused is None
    patch_model(model, budget=32, decode_gemv=True)  # interpreter: the GEMV binds, and "auto" fuses over it
    assert model._quest_state.gemv is not None and model._quest_state.fused.qkv
    unpatch_model(model)
