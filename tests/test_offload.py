"""QuestConfig(offload="cpu"): K/V pages in host memory, a resident pool on the "device" (both the CPU here).

The offloaded cache must decode exactly as the resident one (same logits bit for bit: same pages, same order of
tokens in the same attention kernel), with a pool too small to keep anything between steps and with one that
covers every page; its counters must match a count by hand; what it does not serve must be refused.
"""
import pytest
import torch

import triton_kernels.offload as tko
from quest_hf import QuestCache, patch_model, prefill
from quest_hf.config import QuestConfig
from quest_hf.patch import cache_arg_name

from .conftest import left_padded_batch, one_thread, tiny_model

# 4 query / 2 KV heads (GQA group 2), 3 layers: layer 0 dense (stays resident), 1-2 offloaded.
S, BUDGET = 8, 32
K_STEP = 2 * (BUDGET // S + 1)  # pages one step may choose per KV head: the union of 2 query heads' K + 1
NEW = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", heads=4, kv_heads=2, layers=3)


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch(lengths=(150, 130))


def _arg(model, cache):
    """The cache keyword of this transformers ("cache" from 5.24, "past_key_values" before)."""
    return {cache_arg_name(model): cache}


def _cfg(**kw):
    return QuestConfig(budget=BUDGET, page_size=S, dense_layers=1, **{"backend": "torch", **kw})


def _generate(model, batch, **kw):
    ids, mask = batch
    patch_model(model, config=_cfg(**kw))
    with one_thread():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out, out.past_key_values


@pytest.fixture(scope="module")
def resident(model, batch):
    return _generate(model, batch)[0]


@pytest.mark.parametrize("pages, backend", [
    pytest.param(K_STEP, "torch", id="pool-one-step-torch"),
    pytest.param(10_000, "torch", id="pool-covers-all-torch"),
    pytest.param(K_STEP, "triton", id="pool-one-step-triton-interpreted"),
])
def test_offloaded_decode_equals_resident(model, batch, resident, pages, backend):
    ref = resident if backend == "torch" else _generate(model, batch, backend=backend)[0]
    out, cache = _generate(model, batch, backend=backend, offload="cpu", offload_pages=pages)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)  # not close: the same pages and tokens in the same order
    assert cache.layers[0].pager is None and cache.layers[0].keys.device.type == "cpu"  # dense: resident
    assert all(layer.pager is not None for layer in cache.layers[1:])
    st = cache.offload_stats
    assert st["offloaded_layers"] == 2 and st["steps"] == NEW - 1  # the first token comes from the prefill
    assert st["misses"] > 0 and 0 < st["hit_rate"] < 1


def _decode_by_hand(model, batch, pages, steps=NEW):
    """Prefill, then `steps` greedy decode steps with a selection hook; per step the counters' change."""
    ids, mask = batch
    patch_model(model, config=_cfg(offload="cpu", offload_pages=pages))
    cache = QuestCache.from_model(model, ids.shape[1] + steps + 1)
    chosen = []
    cache.selection_hooks.append(lambda i, q, p: chosen.append((i, cache.layers[i].seq_len, p.clone())))
    deltas = []
    with one_thread(), torch.no_grad():
        out = model(ids, attention_mask=mask, **_arg(model, cache))
        for _ in range(steps):
            before = [layer.pager.counters.clone() for layer in cache.layers[1:]]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, **_arg(model, cache))
            deltas.append([(layer.pager.counters - b).tolist() for layer, b in zip(cache.layers[1:], before)])
    return cache, chosen, deltas


def test_stats_counted_by_hand():
    # A pool that covers every page never evicts: a chosen page hits iff it was chosen (or current) before.
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    cache, chosen, deltas = _decode_by_hand(model, left_padded_batch(lengths=(150, 130)), pages=10_000)
    seen, hits, misses, fetched, per_step = {}, 0, 0, 0, []
    for layer_idx, length, ids in chosen:
        cur = (length - 1) // S
        h = m = 0
        for b in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                pages = {int(p) for p in ids[b, k] if p >= 0}
                assert cur in pages  # the contract: the current page is always chosen
                known = seen.setdefault((layer_idx, b, k), set())
                h += len((pages - {cur}) & known)
                m += len(pages - {cur} - known)
                fetched += 1 + len(pages - {cur} - known)  # the current page is copied in every step
                known |= pages
        hits, misses = hits + h, misses + m
        per_step.append((h, m))
    st = cache.offload_stats
    assert (st["hits"], st["misses"], st["pages_fetched"]) == (hits, misses, fetched)
    assert st["steps"] == NEW
    page_bytes = S * 2 * 16 * 4  # K and V, head_dim 16, fp32
    assert st["bytes_per_step"] == misses * page_bytes / NEW
    assert st["hit_rate"] == hits / (hits + misses)
    steps = [[d[1:3] for d in step] for step in deltas]  # (hits, misses) of layers 1 and 2
    assert [tuple(x) for step in steps for x in step] == per_step
    assert all(m > 0 and h == 0 for h, m in steps[0])  # the first step: every chosen page misses
    assert any(m == 0 and h > 0 for step in steps for h, m in step)  # a layer's step where every chosen page hits


