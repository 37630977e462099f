"""quest_hf.families on tiny models of every decoder family, and the exactness harness of tests/family_models.py."""
import inspect

import pytest
import torch
import transformers as tf

from quest_hf.families import LayerAttention, check_supported, describe, summary
from tests.family_models import (
    FAMILIES,
    left_padded,
    masked_reference_logits,
    missing_reason,
    tiny_family_model,
    tiny_mla_model,
)

# How each family's decoder hands masks to its layers, as read in its modeling file (an independent statement of
# what families._mask_kinds infers from the decoder's source): by config.layer_types, one sliding mask for all
# layers when config.sliding_window is set, or one causal mask.
BY_LAYER_TYPES = {"qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe", "olmo3", "smollm3", "gpt_oss"}
GLOBAL_WINDOW = {"mistral", "mixtral", "phi3", "starcoder2", "qwen3_moe"}
QK_NORM = {"qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3", "cohere"}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add overhead
    yield
    torch.set_num_threads(n)


def family_params():
    return [pytest.param(f, id=f, marks=pytest.mark.skipif(missing_reason(f) is not None,
                                                          reason=str(missing_reason(f)))) for f in FAMILIES]


_MODELS = {}


def model_of(family, **overrides):
    key = (family, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_family_model(family, **overrides)
    return _MODELS[key]


def expected_kinds(family, cfg):
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or None
    if family in BY_LAYER_TYPES:
        return [("sliding", window) if t == "sliding_attention" else ("full", None) for t in cfg.layer_types]
    if family in GLOBAL_WINDOW and window is not None:
        return [("sliding", window)] * n
    return [("full", None)] * n


def test_families_listed():
    assert len(FAMILIES) == 20
    assert set(BY_LAYER_TYPES | GLOBAL_WINDOW) <= set(FAMILIES)


@pytest.mark.parametrize("family", family_params())
def test_tiny_model_builds(family):
    model = model_of(family)
    cfg = model.config
    assert cfg.model_type == ("gemma3_text" if family == "gemma3" else family)  # Gemma3TextConfig
    assert not model.training and cfg.pad_token_id == 0 and cfg.eos_token_id is None
    assert cfg.num_hidden_layers == 4 and cfg.vocab_size == 97
    expected_impl = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    assert cfg._attn_implementation == expected_impl
    ids, mask = left_padded(lengths=(12, 9))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (2, 12, 97) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", family_params())
def test_describe_matches_config_and_modules(family):
    model = model_of(family)
    cfg = model.config.get_text_config()
    layers = describe(model)
    assert [a.layer_idx for a in layers] == list(range(cfg.num_hidden_layers))
    assert [(a.kind, a.window) for a in layers] == expected_kinds(family, cfg)
    attns = [layer.self_attn for layer in model.model.layers]
    for a, module in zip(layers, attns, strict=True):
        assert isinstance(a, LayerAttention)
        assert a.scaling == pytest.approx(module.scaling)
        assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
        assert a.softcap == (cfg.attn_logit_softcapping if family == "gemma2" else None)
        assert a.has_sinks == (family == "gpt_oss")
        assert a.qk_norm == (family in QK_NORM)
        assert a.rope == (bool(cfg.no_rope_layers[a.layer_idx]) if family == "smollm3" else True)
    if family in ("gemma2", "gemma3"):
        assert all(a.scaling == pytest.approx(cfg.query_pre_attn_scalar ** -0.5) for a in layers)
        assert cfg.query_pre_attn_scalar != cfg.head_dim  # the test would not tell the two apart otherwise
    elif family == "granite":
        assert all(a.scaling == pytest.approx(cfg.attention_multiplier) for a in layers)
    else:
        assert all(a.scaling == pytest.approx(16 ** -0.5) for a in layers)
    if family == "gemma2":
        assert [a.kind for a in layers] == ["sliding", "full", "sliding", "full"]
        assert layers[0].softcap == 20.0
    if family == "smollm3":
        assert [a.rope for a in layers] == [True, True, True, False]
    text = summary(model)
    assert text.startswith("layers 0") and ("sinks" in text) == (family == "gpt_oss")


# Sliding settings the defaults leave off, as real checkpoints turn them on.
WINDOW_VARIANTS = [
    pytest.param("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=4), id="qwen2_moe"),
    pytest.param("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), id="qwen3_moe"),
    pytest.param("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), id="qwen3"),
    pytest.param("smollm3", dict(use_sliding_window=True, sliding_window=8), id="smollm3"),
    pytest.param("mixtral", dict(sliding_window=8), id="mixtral"),
    pytest.param("mistral", dict(sliding_window=None), id="mistral-no-window"),
]


@pytest.mark.parametrize("family,overrides", WINDOW_VARIANTS)
def test_describe_window_variants(family, overrides):
    model = model_of(family, **overrides)
    cfg = model.config
    layers = describe(model)
    assert [(a.kind, a.window) for a in layers] == expected_kinds(family, cfg)
    if family == "qwen2_moe":  # alternating, and no sliding_window= reaches the attention function on these layers
        assert [a.kind for a in layers] == ["sliding", "full", "sliding", "full"]
        assert "sliding_window=" not in inspect.getsource(type(model.model.layers[0].self_attn).forward)
    if family == "smollm3":  # SmolLM3 slides its NoPE layers only
        assert [a.kind for a in layers] == ["full", "full", "full", "sliding"] and not layers[3].rope


def test_gemma3_ignores_its_attn_logit_softcapping():
    """Gemma 3 stores attn_logit_softcapping but never passes it to the attention function: describe says None,
    and the model's logits do not depend on it."""
    if missing_reason("gemma3"):
        pytest.skip(missing_reason("gemma3"))
    capped = tiny_family_model("gemma3", attn_logit_softcapping=0.5, attn_implementation="eager")
    plain = tiny_family_model("gemma3", attn_implementation="eager")
    assert all(a.softcap is None for a in describe(capped))
    ids, mask = left_padded(lengths=(12, 9))
    with torch.no_grad():
        torch.testing.assert_close(capped(input_ids=ids, attention_mask=mask).logits,
                                   plain(input_ids=ids, attention_mask=mask).logits)
    # while Gemma 2 at the same cap changes its logits (the check above could fail)
    g2 = tiny_family_model("gemma2", attn_logit_softcapping=0.5)
    g2_plain = tiny_family_model("gemma2", attn_logit_softcapping=None)
    assert describe(g2)[0].softcap == 0.5 and describe(g2_plain)[0].softcap is None
    with torch.no_grad():
        diff = (g2(input_ids=ids, attention_mask=mask).logits - g2_plain(input_ids=ids, attention_mask=mask).logits)
    assert diff.abs().max() > 1e-3


# ---------------------------------------------------------------- check_supported


@pytest.mark.parametrize("family", family_params())
def test_check_supported_accepts(family):
    model = model_of(family)
    assert check_supported(model) == describe(model)


def test_refuses_encoder_decoder():
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                   num_heads=4))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_supported(t5)
    bart = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=97, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_supported(bart, allow_hybrid=True)


def test_refuses_latent_attention():
    with pytest.raises(ValueError, match=r"latent attention \(MLA"):
        check_supported(tiny_mla_model())


def _lfm2():
    return tf.Lfm2ForCausalLM(tf.Lfm2Config(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"], pad_token_id=0))


def test_refuses_recurrent_layers_unless_hybrid_allowed():
    model = _lfm2()
    with pytest.raises(ValueError, match=r"linear-attention / recurrent layers \(conv on layers 0,2\)"):
        check_supported(model)
    layers = check_supported(model, allow_hybrid=True)
    assert [a.layer_idx for a in layers] == [1, 3] and all(a.kind == "full" for a in layers)


def test_refuses_qwen3_next_linear_attention():
    if not hasattr(tf, "Qwen3NextConfig"):
        pytest.skip("no Qwen3Next in this transformers")
    cfg = tf.Qwen3NextConfig(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, pad_token_id=0)
    model = tf.Qwen3NextForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"linear_attention on layers 0-2"):
        check_supported(model)
    assert [a.layer_idx for a in check_supported(model, allow_hybrid=True)] == [3]


def test_refuses_layers_with_attention_and_recurrent_state():
    if not hasattr(tf, "FalconH1Config"):
        pytest.skip("no Falcon-H1 in this transformers")
    cfg = tf.FalconH1Config(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
                            mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, pad_token_id=0)
    model = tf.FalconH1ForCausalLM(cfg)
    types = getattr(model.config, "layer_types", None)
    if not types or types[0] not in ("hybrid", "hybrid_sliding"):
        pytest.skip("this transformers does not type Falcon-H1 layers as 'hybrid'")
    with pytest.raises(ValueError, match="attention and a recurrent state side by side"):
        check_supported(model, allow_hybrid=True)


class _HandRolledAttention(tf.models.llama.modeling_llama.LlamaAttention):
    """Attention that computes softmax itself: a registered attention function would never see it."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = tf.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        k = k.repeat_interleave(self.num_key_value_groups, 1)
        v = v.repeat_interleave(self.num_key_value_groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


class _PreRopeCacheAttention(tf.models.llama.modeling_llama.LlamaAttention):
    """Caches keys before RoPE (rotating the cached keys each step): pages would hold unrotated keys."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if cache is not None:
            key_states, value_states = k, v
            k, v = cache.update(key_states, value_states, self.layer_idx)
        q, k = tf.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        attention_interface = tf.modeling_utils.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, None)
        out, w = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), w


@pytest.mark.parametrize("cls,match", [
    pytest.param(_HandRolledAttention, "does not call HF's attention interface", id="no-interface"),
    pytest.param(_PreRopeCacheAttention, "caches its keys before applying RoPE", id="pre-rope-cache"),
])
def test_refuses_attention_that_bypasses_the_contract(cls, match):
    model = tiny_family_model("llama", layers=2)
    model.model.layers[1].self_attn.__class__ = cls
    with pytest.raises(ValueError, match=match):
        check_supported(model)


def test_refuses_layer_idx_mismatch():
    model = tiny_family_model("llama", layers=2)
    model.model.layers[1].self_attn.layer_idx = 0
    with pytest.raises(ValueError, match="has layer_idx 0"):
        check_supported(model)


def test_refuses_bidirectional_gemma3():
    if missing_reason("gemma3"):
        pytest.skip(missing_reason("gemma3"))
    with pytest.raises(ValueError, match="bidirectional"):
        check_supported(tiny_family_model("gemma3", layers=2, use_bidirectional_attention=True))


# ---------------------------------------------------------------- exactness harness

LENGTHS = (40, 33)  # past every tiny window (8, 16), left-padded


@pytest.mark.parametrize("family", family_params())
def test_reference_with_keep_all_is_the_model(family):
    model = model_of(family)
    ids, mask = left_padded(lengths=LENGTHS)
    H, L = model.config.num_key_value_heads, ids.shape[1]
    keep = [torch.ones(2, H, L, dtype=torch.bool)] * model.config.num_hidden_layers
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    torch.testing.assert_close(masked_reference_logits(model, ids, mask, keep), want, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == ("eager" if family in ("gemma2", "gpt_oss") else "sdpa")


@pytest.mark.parametrize("family", family_params())
def test_reference_with_random_keep_differs(family):
    model = model_of(family)
    ids, mask = left_padded(lengths=LENGTHS)
    H, L = model.config.num_key_value_heads, ids.shape[1]
    g = torch.Generator().manual_seed(0)
    keep = [torch.rand(2, H, L, generator=g) < 0.3 for _ in range(model.config.num_hidden_layers)]
    for k in keep:
        k[..., -1] = True  # the query's own key: every row keeps something
    full = masked_reference_logits(model, ids, mask, [None] * len(keep))
    sparse = masked_reference_logits(model, ids, mask, keep)
    assert torch.isfinite(sparse).all()
    assert (sparse - full).abs().max() > 1e-3


WINDOWED = [pytest.param(f, {}, id=f) for f in ("mistral", "qwen2", "gemma2", "gemma3", "phi3", "olmo3", "starcoder2",
                                                  "gpt_oss")] + WINDOW_VARIANTS[:-1]


@pytest.mark.parametrize("family,overrides", WINDOWED)
def test_window_is_what_the_mask_does(family, overrides):
    """Keeping only the `window` newest keys on each sliding layer changes nothing; dropping the oldest of them
    does: describe()'s window is the model's own (keys k > q - window), whatever keyword the attention gets."""
    if missing_reason(family):
        pytest.skip(missing_reason(family))
    model = model_of(family, **overrides)
    layers = describe(model)
    sliding = [a for a in layers if a.kind == "sliding"]
    assert sliding, f"{family}: no sliding layer in the tiny config"
    ids, mask = left_padded(lengths=LENGTHS)
    H, L = model.config.num_key_value_heads, ids.shape[1]
    keep = [None] * len(layers)
    for a in sliding:
        keep[a.layer_idx] = torch.zeros(2, H, L, dtype=torch.bool)
        keep[a.layer_idx][..., L - a.window:] = True
    full = masked_reference_logits(model, ids, mask, [None] * len(layers))
    torch.testing.assert_close(masked_reference_logits(model, ids, mask, keep), full, atol=1e-5, rtol=1e-5)
    keep[sliding[-1].layer_idx][..., L - sliding[-1].window] = False
    assert (masked_reference_logits(model, ids, mask, keep) - full).abs().max() > 1e-4


def test_multimodal_reads_the_text_decoder():
    """Gemma 3 with a vision tower of as many layers as the text decoder: describe() reads the text layers (sliding
    window, query_pre_attn_scalar scaling), not the vision encoder that comes first among the modules."""
    if missing_reason("gemma3"):
        pytest.skip(missing_reason("gemma3"))
    text = tf.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               query_pre_attn_scalar=32, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=28, patch_size=14)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
        eoi_token_index=298))
    layers = check_supported(model)
    assert [(a.layer_idx, a.kind, a.window) for a in layers] == [(0, "sliding", 8), (1, "sliding", 8)]
    assert all(a.scaling == pytest.approx(32 ** -0.5) and a.qk_norm for a in layers)
