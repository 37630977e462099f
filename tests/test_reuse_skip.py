"""Selection reuse (#16): on a step that reuses its stored selection the score and Top-K launches read the layer's
device flag and return at once, writing nothing; the reuse kernel reads their outputs only on a due step. The flag
off (no flag, or 1) gives today's ids exactly. Captured vs eager at real sizes: tests/gpu/test_gpu_bounds_reuse.py."""
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from quest_hf import QuestConfig, QuestLayer  # noqa: E402
from triton_kernels import topk as topk_mod  # noqa: E402

from .testing import DEVICE as DEV  # noqa: E402

SENTINEL = 0x5A5A5A5A
# Every path of topk_pages: one register tile (one launch a group), the split union (two launches), the one-launch
# union, the tiled search (rows re-read per pass), and mask_rest (the scores written in place).
LAUNCHES = {
    "tile": topk_mod.TOPK_LAUNCH,
    "one-launch-union": dataclasses.replace(topk_mod.TOPK_LAUNCH, split_union=False),
    "tiled": topk_mod.TopKLaunch(max_tile=64),
    "tiled-split": topk_mod.TopKLaunch(max_tile=64, split_union=True),
}
CASES = [
    # B, R, P, k, group, launch
    pytest.param(2, 3, 37, 5, 1, "tile", id="P37-k5"),
    pytest.param(1, 8, 150, 9, 4, "tile", id="P150-split-union4"),
    pytest.param(2, 4, 90, 7, 2, "one-launch-union", id="P90-union2-one-launch"),
    pytest.param(1, 2, 200, 12, 1, "tiled", id="P200-tiled"),
    pytest.param(1, 4, 130, 6, 2, "tiled-split", id="P130-tiled-split-union2"),
]


def _scores(B, R, P, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, R, P, generator=g) * 10  # distinct scores: the reference's tie order does not matter
    s.masked_fill_(torch.rand(B, 1, P, generator=g) < 0.2, float("-inf"))
    s[..., -1] = float("inf")
    return s.to(DEV)


def _flag(value, dtype=torch.int32):
    return torch.tensor(value, dtype=dtype, device=DEV)


@pytest.mark.parametrize("B,R,P,k,group,launch", CASES)
def test_topk_with_the_flag_off_is_todays_topk_exactly(B, R, P, k, group, launch):
    s = _scores(B, R, P, seed=P + k)
    want = tk.topk_pages_ref(s, k, group)
    plain = tk.topk_pages(s, k, group, launch=LAUNCHES[launch])
    assert torch.equal(plain, want)
    for due in (_flag(1), _flag(True, torch.bool), _flag(3, torch.int64)):  # a due step: any nonzero flag
        assert torch.equal(tk.topk_pages(s, k, group, launch=LAUNCHES[launch], due=due), want)
        out = torch.full_like(want, SENTINEL)
        got = tk.topk_pages(s, k, group, launch=LAUNCHES[launch], due=due, out=out)
        assert got is out and torch.equal(out, want)
        ref_out = torch.full_like(want, SENTINEL)
        assert tk.topk_pages_ref(s, k, group, due=due, out=ref_out) is ref_out and torch.equal(ref_out, want)