def test_tiny_pool_misses_and_eviction():
    # A pool of one step's selection: the first step misses every chosen page; later steps evict (LRU) and still
    # decode exactly (test_offloaded_decode_equals_resident); hits + misses count every chosen non-current page.
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    cache, chosen, deltas = _decode_by_hand(model, left_padded_batch(lengths=(150, 130)), pages=K_STEP)
    for (layer_idx, length, ids), (steps, h, m, f) in zip(chosen, [d for step in deltas for d in step]):
        cur = (length - 1) // S
        live = int((ids >= 0).sum()) - ids.shape[0] * ids.shape[1]  # the current page is not counted
        assert (steps, h + m, f) == (1, live, m + ids.shape[0] * ids.shape[1]), (layer_idx, cur)
    assert all(d[1] == 0 for d in deltas[0])
    pool = cache.layers[1].pager
    assert pool.pool_pages == K_STEP and int((pool.slot_of >= 0).sum()) <= K_STEP * 2 * 2


def test_pool_smaller_than_a_step_is_refused(model, batch):
    # offload_pages covers budget // page_size + 1, but under "union" a KV head's 2 query heads choose twice that.
    with pytest.raises(ValueError, match=r"resident pool \(offload_pages=5: 5 pages per KV head\) is smaller than one "
                                         r"decode step's selection \(10 pages"):
        _generate(model, batch, offload="cpu", offload_pages=BUDGET // S + 1)
    with pytest.raises(ValueError, match="offload_pages=4 is smaller than one decode step's selection"):
        _cfg(offload="cpu", offload_pages=4)
    with pytest.raises(ValueError, match=r"offload_bytes=.* pools of 1024-byte pages: 0 pages per KV head\)"):
        _generate(model, batch, offload="cpu", offload_bytes=1000)


def test_offload_bytes_sizes_the_pool(model, batch, resident):
    page_bytes = S * 2 * 16 * 4
    out, cache = _generate(model, batch, offload="cpu", offload_bytes=2 * 2 * 2 * 13 * page_bytes)
    assert torch.equal(out.sequences, resident.sequences)
    assert cache.layers[1].pager.pool_pages == 13  # 2 layers x 2 sequences x 2 KV heads x 13 pages
    assert cache.offload_stats["pool_bytes"] == 2 * 2 * 2 * 14 * page_bytes  # + one scratch page each


@pytest.mark.parametrize("kw, match", [
    pytest.param(dict(offload="gpu"), "offload must be None", id="target"),
    pytest.param(dict(offload_pages=64), "set offload='cpu' too", id="pages-without-offload"),
    pytest.param(dict(offload="cpu", offload_pages=64, offload_bytes=1 << 20), "not both", id="pages-and-bytes"),
    pytest.param(dict(offload="cpu", offload_pages=0), "offload_pages must be a positive int", id="zero"),
    pytest.param(dict(offload="cpu", policy="oracle"), "serves the policies quest, streaming", id="policy"),
])
def test_config_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_beams_copy_and_batch_edits_refused(model, batch):
    ids, mask = batch
    patch_model(model, config=_cfg(offload="cpu"))
    with pytest.raises(NotImplementedError, match="does not serve beam search"), one_thread():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)
    cache = QuestCache.from_model(model)
    with torch.no_grad(), one_thread():
        model(ids, attention_mask=mask, **_arg(model, cache))
    with pytest.raises(NotImplementedError, match="does not copy to or from an offloaded cache"):
        cache.copy()
    patch_model(model, config=_cfg())
    resident = QuestCache.from_model(model)
    with torch.no_grad(), one_thread():
        model(ids, attention_mask=mask, **_arg(model, resident))
    with pytest.raises(NotImplementedError, match="does not copy to or from an offloaded cache"):
        resident.copy(_cfg(offload="cpu"))
    with pytest.raises(NotImplementedError, match="does not serve batch edits"):
        cache.batch_repeat_interleave(2)


