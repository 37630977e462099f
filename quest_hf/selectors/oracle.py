"""The accuracy ceiling of any selector at a budget: attention over the exact top-`budget` tokens by q.k of each
query head, united per KV group. Reads every key: for evaluation only."""
from __future__ import annotations

import torch

from triton_kernels.score import window_start_at

from .base import Selector


class OracleSelector(Selector):
    token_budget = True  # the top-`budget` tokens, any number of them

    def attend(self, layer, q, scale, window, on_select, softcap=0.0, sinks=None):
        budget = layer.config.budget
        B, Hq, D = q.shape
        H, C = layer.keys.shape[1], layer.keys.shape[2]
        G = Hq // H
        keys, vals = layer.keys.float(), layer.values.float()
        ok = layer.valid[:, None, None, :]  # unwritten slots are not valid
        if window:
            ok = ok & (torch.arange(C, device=q.device) >= window_start_at(layer.pos, window))
        logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, D), keys) * scale
        if softcap:  # monotonic: the same top tokens, another softmax over them
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~ok, float("-inf"))
        top = logits.topk(min(budget, C), dim=-1).indices
        chosen = torch.zeros(B, H, G, C, dtype=torch.bool, device=q.device).scatter_(-1, top, True)
        chosen = chosen.any(2, keepdim=True) & ok
        logits = logits.masked_fill(~chosen, float("-inf"))
        out = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(logits, dim=-1).nan_to_num(0.0), vals)
        if sinks is not None:  # the sink's share of the denominator, as sparse_decode_attention_ref
            out = out * torch.sigmoid(torch.logsumexp(logits, -1) - sinks.float().reshape(H, G))[..., None]
        return out.reshape(B, Hq, D).to(q.dtype)

    def bytes_per_step(self, seq_len, kv_heads, head_dim, elt, page_size, pages_read, budget, group):
        return seq_len * kv_heads * head_dim * elt + kv_heads * min(seq_len, group * budget) * head_dim * elt
