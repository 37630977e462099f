"""QuestCache: HF `Cache` of paged K/V plus per-page key min/max (arXiv 2406.10774).

One `QuestLayer` per model layer owns the storage; `QuestCache` is only the list of its layers plus the step
information (which new tokens are padding) handed from the model's forward to them. Storage per layer (see
`triton_kernels/_contract.md`), allocated once at a fixed capacity:

    keys, values  [B, H_kv, C + S, D]       slot order; page p = slots [p*S, (p+1)*S); the last page is a spare
    kmin, kmax    [B, H_kv, (C + S) // S, D] element-wise min/max of each page's valid keys (+inf/-inf: empty)
    valid         [B, C + S] bool            False for padding and unwritten slots
    pos           int64 scalar on the device  the write position (= seq_len, the host mirror)
    kmin8, kmax8  [B, H_kv, (C + S) // S, D] int8, with kscale fp32 [B, H_kv, (C + S) // S]: QuestConfig(bounds=
                  "int8" / "int8_channel")'s 8-bit bounds (triton_kernels/bounds8.py), requantized from kmin/kmax
                  after each append (the written page only on a decode step); None under bounds="key_dtype"
    kchan         [H_kv, D] fp32: bounds="int8_channel"'s channel scales, set from the first keys stored (the
                  prefill) and kept until reset; None otherwise

`C` (`layer.max_tokens`; `layer.capacity` is `C + S`) is what `generate()` will need (prompt + new tokens)
or, for a cache driven by hand, what it has seen so far plus one growth step; a sequence that outgrows it is
moved to a larger allocation (an eighth more, at least `GROWTH_TOKENS`: amortised, and never more than one
growth step over need).

A one-token append is one kernel at the device position `pos`, so a decode step keeps fixed shapes and no host
state: the same step runs eagerly (CPU, `cuda_graph=False`) and is captured as a CUDA graph by the caller
(`quest_hf.graph`). The spare page past `C` is never written: it is the kernels' own always-chosen page
(`score_pages` forces page `P - 1`), so selecting `K + 1` pages over the whole allocation costs no token.

Under `QuestConfig(offload="cpu")` a sparse layer's `keys`/`values` are page-locked host tensors and `layer.pager`
(quest_hf/offload.py) holds the device side: the current page, the resident pool and its page table.
"""
from __future__ import annotations

import contextlib
import copy as _copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import triton_kernels as tk

from .compiled import bucket
from .config import QuestConfig
from .offload import make_pagers, offload_stats
from .ops import Ops, resolve_backend
from .selectors import check_config, selector_for

# A cache driven by hand (no known length) grows by an eighth of its capacity, at least this many tokens.
GROWTH_TOKENS = 256


