"""Static-capacity Quest cache and a CUDA-graph-captured decode step (`QuestConfig(cuda_graph=True)`).

Decode is host-bound in HF: a 7B model spends more time launching kernels than reading bytes. Here the
whole one-token forward is captured once per cache as a CUDA graph and replayed, which needs fixed
shapes and no host state inside the step:
- storage is allocated once for `max_length` tokens (fixed addresses; a cache continued past it grows
  and its graph is captured again);
- each layer keeps its write position `pos` as a device tensor; a decode append is one kernel reading it
  (`append_token_at`; index ops on the PyTorch path);
- selection (the policy's `select_static`: quest and the fixed-budget code selectors) scores every page of
  the capacity (unwritten pages are empty: `-inf`), forces the current page `(pos - 1) // S` read on the
  device (inside the score kernel: `score_pages(pos=)`), and chooses `K + 1` pages: the kernels' own forced
  page is the last capacity page, a spare page past `max_length` that is never written, so it costs no token;
  code selectors encode a page when an append completes it, the position read on the device
  (`encode_codes_at`);
- the first `dense_layers` layers attend over every page through the same kernel (exact dense).
Prefill runs eagerly through the regular path. On CPU the same static step runs without capture.
"""
from __future__ import annotations

import torch

from .cache import QuestLayer, _Step


class StaticQuestLayer(QuestLayer):
    """A `QuestLayer` of fixed capacity whose decode append is driven by the device position `pos`."""

    def __init__(self, config, step: _Step, max_length: int):
        super().__init__(config, step)
        S = config.page_size
        self.max_length = -(-max_length // S) * S
        self.pos: torch.Tensor | None = None
        self.all_pages: torch.Tensor | None = None  # int32 [B, H, P]: the dense layers' "selection"

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self._allocate(self.max_length + self.page_size)  # + the spare page (module docstring)
        self.pos = torch.zeros((), dtype=torch.long, device=self.device)
        B, H = key_states.shape[:2]
        P = self.max_length // self.page_size
        self.all_pages = torch.arange(P, dtype=torch.int32, device=self.device).expand(B, H, P).contiguous()

    def _reserve(self, needed: int) -> None:
        """Past `max_length` (a user continuing a cache): grow like the growing cache; the captured graph
        holds the old addresses, so it is marked for re-capture."""
        if needed <= self.max_length:
            return
        S = self.page_size
        self.max_length = -(-max(needed, self.max_length + self.max_length // 2) // S) * S
        if self.is_initialized:
            self._allocate(self.max_length + S)
            B, H = self.keys.shape[:2]
            P = self.capacity // S
            self.all_pages = torch.arange(P, dtype=torch.int32, device=self.device).expand(B, H, P).contiguous()
            self._graph_invalid = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized and self.seq_len == 0 and key_states.shape[0] != self.keys.shape[0]:
            self.is_initialized = False  # a reused cache meets a new batch size: reallocate
            self._graph_invalid = True
        if key_states.shape[2] != 1 or not self.is_initialized:
            keys, values = super().update(key_states, value_states)  # prefill: host positions
            self.pos.fill_(self.seq_len)
            return keys, values
        self._reserve(self.seq_len + 1)
        self._append_one(key_states, value_states, self._step.get(1, self.device))
        self.seq_len += 1  # host mirror; a graph replay advances it in DecodeGraph.step
        return self.keys, self.values

    def _append_one(self, k, v, valid_new):
        self.ops.append_token_at(self.keys, self.values, self.kmin, self.kmax, self.valid, k, v, valid_new, self.pos)
        self.pos += 1
        self._selector.on_append_at(self)

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        super().reset()
        if self.pos is not None:
            self.pos.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.pos is not None:
            self.pos.fill_(self.seq_len)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static QuestCache has a fixed batch; build it after expanding the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("a static QuestCache has a fixed batch")

    def reorder_cache(self, beam_idx) -> None:
        # In place: the captured graph holds these addresses.
        for name in ("keys", "values", "kmin", "kmax", "valid"):
            t = getattr(self, name)
            t.copy_(t.index_select(0, beam_idx.to(t.device)))


def static_decode_attention(layer: StaticQuestLayer, q, scale: float, is_dense_layer: bool, sliding_window):
    """One decode token over a static layer with fixed shapes (no host state): `[B, H_q, D]`."""
    ops, S = layer.ops, layer.page_size
    if sliding_window:
        raise NotImplementedError("cuda_graph=True does not support sliding-window layers yet; "
                                  "use QuestConfig(cuda_graph=False) for this model")
    cap = layer.capacity
    ids = layer.all_pages if is_dense_layer else layer._selector.select_static(layer, q)
    return ops.sparse_decode_attention(q, layer.keys, layer.values, ids, layer.valid, cap, S, scale, 0)


CAPTURE = True  # False: run the same fixed-shape step eagerly on CUDA too (diagnostics: isolates capture)


class DecodeGraph:
    """Captures one decode forward of a model over one static QuestCache and replays it.

    Step 1 runs eagerly (compiles the Triton kernels, warms cuBLAS), step 2 is captured then replayed,
    later steps copy the new token ids and positions into the graph's inputs and replay.
    """

    def __init__(self):
        self.graph = None
        self.warm = False
        self.captures = 0  # visible to users and tests: how many graphs this cache has captured
        self.replays = 0

    def step(self, forward, cache, cache_arg: str, input_ids, position_ids):
        if position_ids is None:
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        kwargs = dict(use_cache=True, return_dict=True, attention_mask=None)
        if input_ids.device.type != "cuda" or not CAPTURE:
            return forward(input_ids=input_ids, position_ids=position_ids, **{cache_arg: cache}, **kwargs)
        for layer in cache.layers:
            layer._reserve(layer.seq_len + 1)  # a replay cannot grow: grow (and re-capture) before it
        if any(getattr(layer, "_graph_invalid", False) for layer in cache.layers):
            self.graph, self.warm = None, False
            for layer in cache.layers:
                layer._graph_invalid = False
        if not self.warm:
            self.warm = True
            return forward(input_ids=input_ids, position_ids=position_ids, **{cache_arg: cache}, **kwargs)
        if self.graph is None or self.ids.shape != input_ids.shape:
            self.ids, self.positions = input_ids.clone(), position_ids.clone()
            self.graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(input_ids.device)
            with torch.cuda.graph(self.graph):  # records only; Python advanced the host lengths once
                out = forward(input_ids=self.ids, position_ids=self.positions, **{cache_arg: cache}, **kwargs)
            # Keep the output's tensors, never the cache it names: cache -> graph -> output -> cache would be a
            # reference cycle holding every generate call's cache until the cyclic collector runs.
            self.out_type = type(out)
            self.out_fields = {k: v for k, v in out.items() if v is not cache}
            self.cache_field = next((k for k, v in out.items() if v is cache), None)
            self.captures += 1
        else:
            self.ids.copy_(input_ids)
            self.positions.copy_(position_ids)
            for layer in cache.layers:
                layer.seq_len += 1
        self.graph.replay()
        self.replays += 1
        fields = dict(self.out_fields, logits=self.out_fields["logits"].clone())  # the next replay overwrites it
        if self.cache_field is not None:
            fields[self.cache_field] = cache
        return self.out_type(**fields)
