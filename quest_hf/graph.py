"""The captured decode step: one CUDA graph per patched model, applied where the step is called.

Decode is host-bound in HF: a 7B model spends more time launching kernels than reading bytes. A Quest decode step
has fixed shapes and no host state (quest_hf/cache.py), so the patched model's one-token forward is captured once
and replayed, as gpt-fast wraps `decode_one_token` in its `generate`: the cache and its layers know nothing of
graphs. The first decode step over a new cache (or batch shape, or allocation) runs eagerly (compiles the Triton
kernels, warms cuBLAS and torch.compile), the second is captured, later ones copy their token ids, positions and
padding column into the graph's inputs and replay. Selection hooks are recorded inside the graph (the query and
page ids of each sparse layer, as graph outputs) and called after each replay with that step's tensors.
"""
from __future__ import annotations

import weakref

import torch


def selected(graph: DecodeGraph | None, layer_idx: int, q: torch.Tensor, ids: torch.Tensor, layer, hooks) -> None:
    """A sparse layer chose `ids`: call the hooks now, or record the tensors while `graph` captures a step."""
    # The spare page holds no token: drop it (always the last id chosen, so the last column is then free).
    ids = ids.masked_fill(ids == layer.keys.shape[2] // layer.page_size - 1, -1)[..., :-1]
    if graph is not None and graph._recording is not None:
        graph._recording.append((layer_idx, q.clone(), ids))
        return
    for hook in hooks:
        hook(layer_idx, q, ids)


class DecodeGraph:
    """Captures one decode forward of a patched model over one QuestCache and replays it."""

    def __init__(self):
        self.captures = 0  # visible to users and tests: graphs captured, steps replayed
        self.replays = 0
        self._forget()

    def _forget(self):
        self.graph = None
        self.warm = False
        self._cache = None
        self._key = None
        self._records: list = []
        self._recording: list | None = None
        self._out = None

    def release(self) -> None:
        """Drop the graph (and its memory pool); the next decode step captures anew."""
        self._forget()

    def step(self, forward, eager, cache, cache_arg: str, input_ids, position_ids, attention_mask, fixed=None):
        """One decode token: `eager()` runs it uncaptured; `forward(**kw)` is the model's forward to capture, with
        the constant arguments `fixed` (e.g. `logits_to_keep`), which are part of the graph's key."""
        fixed = fixed or {}
        for layer in cache.layers:
            layer.reserve(layer.seq_len + 1)  # a replay cannot grow: grow (and re-capture) before it
        key = (cache.storage, tuple(input_ids.shape), input_ids.device, bool(cache.selection_hooks),
               tuple(sorted(fixed.items())))
        if self._cache is None or self._cache() is not cache or self._key != key:
            self._forget()
            self._cache, self._key = weakref.ref(cache), key
        if not self.warm:
            self.warm = True
            return eager()
        if position_ids is None:
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        if self.graph is None:
            self._capture(forward, cache, cache_arg, input_ids, position_ids, attention_mask, fixed)
        else:
            self._ids.copy_(input_ids)
            self._positions.copy_(position_ids)
            self._set_valid(attention_mask)
            cache.replayed(1)
        self.graph.replay()
        self.replays += 1
        for layer_idx, q, ids in self._records:
            for hook in cache.selection_hooks:
                hook(layer_idx, q, ids)
        out_type, fields, cache_field = self._out
        fields = dict(fields, logits=fields["logits"].clone())  # the next replay overwrites it
        if cache_field is not None:
            fields[cache_field] = cache
        return out_type(**fields)

    def _set_valid(self, attention_mask):
        if attention_mask is None:
            self._valid.fill_(True)
        else:
            self._valid.copy_(attention_mask[:, -1:])

    def _capture(self, forward, cache, cache_arg, input_ids, position_ids, attention_mask, fixed):
        self._ids, self._positions = input_ids.clone(), position_ids.clone()
        self._valid = torch.ones(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        self._set_valid(attention_mask)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(input_ids.device)
        cache._step.pinned = self._valid  # the padding column is read from the graph's own input
        self._recording = []
        try:
            with torch.cuda.graph(graph):  # records only; Python advanced the host lengths once
                out = forward(input_ids=self._ids, position_ids=self._positions, attention_mask=None, use_cache=True,
                              return_dict=True, **fixed, **{cache_arg: cache})
        finally:
            cache._step.pinned = None
            self._records, self._recording = self._recording, None
        # Keep the output's tensors, never the cache it names: cache -> graph -> output -> cache would be a
        # reference cycle.
        self._out = (type(out), {k: v for k, v in out.items() if v is not cache},
                     next((k for k, v in out.items() if v is cache), None))
        self.graph = graph
        self.captures += 1
