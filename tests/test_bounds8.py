"""8-bit page bounds (QuestConfig(bounds="int8") and, where the test is the same, "int8_channel"; triton_kernels/
bounds8.py): the bound never under-estimates q.k, kernels against their twins, and the layer keeps the codes equal to
its exact bounds quantized through every edit. What only the channel scales have: tests/test_bounds8_channel.py."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.eval.accounting import layer_step_bytes, step_bytes
from triton_kernels.bounds8 import empty_bounds8

from .conftest import left_padded_batch, tiny_model
from .testing import DEVICE as DEV
from .testing import F16, F32, nan_empty

triton_ok = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                               reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def quantized(kmin, kmax, chan=None):
    """The 8-bit bounds of every page, by the reference (on channel scales `chan [H_kv, D]` where given)."""
    out = empty_bounds8(*kmin.shape, kmin.device)
    tk.quantize_bounds_ref(kmin, kmax, *out, chan=chan)
    return out


# The two 8-bit settings; the kernel tests give "int8_channel" channel scales smaller than the stored keys need
# (x3 randn keys), so many pages take exponents e > 0.
KINDS = ["int8", "int8_channel"]


def chan_for(kind, H, D, seed):
    if kind == "int8":
        return None
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(H, D, generator=g) * 0.01 + 1e-3).to(DEV)


def with_chan(bounds8, chan):
    """The append kernels' bounds8= tuple: the codes, and the channel scales where there are any."""
    return tuple(bounds8) if chan is None else (*bounds8, chan)


def page_bounds(keys, valid=None):
    """Exact min/max `[B, H, P, D]` of keys `[B, H, P, S, D]` over the valid slots `[B, P, S]` (None: all)."""
    ok = torch.ones(keys.shape[0], *keys.shape[2:4], dtype=torch.bool) if valid is None else valid
    ok = ok[:, None, :, :, None]
    return torch.where(ok, keys, float("inf")).amin(3), torch.where(ok, keys, float("-inf")).amax(3)


# ------------------------------------------------------------------------------------ the bound holds
KEY_KINDS = ["normal", "huge", "tiny", "equal", "negative", "zero", "fp16_extremes", "mixed_scales", "one_spike"]


def adversarial_keys(kind: str, shape, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if kind == "huge":
        x = x * 3e4
    elif kind == "tiny":
        x = x * 1e-6  # fp16 subnormals
    elif kind == "equal":
        x = x[..., :1, :].expand(shape).clone()  # every token of a page the same key
    elif kind == "negative":
        x = -x.abs() - 1.0
    elif kind == "zero":
        x = torch.zeros(shape)
    elif kind == "fp16_extremes":
        choices = torch.tensor([65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1.0])
        x = choices[torch.randint(0, len(choices), shape, generator=g)]
    elif kind == "mixed_scales":  # one channel dominates the scale, the rest are far below one code
        x = x * 1e-3
        x[..., 0] = 3e3
    elif kind == "one_spike":
        x[..., 0, 0] = 6e4
    big = torch.finfo(dtype).max if dtype == F16 else 1e30
    return x.clamp(-big, big).to(dtype)  # finite keys (the contract): fp16 saturates at its largest value


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KEY_KINDS), seed=st.integers(0, 2**31 - 1), S=st.sampled_from([4, 16]),
       D=st.sampled_from([1, 7, 64]), dtype=st.sampled_from([F16, torch.bfloat16, F32]),
       qscale=st.sampled_from([1e-3, 1.0, 1e3]), pad=st.integers(0, 3))
def test_int8_bound_never_under_estimates_the_best_qk_of_a_page(kind, seed, S, D, dtype, qscale, pad):
    B, H, P, G = 1, 2, 3, 2
    keys = adversarial_keys(kind, (B, H, P, S, D), seed, dtype)
    valid = torch.ones(B, P, S, dtype=torch.bool)
    valid[:, 0, :pad] = False  # left padding inside the first page
    kmin, kmax = page_bounds(keys, valid)
    lo8, hi8, scale = quantized(kmin, kmax)
    # The codes enclose the exact bounds as the score kernel computes them: one fp32 product, no tolerance.
    lo, hi = lo8.float() * scale[..., None], hi8.float() * scale[..., None]
    assert (lo <= kmin.float()).all() and (hi >= kmax.float()).all()
    q = (torch.randn(B, H * G, D, generator=torch.Generator().manual_seed(seed + 1)) * qscale).to(dtype)
    assert_scores_bound_the_best_qk(q, keys, valid, kmin, kmax, lo, hi)