class _Step:
    """Which of the tokens entering the cache in this forward are real (not padding), per device."""

    def __init__(self):
        self.valid_new: torch.Tensor | None = None
        self.pinned: torch.Tensor | None = None  # a captured step's own [B, 1] input buffer (quest_hf.graph)
        # Whether the layers round their capacity up to a compile bucket (quest_hf.compiled.bucket): set by the patch,
        # which knows whether the model's uncaptured step compiles (one device, no tensor parallel); None: decided
        # from the config and the layer's device alone (QuestConfig.buckets_capacity).
        self.bucket: bool | None = None
        self._moved: dict[torch.device, torch.Tensor] = {}
        # QuestCache.step_kernels' summary of its layers' `step_kernels`, made again only after one of them changed
        # (read after every decode step by the patch; captured replays change none).
        self.kernels: str | None = None
        self.kernels_stale = False

    def set(self, valid_new: torch.Tensor | None):
        self.valid_new, self._moved = (self.pinned if self.pinned is not None else valid_new), {}

    def for_graph(self) -> None:
        """Hold this step's column as a fresh uint8 tensor of its own (what the append kernel reads; quest_hf.compiled's
        traced step makes it outside its graph): inductor cannot view a bool as uint8, and a view into HF's mask,
        which grows a column a step, has a row stride that changes every step, which the graph's guards recompile on
        (torch 2.11 at batch 1: every step compiled again until dynamo's limit)."""
        v = self.valid_new
        if v is not None:
            self.valid_new = torch.empty(v.shape, dtype=torch.uint8, device=v.device).copy_(v)

    def get(self, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        v = self.valid_new
        if v is None:
            return None
        if v.shape[1] != num_tokens:
            raise ValueError(
                f"the attention_mask covers {v.shape[1]} new tokens but the layer received {num_tokens}; "
                "pass attention_mask of shape [batch, past + new tokens]"
            )
        if v.device != device:  # layers spread over devices (device_map): move once per device and step
            v = self._moved.setdefault(device, v.to(device, non_blocking=True))
        return v

    @contextlib.contextmanager
    def holding(self, valid: torch.Tensor):
        """The layers read `valid` (a captured segment's own `[B, 1]` input, on its device) inside the block, in
        place of this step's column (quest_hf.graph.SegmentGraph: one padding column per segment and device)."""
        saved = self.valid_new, self._moved
        self.valid_new, self._moved = valid, {}
        try:
            yield
        finally:
            self.valid_new, self._moved = saved


class QuestLayer(CacheLayerMixin):
    """Paged K/V and key min/max of one model layer, at a fixed capacity (module docstring).

    `seq_len` slots are filled (host int); `pos` is the same count on the device, which a one-token append
    reads and advances. `ops` is the backend that runs on this layer (`ops.name`). `side` holds selectors'
    per-slot tensors `[B, H_kv, C + S, ...]` (moved, reordered and batch-edited with the pages) and
    `side_state` their host bookkeeping (cleared by `reset`).
    """

    is_compileable = False  # generate() must not compile the step itself: quest_hf.graph captures it
    is_sliding = False  # every token is kept; a sliding window is applied at attention time
    is_croppable = True

    def __init__(self, config: QuestConfig, step: _Step | None = None, capacity: int | None = None,
                 selector=None):
        super().__init__()
        check_config(config, selector)  # the policy's selector is registered and takes these settings
        self.config = config
        # None: the registered selector of `config.policy`; else this one (not registered: calibration's probe).
        self._selector = selector
        self._step = step or _Step()
        self.seq_len = 0
        self.reserved = capacity  # tokens the first allocation holds (None: the first update's + one growth step)
        self.kmin = self.kmax = self.valid = self.pos = None
        # Beam search's page table, int32 [B, P]: the batch row holding page p of sequence b (None: its own row;
        # made by the first reorder under a selector whose kernels read through it, then only changed in place).
        self.rows: torch.Tensor | None = None
        # QuestConfig(fused_step=...): the three-launch step's zeroed state, and which kernels the last step ran.
        self.step_state: torch.Tensor | None = None
        self._step_kernels: str | None = None
        self.side: dict[str, torch.Tensor] = {}
        self.side_state: dict = {}
        self.kmin8 = self.kmax8 = self.kscale = None
        self.kchan: torch.Tensor | None = None
        self.chan_ready = False  # kchan holds the scales of this sequence's first keys (False: set at the next append)
        self.bounds_kind: str | None = None  # the `bounds` setting the 8-bit codes were quantized for
        # Selection reuse (QuestConfig.reselect_every > 1), on the device (triton_kernels/reuse.py): "ids" (the stored
        # selection, [B, H_kv, K]), "since" (the position it was chosen at), "step" (steps since), "due" (int32: this
        # step chooses). Reordered with beams; made due in place by growth, crop and reset.
        self.reuse: dict[str, torch.Tensor] = {}
        self.pager = None  # K/V in host memory (QuestConfig.offload, quest_hf/offload.py); set by QuestCache
        # > 0 while quest_hf.prefill runs: a chunk attends to the earlier tokens in blocks of this many
        self.prefill_block = 0
        self.valid_u8: torch.Tensor | None = None  # set only around a traced compiled step (`kernel_valid`)
        self.ops: Ops | None = None
        self.allocations = 0  # counts buffer moves: a captured step holds the addresses of the last one
        self._dense_ids: torch.Tensor | None = None

    def __repr__(self):
        backend = self.ops.name if self.ops else "?"
        return f"QuestLayer(seq_len={self.seq_len}, capacity={self.capacity}, backend={backend})"

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def step_kernels(self) -> str | None:
        """Which kernels this layer's last decode step ran, and why (`QuestConfig.fused_step`); None before one."""
        return self._step_kernels

    @step_kernels.setter
    def step_kernels(self, text: str | None) -> None:
        if text != self._step_kernels:
            self._step_kernels = text
            self._step.kernels_stale = True  # the cache's summary (QuestCache.step_kernels) is made again on its read

    @property
    def capacity(self) -> int:
        """Slots of the buffers (the `C` of the kernels' contract), the spare page included."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def max_tokens(self) -> int:
        """Tokens this layer holds before it must grow: the capacity less the spare page."""
        return 0 if self.keys is None else self.keys.shape[2] - self.page_size

    @property
    def selector(self):
        """The selector this layer runs: the one it was given, else the registered one of `config.policy`."""
        return self._selector if self._selector is not None else selector_for(self.config.policy)

    # ----------------------------------------------------------------------------------------- storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in tk._common.KV_DTYPES:
            raise TypeError(f"QuestCache stores fp16, bf16 or fp32 keys, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.ops = resolve_backend(self.config.backend, self.device)
        B, H, T, D = key_states.shape
        self.keys = self.values = None
        self._shape = (B, H, D, value_states.shape[-1])
        self.pos = torch.zeros((), dtype=torch.long, device=self.device)
        self.ticket = tk.append_ticket(self.device)  # the decode append's own count (it advances pos in its launch)
        self.is_initialized = True
        need = max(T, self.reserved or 0)
        self._allocate(need if self.reserved and self.reserved >= T else need + self._growth(need))

    def _growth(self, tokens: int) -> int:
        return max(tokens // 8, GROWTH_TOKENS)

    def reserve(self, needed: int) -> None:
        """Make room for `needed` tokens (a larger allocation, one growth step past the need, if they don't fit)."""
        if needed > self.max_tokens:
            self._allocate(max(needed, self.max_tokens + self._growth(self.max_tokens)))

    def _allocate(self, tokens: int) -> None:
        """Move to buffers of `tokens` slots (rounded up to pages) plus the spare page, keeping what is stored."""
        self._materialize()
        S = self.page_size
        bucketed = self._step.bucket
        if bucketed is None:
            bucketed = self.config.buckets_capacity(self.device.type)
        if bucketed:
            tokens = bucket(tokens)  # a compiled step compiles once per capacity (quest_hf/compiled.py); not captured
        cap = -(-tokens // S) * S + S
        B, H, D, Dv = self._shape
        dev, dt = self.device, self.dtype
        # Zero-filled so that no unwritten slot can leak NaN into a masked-out product.
        if self.pager is not None:  # host memory (quest_hf/offload.py)
            keys, values = self.pager.host_buffers(self, B, H, cap, D, Dv, dt)
        else:
            keys = torch.zeros(B, H, cap, D, dtype=dt, device=dev)
            values = torch.zeros(B, H, cap, Dv, dtype=dt, device=dev)
        kmin = torch.full((B, H, cap // S, D), float("inf"), dtype=dt, device=dev)
        kmax = torch.full((B, H, cap // S, D), float("-inf"), dtype=dt, device=dev)
        valid = torch.zeros(B, cap, dtype=torch.bool, device=dev)
        if self.keys is not None:
            n, p = self.seq_len, -(-self.seq_len // S)
            keys[:, :, :n], values[:, :, :n] = self.keys[:, :, :n], self.values[:, :, :n]
            kmin[:, :, :p], kmax[:, :, :p], valid[:, :n] = self.kmin[:, :, :p], self.kmax[:, :, :p], self.valid[:, :n]
            for name, t in self.side.items():
                grown = t.new_zeros(t.shape[0], t.shape[1], cap, *t.shape[3:])
                grown[:, :, :n] = t[:, :, :n]
                self.side[name] = grown
        bounds8 = tk.bounds8.empty_bounds8(B, H, cap // S, D, dev) if self.config.bounds != "key_dtype" else None
        if bounds8 is not None:
            self.bounds_kind = self.config.bounds
        if self.config.bounds == "int8_channel" and self.kchan is None:
            self.kchan = torch.ones(H, D, dtype=torch.float32, device=dev)  # set from the first keys stored
        if bounds8 is not None and self.kmin8 is not None:
            p = -(-self.seq_len // S)
            for new, old in zip(bounds8, (self.kmin8, self.kmax8, self.kscale)):
                new[:, :, :p] = old[:, :, :p]
        self.kmin8, self.kmax8, self.kscale = bounds8 or (None, None, None)
        self.keys, self.values, self.kmin, self.kmax, self.valid = keys, values, kmin, kmax, valid
        if self.pager is not None:
            self.pager.resize(self)
        self.reselect()  # the stored selection names the old spare page, now an ordinary one
        self._dense_ids = None
        self.allocations += 1

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `key_states/value_states [B, H_kv, T, D]`.

        Returns the filled K/V `[B, H_kv, seq_len, D]` (views) for a multi-token forward (prefill, run by HF's
        dense attention), and the whole fixed-shape buffers for a one-token forward (decode, run by Quest's
        attention from this layer's pages, never from what is returned).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        if (B, H, D) != self._shape[:3]:
            raise ValueError(
                f"this QuestCache holds batch {self._shape[0]} x {self._shape[1]} KV heads x head_dim "
                f"{self._shape[2]}, got keys {tuple(key_states.shape)}; use a new QuestCache for a new batch"
            )
        if key_states.dtype != self.dtype:
            raise TypeError(f"this QuestCache stores {self.dtype} keys, got {key_states.dtype}")
        start = self.seq_len
        self.reserve(start + T)
        valid_new = self._step.get(T, self.device)
        # QuestConfig(bounds="int8"): the written pages' 8-bit codes, requantized inside the same append launch.
        bounds8 = self._bounds8_args(key_states, valid_new)
        if self.pager is not None:  # K/V to host memory, the metadata here (quest_hf/offload.py)
            paged = self.pager.append(self, key_states, value_states, valid_new, start)
        elif T == 1:  # the device position: no host value enters the step, so a graph replay stays right
            self.append_decode(key_states, value_states, start)
        else:
            self.ops.append_kv(self.keys, self.values, self.kmin, self.kmax, self.valid,
                               key_states, value_states, valid_new, start, **bounds8)
            self.pos.fill_(start + T)
        if self.pager is not None or T > 1:
            self.selector.on_append(self, key_states, start, valid_new)
        self.seq_len = start + T
        if self.pager is not None:
            return paged
        if T == 1:
            return self.keys, self.values
        return self.keys[:, :, : self.seq_len], self.values[:, :, : self.seq_len]

    def append_decode(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int = -1) -> None:
        """The device half of a one-token append (room for it made already, host length not advanced): store
        `key_states/value_states [B, H_kv, 1, D]` at the device position, advance it, and tell the selector. Reads
        no host length, so quest_hf.compiled traces it into its graph; `start` (the host length, -1 unknown) is
        only handed to the selector, which must not use it for one token."""
        valid_new = self._step.get(1, self.device)
        bounds8 = self._bounds8_args(key_states, valid_new)
        # The same launch advances the device position (one kernel a layer fewer in a captured step).
        self.ops.append_token_at(self.keys, self.values, self.kmin, self.kmax, self.kernel_valid(),
                                 key_states, value_states, valid_new, self.pos, **bounds8, ticket=self.ticket)
        self.selector.on_append(self, key_states, start, valid_new)

    def _bounds8_args(self, key_states: torch.Tensor, valid_new) -> dict:
        """The append's `bounds8=` keyword: the 8-bit codes to requantize (and the channel scales, set here from the
        first keys this sequence stores: device ops, so a compiled step may trace it), or none."""
        if self.kmin8 is None:
            return {}
        if self.kchan is None:
            return dict(bounds8=(self.kmin8, self.kmax8, self.kscale))
        if not self.chan_ready:
            tk.bounds8.channel_scales(key_states, None if valid_new is None else valid_new.bool(), out=self.kchan)
            self.chan_ready = True
        return dict(bounds8=(self.kmin8, self.kmax8, self.kscale, self.kchan))

    def kernel_valid(self) -> torch.Tensor:
        """`valid` as the decode kernels take it: itself, or while quest_hf.compiled traces a step over this layer its
        uint8 view made outside the graph (`valid_u8`; inductor cannot view a bool tensor)."""
        return self.valid if self.valid_u8 is None else self.valid_u8

    def dense_pages(self, window: int = 0) -> torch.Tensor:
        """int32 `[B, H_kv, N]` page ids of a dense decode step: every page of the allocation, or with a sliding
        `window` the `ceil(window / S) + 1` pages from the window's first one (later ones -1), on the device."""
        S = self.page_size
        P = self.keys.shape[2] // S
        B, H = self._shape[:2]
        if not window:
            if self._dense_ids is None:
                self._dense_ids = torch.arange(P, dtype=torch.int32, device=self.device).expand(B, H, P)
            return self._dense_ids
        n = min(P, -(-window // S) + 1)
        first = tk.score.window_start_at(self.pos, window, S)
        ids = first + torch.arange(n, device=self.device)
        cur = torch.div(self.pos - 1, S, rounding_mode="floor")
        return torch.where(ids <= cur, ids, -1).to(torch.int32).expand(B, H, n)

    def bounds_stale(self) -> bool:
        """Whether the 8-bit bounds do not match `config.bounds` (a cache filled or copied under another setting)."""
        want = None if self.config.bounds == "key_dtype" else self.config.bounds
        return self.is_initialized and (self.bounds_kind if self.kmin8 is not None else None) != want

    def sync_bounds(self) -> None:
        """Make the 8-bit bounds match `config.bounds` (after `QuestCache.copy` under another config): quantize every
        page from kmin/kmax (channel scales from the stored pages' bounds: the same max |k| as from their keys), or
        drop them."""
        if self.config.bounds == "key_dtype":
            self.kmin8 = self.kmax8 = self.kscale = self.kchan = None
            self.chan_ready, self.bounds_kind = False, None
        elif self.bounds_stale():
            B, H, P, D = self.kmin.shape
            # Fresh tensors: a fork (QuestCache.copy, the evaluation helpers) may share the old ones with its source.
            self.kmin8, self.kmax8, self.kscale = tk.bounds8.empty_bounds8(B, H, P, D, self.kmin.device)
            if self.config.bounds == "int8_channel":
                self.kchan = torch.ones(H, D, dtype=torch.float32, device=self.kmin.device)
                self.chan_ready = self.seq_len > 0
                if self.chan_ready:
                    tk.bounds8.channel_scales_of_bounds(self.kmin, self.kmax, -(-self.seq_len // self.page_size),
                                                        out=self.kchan)
            else:
                self.kchan, self.chan_ready = None, False
            self.ops.quantize_bounds(self.kmin, self.kmax, self.kmin8, self.kmax8, self.kscale, 0, P,
                                     **self._chan_kw())
            self.bounds_kind = self.config.bounds
            self.allocations += 1

    def _chan_kw(self) -> dict:
        return {} if self.kchan is None else dict(chan=self.kchan)

    def reuse_due(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Selection reuse: the device flag (int32, set by the previous step's `reuse_pages`) of whether this decode
        step chooses afresh, with the stored selection allocated as int32 `shape` `[B, H_kv, K]` (anew, and due, when
        the shape changed). No device op: the flag is read by the kernels."""
        st = self.reuse
        if "ids" not in st or tuple(st["ids"].shape) != tuple(shape):
            dev = self.pos.device
            st["ids"] = torch.full(shape, -1, dtype=torch.int32, device=dev)
            st["since"] = torch.zeros((), dtype=torch.long, device=dev)
            st["step"] = torch.zeros((), dtype=torch.long, device=dev)
            st["due"] = torch.ones((), dtype=torch.int32, device=dev)
            st["ticket"] = torch.zeros((), dtype=torch.int32, device=dev)  # reuse_pages' own counter, kept at 0
        return st["due"]

    def reselect(self) -> None:
        """The next decode step chooses its pages afresh (in place: a captured step holds the counter and flag)."""
        if "step" in self.reuse:
            self.reuse["step"].zero_()
            self.reuse["due"].fill_(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1  # it grows

    # Everything below acts on every buffer (the mixin's versions only know keys/values).
    def _materialize(self) -> None:
        """Apply the page table to the buffers (each sequence's pages moved into its own row); drop the table."""
        if self.rows is None:
            return
        S, rows = self.page_size, self.rows
        B, H, C, D = self.keys.shape
        P = C // S

        def apply(t, paged):  # t viewed as [B, H, P, ...], page p of row b taken from row rows[b, p]
            return tk.score.gather_rows(t.reshape(paged), rows).reshape(t.shape).contiguous()

        self.keys = apply(self.keys, (B, H, P, S, D))
        self.values = apply(self.values, (B, H, P, S, self.values.shape[-1]))
        self.kmin, self.kmax = apply(self.kmin, self.kmin.shape), apply(self.kmax, self.kmax.shape)
        if self.kmin8 is not None:
            self.kmin8, self.kmax8 = apply(self.kmin8, self.kmin8.shape), apply(self.kmax8, self.kmax8.shape)
            self.kscale = apply(self.kscale, self.kscale.shape)
        self.valid = apply(self.valid, (B, 1, P, S))
        self.side = {n: apply(t, (B, H, P, S, *t.shape[3:])) for n, t in self.side.items()}
        self.rows = None
        self.allocations += 1

    def _map(self, fn) -> None:
        if self.pager is not None and self.is_initialized:
            raise NotImplementedError("offload='cpu' does not serve batch edits (num_return_sequences > 1, "
                                      "contrastive or assisted search): use a new QuestCache per batch")
        self._materialize()
        if self.is_initialized:
            for name in ("keys", "values", "kmin", "kmax", "valid", "kmin8", "kmax8", "kscale"):
                if getattr(self, name) is not None:
                    setattr(self, name, fn(getattr(self, name)))
            self.side = {name: fn(t) for name, t in self.side.items()}
            if self.kchan is not None:  # one per KV head and channel, not per sequence: only moved
                self.kchan = self.kchan.to(self.keys.device)
            self.reuse = {}  # a new batch: chosen afresh at the next step
            self._shape = (self.keys.shape[0], *self._shape[1:])
            self._dense_ids = None
            self.allocations += 1

    def reset(self) -> None:
        if self.is_initialized:
            self.kmin.fill_(float("inf"))
            self.kmax.fill_(float("-inf"))
            self.valid.zero_()
            self.pos.zero_()
            if self.kmin8 is not None:
                self.kmin8.fill_(tk.bounds8.CODE_LO_EMPTY)
                self.kmax8.fill_(tk.bounds8.CODE_HI_EMPTY)
                self.kscale.zero_()
            self.chan_ready = False  # the next sequence's first keys set the channel scales (in place)
            self.reselect()
            if self.rows is not None:  # in place: a captured step reads this table
                self.rows.copy_(self._own_rows())
        if self.pager is not None:
            self.pager.reset()
        self.side_state.clear()
        self.seq_len = 0

    def _own_rows(self) -> torch.Tensor:
        B, P = self._shape[0], self.keys.shape[2] // self.page_size
        return torch.arange(B, dtype=torch.int32, device=self.device)[:, None].expand(B, P)

    def _privatize(self, page: int, source_rows: torch.Tensor) -> None:
        """Copy page `page` of each sequence from batch row `source_rows[b]` into its own row b (it will write it)."""
        S = self.page_size
        src, sl = source_rows.long(), slice(page * S, (page + 1) * S)
        self.keys[:, :, sl] = self.keys[src, :, sl]  # advanced indexing reads a copy before the write
        self.values[:, :, sl] = self.values[src, :, sl]
        self.valid[:, sl] = self.valid[src, sl]
        self.kmin[:, :, page] = self.kmin[src, :, page]
        self.kmax[:, :, page] = self.kmax[src, :, page]
        if self.kmin8 is not None:
            for t in (self.kmin8, self.kmax8, self.kscale):
                t[:, :, page] = t[src, :, page]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence b continues sequence `beam_idx[b]`. With a selector whose kernels read the page
        table, the full pages are shared through `rows` (no copy) and only the partial page is copied; otherwise
        every buffer is permuted in place. Either way in place: a captured step holds these addresses."""
        if not self.is_initialized:
            return
        if self.pager is not None:
            raise NotImplementedError("offload='cpu' does not serve beam search (its page table is per sequence): "
                                      "use num_beams=1 or offload=None")
        beam_idx = beam_idx.to(self.device)
        if "ids" in self.reuse:  # sequence b continues beam_idx[b], and reuses its stored selection
            self.reuse["ids"].copy_(self.reuse["ids"].index_select(0, beam_idx))
        if not self.selector.paged_reorder:
            self._materialize()
            bounds8 = (self.kmin8, self.kmax8, self.kscale) if self.kmin8 is not None else ()
            for t in (self.keys, self.values, self.kmin, self.kmax, self.valid, *bounds8, *self.side.values()):
                t.copy_(t.index_select(0, beam_idx))
            return
        if self.rows is None:
            self.rows = self._own_rows().contiguous()
            self.allocations += 1  # a step captured without the table must be captured anew
        S, L = self.page_size, self.seq_len
        full = L // S  # pages before this one are complete: never written again, so shared
        rows = self.rows.index_select(0, beam_idx)
        if L % S:
            self._privatize(full, rows[:, full])
        rows[:, full:] = self._own_rows()[:, full:]
        self.rows.copy_(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (HF's convention: a negative count), metadata included."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        new_len = self.seq_len + tokens_to_remove
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if new_len < 0:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache of {self.seq_len}")
        if self.pager is not None:  # the surviving tokens of the boundary page come back from the host
            self.pager.crop(self, new_len)
            self.seq_len = new_len
            self.selector.on_crop(self, new_len)
            return
        S = self.page_size
        start = new_len // S * S  # the boundary page is rebuilt from its surviving tokens
        if self.rows is not None:  # the boundary page may be shared by beams: each takes its own copy
            p = start // S
            if p < self.rows.shape[1]:
                self._privatize(p, self.rows[:, p].clone())
                self.rows[:, p:] = self._own_rows()[:, p:]
        keep_k, keep_v = self.keys[:, :, start:new_len].clone(), self.values[:, :, start:new_len].clone()
        keep_valid = self.valid[:, start:new_len].clone()
        self.kmin[:, :, start // S:].fill_(float("inf"))
        self.kmax[:, :, start // S:].fill_(float("-inf"))
        self.valid[:, start:] = False
        self.ops.append_kv(self.keys, self.values, self.kmin, self.kmax, self.valid,
                           keep_k, keep_v, keep_valid, start)
        if self.kmin8 is not None:  # the boundary page and every emptied one after it
            self.ops.quantize_bounds(self.kmin, self.kmax, self.kmin8, self.kmax8, self.kscale, start // S, None,
                                     **self._chan_kw())
        self.seq_len = new_len
        self.pos.fill_(new_len)
        self.reselect()
        self.selector.on_crop(self, new_len)


class QuestCache(Cache):
    """A `transformers.Cache` for Quest sparse decoding: one `QuestLayer` per model layer.

    `generate()` of a patched model builds one by itself, sized for prompt + new tokens. To drive the model
    yourself, build one from the patched model and pass it as the cache argument (it grows as needed)::

        cache = QuestCache.from_model(model)
        out = model(input_ids, attention_mask=mask, past_key_values=cache)  # `cache=` on transformers >= 5.24

    `max_length`: tokens to allocate for at the first forward (None: that forward's + one growth step).
    `selection_hooks`: callables `fn(layer_idx, query [B, H_q, D], page_ids [B, H_kv, K])` run after each
    sparse selection, also in a captured step (after its replay, with that step's tensors); empty by default.
    """

    def __init__(self, config: QuestConfig, num_layers: int, max_length: int | None = None):
        if not isinstance(config, QuestConfig):
            raise TypeError(f"QuestCache needs a QuestConfig, got {type(config).__name__}")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        check_config(config)  # what QuestConfig cannot check alone: its settings against the policy's selector
        config.check_layers(num_layers)
        self.quest_config = config
        self._step = _Step()
        self.selection_hooks: list = []
        # Which stop check generate() ran over this cache: "deferred" (one step late, the host never waits)
        # or "per-token"; None until a generate() call (QuestConfig.defer_stop_check).
        self.stop_check: str | None = None
        # True when generate() took this cache over from its previous call, reset.
        self.reused = False
        # How its decode steps ran: "captured" (a CUDA graph replay) or "eager: <why not>"; None before any.
        self.decode_path: str | None = None
        # How quest_hf.prefill's chunks attended to their past ("blockwise ..." or "sdpa ..."); None: not used.
        self.prefill_mode: str | None = None
        # Each layer runs under its own config: its budget (QuestConfig.layer_budgets) is what its selector reads.
        super().__init__(layers=[QuestLayer(config.for_layer(i), self._step, max_length) for i in range(num_layers)])
        for layer, pager in zip(self.layers, make_pagers(config, num_layers)):
            layer.pager = pager  # offload="cpu": sparse layers keep K/V in host memory

    @classmethod
    def from_model(cls, model, max_length: int | None = None) -> QuestCache:
        """A fresh cache with the configuration `patch_model` gave `model`."""
        state = getattr(model, "_quest_state", None)
        if state is None:
            raise ValueError("the model is not patched: call quest_hf.patch_model(model, ...) first, "
                             "or build QuestCache(QuestConfig(...), num_layers)")
        return state.mark_bucket(model, cls(state.config, state.num_layers, max_length))

    def copy(self, config: QuestConfig | None = None) -> QuestCache:
        """An independent copy (tensors included), optionally under another config with the same page_size:
        one dense prefill can then be decoded under many budgets or policies."""
        if self.quest_config.offload is not None or (config is not None and config.offload is not None):
            raise NotImplementedError("QuestCache.copy does not copy to or from an offloaded cache (offload='cpu': "
                                      "its host pages are page-locked): prefill a new cache instead")
        new = _copy.deepcopy(self)
        if config is not None:
            if config.page_size != self.quest_config.page_size:
                raise ValueError(f"a copy keeps the pages: page_size must stay {self.quest_config.page_size}")
            check_config(config)
            config.check_layers(len(new.layers))
            new.quest_config = config
            for i, layer in enumerate(new.layers):
                layer.config = config.for_layer(i)
                layer._selector = None  # the registered selector of the new config's policy
                layer.side_state.clear()  # another policy's bookkeeping starts afresh
                layer.reuse = {}
                if layer.is_initialized:
                    layer.ops = resolve_backend(config.backend, layer.device)
                layer.sync_bounds()
        return new

    def begin_step(self, attention_mask: torch.Tensor | None, num_new_tokens: int) -> None:
        """Record which of the `num_new_tokens` tokens of this forward are real, from HF's 2D padding mask."""
        if attention_mask is None:
            self._step.set(None)
            return
        if attention_mask.dim() != 2 or attention_mask.shape[1] < num_new_tokens:
            raise ValueError(
                f"quest-hf needs the 2D padding attention_mask [batch, past + new tokens], got shape "
                f"{tuple(attention_mask.shape)} for {num_new_tokens} new tokens"
            )
        self._step.set(attention_mask[:, attention_mask.shape[1] - num_new_tokens:].bool())

    def replayed(self, num_tokens: int = 1, layers=None) -> None:
        """A captured step appended `num_tokens` to every layer (or to the layers of index in `layers`: one
        segment's graph, quest_hf.graph.SegmentGraph) on the device: advance their host lengths."""
        for layer in (self.layers if layers is None else [self.layers[i] for i in layers]):
            layer.seq_len += num_tokens

    @property
    def storage(self) -> tuple[int, ...]:
        """Changes whenever a layer's buffers move (growth, a batch edit): a captured step must be re-captured."""
        return tuple(layer.allocations for layer in self.layers)

    @property
    def offload_stats(self) -> dict:
        """Under `offload="cpu"`: resident hit rate, bytes moved per step, pool and host bytes (quest_hf.offload.
        offload_stats; reads the device counters now, one host sync)."""
        return offload_stats(self)

    @property
    def step_kernels(self) -> str | None:
        """Which kernels the sparse layers' last decode steps ran (`QuestConfig.fused_step`), layers with the same
        answer together: e.g. "fused: three launches chained by PDL (layers 2-31)", or "separate: fused_step='auto'
        takes MHA only (...) (layers 2-27)". None before a sparse layer's first decode step. A captured step's
        answer is the one its capture recorded: the replays run those kernels."""
        if self._step.kernels_stale:
            from .families import _ranges

            groups: dict[str, list[int]] = {}
            for i, layer in enumerate(self.layers):
                if layer.step_kernels is not None:
                    groups.setdefault(layer.step_kernels, []).append(i)
            self._step.kernels = "; ".join(f"{what} (layers {_ranges(idx)})" for what, idx in groups.items()) or None
            self._step.kernels_stale = False
        return self._step.kernels

    @property
    def backends(self) -> set[str]:
        """Names of the backends the initialised layers run (`{"triton"}` on CUDA by default)."""
        return {layer.ops.name for layer in self.layers if layer.ops is not None}
