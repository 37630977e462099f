"""GPU-marked: the score kernel's tensor-core forms (`ScoreLaunch.mma`, `score_form`: "mma" on float bounds, "mma8" on
8-bit codes) against the elementwise form and the reference at real sizes: fp16 and bf16, MHA and GQA groups, every
reduce, dead and forced pages.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_score_mma.py`.
"""
import pytest
import torch

import triton_kernels as tk
from triton_kernels.bounds8 import channel_scales_of_bounds, empty_bounds8
from triton_kernels.score import ScoreLaunch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _bounds(B, H, P, D, dtype, empty, seed=0):
    g = torch.Generator(DEV).manual_seed(seed)
    keys = torch.randn(B, H, P, 16, D, generator=g, device=DEV).to(dtype)
    kmin, kmax = keys.amin(3), keys.amax(3)
    kmin[:, :, P - empty:] = float("inf")  # the captured decode's room for new tokens: empty pages
    kmax[:, :, P - empty:] = float("-inf")
    return kmin, kmax


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, Hq, H", [(1, 32, 8), (1, 32, 32), (8, 32, 8), (1, 28, 4), (2, 12, 2)])
@pytest.mark.parametrize("reduce", ["none", "max", "sum"])
def test_mma_scores_match_the_elementwise_form_and_the_reference(dtype, B, Hq, H, reduce):
    D, S, P, empty = 128, 16, 2053, 5
    kmin, kmax = _bounds(B, H, P, D, dtype, empty)
    q = torch.randn(B, Hq, D, device=DEV).to(dtype)
    pos = torch.tensor((P - empty) * S - 3, device=DEV)
    C = P * S
    got = {}
    # The two forms, and (round 34) the elementwise one over 2-channel words (MHA rows only; elsewhere unchanged).
    launches = {True: ScoreLaunch(mma=True), False: ScoreLaunch(mma=False),
                "words": ScoreLaunch(mma=False, packed_bounds=True)}
    assert tk.score.packed_halves(q, kmin, kmax, None, launches["words"]) == (Hq == H)
    for name, launch in launches.items():
        assert tk.score_form(q, kmin, launch=launch) == ("mma" if name is True else "elementwise")
        out = torch.full((B, Hq if reduce == "none" else H, P), float("nan"), device=DEV)
        got[name] = tk.score_pages(q, kmin, kmax, C, S, 64, reduce, pos=pos, launch=launch, out=out)
    ref = tk.score_pages_ref(q, kmin, kmax, C, S, 64, reduce, pos=pos)
    fin = ref.isfinite()
    assert (ref == float("-inf")).any() and (ref == float("inf")).any()
    for s in got.values():
        assert torch.equal(fin, s.isfinite()) and torch.equal(s[~fin], ref[~fin])
        torch.testing.assert_close(s[fin], ref[fin], atol=1e-3, rtol=1e-4)
    # The same pages chosen, but where the two forms' rounding reorders a near-tie at a query head's k-th score:
    # a page one form chooses and the other does not sits within the scores' tolerance of that head's k-th score.
    k, group = 129, Hq // H if reduce == "none" else 1
    a, b = tk.topk_pages(got[True], k, group), tk.topk_pages(got[False], k, group)
    s = ref.reshape(B, -1, group, P)  # [B, rows of ids, group, P]
    kth = s.topk(k, dim=-1).values[..., -1:]  # each query head's k-th score
    for i, (x, y) in enumerate(zip(a.flatten(0, 1).tolist(), b.flatten(0, 1).tolist())):
        for page in set(x) ^ set(y):
            near = (s.flatten(0, 1)[i, :, page] - kth.flatten(0, 1)[i, :, 0]).abs()
            assert page >= 0 and (near <= 1e-3 + 1e-4 * kth.flatten(0, 1)[i, :, 0].abs()).any(), (i, page)


def test_default_form_is_mma_for_gqa_and_elementwise_where_it_cannot_hold():
    q16 = torch.zeros(1, 32, 128, device=DEV, dtype=torch.float16)
    b16 = torch.zeros(1, 8, 4, 128, device=DEV, dtype=torch.float16)
    assert tk.score_form(q16, b16) == "mma"
    assert tk.score_form(q16, torch.zeros(1, 32, 4, 128, device=DEV, dtype=torch.float16)) == "elementwise"  # MHA
    assert tk.score_form(q16.float(), b16) == "elementwise"  # q in another dtype than the bounds
    assert tk.score_form(q16, b16.to(torch.int8), scale=torch.ones(1, 8, 4, device=DEV)) == "mma8"  # 8-bit codes
    assert tk.score_form(q16, b16.to(torch.int8), scale=torch.ones(1, 8, 4, device=DEV),
                         launch=ScoreLaunch(mma=False)) == "elementwise"