def assert_scores_bound_the_best_qk(q, keys, valid, kmin, kmax, lo, hi, chan=None):
    """The 8-bit score (codes quantized from kmin/kmax, on channel scales `chan` where given) of every page of
    `keys [B, H, P, S, D]` is at least its key-dtype score, term by term, and at least the best q.k over the page's
    valid slots but for the fp32 summation of the D terms (`lo`/`hi`: the decoded bounds, for that slack)."""
    B, H, P, S, D = keys.shape
    G = q.shape[1] // H
    L = P * S + 1  # one more slot: the spare page P holds nothing, so every written page is scored
    pad_kmin = torch.cat([kmin, torch.full_like(kmin[:, :, :1], float("inf"))], 2)
    pad_kmax = torch.cat([kmax, torch.full_like(kmax[:, :, :1], float("-inf"))], 2)
    c8 = quantized(pad_kmin, pad_kmax, chan)
    s8 = tk.score_pages_ref(q, c8[0], c8[1], L, S, scale=c8[2], chan=chan)
    s = tk.score_pages_ref(q, pad_kmin, pad_kmax, L, S)
    # Term by term at least the key-dtype bound (rounding is monotonic), which is at least the best q.k.
    assert (s8[..., :P] >= s[..., :P]).all()
    best = torch.einsum("bhgd,bhpsd->bhgps", q.double().reshape(B, H, G, D), keys.double())
    best = best.masked_fill(~valid[:, None, None], float("-inf")).amax(-1).reshape(B, H * G, P)
    slack = 1e-5 * torch.einsum("bhgd,bhpd->bhgp", q.double().abs().reshape(B, H, G, D),
                                torch.maximum(lo.abs(), hi.abs()).double()).reshape(B, H * G, P)
    assert (s8[..., :P].double() >= best - slack).all()  # fp32 summation of the D terms, nothing else


def test_empty_pages_quantize_to_an_empty_marker_and_score_minus_inf():
    kmin = torch.full((1, 1, 3, 8), float("inf"))
    kmax = torch.full((1, 1, 3, 8), float("-inf"))
    kmin[0, 0, 1], kmax[0, 0, 1] = -1.0, 2.0
    lo8, hi8, scale = quantized(kmin, kmax)
    assert (lo8[0, 0, [0, 2]] == 127).all() and (hi8[0, 0, [0, 2]] == -128).all() and (scale[0, 0, [0, 2]] == 0).all()
    q = torch.randn(1, 2, 8)
    s = tk.score_pages_ref(q, lo8, hi8, 33, 16, scale=scale)  # pages 0 (empty), 1, 2 (current: +inf)
    assert (s[..., 0] == float("-inf")).all() and s[..., 1].isfinite().all() and (s[..., 2] == float("inf")).all()


def test_score_refuses_int8_without_a_scale_and_a_scale_on_float_bounds():
    lo8, hi8, scale = empty_bounds8(1, 1, 2, 8, "cpu")
    q = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="int8 bounds .* need their fp32 scale"):
        tk.score_pages_ref(q, lo8, hi8, 16, 16)
    with pytest.raises(ValueError, match="float bounds take none"):
        tk.score_pages_ref(q, lo8.float(), hi8.float(), 16, 16, scale=scale)
    with pytest.raises(ValueError, match="scale must be fp32"):
        tk.score_pages_ref(q, lo8, hi8, 16, 16, scale=scale.half())


