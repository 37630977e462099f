"""Tiny random-weight models of every decoder family quest-hf targets, and an exactness harness.

`tiny_family_model(model_type)` builds a CPU model from the family's own `*Config` (vocab 97, hidden 64, 4 layers,
4 query / 2 KV heads of 16; MoE: 4 experts, top-2; sliding windows of 8 or 16 tokens so that short prompts pass them;
Gemma 2 soft-cap on; GPT-OSS sinks far from zero). `masked_reference_logits` runs the family's own eager attention
with an extra keep-mask on the last query, so a sparse decode path can be checked against HF's own soft-caps,
sinks and scaling.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch

# model_type -> (config class, model class, overrides of the common tiny settings). Names are looked up on
# `transformers`, so a family that a version lacks is reported by `missing_reason`.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    # Layers >= max_window_layers slide (Qwen2's rule): 0-1 full, 2-3 sliding.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                                                       max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    # query_pre_attn_scalar 32 != head_dim 16: scaling is 32**-0.5, not 16**-0.5.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8, attn_logit_softcapping=20.0,
                                                         final_logit_softcapping=30.0, query_pre_attn_scalar=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8, query_pre_attn_scalar=32,
                                                             sliding_window_pattern=3)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=8)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.1)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(use_qk_norm=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=16)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                          sliding_window=8,
                                                          max_position_embeddings=131072)),  # = its YaRN span
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
}
# Families whose logit soft-cap only eager (or flex) applies: transformers 5.24's sdpa raises on `softcap`, 5.17's
# (which lists Gemma 2 as sdpa-capable) silently drops it. Their tiny models run eager.
EAGER_ONLY = ("gemma2",)
# The four families quest-hf accepted by name before families.py.
ORIGINAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def missing_reason(model_type: str) -> str | None:
    """Why this transformers cannot build `model_type` (None when it can)."""
    import transformers

    cfg_name, model_name, _ = FAMILIES[model_type]
    absent = [n for n in (cfg_name, model_name) if not hasattr(transformers, n)]
    if absent:
        return f"transformers {transformers.__version__} has no {' / '.join(absent)} ({model_type} is newer)"
    return None


def tiny_family_model(model_type: str, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                      **overrides):
    """A seeded random-weight `*ForCausalLM` of `model_type` in eval mode, fp32 on CPU.

    Common settings: vocab 97, hidden `heads * head_dim`, intermediate 64, pad_token_id 0, eos_token_id None,
    `attn_implementation="sdpa"` where the family supports it (GPT-OSS does not, and Gemma 2's soft-cap needs
    eager: "eager"). `overrides`
    go to the config last. q/k projections are scaled by 4 so that attention is peaked, not near-uniform.
    """
    import transformers

    reason = missing_reason(model_type)
    if reason is not None:
        raise RuntimeError(reason)
    cfg_name, model_name, family = FAMILIES[model_type]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    settings = dict(vocab_size=97, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                    max_position_embeddings=1024, pad_token_id=0, eos_token_id=None, bos_token_id=1)
    settings.update(family)
    settings.update(overrides)
    sdpa = getattr(model_cls, "_supports_sdpa", True) and model_type not in EAGER_ONLY
    settings.setdefault("attn_implementation", "sdpa" if sdpa else "eager")
    config = cfg_cls(**settings)
    for key in ("pad_token_id", "eos_token_id"):  # GLM-4's config puts its own EOS list back for None
        if key in settings and getattr(config, key, None) != settings[key]:
            setattr(config, key, settings[key])
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)
            if name.endswith(".sinks"):  # init is N(0, 0.02): make the sink term visible in the softmax
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    return model


def left_padded(vocab: int = 97, lengths=(40, 33), seed: int = 1):
    """(input_ids, attention_mask) of a left-padded batch with ragged lengths (conftest's, shorter by default)."""
    from .conftest import left_padded_batch

    return left_padded_batch(vocab, lengths, seed)


def tiny_mla_model():
    """A tiny DeepSeek-V3 (latent attention, MLA): a design Quest refuses."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              pad_token_id=0)
    return tf.DeepseekV3ForCausalLM(cfg)


REFERENCE_NAME = "quest_keep_reference"  # no "sdpa"/"flash"/"paged": transformers matches those specially


def _family_eager(module):
    """The `eager_attention_forward` of the module's own modeling file (soft-cap, sinks as the family does them)."""
    modeling = sys.modules.get(type(module).__module__) or importlib.import_module(type(module).__module__)
    fn = getattr(modeling, "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward")
    return fn


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    original = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


def masked_reference_logits(model, input_ids, attention_mask, keep, position_ids=None) -> torch.Tensor:
    """Logits `[B, V]` of the last position when, in layer i, its query may attend only keys with `keep[i]` True.

    `keep[i]`: bool `[B, H_kv, L]` (L = input length; None or a missing index: no restriction), on top of the
    model's own causal / sliding / padding mask; the other positions attend as usual. With `keep[i]` of
    `[B, H_kv, R, L]` the last R positions are restricted row by row (R decode steps teacher-forced in one forward)
    and the logits of those R positions are returned, `[B, R, V]`; every non-None entry must then have the same R. Every layer runs its family's
    own `eager_attention_forward` (so soft-caps, sinks and scaling are HF's), through a function registered with
    `AttentionInterface` for the duration of the call. The reference a sparse decode of the last token must match
    when it attends exactly the kept keys.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def attention(module, query, key, value, mask, **kwargs):
        i = module.layer_idx
        rows = keep.get(i) if isinstance(keep, dict) else (keep[i] if i < len(keep) else None)
        if rows is not None:
            B, Hq, q, L = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
            ok = rows.to(key.device).bool().repeat_interleave(Hq // rows.shape[1], dim=1)  # [B, Hq, (R,) L]
            ok = ok[:, :, None] if ok.dim() == 3 else ok
            assert ok.shape[:2] + ok.shape[3:] == (B, Hq, L), (ok.shape, (B, Hq, L))
            full = torch.ones(B, Hq, q, L, dtype=torch.bool, device=key.device)
            full[:, :, q - ok.shape[2]:] = ok
            base = mask[..., :L] if mask is not None else torch.zeros(B, 1, q, L, dtype=query.dtype)
            mask = base.masked_fill(~full, torch.finfo(query.dtype).min)
        return _family_eager(module)(module, query, key, value, mask, **kwargs)

    AttentionInterface.register(REFERENCE_NAME, attention)
    AttentionMaskInterface.register(REFERENCE_NAME, eager_mask)
    with _attention_implementation(model, REFERENCE_NAME), torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    rows = {k.shape[2] for k in (keep.values() if isinstance(keep, dict) else keep) if k is not None and k.dim() == 4}
    if rows:
        assert len(rows) == 1, f"keep entries restrict different numbers of rows: {sorted(rows)}"
        return out.logits[:, -rows.pop():].float()
    return out.logits[:, -1].float()