@pytest.mark.parametrize("kind", ["int8", "int8_channel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, Hq, H", [(1, 32, 8), (8, 32, 8), (1, 28, 4), (1, 32, 32)])
@pytest.mark.parametrize("reduce", ["none", "max"])
@pytest.mark.parametrize("qscale", [1e-3, 1.0, 1e3])
def test_mma8_scores_match_the_elementwise_form_and_the_reference(kind, dtype, B, Hq, H, reduce, qscale):
    """The 8-bit codes' tensor-core form: q x channel scales split into three bf16 parts stacked as rows, two products
    (the parts rounded or, `trunc_parts`, truncated). Within fp32 summation of the elementwise form (bytes, or
    `packed_codes` words) and the reference at every query scale, still an upper bound of the float bounds' score (the
    codes round outward), the same Top-K but for near-ties."""
    D, S, P, empty = 128, 16, 2053, 5
    kmin, kmax = _bounds(B, H, P, D, dtype, empty, seed=1)
    chan = channel_scales_of_bounds(kmin, kmax, 64) if kind == "int8_channel" else None
    lo8, hi8, sc = empty_bounds8(B, H, P, D, DEV)
    tk.quantize_bounds(kmin, kmax, lo8, hi8, sc, chan=chan)
    q = (torch.randn(B, Hq, D, device=DEV) * qscale).to(dtype)
    pos = torch.tensor((P - empty) * S - 3, device=DEV)
    C = P * S
    got = {}
    # The two forms, and (round 34) each with its issue-saving option: q' split by truncation ("mma8"), the codes
    # read as 32-bit words (MHA rows on channel scales only; elsewhere the byte path runs).
    launches = {True: ScoreLaunch(mma=True), False: ScoreLaunch(mma=False),
                "trunc": ScoreLaunch(mma=True, trunc_parts=True), "words": ScoreLaunch(mma=False, packed_codes=True)}
    assert tk.score.packed_words(q, lo8, hi8, chan, launches["words"]) == (kind == "int8_channel" and Hq == H)
    for name, launch in launches.items():
        assert tk.score_form(q, lo8, sc, launch) == ("mma8" if name in (True, "trunc") else "elementwise")
        out = torch.full((B, Hq if reduce == "none" else H, P), float("nan"), device=DEV)
        got[name] = tk.score_pages(q, lo8, hi8, C, S, 64, reduce, pos=pos, scale=sc, chan=chan, launch=launch, out=out)
    ref = tk.score_pages_ref(q, lo8, hi8, C, S, 64, reduce, pos=pos, scale=sc, chan=chan)
    exact = tk.score_pages_ref(q, kmin, kmax, C, S, 64, reduce, pos=pos)
    fin = ref.isfinite()
    assert (ref == float("-inf")).any() and (ref == float("inf")).any()
    # fp32 summation of D terms: relative to the sum of |terms|
    se = sc[..., None] * (chan[None, :, None, :] if chan is not None else 1.0)
    big = torch.maximum(lo8.float().abs(), hi8.float().abs()) * se  # [B, H, P, D]
    mag = torch.einsum("bhgd,bhpd->bhgp", q.float().abs().reshape(B, H, Hq // H, D), big)
    mag = mag.reshape(B, Hq, P) if reduce == "none" else mag.amax(2)
    for s in got.values():
        assert torch.equal(fin, s.isfinite()) and torch.equal(s[~fin], ref[~fin])
        assert ((s[fin] - ref[fin]).abs() <= 1e-5 * mag[fin] + 1e-30).all()
        assert (s[fin] >= exact[fin] - 1e-5 * mag[fin]).all()
    k, group = 129, Hq // H if reduce == "none" else 1
    a, b = tk.topk_pages(got[True], k, group), tk.topk_pages(got[False], k, group)
    s = ref.reshape(B, -1, group, P)
    kth = s.topk(k, dim=-1).values[..., -1:]
    tol = 1e-5 * mag.reshape(B, -1, group, P)
    for i, (x, y) in enumerate(zip(a.flatten(0, 1).tolist(), b.flatten(0, 1).tolist())):
        for page in set(x) ^ set(y):
            near = (s.flatten(0, 1)[i, :, page] - kth.flatten(0, 1)[i, :, 0]).abs()
            assert page >= 0 and (near <= 2 * tol.flatten(0, 1)[i, :, page]).any(), (i, page)
