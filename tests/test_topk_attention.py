"""Top-K + sparse attention in one launch (triton_kernels/topk_attend.py) vs its twins (CPU, TRITON_INTERPRET=1)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from triton_kernels import sparse_attention as attn_mod  # noqa: E402
from triton_kernels import topk_attend as ta_mod  # noqa: E402

from .test_kernels import BF16, DEV, F16, F32, assert_close, filled_layer  # noqa: E402

CASES = [
    # B, H_q, H_kv, D, S, L, window_start, k pages, reduce, dtype, left padding per row
    pytest.param(1, 4, 4, 64, 16, 1, 0, 2, "none", F32, (), id="len1-mha"),
    pytest.param(2, 6, 2, 64, 16, 333, 0, 5, "none", F16, (0, 100), id="len333-G3-union-pad"),
    pytest.param(2, 8, 2, 128, 16, 500, 0, 4, "max", BF16, (17, 0), id="len500-G4-max-bf16"),
    pytest.param(1, 8, 1, 64, 16, 260, 0, 3, "sum", F16, (), id="len260-G8-sum"),
    pytest.param(3, 4, 4, 64, 8, 77, 0, 100, "none", F32, (0, 20, 76), id="len77-S8-k>=P"),
    pytest.param(1, 4, 2, 128, 16, 1500, 300, 6, "none", F16, (), id="len1500-window"),
    pytest.param(2, 2, 2, 64, 32, 200, 0, 3, "none", BF16, (5, 0), id="len200-S32"),
]


def _inputs(B, Hq, Hkv, D, S, L, dtype, pad, seed):
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=seed, pad=pad)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEV)
    return q, kc, vc, kmin, kmax, valid


@pytest.mark.parametrize("programs_per_sm,max_tile", [(1, 4096), (8, 16)], ids=["few-splits", "many-splits-tiled"])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,ws,k,reduce,dtype,pad", CASES)
def test_topk_attention_matches_reference(B, Hq, Hkv, D, S, L, ws, k, reduce, dtype, pad, programs_per_sm, max_tile,
                                          monkeypatch):
    monkeypatch.setattr(ta_mod, "PROGRAMS_PER_SM", programs_per_sm)  # the interpreter has 4 "SMs"
    monkeypatch.setattr(ta_mod, "MAX_TILE", max_tile)
    q, kc, vc, kmin, kmax, valid = _inputs(B, Hq, Hkv, D, S, L, dtype, pad, seed=L)
    scores = tk.score_pages_ref(q, kmin, kmax, L, S, ws, reduce)
    scale = D ** -0.5
    want, ids_ref = tk.topk_attention_ref(scores, k, q, kc, vc, valid, L, S, scale, ws, return_ids=True)
    got, ids = tk.topk_attention(scores, k, q, kc, vc, valid, L, S, scale, ws, return_ids=True)
    assert torch.equal(ids, ids_ref)
    assert_close(got, want)


@pytest.mark.parametrize("fuse_merge", [True, False], ids=["fused-merge", "merge-kernel"])
def test_topk_attention_ties_match_the_two_kernels(fuse_merge, monkeypatch):
    # Many equal scores at the k-th: the same lowest-id choice as topk_pages, and the same attention over it.
    monkeypatch.setattr(attn_mod, "FUSE_MERGE_MAX_SPLITS", 1 << 30 if fuse_merge else 0)
    monkeypatch.setattr(ta_mod, "PROGRAMS_PER_SM", 4)
    B, Hq, Hkv, D, S, L, k = 2, 4, 2, 64, 16, 700, 9
    q, kc, vc, kmin, kmax, valid = _inputs(B, Hq, Hkv, D, S, L, F16, (0, 60), seed=11)
    scores = tk.score_pages_ref(q, kmin, kmax, L, S, 0, "none").round()
    ids_two = tk.topk_pages(scores, k, Hq // Hkv)
    got, ids = tk.topk_attention(scores, k, q, kc, vc, valid, L, S, 0.125, return_ids=True)
    assert torch.equal(ids, ids_two)
    assert_close(got, tk.sparse_decode_attention_ref(q, kc, vc, ids_two, valid, L, S, 0.125, 0))


def test_topk_attention_rejects_scores_not_grouped_by_kv_head():
    q, kc, vc, kmin, kmax, valid = _inputs(1, 4, 2, 64, 16, 100, F16, (), seed=1)
    scores = tk.score_pages_ref(q, kmin, kmax, 100, 16, 0, "none")
    with pytest.raises(ValueError, match="H_kv \\* group"):
        tk.topk_attention(scores[:, :3], 2, q, kc, vc, valid, 100, 16, 0.125)
    with pytest.raises(ValueError, match="k >= 1"):
        tk.topk_attention(scores, 0, q, kc, vc, valid, 100, 16, 0.125)
