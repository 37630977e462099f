"""Contexts larger than GPU memory (`QuestConfig(offload="cpu")`): each sparse layer's K/V pages in host memory.

A sparse layer reads `budget` tokens a step, so only those need to be on the GPU. Under `offload="cpu"` every
sparse `QuestLayer` keeps its keys and values `[B, H_kv, C, D]` in page-locked host memory (`layer.keys` /
`layer.values` are those host tensors) and on the GPU only what a step needs to choose and read pages:

    kmin, kmax, valid, pos        as for any layer (scoring and Top-K run on the GPU as before)
    tail_k, tail_v [B, H_kv, S, D] the current page (the decode token is written here and to the host)
    pool_k, pool_v                 R resident pages per (sequence, KV head) + one scratch page
    slot_of [B, H_kv, P + 1]       the page table: logical page -> resident slot (-1 absent)
    page_of, stamp [B, H_kv, R+1]  resident slot -> page, last use (LRU)

Each decode step: the selector's page ids (unchanged) -> `assign_slots` (hits keep their slot, misses take the
least recently used slots no hit holds) -> `fetch_pages` (the misses read from host memory by a Triton kernel,
zero-copy over PCIe; the current page from the tail) -> `sparse_decode_attention` over the pool, its `B * H_kv`
rows as sequences of one KV head and the slot ids as page ids (same kernel, same order of pages and tokens: the
same logits bit for bit). Fixed shapes and device tensors only, so the step is captured in the CUDA graph as
before. The dense layers (`QuestConfig.is_dense`) stay on the GPU. Prefill writes each layer's K/V to the host
as the layer runs; `quest_hf.prefill` (quest_hf/chunked_prefill.py) runs a long prompt in chunks (each chunk's
attention reads the layer's earlier K/V back from the host while that layer runs: `chunk_attention`).
`QuestCache.offload_stats` reports hit rate and bytes moved.

Not served (a clear error): beam search and other batch edits (`reorder_cache`, `batch_select_indices`),
`QuestCache.copy`, attention sinks (GPT-OSS), policies other than "quest" and "streaming".
"""
from __future__ import annotations

import weakref

import torch
from transformers.utils import logging

import triton_kernels.offload as tko

from .config import OFFLOAD_POLICIES, OFFLOAD_TARGETS

logger = logging.get_logger("quest_hf")

DEFAULT_POOL_FACTOR = 2  # default resident pages: twice what one step can choose


def _register(t: torch.Tensor) -> torch.Tensor:
    """Page-lock a host tensor in place (cudaHostRegister: exact size, where pin_memory() rounds allocations up to a
    power of two); unregistered when the tensor is freed."""
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"quest-hf offload: cudaHostRegister of {size / 2**30:.2f} GiB failed ({err}): the host "
                           "may lack the memory to page-lock the K/V cache; use a shorter context")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    t._page_locked = True  # what the kernels' launchers check (besides is_pinned())
    return t


