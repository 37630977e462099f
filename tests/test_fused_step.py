"""The one-launch Quest step (`triton_kernels.fused_step`) against the references it fuses (CPU: the interpreter,
small odd sizes; the compiled kernel at real sizes: tests/gpu/test_gpu_fused_step.py)."""
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton_kernels as tk  # noqa: E402
from triton_kernels import fused_step as fs  # noqa: E402
from triton_kernels.bounds8 import channel_scales, empty_bounds8  # noqa: E402

from .test_kernels import filled_layer  # noqa: E402
from .testing import DEVICE as DEV  # noqa: E402
from .testing import F16, F32, assert_close, nan_empty  # noqa: E402

SMALL = fs.StepLaunch(score_block=16, score_item=32, block_n=16)  # several items and splits a head at these sizes
THREE = fs.StepLaunch(score_block=16, score_item=32, block_n=16, launches=3)
# A resident scoring grid: the interpreter counts 4 SMs, so 4 programs each walk several items of several heads.
RESIDENT = fs.StepLaunch(score_block=16, score_item=16, block_n=16, launches=3, score_programs=1, topk_warps=2)

CASES = [
    # B, H_q, H_kv, D, S, L, k, dtype, pad, reduce, bounds, device position, window, softcap, sinks
    pytest.param(2, 3, 3, 64, 16, 333, 5, F16, (0, 100), "none", "key_dtype", False, 0, 0.0, False, id="mha-pad"),
    pytest.param(1, 4, 2, 32, 8, 411, 9, F32, (), "max", "int8_channel", True, 0, 0.0, False, id="max-int8c-pos"),
    pytest.param(2, 6, 2, 64, 16, 250, 4, F32, (7, 0), "sum", "int8", True, 100, 5.0, True, id="sum-window-cap-sinks"),
    pytest.param(1, 2, 2, 16, 4, 37, 50, F32, (), "none", "key_dtype", False, 0, 0.0, False, id="k>=P"),
    pytest.param(2, 3, 3, 64, 16, 333, 5, F16, (0, 100), "none", "int8_channel", True, 0, 0.0, False,
                 id="mha-int8c-pad"),
]


# The scoring launch in the tensor-core forms (`StepLaunch.score_mma`): "mma" on float bounds in q's 16-bit dtype,
# "mma8" on 8-bit codes (the int8 cases here), the elementwise form otherwise.
THREE_MMA = fs.StepLaunch(score_block=16, score_item=32, block_n=16, launches=3, score_mma=True)
# The scoring launch's ScoreLaunch options (round 34): MHA channel codes (mha-int8c) and fp16 bounds (mha-pad) read
# as 32-bit words.
# trunc_parts runs on a GPU only (the interpreter's "mma8" takes one fp32 part): tests/gpu/test_gpu_fused_step.py.
THREE_OPTS = fs.StepLaunch(score_block=16, score_item=32, block_n=16, launches=3, packed_codes=True,
                           packed_bounds=True)


@pytest.mark.parametrize("launch", [SMALL, THREE, RESIDENT, THREE_MMA, THREE_OPTS],
                         ids=["one-launch", "three-launches", "resident-scoring", "three-launches-mma",
                              "three-launches-opts"])
@pytest.mark.parametrize("B,Hq,Hkv,D,S,L,k,dtype,pad,reduce,bounds,use_pos,window,softcap,sinks", CASES)
def test_fused_step_matches_the_references(B, Hq, Hkv, D, S, L, k, dtype, pad, reduce, bounds, use_pos, window,
                                           softcap, sinks, launch, monkeypatch):
    kc, vc, kmin, kmax, valid = filled_layer(B, Hkv, D, S, L, dtype, seed=L, pad=pad, C=-(-L // S) * S + 3 * S)
    C = kc.shape[2]
    q = (torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(L)) * 2).to(dtype).to(DEV)
    pos = torch.tensor(L, device=DEV) if use_pos else None
    seq = C if use_pos else L
    lo, hi, kw = kmin, kmax, {}
    if bounds != "key_dtype":
        lo, hi, sc = empty_bounds8(*kmin.shape, DEV)
        chan = channel_scales(kc[:, :, :L]) if bounds == "int8_channel" else None
        tk.quantize_bounds(kmin, kmax, lo, hi, sc, chan=chan)
        kw = dict(scale=sc, chan=chan)
    # The word paths are taken where they apply: one query head a KV head, channel codes or 16-bit float bounds.
    assert tk.score.word_form(q, lo, hi, kw.get("scale"), kw.get("chan"), launch.score_form) == (
        1 if launch.packed_codes and bounds == "int8_channel" and Hq == Hkv else
        2 if launch.packed_bounds and bounds == "key_dtype" and dtype != F32 and Hq == Hkv else 0)
    att = dict(softcap=softcap, sinks=torch.linspace(-1, 2, Hq).to(DEV) if sinks else None)
    args = (q, lo, hi, kc, vc, valid, seq, S, k, D ** -0.5, reduce)
    out_ref, ids_ref = fs.quest_step_ref(*args, pos=pos, window=window, **kw, **att)
    ws = fs.step_workspace(B, Hkv, DEV)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))  # an unwritten output slot fails below
    for _ in range(2):  # the workspace comes back zeroed, so a second launch on it is the same
        out, ids = fs.quest_step(*args, pos=pos, window=window, **kw, **att, workspace=ws, launch=launch)
        assert torch.equal(ids, ids_ref)
        assert_close(out, out_ref)
        assert (ws == 0).all()
    # The interpreter has no programmatic dependent launch: the launches ran one after the other, and say so.
    assert fs.quest_step.overlapped is False


def test_fused_step_refuses_what_it_does_not_run():
    kc, vc, kmin, kmax, valid = filled_layer(1, 2, 16, 4, 40, F32, seed=1)
    q = torch.randn(1, 4, 16).to(DEV)
    args = (q, kmin, kmax, kc, vc, valid, 40, 4, 3, 0.25)
    with pytest.raises(ValueError, match="GQA union"):
        fs.quest_step(*args, "none")
    with pytest.raises(ValueError, match="lean_keys"):
        fs.quest_step(*args, "max", launch=fs.StepLaunch(lean_keys=8))
    with pytest.raises(ValueError, match="workspace must be int32"):
        fs.quest_step(*args, "max", workspace=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of score_block"):
        fs.StepLaunch(score_block=16, score_item=40)
    with pytest.raises(ValueError, match="launches must be"):
        fs.StepLaunch(launches=2)
    with pytest.raises(ValueError, match="score_programs"):
        fs.StepLaunch(score_programs=2)  # the resident scoring grid is the three-launch step's
    with pytest.raises(ValueError, match="topk_warps"):
        fs.StepLaunch(topk_warps=2)  # the Top-K has its own launch only in the three-launch step
    with pytest.raises(ValueError, match="topk_warps"):
        fs.StepLaunch(launches=3, topk_warps=3)
    assert fs.fused_step_supported(10, 1, "none", rows=torch.zeros(1, 10, dtype=torch.int32)).startswith("beam")
