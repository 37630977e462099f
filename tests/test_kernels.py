"""Triton launchers vs their PyTorch reference twins (small odd sizes; CPU: TRITON_INTERPRET=1, set by conftest).

The interpreter is never switched on here: pytest imports this module even when `-m gpu` deselects it, and on a
GPU machine that would put every later Triton compile (torch.compile's kernels too) under the interpreter."""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from triton_kernels import sparse_attention as attn_mod  # noqa: E402

from .testing import BF16, F16, F32, assert_close, nan_empty  # noqa: E402
from .testing import DEVICE as DEV  # noqa: E402


def empty_layer(B, H, C, D, S, dtype, g):
    """A layer with garbage (never zero) K/V and metadata in unwritten slots, as torch.empty would leave."""
    kc = torch.randn(B, H, C, D, generator=g).to(dtype) * 100
    vc = torch.randn(B, H, C, D, generator=g).to(dtype) * 100
    kmin = torch.randn(B, H, C // S, D, generator=g).to(dtype)
    kmax = torch.randn(B, H, C // S, D, generator=g).to(dtype)
    valid = torch.zeros(B, C, dtype=torch.bool)
    return [t.to(DEV) for t in (kc, vc, kmin, kmax, valid)]


def recompute_meta(kc, valid, S, filled):
    B, H, C, D = kc.shape
    keys = kc.float().reshape(B, H, C // S, S, D)
    ok = (valid & (torch.arange(C, device=kc.device) < filled)).reshape(B, 1, C // S, S, 1)
    lo = torch.where(ok, keys, float("inf")).amin(3).to(kc.dtype)
    hi = torch.where(ok, keys, float("-inf")).amax(3).to(kc.dtype)
    return lo, hi


def filled_layer(B, H, D, S, L, dtype, seed, pad=(), C=None):
    """Prefill L tokens through append_kv_ref; row b has pad[b] leading padding tokens."""
    g = torch.Generator().manual_seed(seed)
    C = C or -(-L // S) * S + S
    layer = empty_layer(B, H, C, D, S, dtype, g)
    kn = torch.randn(B, H, L, D, generator=g).to(dtype).to(DEV)
    vn = torch.randn(B, H, L, D, generator=g).to(dtype).to(DEV)
    vnew = torch.ones(B, L, dtype=torch.bool, device=DEV)
    for b, n in enumerate(pad):
        vnew[b, :n] = False
    tk.append_kv_ref(*layer, kn, vn, vnew, 0)
    return layer


# ----------------------------------------------------------------------------------------------- append
APPEND_CASES = [
    # B, H, D, S, prefill T, decode steps, dtype, left padding per row
    pytest.param(1, 1, 64, 16, 1, 3, F32, (), id="len1-fp32"),
    pytest.param(2, 3, 64, 16, 15, 2, F16, (0, 7), id="len15-pad-fp16"),
    pytest.param(2, 2, 128, 16, 17, 17, BF16, (3, 16), id="len17-pad-wholepage-bf16"),
    pytest.param(3, 2, 64, 8, 45, 20, F16, (0, 9, 44), id="len45-S8-3rows-fp16"),
    pytest.param(1, 2, 64, 32, 70, 1, F32, (), id="len70-S32-fp32"),
]


@pytest.mark.parametrize("B,H,D,S,T,steps,dtype,pad", APPEND_CASES)
def test_append_matches_reference_and_recomputed_metadata(B, H, D, S, T, steps, dtype, pad):
    g = torch.Generator().manual_seed(T)
    C = -(-(T + steps) // S) * S + S
    mine = empty_layer(B, H, C, D, S, dtype, g)
    ref = [t.clone() for t in mine]
    kn = torch.randn(B, H, T, D, generator=g).to(dtype).to(DEV)
    vn = torch.randn(B, H, T, D, generator=g).to(dtype).to(DEV)
    vnew = torch.ones(B, T, dtype=torch.bool, device=DEV)
    for b, n in enumerate(pad):
        vnew[b, :n] = False
    # A chunked prefill (second chunk starts mid-page), then single-token decode steps.
    cut = T // 2
    for lo, hi in ((0, cut), (cut, T)):
        tk.append_kv(*mine, kn[:, :, lo:hi], vn[:, :, lo:hi], vnew[:, lo:hi], lo)
        tk.append_kv_ref(*ref, kn[:, :, lo:hi], vn[:, :, lo:hi], vnew[:, lo:hi], lo)
    for t in range(T, T + steps):
        k1 = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEV)
        v1 = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEV)
        tk.append_kv(*mine, k1, v1, None, t)
        tk.append_kv_ref(*ref, k1, v1, None, t)
    for name, a, b in zip(("k_cache", "v_cache", "kmin", "kmax", "valid"), mine, ref):
        assert torch.equal(a, b), f"{name} differs from the reference"
    kc, _, kmin, kmax, valid = mine
    filled = T + steps
    P = -(-filled // S)
    lo, hi = recompute_meta(kc, valid, S, filled)
    assert torch.equal(kmin[:, :, :P], lo[:, :, :P]) and torch.equal(kmax[:, :, :P], hi[:, :, :P])
    # Padding never enters min/max: a row padded over a whole page keeps that page empty.
    for b, n in enumerate(pad):
        for p in range(n // S):
            assert torch.isinf(kmin[b, :, p]).all() and (kmin[b, :, p] > 0).all() and (kmax[b, :, p] < 0).all()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_append_token_at_device_position_matches_append_kv(dtype):
    # The captured decode's append: one token at a device position, padded rows, page boundaries crossed, and
    # stale bounds (garbage, as after a crop) in the page a write opens — both twins must ignore them.
    B, H, D, S, T0 = 3, 2, 64, 8, 13
    g = torch.Generator().manual_seed(7)
    mine = filled_layer(B, H, D, S, T0, dtype, seed=3, pad=(0, 5, 12), C=48)
    ref, via_ref = [t.clone() for t in mine], [t.clone() for t in mine]
    pos = torch.tensor(T0, device=DEV)
    for t in range(T0, 30):
        k1 = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEV)
        v1 = torch.randn(B, H, 1, D, generator=g).to(dtype).to(DEV)
        vnew = torch.tensor([[True], [t % 3 != 0], [True]], device=DEV)
        tk.append_token_at(*mine, k1, v1, vnew, pos)
        tk.append_token_at_ref(*via_ref, k1, v1, vnew, pos)
        tk.append_kv_ref(*ref, k1, v1, vnew, t)
        pos += 1
    for name, a, b, c in zip(("k_cache", "v_cache", "kmin", "kmax", "valid"), mine, via_ref, ref):
        n = 30 if name in ("k_cache", "v_cache", "valid") else -(-30 // S)
        a, b, c = (x[:, :n] if name == "valid" else x[:, :, :n] for x in (a, b, c))
        assert torch.equal(a, c) and torch.equal(b, c), f"{name} differs"
    with pytest.raises(ValueError, match="one token"):
        tk.append_token_at(*mine, k1.expand(B, H, 2, D), v1.expand(B, H, 2, D), None, pos)
    with pytest.raises(ValueError, match="pos must be"):
        tk.append_token_at(*mine, k1, v1, None, pos.float())
    with pytest.raises(ValueError, match="ticket must be"):
        tk.append_token_at(*mine, k1, v1, None, pos, ticket=torch.zeros(1, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("B,H", [(3, 2), (1, 1)])
def test_append_token_at_with_a_ticket_advances_the_position_in_its_launch(B, H):
    # The captured decode's append advances the device position itself (one kernel a layer fewer): the same writes
    # as the caller's `pos += 1` after it, the position one further after each launch, the ticket back to 0.
    D, S, T0 = 32, 8, 5
    g = torch.Generator().manual_seed(11)
    plain = filled_layer(B, H, D, S, T0, F16, seed=5, C=40)
    ticked, ticked_ref = [t.clone() for t in plain], [t.clone() for t in plain]
    pos, pos_t, pos_r = (torch.tensor(T0, device=DEV) for _ in range(3))
    ticket, ticket_r = tk.append_ticket(DEV), tk.append_ticket(DEV)
    for t in range(T0, 20):
        k1 = torch.randn(B, H, 1, D, generator=g).to(F16).to(DEV)
        v1 = torch.randn(B, H, 1, D, generator=g).to(F16).to(DEV)
        tk.append_token_at(*plain, k1, v1, None, pos)
        pos += 1
        tk.append_token_at(*ticked, k1, v1, None, pos_t, ticket=ticket)
        tk.append_token_at_ref(*ticked_ref, k1, v1, None, pos_r, ticket=ticket_r)
        assert int(pos_t) == int(pos_r) == t + 1 and int(ticket) == 0 and int(ticket_r) == 0
    for a, b, c in zip(plain, ticked, ticked_ref):
        assert torch.equal(a, b) and torch.equal(a, c)


# ------------------------------------------------------------------------------------------------ score
SCORE_CASES = [
    # B, H_q, H_kv, D, S, L, window_start, reduce, dtype, padding
    pytest.param(1, 1, 1, 64, 16, 1, 0, "none", F32, (), id="len1"),
    pytest.param(2, 3, 1, 64, 16, 15, 0, "none", F16, (0, 4), id="len15-G3"),
    pytest.param(2, 4, 1, 128, 16, 17, 5, "max", BF16, (0, 16), id="len17-G4-max-emptypage"),
    pytest.param(2, 8, 1, 64, 16, 100, 33, "sum", F16, (40, 0), id="len100-G8-sum-window"),
    pytest.param(1, 6, 2, 128, 16, 4097, 1000, "none", F16, (), id="len4097-G3-window"),
    pytest.param(3, 4, 4, 64, 8, 77, 0, "max", F32, (0, 20, 76), id="len77-G1-S8-max"),
]


@pytest.mark.parametrize("mma", [None, True, False])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,ws,reduce,dtype,pad", SCORE_CASES)
def test_score_matches_reference(B, Hq, Hkv, D, S, L, ws, reduce, dtype, pad, mma):
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=L, pad=pad)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    launch = tk.score.ScoreLaunch(mma=mma)
    form = tk.score_form(q, kmin, launch=launch)
    # The tensor-core form: float bounds in q's 16-bit dtype; by default only for a group of 2+ query heads.
    assert form == ("mma" if dtype != F32 and mma is not False and (mma or Hq > Hkv) else "elementwise")
    got = tk.score_pages(q, kmin, kmax, L, S, ws, reduce, launch=launch)
    want = tk.score_pages_ref(q, kmin, kmax, L, S, ws, reduce)
    assert got.dtype == torch.float32 and got.shape == want.shape
    inf = ~want.isfinite()
    assert torch.equal(got[inf], want[inf]) and got[~inf].isfinite().all()
    if (ws >= S or any(n >= S for n in pad)) and L > S:  # the case holds dead pages: make sure they are tested
        assert (want == float("-inf")).any()
    assert_close(got[~inf], want[~inf], F32)


HALF_WORD_CASES = [
    # B, H, D, S, L, window_start, dtype, padding, beams' page table
    pytest.param(1, 1, 64, 16, 20, 0, F16, (), False, id="len20-fp16"),
    pytest.param(2, 3, 128, 16, 4097, 1000, BF16, (0, 100), True, id="len4097-bf16-window-pad-rows"),
    pytest.param(3, 2, 64, 8, 77, 0, F16, (0, 20, 76), True, id="len77-S8-fp16-pad-rows"),
]


@pytest.mark.parametrize("B,H,D,S,L,ws,dtype,pad,beams", HALF_WORD_CASES)
def test_score_packed_bounds_as_the_element_path_and_the_twin(B, H, D, S, L, ws, dtype, pad, beams, monkeypatch):
    # ScoreLaunch.packed_bounds: MHA rows over 16-bit float bounds read 2 channels a 32-bit word and take each
    # channel's bound by q's sign. The same products as the element path; sums fused (rounding only).
    kc, vc, kmin, kmax, valid = filled_layer(B, H, D, S, L, dtype, seed=L, pad=pad)
    C = kc.shape[2]
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    q[:, :, :3] = 0.0  # q = 0 takes either bound
    rows = torch.randint(0, B, (B, C // S), dtype=torch.int32, device=DEV) if beams else None
    kw = dict(pos=torch.tensor(L, device=DEV), rows=rows)
    launch = tk.score.ScoreLaunch(packed_bounds=True)
    assert tk.score.packed_halves(q, kmin, kmax, None, launch) and tk.score.word_form(q, kmin, kmax, None, None, launch) == 2
    want = tk.score_pages_ref(q, kmin, kmax, C, S, ws, "none", **kw)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    got = tk.score_pages(q, kmin, kmax, C, S, ws, "none", launch=launch, **kw)
    elem = tk.score_pages(q, kmin, kmax, C, S, ws, "none", **kw)
    fin = want.isfinite()
    assert fin.any() and (~fin).any() and not got.isnan().any()
    assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin])
    assert_close(got[fin], want[fin], F32)
    assert_close(got[fin], elem[fin], F32)


@pytest.mark.parametrize("what", ["off", "gqa", "fp32", "scale", "mma", "odd_d", "strided", "offset"])
def test_score_packed_bounds_decline_where_they_do_not_apply(what):
    B, H, P, D = 1, 2, 4, 64
    kmin = torch.zeros(B, H, P, D, dtype=F16)
    kmax, q, scale = kmin.clone(), torch.zeros(B, H, D, dtype=F16), None
    launch = tk.score.ScoreLaunch(packed_bounds=True)
    assert tk.score.packed_halves(q, kmin, kmax, None, launch)
    if what == "off":
        launch = tk.score.ScoreLaunch()
    elif what == "gqa":
        q = torch.zeros(B, 2 * H, D, dtype=F16)
    elif what == "fp32":
        kmin, kmax, q = kmin.float(), kmax.float(), q.float()
    elif what == "scale":  # 8-bit codes take packed_codes instead
        scale = torch.ones(B, H, P)
    elif what == "mma":  # the tensor-core form, asked for at MHA
        launch = tk.score.ScoreLaunch(packed_bounds=True, mma=True)
    elif what == "odd_d":
        kmin, kmax, q = kmin[..., :63], kmax[..., :63], q[..., :63]
    elif what == "strided":
        kmin = torch.zeros(B, H, P, 2 * D, dtype=F16)[..., ::2]
    else:  # rows not on a word boundary
        kmin = torch.zeros(B * H * P * D + 1, dtype=F16)[1:].view(B, H, P, D)
    assert not tk.score.packed_halves(q, kmin, kmax, scale, launch)


@pytest.mark.parametrize("reduce", ["none", "max", "sum"])
def test_score_forces_the_device_position_page(reduce):
    # The captured step scores the whole capacity; the page holding position pos - 1 is forced in the kernel.
    B, Hq, Hkv, D, S, L = 2, 4, 2, 64, 16, 90
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, F16, seed=2, pad=(0, 20))
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(3)).to(F16).to(DEV)
    C = kc.shape[2]
    plain = tk.score_pages_ref(q, kmin, kmax, C, S, 0, reduce)
    for pos in (1, 40, 90):
        p = torch.tensor(pos, device=DEV)
        got = tk.score_pages(q, kmin, kmax, C, S, 0, reduce, pos=p)
        want = tk.score_pages_ref(q, kmin, kmax, C, S, 0, reduce, pos=p)
        cur = (pos - 1) // S
        assert (got[..., cur] == float("inf")).all() and (got[..., -1] == float("inf")).all()
        other = torch.ones(got.shape[-1], dtype=torch.bool)
        other[[cur, -1]] = False
        assert torch.equal(want[..., other], plain[..., other])  # nothing else changes
        inf = ~want.isfinite()
        assert torch.equal(got[inf], want[inf])
        assert_close(got[~inf], want[~inf], F32)
    with pytest.raises(ValueError, match="pos must be one integer"):
        tk.score_pages(q, kmin, kmax, C, S, 0, reduce, pos=torch.tensor([1, 2], device=DEV))


# ------------------------------------------------------------------------------------------------- topk
def random_scores(B, R, P, seed, ties=False, dead=0.2):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, R, P, generator=g) * 10
    if ties:
        s = s.round()  # many equal scores, the k-th among them
    # Dead pages are dead for every query head (as empty/out-of-window pages are), so the union cannot hide
    # a wrongly chosen one.
    s.masked_fill_(torch.rand(B, 1, P, generator=g) < dead, float("-inf"))
    s[..., -1] = float("inf")
    return s.to(DEV)


TOPK_CASES = [
    # B, R, P, k, group, ties, share of -inf pages
    pytest.param(1, 1, 1, 1, 1, False, 0.2, id="P1"),
    pytest.param(2, 3, 15, 4, 1, False, 0.2, id="P15-k4"),
    pytest.param(2, 4, 17, 100, 4, False, 0.2, id="P17-k>=P-union4"),
    pytest.param(1, 6, 300, 20, 3, False, 0.2, id="P300-union3"),
    pytest.param(2, 8, 700, 33, 8, False, 0.2, id="P700-union8"),
    pytest.param(1, 2, 3000, 128, 1, False, 0.2, id="P3000-tiled"),
    pytest.param(2, 3, 257, 40, 1, True, 0.2, id="P257-ties"),
    pytest.param(1, 2, 2500, 300, 1, True, 0.2, id="P2500-ties-tiled"),
    pytest.param(1, 2, 8192, 128, 1, True, 0.5, id="P8192-ties-halfdead"),
    pytest.param(1, 4, 8192, 128, 4, False, 0.2, id="P8192-union4-tiled"),
    pytest.param(2, 1, 8191, 1000, 1, False, 0.95, id="P8191-k>live"),
]


@pytest.mark.parametrize("B,R,P,k,group,ties,dead", TOPK_CASES)
def test_topk_matches_reference(B, R, P, k, group, ties, dead):
    s = random_scores(B, R, P, seed=P + k, ties=ties, dead=dead)
    got = tk.topk_pages(s, k, group)
    want = tk.topk_pages_ref(s, k, group)
    assert got.dtype == torch.int32 and got.shape == want.shape == (B, R // group, min(group * k, P))
    live = got >= 0
    # Valid ids first, strictly ascending, then only -1.
    assert torch.equal(live, live.cummin(-1).values), "-1 before a chosen id"
    ids = got.long().clamp(min=0)
    assert ((ids[..., 1:] > ids[..., :-1]) | ~live[..., 1:]).all(), "ids not strictly ascending"
    rows = s.view(B, R // group, group, P)
    if not ties:
        assert torch.equal(got, want)
        return
    assert group == 1
    # Ties may be broken any way: same -1 count, and the same multiset of chosen scores per row.
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    def pick(x):
        return torch.where(x >= 0, rows[:, :, 0].gather(-1, x.long().clamp(min=0)), 0.0).sort(-1).values

    assert torch.equal(pick(got), pick(want))
    assert not torch.isneginf(rows[:, :, 0].gather(-1, ids))[live].any(), "a -inf page was chosen"
    # Ties go to the lowest page ids: every tied page left out has a higher id than every tied page chosen.
    for b in range(B):
        for r in range(R):
            row, chosen = s[b, r], got[b, r][live[b, r]].long()
            if len(chosen) < min(k, P):
                continue
            thr = row[chosen].min()
            tied = (row == thr).nonzero().flatten()
            taken = tied[torch.isin(tied, chosen)]
            left = tied[~torch.isin(tied, chosen)]
            assert len(left) == 0 or len(taken) == 0 or taken.max() < left.min()


def _adversarial_rows(kind, B, R, P, k, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, R, P, generator=g)
    if kind == "ties":
        s = s.round()
    elif kind == "negative":
        s = -s.abs()
    elif kind == "denormal":
        s = s * 1e-40  # the row's span is denormal: its scale overflows
    elif kind == "huge-spread":
        s[..., ::2] *= 3e38  # the span overflows fp32
    elif kind == "inf-beyond-k":
        s[..., : k + 3] = float("inf")  # the k-th pick is an +inf page
    elif kind == "all-equal":
        s = torch.full_like(s, 0.25)
    elif kind == "close":  # thousands of distinct scores inside one 16-bit rank bucket of the row's range
        s = 1.0 + torch.randint(0, 64, (B, R, P), generator=g) * 2.0 ** -23
        s[..., 0] = 1e6
    s.masked_fill_(torch.rand(B, 1, P, generator=g) < 0.2, float("-inf"))
    s[..., -1] = float("inf")
    return s.to(DEV)


@pytest.mark.parametrize("kind", ["ties", "negative", "denormal", "huge-spread", "inf-beyond-k", "all-equal", "close"])
@pytest.mark.parametrize("rank_bits", [2, 16])
@pytest.mark.parametrize("B,R,P,k,group,split", [(2, 4, 300, 20, 1, True), (1, 4, 257, 33, 4, True),
                                                 (1, 4, 257, 33, 4, False)])
def test_topk_ranked_search_chooses_the_32_bit_searchs_pages(kind, rank_bits, B, R, P, k, group, split):
    # Ranking by quantised scores first must give exactly the pages (ties: lowest ids) of the search over the
    # scores' own bits; rank_bits=2 puts the k-th pick inside a shared bucket nearly always (the exact bucket search).
    from triton_kernels import topk as topk_mod

    s = _adversarial_rows(kind, B, R, P, k, seed=P + rank_bits)
    ranked = tk.topk_pages(s.clone(), k, group, launch=topk_mod.TopKLaunch(rank_bits=rank_bits, split_union=split))
    plain = tk.topk_pages(s.clone(), k, group, launch=topk_mod.TopKLaunch(rank_bits=0, split_union=split))
    assert torch.equal(ranked, plain)
    if group == 1:  # (a union's size depends on how each row broke its ties, which the reference does its own way)
        want = tk.topk_pages_ref(s, k, group)
        assert torch.equal((ranked < 0).sum(-1), (want < 0).sum(-1))
        chosen = s.gather(-1, ranked.long().clamp(min=0)).masked_fill(ranked < 0, 0.0).sort(-1).values
        best = s.gather(-1, want.long().clamp(min=0)).masked_fill(want < 0, 0.0).sort(-1).values
        assert torch.equal(chosen, best)  # the same scores chosen


def test_topk_launch_rejects_odd_rank_bits():
    from triton_kernels import topk as topk_mod

    with pytest.raises(ValueError, match="rank_bits must be 0 or even"):
        topk_mod.TopKLaunch(rank_bits=15)


@pytest.mark.parametrize("B,R,P,k,group,ties", [(1, 4, 700, 40, 4, False), (2, 2, 1000, 300, 1, True),
                                                 (1, 3, 333, 333, 3, False)])
def test_topk_tiled_path_matches_reference(B, R, P, k, group, ties, monkeypatch):
    # Rows longer than one register tile loop over tiles on every pass (128K-token unions on a GPU).
    from triton_kernels import topk as topk_mod

    launch = topk_mod.TopKLaunch(max_tile=256)
    assert not topk_mod.launch_config(P, group, launch)[2]
    s = random_scores(B, R, P, seed=P, ties=ties)
    got, want = tk.topk_pages(s, k, group, launch=launch), tk.topk_pages_ref(s, k, group)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    if ties:  # lowest ids among the ties: compare against a stable sort by (-score, id)
        order = torch.sort(-s, dim=-1, stable=True).indices[..., :k]
        exp = torch.where(torch.isneginf(s.gather(-1, order)), P, order).sort(-1).values
        assert torch.equal(got.long(), torch.where(exp < P, exp, -1))
    else:
        assert torch.equal(got, want)


TAIL_KINDS = ["ties", "negative", "denormal", "inf-beyond-k", "all-equal", "close", "ties-in-tail"]
# Every adversarial kind on the captured decode's rows (2053 pages) and one short row; three kinds on the other paths.
TAIL_CASES = [(kind, *case) for case in [(2, 3, 300, 20, 1, "one"), (1, 4, 2053, 129, 4, "split"),
                                         (1, 2, 2053, 129, 1, "one")] for kind in TAIL_KINDS] + \
    [(kind, *case) for case in [(1, 4, 257, 33, 4, "split"), (1, 4, 257, 33, 4, "one"), (1, 4, 300, 40, 4, "serial"),
                                (2, 2, 300, 40, 1, "mask"), (1, 4, 300, 33, 4, "mask"), (1, 2, 300, 40, 1, "rank0")]
     for kind in ("ties-in-tail", "denormal", "inf-beyond-k")]


@pytest.mark.parametrize("kind,B,R,P,k,group,how", TAIL_CASES)
def test_topk_tail_tile_gives_the_one_tiles_ids(kind, B, R, P, k, group, how):
    # TopKLaunch(tail_tile): a row just past a power of two as that tile plus a tail tile, the same ids as the one
    # widened tile (ties to the lowest ids across both tiles), every path: one launch, split union (serial and
    # chunked pass 2), mask_rest, the 32-bit search.
    from triton_kernels import topk as topk_mod

    s = _adversarial_rows("ties" if kind == "ties-in-tail" else kind, B, R, P, k, seed=P + k)
    if kind == "ties-in-tail":  # the k-th score shared by pages on both sides of the tile's edge
        block = 1 << (P.bit_length() - 1)
        s[..., block - 40: P - 1] = 0.5
    base = dict(split_union=how != "one", rank_bits=0 if how == "rank0" else 16,
                chunked_union_min_pages=None if how == "serial" else 2048)
    plain, tail = topk_mod.TopKLaunch(**base, tail_tile=0), topk_mod.TopKLaunch(**base, tail_tile=64)
    assert topk_mod.tail_config(P, group, tail)[0] and not topk_mod.tail_config(P, group, plain)[0]
    mask = how == "mask"
    s_plain, s_tail = s.clone(), s.clone()
    want = tk.topk_pages(s_plain, k, group, mask_rest=mask, launch=plain)
    got = tk.topk_pages(s_tail, k, group, mask_rest=mask, launch=tail)
    assert torch.equal(got, want)
    assert torch.equal(s_tail, s_plain)  # mask_rest: the same scores set to -inf (else both untouched)


LEAN_KINDS = ["plain", "ties", "negative", "denormal", "huge-spread", "inf-beyond-k", "all-equal", "close", "ties-in-tail"]
# B, R, P, k, group, how, rank_bits. Every kind through the rank-bucket fallback (rank_bits=2) of one launch (a tail
# tile past 256) and of the split union's thresholds pass; the other paths and the 32K decode's rows on fewer kinds.
LEAN_CASES = ([(kind, 2, 3, 300, 20, 1, "one", 2) for kind in LEAN_KINDS]
              + [(kind, 1, 4, 300, 33, 4, "split", 2) for kind in LEAN_KINDS]
              + [(kind, *case) for kind in ("plain", "ties") for case in [
                  (2, 3, 300, 20, 1, "one", 16), (1, 2, 200, 40, 1, "one", 16), (2, 2, 300, 40, 1, "mask", 16),
                  (2, 2, 257, 40, 1, "mask", 2), (1, 4, 257, 33, 4, "serial", 2)]]
              + [(kind, *case) for kind in ("plain", "ties-in-tail")
                 for case in [(1, 4, 2053, 129, 4, "split", 16), (1, 2, 2053, 129, 1, "one", 16)]])


@pytest.mark.parametrize("kind,B,R,P,k,group,how,rank_bits", LEAN_CASES)
def test_topk_lean_path_gives_the_same_ids(kind, B, R, P, k, group, how, rank_bits):
    # TopKLaunch(lean): one row a program (MHA rows, shared scores, the split union's thresholds) with one reduction
    # a whole-row step and no threshold key or tie ranks for a row whose k-th pick is alone in its rank bucket: the
    # same ids (ties to the lowest ids, across the tile and its tail), thresholds and -inf masking as the path it
    # replaces. rank_bits=2 puts the k-th pick inside a shared bucket nearly always (the exact key and tie cutoff).
    from triton_kernels import topk as topk_mod

    if kind == "plain":
        s = random_scores(B, R, P, seed=P + k)
    else:
        s = _adversarial_rows("ties" if kind == "ties-in-tail" else kind, B, R, P, k, seed=P + k + rank_bits)
    if kind == "ties-in-tail" and P > 256:  # the k-th score shared by pages on both sides of the tile's edge
        block = 1 << (P.bit_length() - 1)
        s[..., block - 40: P - 1] = 0.5
    base = dict(split_union=how != "one", rank_bits=rank_bits, chunked_union_min_pages=None if how == "serial" else 2048)
    lean, old = topk_mod.TopKLaunch(**base), topk_mod.TopKLaunch(**base, lean=0)
    assert topk_mod.lean_config(P, 1, lean) and not topk_mod.lean_config(P, 1, old)
    mask = how == "mask"
    s_old, s_lean = s.clone(), s.clone()
    want = tk.topk_pages(s_old, k, group, mask_rest=mask, launch=old)
    out = torch.full_like(want, 12345)
    got = tk.topk_pages(s_lean, k, group, mask_rest=mask, launch=lean, out=out)
    assert torch.equal(got, want)
    assert torch.equal(s_lean, s_old)  # mask_rest: the same scores set to -inf (else both untouched)
    if group > 1:  # the thresholds pass: the same threshold keys; ties taken: the lean `need` covers every tie it
        thr_old, need_old, cut_old = topk_mod._thresholds(s, k, old)  # takes, and the cutoff says which
        thr, need, cut = topk_mod._thresholds(s, k, lean)
        assert cut_old is None and torch.equal(thr, thr_old)
        rows = s.reshape(B * R, P)
        ties = torch.where(torch.isneginf(rows), 0, (topk_mod_key(rows) == thr[:, None]).int()).sum(1)
        assert ((need == need_old) | ((cut == 2**31 - 1) & (need >= ties))).all()


def topk_mod_key(x):
    """The int32 order key of fp32 scores (triton_kernels.topk's `_order_key`), on the host."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def test_topk_lean_config_only_for_rows_a_program():
    from triton_kernels import topk as topk_mod

    on = topk_mod.TopKLaunch()
    assert topk_mod.lean_config(2053, 1, on) and topk_mod.lean_config(2048, 1, on)
    assert not topk_mod.lean_config(2048, 4, on)  # a union of rows in one program keeps the grouped path
    assert not topk_mod.lean_config(2048, 1, topk_mod.TopKLaunch(rank_bits=0))
    assert not topk_mod.lean_config(3000, 1, topk_mod.TopKLaunch(max_tile=256))  # tiled rows
    assert not topk_mod.lean_config(8197, 1, on) and topk_mod.lean_config(8197, 1, topk_mod.TopKLaunch(lean=8192))
    assert not topk_mod.lean_config(2048, 1, topk_mod.TopKLaunch(lean=0))


def test_topk_tail_config_picks_rows_just_past_a_power_of_two():
    from triton_kernels import topk as topk_mod

    on = topk_mod.TopKLaunch(tail_tile=64)
    assert topk_mod.tail_config(2053, 1, on) == (2048, 16) and topk_mod.launch_config(2053, 1, on) == (2048, 4, True)
    assert topk_mod.tail_config(8197, 1, on) == (8192, 16)
    assert topk_mod.tail_config(8197, 4, on) == (0, 0)  # 4 x 8208 keys: over max_tile, the tiled path
    assert topk_mod.tail_config(2100, 1, on) == (2048, 64)
    for P in (2048, 2200, 255, 100):  # a power of two, too far past one, too short
        assert topk_mod.tail_config(P, 1, on) == (0, 0)
    assert topk_mod.tail_config(16389, 4, on) == (0, 0)  # over max_tile: the tiled path
    assert topk_mod.tail_config(2053, 1) == (2048, 16)  # on by default
    assert topk_mod.tail_config(2053, 1, topk_mod.TopKLaunch(tail_tile=0)) == (0, 0)


def test_set_topk_launch_replaces_the_default_every_call_reads(monkeypatch):
    # The benchmarks' --topk-launch: topk_pages, launch_config and tail_config without launch= read the module's
    # TOPK_LAUNCH at each call, so replacing it changes what a whole decode launches; bad settings are refused.
    from quest_hf.bench import set_topk_launch, topk_launch_fields
    from triton_kernels import topk as topk_mod

    monkeypatch.setattr(topk_mod, "TOPK_LAUNCH", topk_mod.TOPK_LAUNCH)
    before = topk_mod.tail_config(2053, 1)  # the library default (tail tile on)
    launch = set_topk_launch(["tail_tile=0", "chunked_union_min_pages=None", "split_union=False"])
    assert topk_mod.TOPK_LAUNCH is launch and launch.chunked_union_min_pages is None and not launch.split_union
    assert topk_mod.tail_config(2053, 1) == (0, 0) and before == (2048, 16)
    assert topk_mod.launch_config(2053, 1) == topk_mod.launch_config(2053, 1, launch)
    s = random_scores(1, 4, 2053, seed=3)
    assert torch.equal(tk.topk_pages(s, 129, 4), tk.topk_pages(s, 129, 4, launch=launch))
    for bad in (["tail_tyle=64"], ["tail_tile"]):
        with pytest.raises(SystemExit, match="TopKLaunch fields as NAME=VALUE"):
            set_topk_launch(bad)
    assert topk_launch_fields(["KEYS_PER_THREAD=32", "block_p=None"]) == dict(keys_per_thread=32, block_p=None)


@pytest.mark.parametrize("tile", [None, 256], ids=["one-tile", "tiled"])
@pytest.mark.parametrize("B,R,P,k,group", [(1, 4, 700, 40, 4), (2, 6, 300, 20, 3), (2, 8, 17, 100, 8), (1, 2, 64, 5, 2)])
def test_topk_union_in_two_launches_equals_one(B, R, P, k, group, tile, monkeypatch):
    # Unions run as per-row thresholds + one union program per group (SPLIT_UNION); with heavy ties and -inf
    # pages they give exactly the one-launch kernel's ids (both take the lowest ids among a row's ties).
    from triton_kernels import topk as topk_mod

    launch = topk_mod.TopKLaunch(max_tile=tile) if tile else topk_mod.TOPK_LAUNCH
    s = random_scores(B, R, P, seed=P + k, ties=True, dead=0.3)
    assert topk_mod.TOPK_LAUNCH.split_union
    split = tk.topk_pages(s, k, group, launch=launch)
    one = tk.topk_pages(s, k, group, launch=dataclasses.replace(launch, split_union=False))
    assert torch.equal(split, one)
    # Expected: each row's k best by a stable sort on (-score, id), -inf never, united over the group.
    order = torch.sort(-s, dim=-1, stable=True).indices[..., :k]
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order, s.gather(-1, order) > float("-inf"))
    chosen = chosen.view(B, R // group, group, P).any(2)
    o_p = torch.arange(P, device=s.device)
    ids = torch.where(chosen, o_p, P + o_p).sort(-1).values[..., :split.shape[-1]]
    assert torch.equal(split.long(), torch.where(ids < P, ids, -1))


@pytest.mark.parametrize("tile", [None, 256], ids=["one-tile", "tiled"])
@pytest.mark.parametrize("B,R,P,k,group,ties", [(2, 3, 300, 40, 1, False), (1, 4, 700, 33, 4, False),
                                                 (2, 2, 1000, 300, 1, True), (1, 2, 20, 50, 1, False)])
def test_topk_mask_rest_leaves_each_rows_own_choice(B, R, P, k, group, ties, tile, monkeypatch):
    # Two-stage selectors: the scores a row did not choose become -inf in place (the candidates keep theirs).
    from triton_kernels import topk as topk_mod

    launch = topk_mod.TopKLaunch(max_tile=tile) if tile else topk_mod.TOPK_LAUNCH
    s = random_scores(B, R, P, seed=P + 1, ties=ties)
    got_s, want_s = s.clone(), s.clone()
    got = tk.topk_pages(got_s, k, group, mask_rest=True, launch=launch)
    assert torch.equal(got, tk.topk_pages(s.clone(), k, group, launch=launch))  # the ids are as without mask_rest
    tk.topk_pages_ref(want_s, k, group, mask_rest=True)
    kept = got_s > float("-inf")
    assert torch.equal(got_s[kept], s[kept])  # kept scores are untouched
    assert (kept.sum(-1) <= min(k, P)).all()
    if not ties:  # without ties each row's own k best are unique
        assert torch.equal(got_s, want_s)
    else:  # the same number kept, the same multiset of kept scores, ties to the lowest ids
        assert torch.equal(kept.sum(-1), (want_s > float("-inf")).sum(-1))
        assert torch.equal(got_s.sort(-1).values, want_s.sort(-1).values)
    # Every chosen id of a group is kept by at least one of its rows.
    rows = kept.view(B, R // group, group, P).any(2)
    ids = got.long().clamp(min=0)
    assert rows.gather(-1, ids)[got >= 0].all()


@pytest.mark.parametrize("P", [1, 37, 300, 2053])
def test_top_p_mask_matches_reference(P):
    # The adaptive budget's page filter (qcode_topp): same kept pages as the sorted-cumsum reference; at
    # top_p = 1 they may differ only on pages holding under float resolution of the row's mass.
    g = torch.Generator().manual_seed(P)
    s = torch.randn(3, 4, P, generator=g) * 3
    s.masked_fill_(torch.rand(3, 4, P, generator=g) < 0.2, float("-inf"))
    s = s.to(DEV)
    for p in (0.3, 0.5, 0.9, 1.0):
        got, want = tk.top_p_mask(s, p, 16), tk.top_p_mask_ref(s, p, 16)
        assert (got[..., -1] == float("inf")).all() and (want[..., -1] == float("inf")).all()
        diff = got != want
        if p < 1.0:
            assert not diff.any(), f"top_p={p}: {int(diff.sum())} pages differ"
        else:
            assert (torch.softmax(s, -1)[diff] < 1e-6).all()
        assert torch.equal(got[~diff], want[~diff])
    with pytest.raises(ValueError, match="top_p"):
        tk.top_p_mask(s, 0.0, 16)


@pytest.mark.parametrize("P, S", [(40, 16), (301, 8)])
def test_top_p_mask_at_the_device_position(P, S):
    # Rows over a whole allocation (captured top-p): the page at pos is the one always kept, and the pages after it
    # (no mass) change nothing: the kept set equals that of the row cut at the current page.
    g = torch.Generator().manual_seed(P)
    s = torch.randn(2, 3, P, generator=g) * 3
    for L in (1, S, S + 1, 5 * S - 3):
        cur = (L - 1) // S
        row = s.clone()
        row[..., cur + 1:] = float("-inf")
        pos = torch.tensor(L, device=DEV)
        for p in (0.5, 0.9):
            want = tk.top_p_mask_ref(row[..., :cur + 1].to(DEV), p, 8)
            for fn in (tk.top_p_mask_ref, tk.top_p_mask):
                got = fn(row.to(DEV), p, 8, pos=pos, page_size=S)
                assert (got[..., cur] == float("inf")).all() and (got[..., cur + 1:] == float("-inf")).all()
                assert torch.equal(got[..., :cur + 1], want), (fn.__name__, L, p)
    with pytest.raises(ValueError, match="pos must be one integer tensor"):
        tk.top_p_mask_ref(s.to(DEV), 0.5, 8, pos=torch.tensor(3, device=DEV))  # no page_size


def test_topk_all_scores_equal_takes_lowest_ids():
    s = torch.zeros(1, 2, 5000)
    s[0, 1, :100] = float("-inf")
    got = tk.topk_pages(s.to(DEV), 7, 1)[0]
    assert got[0].tolist() == list(range(7)) and got[1].tolist() == list(range(100, 107))


def test_topk_counts_exactly_k_per_row_before_the_union():
    # Union of rows with disjoint preferences: every row contributes exactly k pages.
    P, k = 64, 5
    s = torch.full((1, 4, P), -1.0)
    for r in range(4):
        s[0, r, r * 10:r * 10 + 8] = torch.arange(8, 0, -1).float()
    s[..., -1] = float("inf")
    got = tk.topk_pages(s.to(DEV), k, 4)[0, 0]
    expect = sorted({r * 10 + i for r in range(4) for i in range(k - 1)} | {P - 1})
    assert got[got >= 0].tolist() == expect and (got < 0).sum().item() == 4 * k - len(expect)


# -------------------------------------------------------------------------------------------- attention
ATTN_CASES = [
    # B, H_q, H_kv, D, S, L, window_start, k pages, dtype, padding
    pytest.param(1, 1, 1, 64, 16, 1, 0, 4, F32, (), id="len1"),
    pytest.param(2, 3, 1, 64, 16, 15, 0, 2, F16, (0, 6), id="len15-G3-pad"),
    pytest.param(2, 4, 1, 128, 16, 17, 3, 1, BF16, (0, 16), id="len17-G4-window-k1"),
    pytest.param(2, 8, 1, 64, 16, 100, 20, 3, F16, (37, 0), id="len100-G8"),
    pytest.param(1, 8, 2, 128, 16, 4097, 900, 24, F16, (), id="len4097-G4-window"),
    pytest.param(3, 4, 4, 64, 8, 77, 0, 100, F32, (0, 20, 76), id="len77-G1-k>=P"),
    pytest.param(1, 2, 2, 128, 32, 200, 0, 3, BF16, (), id="len200-S32"),
]


@pytest.mark.parametrize("fuse_merge", [True, False], ids=["fused-merge", "merge-kernel"])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,ws,k,dtype,pad", ATTN_CASES)
def test_sparse_attention_matches_reference(B, Hq, Hkv, D, S, L, ws, k, dtype, pad, fuse_merge, monkeypatch):
    launch = attn_mod.AttentionLaunch(fuse_merge_max_splits=1 << 30 if fuse_merge else 0)
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=L + 1, pad=pad)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    scores = tk.score_pages_ref(q, kmin, kmax, L, S, ws, "none")
    ids = tk.topk_pages_ref(scores, k, Hq // Hkv)
    scale = D ** -0.5
    got = tk.sparse_decode_attention(q, kc, vc, ids, valid, L, S, scale, ws, launch=launch)
    want = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, L, S, scale, ws)
    assert_close(got, want)


def test_sparse_attention_masks_minus_one_anywhere_and_empty_rows_give_zero(monkeypatch):
    B, Hq, Hkv, D, S, L = 2, 4, 2, 64, 16, 90
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, F16, seed=5, pad=(0, 50))
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(3)).to(F16).to(DEV)
    ids = torch.tensor([[[5, -1, 0, 3, -1], [-1, -1, -1, -1, -1]],
                        [[0, 1, 2, -1, 5], [4, -1, -1, 1, 0]]], dtype=torch.int32, device=DEV)
    want = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, L, S, 0.125, 0)
    _nan_empty(monkeypatch)  # the zeros of the empty head must be written, not left from the allocation
    got = tk.sparse_decode_attention(q, kc, vc, ids, valid, L, S, 0.125, 0)
    assert_close(got, want)
    assert (got[0, 2:] == 0).all()  # KV head 1 of row 0 chose nothing
    assert (got[1, :2] != 0).any()  # row 1 head 0: pages 0-2 are padding only, page 5 is live


def test_quest_step_end_to_end_matches_reference():
    B, Hq, Hkv, D, S, L, k = 2, 6, 2, 64, 16, 333, 5
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, F16, seed=9, pad=(0, 100))
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(4)).to(F16).to(DEV)
    for reduce, group in (("none", 3), ("max", 1), ("sum", 1)):
        s = tk.score_pages(q, kmin, kmax, L, S, 0, reduce)
        ids = tk.topk_pages(s, k, group)
        out = tk.sparse_decode_attention(q, kc, vc, ids, valid, L, S, 0.125, 0)
        s_ref = tk.score_pages_ref(q, kmin, kmax, L, S, 0, reduce)
        ids_ref = tk.topk_pages_ref(s_ref, k, group)
        assert torch.equal(ids, ids_ref)
        assert_close(out, tk.sparse_decode_attention_ref(q, kc, vc, ids_ref, valid, L, S, 0.125, 0))


@pytest.mark.parametrize("L, window, S", [(45, 13, 4), (45, 40, 4), (97, 16, 16), (33, 100, 8)])
def test_device_window_equals_the_host_window(L, window, S):
    # The captured step reads a sliding window's first slot from the device position (pos - window) over the
    # whole allocation; it must score and attend exactly as the host window_start over the written slots.
    g = torch.Generator().manual_seed(L + window)
    B, H, G, D, C = 2, 2, 3, 16, 128
    keys, values = torch.zeros(B, H, C, D, device=DEV), torch.zeros(B, H, C, D, device=DEV)
    kmin = torch.full((B, H, C // S, D), float("inf"), device=DEV)
    kmax = torch.full((B, H, C // S, D), float("-inf"), device=DEV)
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    tk.append_kv_ref(keys, values, kmin, kmax, valid, torch.randn(B, H, L, D, generator=g).to(DEV),
                     torch.randn(B, H, L, D, generator=g).to(DEV), None, 0)
    q = torch.randn(B, H * G, D, generator=g).to(DEV)
    pos, ws = torch.tensor(L, device=DEV), max(0, L - window)
    P = -(-L // S)
    for score in (tk.score_pages_ref, tk.score_pages):
        dev = score(q, kmin, kmax, C, S, 0, "none", pos=pos, window=window)
        host = score(q, kmin, kmax, L, S, ws, "none")
        assert torch.equal(dev[..., :P - 1], host[..., :P - 1]) and (dev[..., P - 1] == float("inf")).all()
        assert (dev[..., P:-1] == float("-inf")).all()  # unwritten pages; the last (spare) one is forced
    ids = tk.topk_pages_ref(tk.score_pages_ref(q, kmin, kmax, C, S, 0, "none", pos=pos, window=window), 3, G)
    for attend in (tk.sparse_decode_attention_ref, tk.sparse_decode_attention):
        dev = attend(q, keys, values, ids, valid, C, S, 0.25, pos=pos, window=window)
        host = attend(q, keys, values, ids, valid, L, S, 0.25, ws)
        assert not dev.isnan().any()
        torch.testing.assert_close(dev, host, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="window= is the device-side sliding window: it needs pos="):
        tk.score_pages_ref(q, kmin, kmax, C, S, 0, "none", window=window)


# Soft-cap (Gemma 2) and sinks (GPT-OSS): B, H_q, H_kv, D, S, L, k pages, dtype, padding, softcap, sinks.
CAP_SINK_CASES = [
    pytest.param(1, 1, 1, 64, 16, 1, 4, F32, (), 2.0, False, id="len1-cap2"),
    pytest.param(2, 3, 1, 64, 16, 15, 2, F16, (0, 6), 0.0, True, id="len15-G3-sinks"),
    pytest.param(2, 4, 1, 128, 16, 17, 1, BF16, (0, 16), 50.0, True, id="len17-G4-k1-cap50-sinks"),
    pytest.param(2, 8, 1, 64, 16, 100, 3, F16, (37, 0), 5.0, False, id="len100-G8-cap5"),
    pytest.param(1, 8, 2, 128, 16, 4097, 24, F32, (), 20.0, True, id="len4097-G4-cap20-sinks"),
    pytest.param(3, 4, 4, 64, 8, 77, 100, F32, (0, 20, 76), 1.0, True, id="len77-G1-k>=P-cap1-sinks"),
]


def _nan_empty(monkeypatch):
    """Every float torch.empty starts as NaN, so that a slot the kernel does not write fails the test."""
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))


@pytest.mark.parametrize("fuse_merge", [True, False], ids=["fused-merge", "merge-kernel"])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,k,dtype,pad,softcap,use_sinks", CAP_SINK_CASES)
def test_sparse_attention_softcap_sinks_match_reference(B, Hq, Hkv, D, S, L, k, dtype, pad, softcap, use_sinks,
                                                        fuse_merge, monkeypatch):
    launch = attn_mod.AttentionLaunch(fuse_merge_max_splits=1 << 30 if fuse_merge else 0)
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=L + 3, pad=pad)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(B, Hq, D, generator=g) * 3).to(dtype).to(DEV)  # logits well past a cap of 1-5
    sinks = torch.linspace(-2.0, 4.0, Hq).to(DEV) if use_sinks else None
    ids = tk.topk_pages_ref(tk.score_pages_ref(q, kmin, kmax, L, S, 0, "none"), k, Hq // Hkv)
    if B > 1:
        ids[1, 0] = -1  # a KV head that chose nothing: 0 whatever the sink
    scale = D ** -0.5
    want = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, L, S, scale, 0, softcap=softcap, sinks=sinks)
    _nan_empty(monkeypatch)
    got = tk.sparse_decode_attention(q, kc, vc, ids, valid, L, S, scale, 0, softcap=softcap, sinks=sinks,
                                     launch=launch)
    assert_close(got, want)
    if B > 1:
        assert (got[1, : Hq // Hkv] == 0).all()
    plain = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, L, S, scale, 0)
    if L > 1 or use_sinks:  # (one token alone gets weight 1 under any cap)
        assert (want.float() - plain.float()).abs().max() > 1e-2  # the cap / sinks change the output


def test_softcap_sinks_reference_is_the_eager_formula():
    """The twin against HF's eager formula written out: softcap * tanh(s / softcap), a sink column per query head in
    the softmax then dropped (GPT-OSS's eager_attention_forward), over every token; also at the device window."""
    B, Hq, Hkv, D, S, L, C = 2, 6, 2, 32, 8, 45, 64
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, F32, seed=11, pad=(0, 9), C=C)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(5)).to(DEV) * 2
    sinks = torch.linspace(-1.0, 3.0, Hq).to(DEV)
    scale, cap, window = 0.3, 4.0, 13
    ids = torch.arange(C // S, dtype=torch.int32, device=DEV).expand(B, Hkv, -1).contiguous()
    for pos, win in ((None, 0), (torch.tensor(L, device=DEV), window)):
        got = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, C if win else L, S, scale, pos=pos, window=win,
                                             softcap=cap, sinks=sinks)
        k = kc.repeat_interleave(Hq // Hkv, 1)[:, :, :L]
        v = vc.repeat_interleave(Hq // Hkv, 1)[:, :, :L]
        s = torch.einsum("bhd,bhnd->bhn", q, k) * scale
        s = cap * torch.tanh(s / cap)
        ok = valid[:, None, :L] & (torch.arange(L, device=DEV) >= (L - win if win else 0))
        s = s.masked_fill(~ok, float("-inf"))
        s = torch.cat([s, sinks[None, :, None].expand(B, Hq, 1)], -1)
        w = torch.softmax(s, -1)[..., :-1]
        torch.testing.assert_close(got, torch.einsum("bhn,bhnd->bhd", w, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap, use_sinks", [(0.0, False), (4.0, True)], ids=["plain", "cap4-sinks"])
def test_prefix_attention_equals_every_page(dtype, softcap, use_sinks):
    """The CPU eager step's dense layers attend the filled prefix in place: the same output as the page twin given
    every page (GQA, left padding, a window start, a partly filled allocation), and a window start past page 0."""
    B, Hq, Hkv, D, S, L, C = 2, 6, 2, 32, 8, 45, 72
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=13, pad=(0, 11), C=C)
    q = (torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(6)) * 2).to(dtype).to(DEV)
    sinks = torch.linspace(-1.0, 3.0, Hq).to(DEV) if use_sinks else None
    ids = torch.arange(C // S, dtype=torch.int32, device=DEV).expand(B, Hkv, -1).contiguous()
    for ws in (0, 3, 20):
        want = tk.sparse_decode_attention_ref(q, kc, vc, ids, valid, L, S, 0.3, ws, softcap=softcap, sinks=sinks)
        got = tk.prefix_decode_attention_ref(q, kc, vc, valid, L, 0.3, ws, softcap, sinks)
        assert got.dtype == dtype and got.shape == (B, Hq, D)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"need 0 <= window_start \(45\) < seq_len \(45\)"):
        tk.prefix_decode_attention_ref(q, kc, vc, valid, L, 0.3, L)


def test_softcap_sinks_and_values_checked():
    kc, vc, kmin, kmax, valid = filled_layer(1, 1, 16, 4, 8, F32, seed=1)
    q = torch.randn(1, 2, 16).to(DEV)
    ids = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEV)
    for attend in (tk.sparse_decode_attention_ref, tk.sparse_decode_attention):
        with pytest.raises(ValueError, match="softcap must be >= 0"):
            attend(q, kc, vc, ids, valid, 8, 4, 1.0, softcap=-1.0)
        with pytest.raises(ValueError, match=r"sinks must be fp32 \[H_q=2\]"):
            attend(q, kc, vc, ids, valid, 8, 4, 1.0, sinks=torch.zeros(1).to(DEV))
        with pytest.raises(ValueError, match=r"sinks must be fp32"):
            attend(q, kc, vc, ids, valid, 8, 4, 1.0, sinks=torch.zeros(2, dtype=F16).to(DEV))
        # One head dim for keys and values: a V cache of another shape or dtype is refused, not read with K's strides.
        with pytest.raises(ValueError, match="v_cache must match k_cache"):
            attend(q, kc, vc[..., :8], ids, valid, 8, 4, 1.0)
        with pytest.raises(ValueError, match="v_cache must match k_cache"):
            attend(q, kc, vc.to(F16), ids, valid, 8, 4, 1.0)