class Pager:
    """The host K/V and the resident pool of one sparse layer (module docstring); `layer.pager`."""

    def __init__(self, config, layer_idx: int, share: int):
        self.config, self.layer_idx = config, layer_idx
        self.share = share  # offloaded layers in the cache: offload_bytes is split between them
        self.pool_pages: int | None = None  # R, set when the first decode step says how many pages a step chooses
        self.pool_k = self.pool_v = self.pool_valid = None
        self.slot_of = self.page_of = self.stamp = None
        self.tail_k = self.tail_v = None
        self.counters: torch.Tensor | None = None  # int64 [4]: steps, hits, misses, pages fetched
        self._stage = None

    def __repr__(self):
        return f"Pager(layer={self.layer_idx}, pool_pages={self.pool_pages})"

    # ------------------------------------------------------------------------------------------- storage
    def host_buffers(self, layer, B, H, cap, D, Dv, dtype):
        """Zeroed host K/V of `cap` slots (page-locked when the layer is on CUDA, so kernels can read them)."""
        dev = layer.device
        if dev.type == "cuda" and layer.ops.name != "triton":
            raise ValueError("offload='cpu' on CUDA reads host pages with the Triton kernels: use backend='auto' "
                             f"or 'triton', not {layer.ops.name!r}")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"offload='cpu' serves layers on CUDA (or the CPU, for tests), not {dev.type}")
        if dev.type == "cuda" and layer.keys is not None:
            torch.cuda.synchronize(dev)  # growth copies the old host K/V on the CPU: the device's writes land first
        keys = torch.zeros(B, H, cap, D, dtype=dtype)  # zeros: no unwritten slot can leak NaN into a masked product
        values = torch.zeros(B, H, cap, Dv, dtype=dtype)
        if dev.type == "cuda":
            keys, values = _register(keys), _register(values)
        return keys, values

    def resize(self, layer) -> None:
        """New buffers (first allocation or growth): page table for the new page count, pool emptied."""
        B, H, D, Dv = layer._shape
        S, dev = layer.page_size, layer.device
        P = layer.keys.shape[2] // S
        self.slot_of = torch.full((B, H, P + 1), -1, dtype=torch.int32, device=dev)
        if self.tail_k is None or self.tail_k.shape[0] != B:
            self.tail_k = torch.zeros(B, H, S, D, dtype=layer.dtype, device=dev)
            self.tail_v = torch.zeros(B, H, S, Dv, dtype=layer.dtype, device=dev)
        if self.counters is None:
            self.counters = torch.zeros(4, dtype=torch.long, device=dev)
        self._stage = None
        self.invalidate()

    def _ensure_pool(self, layer, chosen: int, group: int) -> None:
        if self.pool_k is not None:
            if chosen > self.pool_pages:
                raise ValueError(f"layer {self.layer_idx}: a decode step chose {chosen} pages per KV head but the "
                                 f"resident pool holds {self.pool_pages}; raise QuestConfig.offload_pages")
            return
        cfg = layer.config
        B, H, D, Dv = layer._shape
        S = layer.page_size
        most = (cfg.num_pages + 1) * (group if cfg.gqa_mode == "union" else 1)  # what any step may choose
        page_bytes = S * (D + Dv) * layer.keys.element_size()
        if cfg.offload_pages is not None:
            R, source = cfg.offload_pages, f"offload_pages={cfg.offload_pages}"
        elif cfg.offload_bytes is not None:
            R = cfg.offload_bytes // (self.share * B * H * page_bytes)
            source = (f"offload_bytes={cfg.offload_bytes} over {self.share} offloaded layers x {B * H} "
                      f"(sequence, KV head) pools of {page_bytes}-byte pages")
        else:
            R, source = DEFAULT_POOL_FACTOR * most, "the default"
        if R < max(most, chosen):
            raise ValueError(
                f"layer {self.layer_idx}: the resident pool ({source}: {R} pages per KV head) is smaller than one "
                f"decode step's selection ({max(most, chosen)} pages per KV head: budget {cfg.budget} / page_size "
                f"{S} + 1, x {group} query heads per KV head under gqa_mode='union'); give offload_pages >= "
                f"{max(most, chosen)} (offload_bytes >= {max(most, chosen) * page_bytes * self.share * B * H})")
        dev = layer.device
        self.pool_pages = R
        self.pool_k = torch.zeros(B * H, 1, (R + 1) * S, D, dtype=layer.dtype, device=dev)
        self.pool_v = torch.zeros(B * H, 1, (R + 1) * S, Dv, dtype=layer.dtype, device=dev)
        self.pool_valid = torch.zeros(B * H, (R + 1) * S, dtype=torch.bool, device=dev)
        self.page_of = torch.full((B, H, R + 1), -1, dtype=torch.int32, device=dev)
        self.stamp = torch.full((B, H, R + 1), -1, dtype=torch.long, device=dev)

    def invalidate(self) -> None:
        """Forget every resident page (their host copies changed: a prefill chunk, a crop, a reset). In place."""
        if self.slot_of is not None:
            self.slot_of.fill_(-1)
        if self.page_of is not None:
            self.page_of.fill_(-1)
            self.stamp.fill_(-1)

    def reset(self) -> None:
        self.invalidate()
        if self.counters is not None:
            self.counters.zero_()

    def _staged(self, layer):
        """Stand-ins for the full K/V in the metadata append (its Triton kernel folds min/max from the new tokens
        and the old bounds, never from stored keys): one device slot broadcast over the capacity."""
        if self._stage is None:
            B, H, D, Dv = layer._shape
            C = layer.keys.shape[2]
            one = lambda d: torch.zeros(B, H, 1, d, dtype=layer.dtype, device=layer.device).expand(B, H, C, d)  # noqa: E731
            self._stage = (one(D), one(Dv))
        return self._stage

    # -------------------------------------------------------------------------------------------- append
    def append(self, layer, k, v, valid_new, start: int):
        """`QuestLayer.update` of an offloaded layer: K/V to the host, metadata on the device, `pos` advanced.
        Returns the K/V a multi-token forward attends to (this layer's whole sequence, on the device, for this
        layer's attention only), or the host buffers for a decode token (never read: attention reads the pool)."""
        T = k.shape[2]
        ops, S = layer.ops, layer.page_size
        direct = ops.name == "torch"
        mk, mv = (layer.keys, layer.values) if direct else self._staged(layer)
        with _on(layer.device):
            if T == 1:
                # No `ticket=` here (QuestLayer.append_decode's one-launch advance): the host write below reads
                # the same position, so it moves on only after both.
                ops.append_token_at(mk, mv, layer.kmin, layer.kmax, layer.valid, k, v, valid_new, layer.pos)
                write = tko.write_token_at_ref if direct else tko.write_token_at
                write(layer.keys, layer.values, self.tail_k, self.tail_v, k, v, layer.pos)
                layer.pos += 1
                return layer.keys, layer.values
            ops.append_kv(mk, mv, layer.kmin, layer.kmax, layer.valid, k, v, valid_new, start)
        end = start + T
        if not direct:
            _to_host(layer.keys, k, start)
            _to_host(layer.values, v, start)
        layer.pos.fill_(end)
        cur = (end - 1) // S * S
        self.tail_k.copy_(_from_host(layer.keys, cur, cur + S, layer.device), non_blocking=True)
        self.tail_v.copy_(_from_host(layer.values, cur, cur + S, layer.device), non_blocking=True)
        self.invalidate()
        if start == 0 or layer.prefill_block:  # chunk_attention reads the past from the host block by block
            return k, v
        # A later chunk attends to every earlier token: this layer's past comes back from the host for the
        # duration of its attention (the only time a sparse layer's whole cache is on the GPU).
        return (torch.cat([_from_host(layer.keys, 0, start, layer.device), k.to(layer.dtype)], 2),
                torch.cat([_from_host(layer.values, 0, start, layer.device), v.to(layer.dtype)], 2))

    def crop(self, layer, new_len: int) -> None:
        """`QuestLayer.crop`: the boundary page's metadata rebuilt from its surviving tokens (read from the host)."""
        S = layer.page_size
        if layer.device.type == "cuda":
            torch.cuda.synchronize(layer.device)  # the host copies of the last steps' tokens are complete
        start = new_len // S * S
        keep_k = _from_host(layer.keys, start, new_len, layer.device)
        keep_v = _from_host(layer.values, start, new_len, layer.device)
        keep_valid = layer.valid[:, start:new_len].clone()
        layer.kmin[:, :, start // S:].fill_(float("inf"))
        layer.kmax[:, :, start // S:].fill_(float("-inf"))
        layer.valid[:, start:] = False
        layer.pos.fill_(start)
        if new_len > start:
            self.append(layer, keep_k, keep_v, keep_valid, start)
        self.invalidate()

    # ------------------------------------------------------------------------------------------- attend
    def attend(self, layer, q, ids, scale: float, window: int, softcap: float = 0.0, sinks=None):
        """`attend_pages` of an offloaded layer: `q [B, H_q, D]` over the pages `ids [B, H_kv, K]`."""
        if sinks is not None:
            raise ValueError(f"layer {self.layer_idx}: offload='cpu' does not serve attention sinks (GPT-OSS): the "
                             "pooled attention runs each KV head as its own sequence; use offload=None")
        B, Hq, D = q.shape
        H = layer.kmin.shape[1]
        G, K, S = Hq // H, ids.shape[2], layer.page_size
        self._ensure_pool(layer, K, G)
        triton = layer.ops.name == "triton"
        with _on(layer.device):
            slots, fetch = (tko.assign_slots if triton else tko.assign_slots_ref)(
                ids, self.slot_of, self.page_of, self.stamp, layer.pos, S, self.counters)
            (tko.fetch_pages if triton else tko.fetch_pages_ref)(
                layer.keys, layer.values, self.tail_k, self.tail_v, layer.valid, ids, slots, fetch,
                self.pool_k, self.pool_v, self.pool_valid, layer.pos, S, window)
        kw = {"softcap": softcap} if softcap else {}
        out = layer.ops.sparse_decode_attention(q.reshape(B * H, G, D), self.pool_k, self.pool_v,
                                                slots.view(B * H, 1, K), self.pool_valid, self.pool_k.shape[2],
                                                S, scale, 0, **kw)
        return out.view(B, Hq, -1)


class _on:
    """Launch on `device` (with a device_map, the current CUDA device may be another one)."""

    def __init__(self, device):
        self.ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _to_host(host: torch.Tensor, new: torch.Tensor, start: int) -> None:
    """`new [B, H, T, D]` (device) into host slots `[start, start + T)`: one asynchronous copy per (b, head), each a
    contiguous host range (a strided host slice would go through a synchronous staging copy)."""
    T = new.shape[2]
    for b in range(host.shape[0]):
        for h in range(host.shape[1]):
            host[b, h, start:start + T].copy_(new[b, h], non_blocking=True)


def _from_host(host: torch.Tensor, start: int, end: int, device) -> torch.Tensor:
    """Host slots `[start, end)` as a new device tensor `[B, H, end - start, D]` (asynchronous copies)."""
    B, H, _, D = host.shape
    out = torch.empty(B, H, end - start, D, dtype=host.dtype, device=device)
    if device.type == "cpu":
        return out.copy_(host[:, :, start:end])
    for b in range(B):
        for h in range(H):
            out[b, h].copy_(host[b, h, start:end], non_blocking=True)
    return out


def chunk_attention(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    block: int) -> torch.Tensor:
    """Attention of a prefill chunk `query [B, H_q, q, D]` over its layer's whole sequence, reading the earlier
    tokens in blocks of `block` (from host memory for an offloaded layer, else from the layer's buffers): flash
    attention per block with its log-sum-exp, merged exactly (fp32). `key/value [B, H_kv, >= q, D]`: the chunk's own
    are the last q. Only for full causal attention without padding, soft-cap or sinks (`prefill` checks). Returns
    `[B, q, H_q, D]` as HF's attention functions do. Memory: one block of K/V (repeated to H_q heads) at a time."""
    B, Hq, q, D = query.shape
    start = layer.seq_len - q
    acc, lse = _attend_lse(query, key[:, :, -q:], value[:, :, -q:], scale, causal=True)
    acc = acc.float()
    for s in range(0, start, block):  # a running log-sum-exp merge: one block's output held at a time
        e = min(start, s + block)
        if layer.keys.device == query.device:
            kb, vb = layer.keys[:, :, s:e], layer.values[:, :, s:e]
        else:
            kb, vb = _from_host(layer.keys, s, e, query.device), _from_host(layer.values, s, e, query.device)
        out, part = _attend_lse(query, kb, vb, scale, causal=False)
        both = torch.logaddexp(lse, part)
        acc = acc * torch.exp(lse - both)[..., None] + out.float() * torch.exp(part - both)[..., None]
        lse = both
    return acc.to(query.dtype).transpose(1, 2).contiguous()


def _attend_lse(q, k, v, scale: float, causal: bool):
    """(softmax(q k^T * scale) v `[B, H_q, q, D]`, its log-sum-exp fp32 `[B, H_q, q]`); GQA by repeating K/V heads."""
    G = q.shape[1] // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
    return out, lse[..., : q.shape[2]].float()


def make_pagers(config, num_layers: int) -> list[Pager | None]:
    """One Pager per sparse layer under `config.offload`, None for the dense ones (and without offload)."""
    if config.offload is None:
        return [None] * num_layers
    sparse = [i for i in range(num_layers) if not config.is_dense(i)]
    if not sparse:
        logger.warning_once("quest-hf: offload='cpu' but every layer is dense: nothing is offloaded")
    return [Pager(config.for_layer(i), i, len(sparse)) if i in sparse else None for i in range(num_layers)]


def offload_stats(cache) -> dict:
    """Resident-pool figures of a QuestCache under offload (one host sync: the device counters are read now).

    `steps`: decode steps; `hit_rate`: of the chosen pages other than the current one, the fraction already
    resident; `pages_fetched`: pages copied into pools (misses and the current page) over all layers and steps;
    `bytes_per_step`: host->GPU bytes a decode step moved (misses only: the current page comes from the GPU);
    `to_host_bytes_per_step`: GPU->host bytes (the decode token of each offloaded layer); `pool_bytes`: device
    bytes of the pools, `host_bytes`: the host K/V; `layers`: the same per offloaded layer index."""
    per, total = {}, torch.zeros(4, dtype=torch.long)
    pool_bytes = host_bytes = to_host = 0
    page_io = 0.0
    for i, layer in enumerate(cache.layers):
        p = getattr(layer, "pager", None)
        if p is None or p.counters is None:
            continue
        c = p.counters.tolist()
        B, H, D, Dv = layer._shape
        elt = layer.keys.element_size()
        page = layer.page_size * (D + Dv) * elt
        steps, hits, misses, fetched = c
        per[i] = dict(steps=steps, hits=hits, misses=misses, pages_fetched=fetched,
                      hit_rate=hits / (hits + misses) if hits + misses else None,
                      bytes_per_step=misses * page / steps if steps else 0.0)
        total += torch.tensor(c)
        page_io += misses * page
        to_host += B * H * (D + Dv) * elt
        host_bytes += 2 * layer.keys.numel() * elt
        if p.pool_k is not None:
            pool_bytes += (p.pool_k.numel() + p.pool_v.numel()) * elt
    layers = len(per)
    steps = int(total[0]) // layers if layers else 0
    hits, misses = int(total[1]), int(total[2])
    return dict(offloaded_layers=layers, steps=steps, hits=hits, misses=misses, pages_fetched=int(total[3]),
                hit_rate=hits / (hits + misses) if hits + misses else None,
                bytes_per_step=page_io / steps if steps else 0.0, to_host_bytes_per_step=to_host,
                pool_bytes=pool_bytes, host_bytes=host_bytes, layers=per)


__all__ = ["Pager", "make_pagers", "offload_stats", "chunk_attention", "OFFLOAD_TARGETS", "OFFLOAD_POLICIES"]
