"""QuestConfig.fuse_residual: the residual adds of plain pre-norm decoder layers run inside their norms' compiled
kernels (quest_hf/fuse.py). On CPU dynamo's "eager" backend runs the same wrapping (the kernel count is the GPU
suite's: tests/gpu/test_gpu_fuse_residual.py); here: which layers it takes, same outputs, what it leaves alone."""
import pytest
import torch

from quest_hf import patch_model, unpatch_model
from quest_hf.binding import MISSING
from quest_hf.fuse import standard_layer

from .conftest import left_padded_batch, tiny_model

ON_CPU = dict(compile_backend="eager", _compile_devices=("cuda", "cpu"))
NEW = 6  # new tokens: 5 decode steps after the prefill's


def _gen(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        assert torch.equal(x, y)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_fused_residual_adds_give_the_unfused_outputs(family):
    model = tiny_model(family, heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(60, 41))
    patch_model(model, budget=32, fuse_residual=False, **ON_CPU)
    assert not model._quest_state.compiled.residual
    plain = _gen(model, ids, mask)
    patch_model(model, budget=32, **ON_CPU)  # fuse_residual=True is the default
    compiled = model._quest_state.compiled
    layers = model.model.layers
    assert compiled.residual == {i: "fused" for i in range(len(layers))}
    assert all(type(vars(layer)["forward"]).__name__ == "Method" for layer in layers)
    fused = _gen(model, ids, mask)
    _same(plain, fused)
    # Each decode step: every layer's output reaches the next input norm (the last one's the final norm) computed.
    assert compiled.residual_hits == len(layers) * (NEW - 1) and compiled.pending is None
    post = layers[0].post_attention_layernorm
    assert post._quest_compiled_calls == NEW - 1  # its add ran compiled with it, once a decode step
    patch_model(model, budget=32, fuse_residual=False, **ON_CPU)  # re-configuring unbinds the layers' forwards
    assert all("forward" not in vars(layer) for layer in layers)
    patch_model(model, budget=32, **ON_CPU)
    unpatch_model(model)
    assert all("forward" not in vars(layer) for layer in layers)
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_hook_that_replaces_or_edits_a_layer_output_is_seen_by_the_next_norm():
    """The norm output computed with an add is taken only by that norm's call on that very tensor, unchanged: a
    forward hook returning a new tensor, or editing the output in place, makes the next norm compute anew."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(50, 37))
    layers = model.model.layers
    hooks = [layers[0].register_forward_hook(lambda m, a, out: out * 1.5),
             layers[1].register_forward_hook(lambda m, a, out: out.mul_(0.5))]
    try:
        patch_model(model, budget=32, fuse_residual=False, **ON_CPU)
        plain = _gen(model, ids, mask)
        patch_model(model, budget=32, **ON_CPU)
        fused = _gen(model, ids, mask)
        _same(plain, fused)
        # Layers 2 and 3 hand theirs on (to layer 3's input norm, to the final norm); 0 and 1 were hooked.
        assert model._quest_state.compiled.residual_hits == 2 * (NEW - 1)
    finally:
        for h in hooks:
            h.remove()
        unpatch_model(model)


def test_standard_layer_takes_only_the_plain_pre_norm_forward():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    params = standard_layer(LlamaDecoderLayer)
    assert isinstance(params, tuple) and params[:2] == ("attention_mask", "position_ids")

    class Scaled(LlamaDecoderLayer):  # one statement more than the plain form
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = hidden_states * 0.5
            hidden_states = residual + hidden_states
            return hidden_states

    class Dropped(LlamaDecoderLayer):  # the plain form, but an argument of its own not handed to the attention
        def forward(self, hidden_states, attention_mask=None, extra=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    class Same(LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, **kw):
            """A docstring and comments change nothing."""
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kw)
            hidden_states = residual + hidden_states  # the add
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    assert "not the plain pre-norm" in standard_layer(Scaled)
    assert "not the plain pre-norm" in standard_layer(Dropped)
    assert standard_layer(Same) == ("attention_mask",)


def test_layers_of_another_form_keep_their_forward():
    import transformers as tf

    cfg = tf.Phi3Config(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        attn_implementation="sdpa", pad_token_id=0, eos_token_id=None, bos_token_id=1)
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(cfg).eval()
    ids, mask = left_padded_batch(lengths=(40, 33))
    patch_model(model, budget=32, fuse_residual=False, **ON_CPU)
    plain = _gen(model, ids, mask)
    patch_model(model, budget=32, **ON_CPU)
    compiled = model._quest_state.compiled
    assert set(compiled.residual) == {0, 1, 2}
    assert all("Phi3DecoderLayer.forward is not the plain pre-norm" in v for v in compiled.residual.values())
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    _same(plain, _gen(model, ids, mask))
    assert compiled.residual_hits == 0
    unpatch_model(model)


def test_hooked_layers_and_norms_are_left_alone():
    """accelerate's hooks (device_map, offload) move inputs in the forward they replace: a hooked layer keeps that
    forward, and a hooked final norm is not handed the last layer's output."""
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(50, 37))
    layers = model.model.layers
    calls = []

    def hooked_forward(*args, __original=layers[2].forward, **kwargs):  # what accelerate's add_hook_to_module sets
        calls.append(1)
        return __original(*args, **kwargs)

    layers[2].forward = hooked_forward
    layers[2]._hf_hook = object()
    model.model.norm._hf_hook = object()
    try:
        patch_model(model, budget=32, fuse_residual=False, **ON_CPU)
        plain = _gen(model, ids, mask)
        patch_model(model, budget=32, **ON_CPU)
        compiled = model._quest_state.compiled
        assert compiled.residual[2].startswith("its forward is replaced on the module")
        assert [compiled.residual[i] for i in (0, 1, 3)] == ["fused"] * 3
        calls.clear()
        _same(plain, _gen(model, ids, mask))
        assert len(calls) == NEW  # the hooked forward ran for the prefill and every decode step
        # Handed on: layer 0 -> layer 1's norm, layer 1 -> layer 2's (its own forward calls it); not 3 -> the final norm.
        assert compiled.residual_hits == 2 * (NEW - 1)
    finally:
        unpatch_model(model)
        del layers[2].forward, layers[2]._hf_hook, model.model.norm._hf_hook