# ----------------------------------------------------------------------------------- kernels vs twins
def stored_layer(B, H, D, S, L, C, dtype, seed, pad=()):
    g = torch.Generator().manual_seed(seed)
    keys = torch.zeros(B, H, C, D, dtype=dtype)
    values = torch.zeros_like(keys)
    kmin = torch.full((B, H, C // S, D), float("inf"), dtype=dtype)
    kmax = torch.full_like(kmin, float("-inf"))
    valid = torch.zeros(B, C, dtype=torch.bool)
    vnew = torch.ones(B, L, dtype=torch.bool)
    for b, n in enumerate(pad):
        vnew[b, :n] = False
    k = (torch.randn(B, H, L, D, generator=g) * 3).to(dtype)
    tk.append_kv_ref(keys, values, kmin, kmax, valid, k, k, vnew, 0)
    return [t.to(DEV) for t in (keys, values, kmin, kmax, valid)]


QUANT_CASES = [
    # B, H, D, S, L, dtype, left padding
    pytest.param(1, 1, 64, 16, 1, F32, (), id="len1-fp32"),
    pytest.param(2, 3, 64, 16, 17, F16, (0, 16), id="len17-pad-page-fp16"),
    pytest.param(3, 2, 128, 8, 45, torch.bfloat16, (0, 9, 44), id="len45-S8-bf16"),
    pytest.param(1, 2, 7, 4, 15, F16, (), id="D7-S4"),
]


@triton_ok
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("B,H,D,S,L,dtype,pad", QUANT_CASES)
def test_quantize_kernels_equal_their_twins_bit_for_bit(B, H, D, S, L, dtype, pad, kind):
    C = -(-L // S) * S + 2 * S
    _, _, kmin, kmax, _ = stored_layer(B, H, D, S, L, C, dtype, L, pad)
    P = C // S
    chan = chan_for(kind, H, D, L)
    # Poisoned outputs: a code or scale the kernel does not write is not the reference's.
    mine = [torch.full((B, H, P, D), 55, dtype=torch.int8, device=DEV), torch.full((B, H, P, D), -55, dtype=torch.int8,
            device=DEV), torch.full((B, H, P), float("nan"), device=DEV)]
    ref = [t.clone() for t in mine]
    tk.quantize_bounds(kmin, kmax, *mine, 1, P - 1, chan=chan)
    tk.quantize_bounds_ref(kmin, kmax, *ref, 1, P - 1, chan=chan)
    for a, b in zip(mine, ref):
        assert torch.equal(a[:, :, 1:], b[:, :, 1:]) and not a[:, :, 1:].isnan().any()
        torch.testing.assert_close(a[:, :, :1], b[:, :, :1], atol=0, rtol=0, equal_nan=True)  # page 0 untouched
    pos = torch.tensor(L, device=DEV)
    tk.quantize_bounds_at(kmin, kmax, *mine, pos, S, chan=chan)  # the page holding slot L - 1 (page 0 when L <= S)
    tk.quantize_bounds_at_ref(kmin, kmax, *ref, pos, S, chan=chan)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
    full = quantized(kmin, kmax, chan)
    if chan is not None:
        assert full[2].max() > 1  # some page did take an exponent
    page = (L - 1) // S
    for a, b in zip(mine, full):
        assert torch.equal(a[:, :, page], b[:, :, page])


@triton_ok
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("B,H,D,S,L,dtype,pad", QUANT_CASES)
def test_append_kernels_requantize_the_pages_they_write_as_their_twins(B, H, D, S, L, dtype, pad, kind):
    # The decode append writes the page's codes in its own launch (USE_BOUNDS8): they must equal the reference's
    # and the codes of the exact bounds, after a multi-token append (mid-page start) and one-token appends.
    steps = S + 3
    C = -(-(L + steps) // S) * S + S
    g = torch.Generator().manual_seed(L)
    base = [torch.zeros(B, H, C, D, dtype=dtype), torch.zeros(B, H, C, D, dtype=dtype),
            torch.full((B, H, C // S, D), float("inf"), dtype=dtype), torch.full((B, H, C // S, D), float("-inf"),
            dtype=dtype), torch.zeros(B, C, dtype=torch.bool)]
    ref, mine = [t.to(DEV) for t in base], [t.clone().to(DEV) for t in base]
    ref8 = list(empty_bounds8(B, H, C // S, D, DEV))
    mine8 = [t.clone() for t in ref8]  # pages never written stay empty in both
    chan = chan_for(kind, H, D, L + 1)
    k = (torch.randn(B, H, L, D, generator=g) * 3).to(dtype).to(DEV)
    vnew = torch.ones(B, L, dtype=torch.bool, device=DEV)
    for b, n in enumerate(pad):
        vnew[b, :n] = False
    cut = L // 2
    for lo, hi in ((0, cut), (cut, L)):
        tk.append_kv_ref(*ref, k[:, :, lo:hi], k[:, :, lo:hi], vnew[:, lo:hi], lo, bounds8=with_chan(ref8, chan))
        tk.append_kv(*mine, k[:, :, lo:hi], k[:, :, lo:hi], vnew[:, lo:hi], lo, bounds8=with_chan(mine8, chan))
    pos = torch.tensor(L, device=DEV)
    for i in range(steps):  # every other token 100x larger: on channel scales, pages past their range
        k1 = (torch.randn(B, H, 1, D, generator=g) * (3 if i % 2 else 300)).to(dtype).to(DEV)
        tk.append_token_at_ref(*ref, k1, k1, None, pos, bounds8=with_chan(ref8, chan))
        tk.append_token_at(*mine, k1, k1, None, pos, bounds8=with_chan(mine8, chan))
        pos += 1
    for a, b in zip(mine + mine8, ref + ref8):
        assert torch.equal(a, b)
    for a, b in zip(mine8, quantized(mine[2], mine[3], chan)):
        assert torch.equal(a, b)


SCORE_CASES = [
    # B, H_kv, G, D, S, L, reduce, left padding, beams' page table
    pytest.param(1, 1, 1, 64, 16, 1, "none", (), False, id="len1-mha"),
    pytest.param(2, 2, 3, 64, 16, 15, "none", (0, 7), False, id="len15-pad-gqa3"),
    pytest.param(2, 2, 4, 128, 16, 17, "max", (0, 16), False, id="len17-max-wholepage"),
    pytest.param(3, 1, 8, 64, 8, 45, "sum", (), True, id="len45-S8-sum-rows"),
    pytest.param(2, 3, 4, 64, 16, 4097, "none", (0, 100), True, id="len4097-rows"),
]


@triton_ok
@pytest.mark.parametrize("mma", [None, False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("B,H,G,D,S,L,reduce,pad,beams", SCORE_CASES)
def test_int8_score_kernel_matches_its_twin(B, H, G, D, S, L, reduce, pad, beams, kind, mma, monkeypatch):
    C = -(-L // S) * S + S
    _, _, kmin, kmax, _ = stored_layer(B, H, D, S, L, C, F16, L, pad)
    chan = chan_for(kind, H, D, L)
    lo8, hi8, scale = quantized(kmin, kmax, chan)
    q = torch.randn(B, H * G, D, device=DEV).half()
    pos = torch.tensor(L, device=DEV)
    rows = torch.randint(0, B, (B, C // S), dtype=torch.int32, device=DEV) if beams else None
    kw = dict(pos=pos, rows=rows, scale=scale, chan=chan)
    want = tk.score_pages_ref(q, lo8, hi8, C, S, 0, reduce, **kw)
    launch = tk.score.ScoreLaunch(mma=mma)
    # The codes' tensor-core form (two products over bf16 parts of q x channel scales, stacked as rows): GQA by default.
    assert tk.score_form(q, lo8, scale, launch) == ("mma8" if mma or (mma is None and G > 1) else "elementwise")
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    got = tk.score_pages(q, lo8, hi8, C, S, 0, reduce, launch=launch, **kw)
    assert not got.isnan().any()
    fin = want.isfinite()
    assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin])
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-5)
    # The codes read half the bytes of the fp16 bounds and score at least as high (an upper bound of them).
    exact = tk.score_pages_ref(q, kmin, kmax, C, S, 0, reduce, pos=pos, rows=rows)
    assert (want[fin] >= exact[fin]).all()
    assert lo8.element_size() * 2 == kmin.element_size()


# -------------------------------------------------------------------------------------- the layer
def assert_codes_match(layer):
    """The layer's codes are its exact bounds quantized (on its channel scales, if it has them), on every page of the
    allocation."""
    assert layer.kmin8 is not None and (layer.kchan is not None) == (layer.config.bounds == "int8_channel")
    for a, b in zip((layer.kmin8, layer.kmax8, layer.kscale), quantized(layer.kmin, layer.kmax, layer.kchan)):
        assert torch.equal(a, b)


@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
def test_layer_keeps_the_codes_through_growth_crop_beams_batch_edits_and_reset(kind, single_thread):
    model = tiny_model("llama", heads=4, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(45, 30))
    patch_model(model, budget=32, page_size=8, dense_layers=1, bounds=kind, backend="torch")
    cache = QuestCache.from_model(model)  # grows when driven by hand
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.layers[-1]
    assert_codes_match(layer)
    first = layer.allocations
    m = mask
    tok = out.logits[:, -1].argmax(-1)
    for _ in range(layer.max_tokens - layer.seq_len + 3):  # past the first allocation
        m = torch.cat([m, m.new_ones(2, 1)], 1)
        tok = model(input_ids=tok[:, None], attention_mask=m, past_key_values=cache).logits[:, -1].argmax(-1)
    assert layer.allocations > first
    assert_codes_match(layer)
    cache.crop(-13)
    assert_codes_match(layer)
    cache.reorder_cache(torch.tensor([1, 1]))  # beams: a page table, the partial page privatised
    assert layer.rows is not None
    assert_codes_match(layer)
    layer._materialize()
    assert_codes_match(layer)
    cache.batch_repeat_interleave(2)
    assert layer.kmin8.shape[0] == 4
    assert_codes_match(layer)
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert_codes_match(layer)
    copy = cache.copy()
    assert copy.layers[-1].kmin8 is not layer.kmin8
    assert_codes_match(copy.layers[-1])
    layer.reset()
    assert_codes_match(layer)
    assert (layer.kmin8 == 127).all() and (layer.kscale == 0).all()


@torch.no_grad()
def test_a_copy_under_another_bounds_setting_builds_or_drops_the_codes(single_thread):
    model = tiny_model("llama")
    ids, mask = left_padded_batch()
    patch_model(model, budget=32, dense_layers=1, backend="torch")
    cache = QuestCache.from_model(model)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.layers[-1].kmin8 is None
    int8 = cache.copy(QuestConfig(budget=32, dense_layers=1, backend="torch", bounds="int8"))
    assert_codes_match(int8.layers[-1])
    back = int8.copy(QuestConfig(budget=32, dense_layers=1, backend="torch"))
    assert back.layers[-1].kmin8 is None


def _rule_on_codes_hook(cache_of, chosen):
    """Each sparse selection equals the paper's rule on the exact length, scored on the layer's 8-bit bounds."""
    def hook(layer_idx, q, ids):
        layer = cache_of[0].layers[layer_idx]
        L, S = layer.seq_len, layer.page_size
        layer._materialize()  # the rule reads each sequence's own rows
        G = q.shape[1] // layer.kmin.shape[1]
        lo8, hi8, scale = quantized(layer.kmin, layer.kmax, layer.kchan)
        ref = tk.topk_pages_ref(tk.score_pages_ref(q, lo8, hi8, L, S, scale=scale, chan=layer.kchan),
                                layer.config.num_pages, G)
        got = [set(r.tolist()) - {-1} for r in ids.flatten(0, 1)]
        assert got == [set(r.tolist()) - {-1} for r in ref.flatten(0, 1)]
        chosen.append(sum(map(len, got)))
    return hook


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_ok)])
def test_small_budget_reads_the_pages_the_rule_picks_on_the_codes(backend, kind, single_thread):
    # Left padding: all-padding pages must score -inf (never chosen), or the sets differ from the exact-length rule.
    model = tiny_model("llama", heads=8, kv_heads=2, layers=2 if backend == "triton" else 3)
    ids, mask = left_padded_batch(lengths=(70, 33))
    patch_model(model, budget=32, page_size=8, dense_layers=1, bounds=kind, backend=backend)
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + 8)
    chosen = []
    cache.selection_hooks.append(_rule_on_codes_hook([cache], chosen))
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert len(chosen) == 7 * (len(cache.layers) - 1) and min(chosen) > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("beams", [1, 3])
def test_covering_budget_with_int8_bounds_gives_the_unpatched_tokens(beams, kind, single_thread):
    # The allocation is far larger than the budget's pages, so every step selects (the dense shortcut never runs):
    # the written pages must all be chosen, the empty ones never, left padding and beams included.
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(45, 38))
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=beams, output_scores=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    patch_model(model, budget=128, page_size=8, dense_layers=0, bounds=kind, backend="torch")
    cache = QuestCache.from_model(model, max_length=400)
    seen = []
    cache.selection_hooks.append(lambda i, q, page_ids: seen.append(i))
    out = model.generate(ids, past_key_values=cache, **kw)
    assert len(seen) == 9 * 4 and cache.layers[0].kmin8 is not None
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_config_validates_bounds():
    assert QuestConfig().bounds == "key_dtype"
    with pytest.raises(ValueError, match="unknown bounds 'fp8'; choose 'key_dtype'"):
        QuestConfig(bounds="fp8")
    cfg = QuestConfig(bounds="int8", policy="qcode1_2s", page_size=32)  # the selector's rule: checked when bound
    with pytest.raises(ValueError, match="bounds='int8' is read by policy 'quest' only; policy 'qcode1_2s'"):
        QuestCache(cfg, 2)
    with pytest.raises(ValueError, match="is read by policy 'quest' only"):
        patch_model(tiny_model("llama"), config=cfg)


def test_accounting_counts_the_8bit_metadata():
    L, H, D, S, elt = 8192, 8, 128, 16, 2
    fp16 = step_bytes("quest", L, H, D, elt, S, pages_read=100, budget=512)
    int8 = step_bytes("quest", L, H, D, elt, S, pages_read=100, budget=512, bounds="int8")
    pages = L // S * H
    assert fp16 - int8 == pages * (2 * D * elt - (2 * D + 4))
    cfg = QuestConfig(budget=512, bounds="int8")
    assert layer_step_bytes(cfg, 5, L, H, D, elt, pages_read=100) == int8
