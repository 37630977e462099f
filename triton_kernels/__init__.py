"""Quest decode kernels (Triton) and their plain-PyTorch reference twins. No transformers import here."""
from .append import append_kv, append_kv_ref, append_ticket, append_token_at, append_token_at_ref
from .score import REDUCES, score_form, score_pages, score_pages_ref
from .sparse_attention import prefix_decode_attention_ref, sparse_decode_attention, sparse_decode_attention_ref
from .topk import top_p_mask, top_p_mask_ref, topk_pages, topk_pages_ref

__all__ = [
    "REDUCES",
    "append_kv", "append_kv_ref", "append_ticket", "append_token_at", "append_token_at_ref",
    "score_form", "score_pages", "score_pages_ref",
    "topk_pages", "topk_pages_ref", "top_p_mask", "top_p_mask_ref",
    "sparse_decode_attention", "sparse_decode_attention_ref", "prefix_decode_attention_ref",
]
from .key_codes import (  # noqa: E402
    code_scores,
    code_scores_ref,
    encode_codes,
    encode_codes_at,
    encode_codes_at_ref,
    encode_codes_ref,
)

__all__ += ["encode_codes", "encode_codes_ref", "encode_codes_at", "encode_codes_at_ref", "code_scores",
            "code_scores_ref"]
from .bounds8 import quantize_bounds, quantize_bounds_at, quantize_bounds_at_ref, quantize_bounds_ref  # noqa: E402

__all__ += ["quantize_bounds", "quantize_bounds_ref", "quantize_bounds_at", "quantize_bounds_at_ref"]
from .reuse import reuse_pages, reuse_pages_ref  # noqa: E402

__all__ += ["reuse_pages", "reuse_pages_ref"]
