"""The one-launch Quest decode step (triton_kernels/quest_step.py) vs its PyTorch twin (CPU, TRITON_INTERPRET=1)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from triton_kernels import quest_step  # noqa: E402

from .test_kernels import DEV, BF16, F16, F32, assert_close, filled_layer  # noqa: E402

CASES = [
    # B, H_q, H_kv, D, S, L, window_start, k pages, reduce, dtype, left padding per row
    pytest.param(1, 4, 4, 64, 16, 1, 0, 2, "none", F32, (), id="len1-mha"),
    pytest.param(2, 6, 2, 64, 16, 333, 0, 5, "none", F16, (0, 100), id="len333-G3-union-pad"),
    pytest.param(2, 8, 2, 128, 16, 500, 0, 4, "max", BF16, (17, 0), id="len500-G4-max-bf16"),
    pytest.param(1, 8, 1, 64, 16, 260, 0, 3, "sum", F16, (), id="len260-G8-sum"),
    pytest.param(3, 4, 4, 64, 8, 77, 0, 100, "none", F32, (0, 20, 76), id="len77-S8-k>=P"),
    pytest.param(1, 4, 2, 128, 16, 1500, 300, 6, "none", F16, (), id="len1500-window-multichunk"),
    pytest.param(2, 2, 2, 64, 32, 200, 0, 3, "none", BF16, (5, 0), id="len200-S32"),
]


def _inputs(B, Hq, Hkv, D, S, L, dtype, pad, seed):
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=seed, pad=pad)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    return q, kc, vc, kmin, kmax, valid


@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,ws,k,reduce,dtype,pad", CASES)
def test_quest_decode_matches_reference(B, Hq, Hkv, D, S, L, ws, k, reduce, dtype, pad):
    q, kc, vc, kmin, kmax, valid = _inputs(B, Hq, Hkv, D, S, L, dtype, pad, seed=L)
    scale = D ** -0.5
    want, ids_ref = tk.quest_decode_ref(q, kc, vc, kmin, kmax, valid, L, S, k, scale, ws, reduce, return_ids=True)
    for _ in range(2):  # the second call finds the counters the first one left: they must be back at zero
        got, ids = tk.quest_decode(q, kc, vc, kmin, kmax, valid, L, S, k, scale, ws, reduce, return_ids=True)
        assert torch.equal(ids, ids_ref)
        assert_close(got, want)
    sync = next(w["sync"] for key, w in quest_step._workspaces.items() if key[1:3] == (B, Hkv))
    assert (sync == 0).all()


@pytest.mark.parametrize("tile", [False, True], ids=["one-tile", "tiled"])
def test_quest_decode_forces_the_device_position_page(tile, monkeypatch):
    # The captured step scores the whole capacity and forces the page holding position pos - 1.
    if tile:
        monkeypatch.setattr(quest_step, "TOPK_MAX_TILE", 16)
    B, Hq, Hkv, D, S, L = 2, 4, 2, 64, 16, 300
    q, kc, vc, kmin, kmax, valid = _inputs(B, Hq, Hkv, D, S, L, F16, (0, 40), seed=7)
    C = kc.shape[2]
    for pos in (17, 161, 300):
        p = torch.tensor(pos, device=DEV)
        want, ids_ref = tk.quest_decode_ref(q, kc, vc, kmin, kmax, valid, C, S, 3, 0.125, pos=p, return_ids=True)
        got, ids = tk.quest_decode(q, kc, vc, kmin, kmax, valid, C, S, 3, 0.125, pos=p, return_ids=True)
        assert ((ids == (pos - 1) // S).sum(-1) == 1).all()  # chosen by every KV head
        assert torch.equal(ids, ids_ref)
        assert_close(got, want)


def test_quest_decode_poisoned_workspace_and_output_do_not_leak():
    # Scores, ids and partials are fully rewritten each call: NaN left in them from before must not matter.
    B, Hq, Hkv, D, S, L, k = 2, 4, 2, 64, 16, 211, 4
    q, kc, vc, kmin, kmax, valid = _inputs(B, Hq, Hkv, D, S, L, F16, (0, 33), seed=3)
    want = tk.quest_decode_ref(q, kc, vc, kmin, kmax, valid, L, S, k, 0.125)
    tk.quest_decode(q, kc, vc, kmin, kmax, valid, L, S, k, 0.125)
    for key, ws in quest_step._workspaces.items():
        for name in ("scores", "m", "l", "acc"):
            ws[name].fill_(float("nan"))
        ws["ids"].fill_(7)
    assert_close(tk.quest_decode(q, kc, vc, kmin, kmax, valid, L, S, k, 0.125), want)


def test_quest_decode_rejects_bad_input():
    q, kc, vc, kmin, kmax, valid = _inputs(1, 4, 2, 64, 16, 100, F16, (), seed=1)
    with pytest.raises(ValueError, match="pos must be one integer"):
        tk.quest_decode(q, kc, vc, kmin, kmax, valid, 100, 16, 2, 0.125, pos=torch.tensor(3.0))
    with pytest.raises(ValueError, match="k must be"):
        tk.quest_decode(q, kc, vc, kmin, kmax, valid, 100, 16, 0, 0.125)
    with pytest.raises(ValueError, match="k_cache must be"):
        tk.quest_decode(q, kc[:, :, :64], vc[:, :, :64], kmin, kmax, valid, 100, 16, 2, 0.125)
    with pytest.raises(ValueError, match="query heads cannot be grouped"):
        tk.quest_decode(q[:, :3], kc, vc, kmin, kmax, valid, 100, 16, 2, 0.125)