@pytest.mark.parametrize("B,R,P,k,group,launch", CASES)
def test_topk_with_the_flag_on_leaves_its_outputs_untouched(B, R, P, k, group, launch, monkeypatch):
    s = _scores(B, R, P, seed=P + k)
    kept = s.clone()
    for due in (_flag(0), _flag(False, torch.bool)):
        out = torch.full((B, R // group, min(group * k, P)), SENTINEL, dtype=torch.int32, device=DEV)
        assert tk.topk_pages(s, k, group, launch=LAUNCHES[launch], due=due, out=out) is out
        assert (out == SENTINEL).all(), "a reusing step's Top-K wrote its output"
        ref_out = out.clone()
        tk.topk_pages_ref(s, k, group, due=due, out=ref_out)  # the twin: the same (untouched) buffer
        assert torch.equal(ref_out, out)
        assert torch.equal(s, kept)  # nothing read is written either
    # mask_rest (scores written in place on a due step) writes neither the ids nor the scores.
    out = torch.full((B, R // group, min(group * k, P)), SENTINEL, dtype=torch.int32, device=DEV)
    tk.topk_pages(s, k, group, mask_rest=True, launch=LAUNCHES[launch], due=_flag(0), out=out)
    assert (out == SENTINEL).all() and torch.equal(s, kept)
    ref_s = s.clone()
    tk.topk_pages_ref(ref_s, k, group, mask_rest=True, due=_flag(0))
    assert torch.equal(ref_s, kept)
    # Nor the fresh result: every slot keeps what the allocator left (here a known pattern), and the split
    # union's thresholds (read by its second launch only under the same flag) stay unwritten too.
    empties = []

    def poisoned(real):
        def make(*args, **kw):
            t = real(*args, **kw)
            if t.dtype == torch.int32:  # the ids and the split union's thresholds
                empties.append(t.fill_(SENTINEL))
            return t
        return make

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    fresh = tk.topk_pages(s, k, group, launch=LAUNCHES[launch], due=_flag(0))
    monkeypatch.undo()
    split = group > 1 and LAUNCHES[launch].split_union
    assert (fresh == SENTINEL).all() and len(empties) >= (3 if split else 1)
    assert all((t == SENTINEL).all() for t in empties)


def test_flagged_topk_checks_its_flag_and_out():
    s = _scores(1, 2, 20, seed=0)
    with pytest.raises(ValueError, match="due must be one integer or bool tensor"):
        tk.topk_pages(s, 3, 1, due=torch.tensor([1, 0], device=DEV))
    with pytest.raises(ValueError, match="due must be one integer or bool tensor"):
        tk.topk_pages_ref(s, 3, 1, due=torch.tensor(1.0, device=DEV))
    for bad in (torch.empty(1, 2, 4, dtype=torch.int32, device=DEV), torch.empty(1, 2, 3, device=DEV)):
        with pytest.raises(ValueError, match="out must be torch.int32 \\(1, 2, 3\\)"):
            tk.topk_pages(s, 3, 1, out=bad)


def _bounds(B, H, P, D, S, filled, g):
    kmin = torch.full((B, H, P, D), float("inf"))
    kmax = torch.full((B, H, P, D), float("-inf"))
    k = torch.randn(B, H, filled, D, generator=g)
    n = filled // S
    kmin[:, :, :n] = k[:, :, : n * S].reshape(B, H, n, S, D).amin(3)
    kmax[:, :, :n] = k[:, :, : n * S].reshape(B, H, n, S, D).amax(3)
    return kmin.to(DEV), kmax.to(DEV)


@pytest.mark.parametrize("reduce", ["none", "max"])
@pytest.mark.parametrize("rows", [False, True], ids=["own-rows", "page-table"])
def test_score_with_the_flag_on_reads_and_writes_nothing(reduce, rows):
    g = torch.Generator().manual_seed(3)
    B, H, G, P, D, S = 2, 2, 3, 21, 16, 4
    kmin, kmax = _bounds(B, H, P, D, S, 17 * S, g)
    q = torch.randn(B, H * G, D, generator=g).to(DEV)
    pos = torch.tensor(17 * S - 2, device=DEV)
    table = torch.tensor([[1] * P, [0] * P], dtype=torch.int32, device=DEV) if rows else None
    kw = dict(pos=pos, rows=table)
    want = tk.score_pages_ref(q, kmin, kmax, P * S, S, 0, reduce, **kw)
    fin = want.isfinite()
    for due in (None, _flag(1), _flag(True, torch.bool)):  # flag off: today's scores
        got = tk.score_pages(q, kmin, kmax, P * S, S, 0, reduce, due=due, **kw)
        assert torch.equal(got.isfinite(), fin) and torch.equal(got[~fin], want[~fin])
        torch.testing.assert_close(got[fin], want[fin], atol=1e-5, rtol=1e-5)
        out = torch.full_like(want, 7.0)
        assert tk.score_pages(q, kmin, kmax, P * S, S, 0, reduce, due=due, out=out, **kw) is out
        assert torch.equal(out.isfinite(), fin) and torch.equal(out[~fin], want[~fin])
    for due in (_flag(0), _flag(False, torch.bool)):
        out = torch.full_like(want, 7.0)
        tk.score_pages(q, kmin, kmax, P * S, S, 0, reduce, due=due, out=out, **kw)
        assert (out == 7.0).all(), "a reusing step's score wrote its output"
        ref_out = torch.full_like(want, 7.0)
        tk.score_pages_ref(q, kmin, kmax, P * S, S, 0, reduce, due=due, out=ref_out, **kw)
        assert (ref_out == 7.0).all()


def test_reuse_kernel_does_not_read_a_reusing_steps_topk_output():
    # `fresh` is unwritten on a reusing step: whatever it holds (here ids no selection could hold), the merge
    # attends the stored selection, as its twin does.
    B, H, K, S, every = 2, 3, 5, 4, 4
    stored = torch.tensor([0, 2, 5, 8, 40], dtype=torch.int32).expand(B, H, K).contiguous().to(DEV)
    state = [stored, torch.tensor(37, device=DEV), torch.tensor(1, device=DEV), _flag(0)]
    mine = [t.clone() for t in state]
    garbage = torch.full((B, H, K), SENTINEL, dtype=torch.int32, device=DEV)
    pos = torch.tensor(41, device=DEV)  # one page (10) started since the selection (at 37: page 9 current)
    got = tk.reuse_pages(garbage, *mine, pos, S, every)
    want = tk.reuse_pages_ref(garbage.clone(), *state, pos, S, every)
    assert torch.equal(got, want)
    assert got[0, 0].tolist() == [0, 2, 5, 8, 10, 40]
    assert torch.equal(mine[0], stored) and all(torch.equal(a, b) for a, b in zip(mine, state))


def _drive(backend, every, steps, S=4, seed=0):
    """A GQA layer driven by hand over `steps` decode steps: each step's selected page ids."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, D = 2, 2, 2, 16
    cfg = QuestConfig(budget=3 * S, page_size=S, reselect_every=every, backend=backend)
    layer = QuestLayer(cfg, capacity=12 * S)
    layer.update(torch.randn(B, H, 5 * S + 1, D, generator=g).to(DEV),
                 torch.randn(B, H, 5 * S + 1, D, generator=g).to(DEV))
    seen = []
    for t in range(steps):
        layer.update((torch.randn(B, H, 1, D, generator=g) * (1 + t % 3)).to(DEV),
                     torch.randn(B, H, 1, D, generator=g).to(DEV))
        seen.append((layer.selector.select(layer, torch.randn(B, H * G, D, generator=g).to(DEV), 0).clone(),
                     int(layer.reuse["due"])))
    return seen


@pytest.mark.parametrize("every", [2, 4])
def test_reuse_steps_select_the_torch_paths_pages(every):
    steps = 3 * every + 1
    torch_ids, triton_ids = _drive("torch", every, steps), _drive("triton", every, steps)
    assert [d for _, d in torch_ids] == [d for _, d in triton_ids] == [int((t + 1) % every == 0)
                                                                       for t in range(steps)]
    for t, ((a, _), (b, _)) in enumerate(zip(torch_ids, triton_ids)):
        assert torch.equal(a, b), f"step {t}"