@pytest.mark.parametrize("family, overrides", [
    pytest.param("mistral", dict(sliding_window=64), id="mistral-window-past-the-budget"),
    pytest.param("mistral", {}, id="mistral-window-within-the-budget"),
    pytest.param("gemma2", {}, id="gemma2-softcap-and-window"),
])
def test_families_offloaded_equal_resident(family, overrides):
    # Sliding windows (folded into the pool's valid bits each step; a window within the budget decodes dense, also
    # through the pool) and a logit soft-cap: the offloaded cache gives the resident cache's logits.
    from .family_models import left_padded, tiny_family_model

    model = tiny_family_model(family, layers=3, **overrides)
    ids, mask = left_padded(lengths=(120, 100))
    logits = {}
    for offload in (None, "cpu"):
        patch_model(model, config=_cfg(offload=offload))
        with one_thread():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        logits[offload] = out.sequences, out.logits
        if offload:
            assert out.past_key_values.offload_stats["pages_fetched"] > 0
    # Not bit-equal on CPU: there the resident layers that decode dense attend their prefix in place, the offloaded
    # ones read their pool (the same tokens, summed in another order).
    assert torch.equal(logits["cpu"][0], logits[None][0])
    for a, b in zip(logits["cpu"][1], logits[None][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sinks_refused():
    from .family_models import left_padded, missing_reason, tiny_family_model

    if missing_reason("gpt_oss"):
        pytest.skip(missing_reason("gpt_oss"))
    model = tiny_family_model("gpt_oss", layers=2)
    patch_model(model, config=QuestConfig(budget=16, page_size=4, dense_layers=0, backend="torch", offload="cpu"))
    ids, mask = left_padded(lengths=(60, 50))
    with pytest.raises(ValueError, match="does not serve attention sinks"), one_thread():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_blockwise_prefill(model):
    # An unpadded batch: chunks (not page-aligned) attend to the past in blocks (from the host when offloaded);
    # offloaded and resident caches prefilled so give the same logits bit for bit, close to one-shot prefill's.
    from transformers.masking_utils import AttentionMaskInterface

    ids = torch.randint(2, 97, (2, 150), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    out, masks = {}, []
    for offload in (None, "cpu"):
        patch_model(model, config=_cfg(offload=offload))
        registered = AttentionMaskInterface._global_mapping["quest"]

        def spy(*args, registered=registered, **kwargs):
            masks.append(1)
            return registered(*args, **kwargs)

        AttentionMaskInterface._global_mapping["quest"] = spy
        try:
            with one_thread():
                cache, logits = prefill(model, ids[:, :-1], mask[:, :-1], chunk=37, block=20,
                                        max_length=ids.shape[1] + NEW)
            assert not masks  # no [chunk, past] mask was built: every layer attends in blocks
            assert AttentionMaskInterface._global_mapping["quest"] is spy  # put back
        finally:
            AttentionMaskInterface._global_mapping["quest"] = registered
        with one_thread():
            assert cache.prefill_mode == "blockwise over the past (3 of 3 layers)"
            assert all(layer.prefill_block == 0 for layer in cache.layers)
            gen = model.generate(ids, attention_mask=mask, **_arg(model, cache), max_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        out[offload] = logits, gen
    assert torch.equal(out["cpu"][0], out[None][0])
    assert torch.equal(out["cpu"][1].sequences, out[None][1].sequences)
    for a, b in zip(out["cpu"][1].logits, out[None][1].logits):
        assert torch.equal(a, b)
    patch_model(model, config=_cfg())
    with one_thread(), torch.no_grad():
        whole = model(ids[:, :-1], attention_mask=mask[:, :-1]).logits[:, -1]
    torch.testing.assert_close(out["cpu"][0], whole, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_crop(model, batch, resident):
    # prefill() in chunks that split pages (each later chunk attends to the layer's K/V read back from the host),
    # then generate() continues: the same tokens as the one-shot resident prefill; then a crop and more steps give
    # the resident cache's logits after the same crop.
    ids, mask = batch
    patch_model(model, config=_cfg(offload="cpu"))
    with one_thread():
        cache, _ = prefill(model, ids[:, :-1], mask[:, :-1], chunk=37, max_length=ids.shape[1] + NEW)
        assert cache.prefill_mode == "sdpa over the whole past"  # padded: the past comes back to the device
        out = model.generate(ids, attention_mask=mask, **_arg(model, cache), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, resident.sequences)
    logits = {}
    for offload in (None, "cpu"):
        patch_model(model, config=_cfg(offload=offload))
        c = QuestCache.from_model(model, ids.shape[1] + 8)
        m = mask
        with one_thread(), torch.no_grad():
            o = model(ids, attention_mask=m, **_arg(model, c))
            for step in range(6):
                if step == 3:
                    c.crop(-2)
                    m = m[:, :-2]
                m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
                o = model(o.logits[:, -1:].argmax(-1), attention_mask=m, **_arg(model, c))
        logits[offload] = o.logits
    assert torch.equal(logits["cpu"], logits[None])


def test_growth_keeps_decoding_exactly(model, batch):
    # A cache sized for the prompt only grows at the first decode step (the host K/V move to a larger page-locked
    # buffer, the page table is rebuilt, the pool emptied): still the resident cache's logits, step by step.
    ids, mask = batch
    logits = {}
    for offload in (None, "cpu"):
        patch_model(model, config=_cfg(offload=offload))
        cache = QuestCache.from_model(model, ids.shape[1])
        m, steps = mask, []
        with one_thread(), torch.no_grad():
            o = model(ids, attention_mask=m, **_arg(model, cache))
            allocations = cache.layers[1].allocations
            for _ in range(4):
                m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
                o = model(o.logits[:, -1:].argmax(-1), attention_mask=m, **_arg(model, cache))
                steps.append(o.logits)
        assert cache.layers[1].allocations > allocations  # it grew
        logits[offload] = steps
    for a, b in zip(logits["cpu"], logits[None]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ kernels and twins


@pytest.mark.parametrize("assign", [pytest.param(tko.assign_slots_ref, id="ref"),
                                    pytest.param(tko.assign_slots, id="triton-interpreted")])
def test_assign_slots_lru_by_hand(assign):
    # One sequence, one KV head, R = 3 slots, P = 9 pages (page 8 is the spare), S = 4.
    slot_of = torch.full((1, 1, 10), -1, dtype=torch.int32)
    page_of = torch.full((1, 1, 4), -1, dtype=torch.int32)
    stamp = torch.full((1, 1, 4), -1, dtype=torch.long)
    counters = torch.zeros(4, dtype=torch.long)

    def step(pos, ids):
        ids = torch.tensor(ids, dtype=torch.int32).view(1, 1, -1)
        slots, fetch = assign(ids, slot_of, page_of, stamp, torch.tensor(pos), 4, counters)
        return slots.view(-1).tolist(), fetch.view(-1).tolist()

    assert step(9, [0, 2, 8]) == ([0, 1, -1], [True, True, False])  # both miss (page 2 is current); spare: no slot
    assert step(13, [0, 3, 8]) == ([0, 2, -1], [False, True, False])  # 0 hits; 3 (current) takes the empty slot
    # 1 misses: the oldest slot no hit holds is page 2's (slot 1, last used at pos 9); 0 and 3 hit.
    assert step(14, [0, 1, 3]) == ([0, 1, 2], [False, True, True])
    assert slot_of[0, 0, :9].tolist() == [0, 1, -1, 2, -1, -1, -1, -1, -1]
    assert page_of[0, 0, :3].tolist() == [0, 1, 3]
    # Non-current pages only: hits 0 + 1 (page 0) + 1 (page 0); misses 1 (page 0) + 0 + 1 (page 1); fetched
    # 2 + 1 + 2 (the misses and the current page, every step).
    assert counters.tolist() == [3, 2, 2, 5]
    with pytest.raises(ValueError, match="chose 4 pages per KV head but the resident pool holds 3"):
        step(15, [0, 1, 2, 3])


@pytest.mark.parametrize("B, H, P, K, R", [
    pytest.param(2, 3, 40, 7, 9, id="gqa-small-pool"),
    pytest.param(1, 2, 300, 33, 70, id="odd-sizes"),
])
def test_assign_slots_twins(B, H, P, K, R):
    # Twenty steps of random selections (distinct ids, -1 pads, the spare page, the current page): the kernel's
    # slots, fetch flags, page table, slot owners, stamps and counters equal the reference's at every step.
    g = torch.Generator().manual_seed(P)
    tables = [(torch.full((B, H, P + 1), -1, dtype=torch.int32), torch.full((B, H, R + 1), -1, dtype=torch.int32),
               torch.full((B, H, R + 1), -1, dtype=torch.long), torch.zeros(4, dtype=torch.long)) for _ in range(2)]
    for step in range(20):
        pos = torch.tensor(100 + step * 3)
        cur = (int(pos) - 1) // 4
        ids = torch.stack([torch.randperm(P, generator=g)[:K] for _ in range(B * H)]).view(B, H, K).int()
        ids[..., 0] = cur
        ids[..., 1] = torch.where(ids[..., 1] == cur, ids[..., 1], P - 1)  # the spare page
        ids[0, 0, -2:] = -1
        ids = torch.where((ids == cur) & (torch.arange(K) > 0), -1, ids)  # distinct
        outs = [f(ids, *t[:3], pos, 4, t[3]) for f, t in zip((tko.assign_slots_ref, tko.assign_slots), tables)]
        for a, b in zip(outs[1], outs[0]):
            assert torch.equal(a, b), step
        for i, (a, b) in enumerate(zip(tables[1], tables[0])):
            a, b = (a[..., :-1], b[..., :-1]) if i < 3 else (a, b)  # the scratch columns are the reference's
            assert torch.equal(a, b), (step, i)


@pytest.mark.parametrize("B, H, C, D, K, R, window, pos", [
    pytest.param(2, 3, 64, 16, 5, 7, 0, 37, id="gqa-partial-page"),
    pytest.param(1, 2, 32, 32, 4, 4, 13, 32, id="window-full-page"),
])
def test_fetch_pages_twins(B, H, C, D, K, R, window, pos):
    g = torch.Generator().manual_seed(0)
    host_k, host_v = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    tail_k, tail_v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    valid = torch.rand(B, C, generator=g) > 0.2
    ids = torch.stack([torch.randperm(C // S, generator=g)[:K] for _ in range(B * H)]).view(B, H, K).int()
    ids[0, 0, -1] = -1
    ids[:, :, 0] = (pos - 1) // S  # the current page
    slots = torch.stack([torch.randperm(R, generator=g)[:K] for _ in range(B * H)]).view(B, H, K).int()
    slots[ids < 0] = -1
    fetch = torch.rand(B, H, K, generator=g) > 0.4
    fetch[:, :, 0] = True
    # Sentinels: a slot neither twin writes keeps them; the scratch page R (where the reference scatters what it
    # does not copy) is left out of the comparison.
    pools = [(torch.full((B * H, 1, (R + 1) * S, D), 7.0), torch.full((B * H, 1, (R + 1) * S, D), 7.0),
              torch.zeros(B * H, (R + 1) * S, dtype=torch.bool)) for _ in range(2)]
    p = torch.tensor(pos)
    tko.fetch_pages_ref(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, *pools[0], p, S, window)
    tko.fetch_pages(host_k, host_v, tail_k, tail_v, valid, ids, slots, fetch, *pools[1], p, S, window)
    for (k1, v1, ok1), (k0, v0, ok0) in zip(pools[1:], pools[:1]):
        assert torch.equal(k1[:, :, : R * S], k0[:, :, : R * S]) and torch.equal(v1[:, :, : R * S], v0[:, :, : R * S])
        assert torch.equal(ok1[:, : R * S], ok0[:, : R * S])
    pk = pools[0][0].view(B, H, R + 1, S, D)
    b_, h_, k_ = 0, 1, 1
    if fetch[b_, h_, k_] and slots[b_, h_, k_] >= 0:  # a fetched non-current page holds the host page
        page, slot = int(ids[b_, h_, k_]), int(slots[b_, h_, k_])
        assert torch.equal(pk[b_, h_, slot], host_k[b_, h_, page * S:(page + 1) * S])
    cur_slot = int(slots[0, 1, 0])
    assert torch.equal(pk[0, 1, cur_slot], tail_k[0, 1])  # the current page comes from the tail


def test_write_token_twins():
    g = torch.Generator().manual_seed(0)
    bufs = [torch.zeros(2, 3, 40, 16), torch.zeros(2, 3, 40, 16), torch.zeros(2, 3, S, 16), torch.zeros(2, 3, S, 16)]
    twin = [t.clone() for t in bufs]
    k, v = torch.randn(2, 3, 1, 16, generator=g), torch.randn(2, 3, 1, 16, generator=g)
    pos = torch.tensor(21)
    tko.write_token_at_ref(*bufs, k, v, pos)
    tko.write_token_at(*twin, k, v, pos)
    for a, b in zip(twin, bufs):
        assert torch.equal(a, b)
    assert torch.equal(bufs[0][:, :, 21], k[:, :, 0]) and torch.equal(bufs[3][:, :, 21 % S], v[:, :, 0])
