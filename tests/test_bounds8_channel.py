"""8-bit page bounds on channel scales (QuestConfig(bounds="int8_channel"), triton_kernels/bounds8.py): the bound never
under-estimates q.k, pages past the prefill's range take a larger exponent, kernels equal their twins bit for bit, and
the layer keeps its codes equal to its exact bounds quantized on its channel scales through every edit."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, patch_model
from triton_kernels.bounds8 import channel_scales, channel_scales_of_bounds, empty_bounds8

from .conftest import left_padded_batch, tiny_model
from .test_bounds8 import (
    KEY_KINDS,
    adversarial_keys,
    assert_scores_bound_the_best_qk,
    chan_for,
    page_bounds,
    quantized,
    stored_layer,
    triton_ok,
)
from .testing import DEVICE as DEV
from .testing import F16, F32, nan_empty


def decoded(lo8, hi8, kscale, chan):
    """The fp32 bounds the score kernel computes: code x (channel scale x page scale)."""
    se = chan[None, :, None, :] * kscale[..., None]
    return lo8.float() * se, hi8.float() * se


# ------------------------------------------------------------------------------------ the bound holds
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KEY_KINDS), seed=st.integers(0, 2**31 - 1), S=st.sampled_from([4, 16]),
       D=st.sampled_from([1, 7, 64]), dtype=st.sampled_from([F16, torch.bfloat16, F32]),
       qscale=st.sampled_from([1e-3, 1.0, 1e3]), grow=st.sampled_from([1e-3, 1.0, 37.0, 3e3]),
       pad=st.integers(0, 3))
def test_channel_bound_never_under_estimates_the_best_qk_of_a_page(kind, seed, S, D, dtype, qscale, grow, pad):
    # The channel scales come from the first page (the "prefill"); later pages hold keys up to `grow` times larger,
    # so they need exponents e > 0 (or stay far inside the range).
    B, H, P, G = 1, 2, 4, 2
    keys = adversarial_keys(kind, (B, H, P, S, D), seed, F32)
    keys[:, :, 1:] = keys[:, :, 1:] * grow
    big = torch.finfo(dtype).max if dtype == F16 else 1e30
    keys = keys.clamp(-big, big).to(dtype)
    valid = torch.ones(B, P, S, dtype=torch.bool)
    valid[:, 0, :pad] = False
    kmin, kmax = page_bounds(keys, valid)
    chan = channel_scales(keys[:, :, 0], valid[:, 0])
    lo8, hi8, ks = quantized(kmin, kmax, chan)
    assert (lo8 >= -127).all() and (hi8 <= 127).all()
    lo, hi = decoded(lo8, hi8, ks, chan)
    # Exactly as the kernel computes it: no tolerance.
    assert (lo <= kmin.float()).all() and (hi >= kmax.float()).all()
    assert ((ks == torch.exp2(torch.log2(ks).round())) & (ks >= 1)).all()  # a power of two, e >= 0
    q = (torch.randn(B, H * G, D, generator=torch.Generator().manual_seed(seed + 1)) * qscale).to(dtype)
    assert_scores_bound_the_best_qk(q, keys, valid, kmin, kmax, lo, hi, chan)


def test_pages_past_the_prefill_range_take_the_smallest_exponent_that_fits():
    D = 8
    chan = torch.full((1, D), 0.5)  # 127 codes cover |k| <= 63.5
    kmin = torch.tensor([-1.0, -63.5, -64.0, -100.0, -6350.0, 0.0]).view(1, 1, 6, 1).expand(1, 1, 6, D).clone()
    kmax = -kmin
    kmax[0, 0, 5] = 1e-30  # far below one step: codes 0 / 1 on e = 0
    lo8, hi8, ks = quantized(kmin, kmax, chan)
    # |k| / 0.5 = 2, 127, 128, 200, 12700, ~0 -> e = 0, 0, 1, 1, 7, 0
    assert ks[0, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 128.0, 1.0]
    assert lo8[0, 0, :, 0].tolist() == [-2, -127, -64, -100, -100, 0] and hi8[0, 0, 5, 0] == 1
    # A channel small at prefill keeps its own fine step: a page's largest channel does not coarsen it.
    chan2 = torch.tensor([[1.0, 2.0 ** -10]])
    small = 48 * 2.0 ** -10
    lo8, hi8, ks = quantized(torch.tensor([[[[-100.0, -small]]]]), torch.tensor([[[[100.0, small]]]]), chan2)
    assert ks.item() == 1.0 and lo8[0, 0, 0].tolist() == [-100, -48] and hi8[0, 0, 0].tolist() == [100, 48]


def test_channel_scales_ignore_padding_and_take_the_batch_max():
    keys = torch.zeros(2, 3, 5, 4)
    keys[0, :, 0] = 1e4  # padding: ignored
    keys[0, 1, 2, 3] = -254.0
    keys[1, 2, 4, 0] = 12.7
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, 0] = False
    chan = channel_scales(keys, valid)
    assert chan.shape == (3, 4) and chan[1, 3] == 2.0 and torch.isclose(chan[2, 0], torch.tensor(0.1))
    assert chan[0, 0] == 2.0 ** -24  # all-zero channels: the floor
    # From the page bounds (one page of the 5 tokens a row, then an empty page): the same scales.
    ok = valid[:, None, :, None]
    kmin = keys.masked_fill(~ok, float("inf")).amin(2, keepdim=True)
    kmax = keys.masked_fill(~ok, float("-inf")).amax(2, keepdim=True)
    kmin, kmax = torch.cat([kmin, torch.full_like(kmin, float("inf"))], 2), torch.cat([kmax, -torch.full_like(kmax, float("inf"))], 2)
    assert torch.equal(channel_scales_of_bounds(kmin, kmax, 2), chan)


def test_checks_refuse_channel_scales_of_the_wrong_shape_or_without_codes():
    lo8, hi8, ks = empty_bounds8(1, 2, 3, 8, "cpu")
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"chan must be fp32 \[H_kv=2, D=8\]"):
        tk.score_pages_ref(q, lo8, hi8, 16, 16, scale=ks, chan=torch.ones(8, 2))
    with pytest.raises(ValueError, match="chan= .* goes with int8 codes"):
        tk.score_pages_ref(q, lo8.float(), hi8.float(), 16, 16, chan=torch.ones(2, 8))
    with pytest.raises(ValueError, match="chan must be fp32"):
        tk.quantize_bounds_ref(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), lo8, hi8, ks,
                               chan=torch.ones(2, 8, dtype=torch.float64))


# ----------------------------------------------------------------------------------- kernels vs twins
# The quantize, append and score kernels against their twins, the layer through every edit, the rule's pages and the
# covering budget run for both 8-bit settings in tests/test_bounds8.py (parametrized over "int8" / "int8_channel").
def test_append_refuses_a_bounds8_tuple_of_the_wrong_length():
    B, H, C, D, S = 1, 2, 16, 8, 8
    cache = [torch.zeros(B, H, C, D), torch.zeros(B, H, C, D), torch.full((B, H, C // S, D), float("inf")),
             torch.full((B, H, C // S, D), float("-inf")), torch.zeros(B, C, dtype=torch.bool)]
    k = torch.randn(B, H, 1, D)
    with pytest.raises(ValueError, match="bounds8 is"):
        tk.append_kv_ref(*cache, k, k, None, 0, bounds8=tuple(empty_bounds8(B, H, C // S, D, "cpu"))[:2])


# -------------------------------------------------------------------------------------- the layer
def assert_codes_match(layer):
    assert layer.kmin8 is not None and layer.kchan is not None and layer.chan_ready
    for a, b in zip((layer.kmin8, layer.kmax8, layer.kscale), quantized(layer.kmin, layer.kmax, layer.kchan)):
        assert torch.equal(a, b)


@torch.no_grad()
def test_layer_sets_the_scales_at_prefill_keeps_them_and_resets_them_in_place(single_thread):
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(45, 30))
    patch_model(model, budget=32, page_size=8, dense_layers=1, bounds="int8_channel", backend="torch")
    cache = QuestCache.from_model(model)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.layers[-1]
    assert_codes_match(layer)
    # The prefill's scales (padding excluded): max |k| over its valid tokens / 127, as stored.
    want = channel_scales(layer.keys[:, :, :ids.shape[1]], mask.bool())
    assert torch.equal(layer.kchan, want)
    chan_ptr, first = layer.kchan.data_ptr(), layer.allocations
    m, tok = mask, out.logits[:, -1].argmax(-1)
    for _ in range(layer.max_tokens - layer.seq_len + 3):  # decode tokens do not move them, nor does growth
        m = torch.cat([m, m.new_ones(2, 1)], 1)
        tok = model(input_ids=tok[:, None], attention_mask=m, past_key_values=cache).logits[:, -1].argmax(-1)
    assert layer.allocations > first and torch.equal(layer.kchan, want)
    assert_codes_match(layer)
    cache.batch_repeat_interleave(2)  # one set a KV head, whatever the batch
    assert layer.kmin8.shape[0] == 4 and layer.kchan.shape == want.shape
    cache.batch_select_indices(torch.tensor([0, 3]))
    cache.reset()
    assert not layer.chan_ready and (layer.kmin8 == 127).all() and (layer.kscale == 0).all()
    # The next sequence's prefill sets new scales, in the same tensor (a captured step keeps its address).
    model(input_ids=torch.full_like(ids, 7), attention_mask=mask, past_key_values=cache)
    assert cache.layers[-1].kchan.data_ptr() == chan_ptr and not torch.equal(cache.layers[-1].kchan, want)
    assert_codes_match(cache.layers[-1])


@torch.no_grad()
def test_a_copy_under_another_bounds_setting_rebuilds_the_codes(single_thread):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32, dense_layers=1, backend="torch", bounds="int8_channel")
    direct = QuestCache.from_model(model)
    model(input_ids=ids, attention_mask=mask, past_key_values=direct)
    patch_model(model, budget=32, dense_layers=1, backend="torch")
    cache = QuestCache.from_model(model)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.layers[-1].kmin8 is None
    chan = cache.copy(QuestConfig(budget=32, dense_layers=1, backend="torch", bounds="int8_channel"))
    assert_codes_match(chan.layers[-1])
    # Scales from the stored page bounds equal the ones the prefill set from its keys.
    assert torch.equal(chan.layers[-1].kchan, direct.layers[-1].kchan)
    int8 = chan.copy(QuestConfig(budget=32, dense_layers=1, backend="torch", bounds="int8"))
    assert int8.layers[-1].kchan is None and int8.layers[-1].bounds_kind == "int8"
    again = int8.copy(QuestConfig(budget=32, dense_layers=1, backend="torch", bounds="int8_channel"))
    assert_codes_match(again.layers[-1])
    assert torch.equal(again.layers[-1].kmin8, chan.layers[-1].kmin8)
    back = again.copy(QuestConfig(budget=32, dense_layers=1, backend="torch"))
    assert back.layers[-1].kmin8 is None and back.layers[-1].kchan is None


@torch.no_grad()
def test_a_hand_driven_loop_with_no_prefill_sets_the_scales_from_its_first_token(single_thread):
    model = tiny_model("llama", heads=4, kv_heads=2)
    patch_model(model, budget=16, page_size=8, dense_layers=1, bounds="int8_channel", backend="torch")
    cache = QuestCache.from_model(model)
    tok = torch.tensor([[5]])
    for _ in range(40):
        tok = model(input_ids=tok, past_key_values=cache).logits[:, -1:].argmax(-1)
    layer = cache.layers[-1]
    assert_codes_match(layer)
    assert torch.equal(layer.kchan, channel_scales(layer.keys[:, :, :1]))


# ------------------------------------------------------------------------ the score's packed-word path
WORD_CASES = [
    # B, H, D, S, L, left padding, beams' page table
    pytest.param(1, 1, 64, 16, 20, (), False, id="len20"),
    pytest.param(2, 3, 128, 16, 4097, (0, 100), True, id="len4097-pad-rows"),
    pytest.param(2, 2, 64, 8, 45, (0, 7), True, id="len45-S8-rows"),
]


@triton_ok
@pytest.mark.parametrize("qscale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("B,H,D,S,L,pad,beams", WORD_CASES)
def test_packed_code_words_score_as_the_byte_path_and_the_twin(B, H, D, S, L, pad, beams, qscale, monkeypatch):
    # ScoreLaunch.packed_codes: MHA rows over channel-scale codes read 4 codes a 32-bit word and take each channel's
    # code by q's sign. Same -inf / +inf pages as the twin, finite scores within fp32 summation of its.
    C = -(-L // S) * S + S
    _, _, kmin, kmax, _ = stored_layer(B, H, D, S, L, C, F16, L, pad)
    chan = chan_for("int8_channel", H, D, L)
    lo8, hi8, scale = quantized(kmin, kmax, chan)
    q = (torch.randn(B, H, D, generator=torch.Generator().manual_seed(L)) * qscale).half().to(DEV)
    q[:, :, :3] = 0.0  # q = 0 takes either code: both give 0
    rows = torch.randint(0, B, (B, C // S), dtype=torch.int32, device=DEV) if beams else None
    kw = dict(pos=torch.tensor(L, device=DEV), rows=rows, scale=scale, chan=chan)
    launch = tk.score.ScoreLaunch(packed_codes=True)
    assert tk.score.packed_words(q, lo8, hi8, chan, launch)
    want = tk.score_pages_ref(q, lo8, hi8, C, S, 0, "none", **kw)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    got = tk.score_pages(q, lo8, hi8, C, S, 0, "none", launch=launch, **kw)
    byte = tk.score_pages(q, lo8, hi8, C, S, 0, "none", **kw)
    fin = want.isfinite()
    assert fin.any() and (~fin).any() and not got.isnan().any()
    assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin])
    big = torch.maximum(lo8.abs(), hi8.abs()).float() * chan[None, :, None, :] * scale[..., None]  # [B, H, P, D]
    if rows is not None:  # each page read from the batch row the page table names
        page = torch.arange(C // S, device=DEV)
        big = big[rows.long(), :, page[None, :]].permute(0, 2, 1, 3)
    mag = (q.float().abs()[:, :, None, :] * big).sum(-1)  # sum of |terms|: fp32 summation's scale
    for s in (got, byte):
        assert ((s[fin] - want[fin]).abs() <= 1e-5 * mag[fin] + 1e-30).all()


@pytest.mark.parametrize("what", ["off", "gqa", "no_chan", "odd_d", "strided", "offset"])
def test_packed_code_words_decline_where_the_layout_does_not_allow_them(what):
    B, H, P, D = 1, 2, 4, 64
    lo8, hi8, scale = empty_bounds8(B, H, P, D, "cpu")
    chan = torch.ones(H, D)
    q = torch.zeros(B, H, D)
    launch = tk.score.ScoreLaunch(packed_codes=True)
    assert tk.score.packed_words(q, lo8, hi8, chan, launch)
    if what == "off":
        launch = tk.score.ScoreLaunch()
    elif what == "gqa":
        q = torch.zeros(B, 2 * H, D)
    elif what == "no_chan":
        chan = None
    elif what == "odd_d":
        lo8, hi8 = lo8[..., :62], hi8[..., :62]
        q, chan = q[..., :62], chan[:, :62]
    elif what == "strided":  # one code every other byte
        lo8 = torch.zeros(B, H, P, 2 * D, dtype=torch.int8)[..., ::2]
    else:  # rows not on a word boundary
        lo8 = torch.zeros(B * H * P * D + 1, dtype=torch.int8)[1:].view(B, H, P, D)
    assert not tk.score.packed_words(q, lo8, hi8, chan, launch)


@triton_ok
def test_truncated_parts_of_q_are_exact_bf16_parts_of_it():
    # ScoreLaunch.trunc_parts ("mma8" on a GPU): q x channel scale in three bf16 parts by truncation, each exactly a
    # bf16 value, summing exactly to x, the first two the top 8 significant bits of what is left.
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 4096)
    x[:3] = torch.tensor([0.0, -0.0, 1.0 + 2**-23])
    parts = tk.score.truncated_parts_ref(x)
    got = tk.score.truncated_parts(x.to(DEV)).cpu()
    assert torch.equal(got, parts)
    assert all(torch.equal(p.to(torch.bfloat16).float(), p) for p in parts)
    assert torch.equal(parts[0].double() + parts[1].double() + parts[2].double(), x.double())
