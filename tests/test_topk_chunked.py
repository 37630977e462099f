"""The split union's chunk-parallel pass 2, in three launches (`TopKLaunch.chunked_union_min_pages`) and in one
(`TopKLaunch.onepass_union`: tie cutoffs from the thresholds pass, chunks by ticket, counts published to later
chunks), against the serial pass 2 and `topk_pages_ref` (CPU: TRITON_INTERPRET=1, set by conftest; chunks of 16-32
pages so that several run)."""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from triton_kernels import topk as topk_mod  # noqa: E402

from .testing import DEVICE as DEV  # noqa: E402

POISON = 0x7FC00000  # a NaN's bit pattern: a slot the kernels never wrote shows it


def chunked(chunk=16, onepass=False):
    """Launches of the chunked pass 2: three launches (False), one (True), or one after the grouped thresholds
    pass ("grouped": lean=0, the tie cutoff found from its threshold and ties)."""
    return topk_mod.TopKLaunch(chunked_union_min_pages=1, union_chunk=chunk, onepass_union=bool(onepass),
                               lean=0 if onepass == "grouped" else topk_mod.TopKLaunch.lean)


def scores(kind, B, R, P, k, seed):
    """Score rows as `score_pages` hands them over: -inf pages dead for every head, +inf ones forced."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, R, P, generator=g) * 10
    dead = 0.2
    if kind == "ties":  # many equal scores, the k-th among them
        s = s.round() / 4
    elif kind == "all-equal":  # one tie at T over the whole row: `need` ranks it across every chunk
        s = torch.full_like(s, 0.25)
    elif kind == "inf-beyond-k":  # more forced (+inf) pages than k: T = +inf, ties at +inf
        s[..., torch.rand(P, generator=g) < 0.3] = float("inf")
    elif kind == "mostly-dead":  # fewer live pages than the output holds: a long -1 tail
        dead = 0.9
    s.masked_fill_(torch.rand(B, 1, P, generator=g) < dead, float("-inf"))
    s[..., -1] = float("inf")  # the current page
    s[..., P // 2] = float("inf")  # a forced page at the device position
    return s.to(DEV)


def expected(s, k, group):
    """Each row's k best by a stable sort on (-score, id) (ties to the lowest ids), -inf never, united per group,
    ascending, -1 padded to min(group * k, P)."""
    B, R, P = s.shape
    order = torch.sort(-s, dim=-1, stable=True).indices[..., :k]
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order, s.gather(-1, order) > float("-inf"))
    chosen = chosen.view(B, R // group, group, P).any(2)
    o_p = torch.arange(P, device=s.device)
    ids = torch.where(chosen, o_p, P + o_p).sort(-1).values[..., :min(group * k, P)]
    return torch.where(ids < P, ids, -1).to(torch.int32)


def as_sets(ids):
    return [set(r.tolist()) - {-1} for r in ids.flatten(0, 1)]


CASES = [
    # B, R, P, k, group, kind, union_chunk
    pytest.param(1, 4, 100, 9, 2, "random", 16, id="P100-not-a-multiple-union2"),
    pytest.param(3, 6, 64, 7, 3, "ties", 16, id="B3-P64-a-multiple-union3"),
    pytest.param(2, 8, 200, 12, 4, "ties", 32, id="P200-ties-union4-chunk32"),
    pytest.param(1, 8, 90, 5, 8, "random", 16, id="P90-union8"),
    pytest.param(1, 4, 10, 3, 4, "random", 16, id="P10-below-one-chunk"),
    pytest.param(2, 4, 120, 30, 2, "all-equal", 16, id="P120-ties-straddle-chunks"),
    pytest.param(1, 4, 150, 12, 4, "inf-beyond-k", 16, id="P150-inf-beyond-k"),
    pytest.param(1, 4, 160, 40, 4, "mostly-dead", 16, id="P160-tail-longer-than-union"),
    pytest.param(1, 2, 48, 100, 2, "random", 16, id="P48-k>=P"),
    pytest.param(1, 4, 600, 40, 4, "ties", 16, id="P600-38-chunks"),
]


@pytest.mark.parametrize("B,R,P,k,group,kind,chunk,onepass", [
    pytest.param(*case.values, onepass, id=f"{case.id}-{name}") for case in CASES
    for onepass, name in [(False, "3-launch"), (True, "onepass"), ("grouped", "onepass-grouped")]
    # the grouped thresholds pass's tie cutoffs: where ties straddle chunks
    if onepass != "grouped" or case.values[5] in ("ties", "all-equal")])
def test_chunked_union_equals_serial_and_reference(B, R, P, k, group, kind, chunk, onepass):
    s = scores(kind, B, R, P, k, seed=P + k)
    s0 = s.clone()
    out = torch.full((B, R // group, min(group * k, P)), POISON, dtype=torch.int32, device=DEV)
    got = tk.topk_pages(s, k, group, launch=chunked(chunk, onepass), out=out)
    assert got is out and torch.equal(s, s0)  # scores only read
    serial = tk.topk_pages(s, k, group, launch=topk_mod.TopKLaunch(onepass_union=False))
    want = expected(s, k, group)
    assert torch.equal(got, serial)
    assert torch.equal(got, want)  # ascending, every slot written, -1 tail
    if kind in ("random", "mostly-dead"):  # no ties at the k-th score: the reference's own choice is the same
        ref = tk.topk_pages_ref(s, k, group)
        assert as_sets(got) == as_sets(ref) and torch.equal(got, ref)


@pytest.mark.parametrize("onepass", [False, True], ids=["3-launch", "onepass"])
@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_chunked_union_reads_any_strides(layout, onepass):
    B, R, P, k, group = 2, 4, 70, 6, 4
    base = scores("ties", B, R, 2 * P, k, seed=3)
    if layout == "transposed":  # [B, P, R] storage seen as [B, R, P]
        s = base[..., :P].transpose(1, 2).contiguous().transpose(1, 2)
        assert s.stride(2) == R
    else:  # every other page of a wider row
        s = base[..., ::2]
        assert s.stride(2) == 2
    got = tk.topk_pages(s, k, group, launch=chunked(onepass=onepass))
    assert torch.equal(got, tk.topk_pages(s.contiguous(), k, group))
    assert torch.equal(got, expected(s.contiguous(), k, group))


@pytest.mark.parametrize("onepass", [False, True], ids=["3-launch", "onepass"])
def test_chunked_union_strided_out(onepass):
    B, R, P, k, group = 1, 4, 50, 5, 2
    s = scores("ties", B, R, P, k, seed=5)
    store = torch.full((B, 2 * (R // group), 2 * group * k), POISON, dtype=torch.int32, device=DEV)
    out = store[:, ::2, ::2]
    tk.topk_pages(s, k, group, launch=chunked(onepass=onepass), out=out)
    assert torch.equal(out, expected(s, k, group))
    assert (store[:, 1::2] == POISON).all() and (store[:, :, 1::2] == POISON).all()


@pytest.mark.parametrize("onepass", [False, True], ids=["3-launch", "onepass"])
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.bool])
def test_chunked_union_due_flag(flag_dtype, onepass):
    # Reuse's flag 0: nothing written (the prefilled `out` keeps every value); 1: the usual ids.
    B, R, P, k, group = 1, 4, 60, 5, 4
    s = scores("ties", B, R, P, k, seed=7)
    out = torch.full((B, R // group, group * k), POISON, dtype=torch.int32, device=DEV)
    launch = chunked(onepass=onepass)
    tk.topk_pages(s, k, group, launch=launch, due=torch.tensor(0, dtype=flag_dtype, device=DEV), out=out)
    assert (out == POISON).all()
    tk.topk_pages(s, k, group, launch=launch, due=torch.tensor(1, dtype=flag_dtype, device=DEV), out=out)
    assert torch.equal(out, expected(s, k, group))


def test_chunked_union_runs_from_its_page_count_only(monkeypatch):
    # By default the one-pass union for rows held in registers; without it, the three-launch chunked pass 2 from
    # 2048 pages a row (where it was timed faster) and the serial pass 2 below it; rows too long for one register
    # tile never take the one-pass union (their thresholds pass finds no tie cutoffs).
    assert topk_mod.TOPK_LAUNCH.chunked_union_min_pages == 2048 and topk_mod.TOPK_LAUNCH.onepass_union
    calls = []
    for name in ("_serial_union", "_chunked_union", "_onepass_union"):
        real = getattr(topk_mod, name)
        monkeypatch.setattr(topk_mod, name, lambda *a, _n=name, _f=real, **kw: (calls.append(_n), _f(*a, **kw)))
    s = scores("random", 1, 4, 40, 3, seed=9)
    launch = dataclasses.replace(chunked(), chunked_union_min_pages=40)
    tk.topk_pages(s, 3, 2)
    tk.topk_pages(s, 3, 2, launch=topk_mod.TopKLaunch(onepass_union=False))
    tk.topk_pages(s, 3, 2, launch=launch)
    tk.topk_pages(s[..., :39], 3, 2, launch=launch)
    tk.topk_pages(s, 3, 2, launch=topk_mod.TopKLaunch(max_tile=32))
    assert calls == ["_onepass_union", "_serial_union", "_chunked_union", "_serial_union", "_serial_union"]


@pytest.mark.parametrize("chunk", [8, 48])
def test_topk_launch_rejects_odd_union_chunk(chunk):
    with pytest.raises(ValueError, match="union_chunk must be a power of two"):
        topk_mod.TopKLaunch(union_chunk=chunk)