def test_fused_layers_run_per_segment_and_rebind_beneath_the_interception(single_thread):
    """A decode step per device segment intercepts each layer's forward (quest_hf.patch._intercept_layers); the fused
    forward sits beneath that interception whichever was bound first, and re-patching takes it out of the chain
    without taking the interception with it."""
    from quest_hf.graph import SegmentGraph
    from quest_hf.patch import _force_segments

    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(50, 37))
    patch_model(model, budget=32, fuse_residual=False, **ON_CPU)
    plain = _gen(model, ids, mask)
    layers = model.model.layers
    try:
        patch_model(model, budget=32, **ON_CPU)
        _force_segments(model, (2,), capture=False)
        _same(plain, _gen(model, ids, mask))  # fused first, intercepted at this first decode over segments
        graph = model._quest_state.graph
        assert isinstance(graph, SegmentGraph) and graph.steps == NEW - 2  # the first decode step observes
        for layer in layers:
            top = vars(layer)["forward"]
            assert top.__func__.__name__ == "_layer_forward" and top.previous.__func__.__name__ == "_decode_layer_forward"
        hits = model._quest_state.compiled.residual_hits
        assert hits > 0
        patch_model(model, budget=32, fuse_residual=False, **ON_CPU)  # unfused under the interception
        assert all(vars(layer)["forward"].__func__.__name__ == "_layer_forward" for layer in layers)
        assert all(vars(layer)["forward"].previous is MISSING for layer in layers)
        _same(plain, _gen(model, ids, mask))
        patch_model(model, budget=32, **ON_CPU)  # fused again, now bound beneath the interception
        assert all(vars(layer)["forward"].previous.__func__.__name__ == "_decode_layer_forward" for layer in layers)
        steps = graph.steps
        _same(plain, _gen(model, ids, mask))
        assert model._quest_state.graph.steps > steps
    finally:
        unpatch_model(model)
    assert all("forward" not in vars(layer) for layer in layers)
