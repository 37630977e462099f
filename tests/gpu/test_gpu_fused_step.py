"""GPU-marked: the one-launch Quest step (`triton_kernels.fused_step.quest_step`) compiled at real layer sizes,
against the separate kernels (the same ids, exactly) and the references (outputs), plain and as CUDA-graph
replays (the workspace must come back to zero after every launch: a replay reuses it).

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_fused_step.py`.
"""
import pytest
import torch

import triton_kernels as tk
from triton_kernels import fused_step as fs
from triton_kernels.bounds8 import channel_scales, empty_bounds8
from triton_kernels.score import ScoreLaunch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
S = 16


def layer(B, H, L, D, extra, seed, dtype=torch.float16):
    """L tokens (row 0 left-padded) in an allocation of whole pages plus `extra` empty ones, bounds by append_kv_ref."""
    g = torch.Generator(DEV).manual_seed(seed)
    C = -(-L // S) * S + extra * S
    kc = torch.randn(B, H, C, D, device=DEV, dtype=dtype, generator=g)
    vc = torch.randn(B, H, C, D, device=DEV, dtype=dtype, generator=g)
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    valid[:, :L] = True
    valid[0, : min(L // 3, 700)] = False  # left padding in row 0
    kmin = torch.full((B, H, C // S, D), float("inf"), device=DEV, dtype=dtype)
    kmax = -kmin
    tk.append_kv_ref(kc, vc, kmin, kmax, torch.zeros_like(valid), kc[:, :, :L].clone(), vc[:, :, :L].clone(),
                     valid[:, :L].clone(), 0)
    return kc, vc, kmin, kmax, valid


CASES = [
    # B, H_q, H_kv, L, extra pages, reduce, bounds, window, softcap, sinks, k
    pytest.param(1, 32, 32, 32768, 0, "none", "key_dtype", 0, 0.0, False, 128, id="7b-32k"),
    pytest.param(1, 32, 32, 32768, 5, "none", "key_dtype", 0, 0.0, False, 129, id="7b-32k-alloc-pos"),
    pytest.param(1, 32, 32, 131072, 5, "none", "int8_channel", 0, 0.0, False, 129, id="7b-128k-alloc-int8c"),
    pytest.param(1, 32, 8, 32768 + 37, 4, "max", "key_dtype", 0, 0.0, False, 129, id="8b-32k-max-odd"),
    pytest.param(1, 32, 8, 32768, 5, "sum", "int8", 4096, 30.0, True, 129, id="8b-sum-int8-window-cap-sinks"),
    pytest.param(8, 32, 32, 8192, 3, "none", "key_dtype", 0, 0.0, False, 129, id="b8-8k"),
    pytest.param(2, 4, 1, 3001, 2, "max", "key_dtype", 0, 0.0, False, 500, id="k-near-P"),
]


LAUNCHES = [fs.STEP_LAUNCH, fs.StepLaunch(launches=3), fs.StepLaunch(launches=3, score_item=32, score_block=32,
                                                                      score_programs=2),
            fs.StepLaunch(launches=3, score_programs=4, packed_codes=True, trunc_parts=True, packed_bounds=True)]
LAUNCH_IDS = ["one-launch", "three-launches", "resident-scoring", "three-launches-score-opts"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("B,Hq,Hkv,L,extra,reduce,bounds,window,softcap,sinks,k", CASES)
def test_fused_step_equals_the_separate_kernels(B, Hq, Hkv, L, extra, reduce, bounds, window, softcap, sinks, k,
                                                launch):
    D = 128
    kc, vc, kmin, kmax, valid = layer(B, Hkv, L, D, extra, seed=L + Hkv)
    C = kc.shape[2]
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.float16) * 2
    pos = torch.tensor(L, device=DEV) if extra else None
    lo, hi, kw = kmin, kmax, {}
    if bounds != "key_dtype":
        lo, hi, sc = empty_bounds8(*kmin.shape, DEV)
        chan = channel_scales(kc[:, :, :L]) if bounds == "int8_channel" else None
        tk.quantize_bounds(kmin, kmax, lo, hi, sc, chan=chan)
        kw = dict(scale=sc, chan=chan)
    sink = torch.linspace(-1, 3, Hq, device=DEV) if sinks else None
    att = dict(softcap=softcap, sinks=sink)
    # The separate score with the step's score options (round 34's packed codes and bounds, truncated parts), so both
    # compute each page's score alike.
    opts = ScoreLaunch(packed_codes=launch.packed_codes, trunc_parts=launch.trunc_parts,
                       packed_bounds=launch.packed_bounds)
    s = tk.score_pages(q, lo, hi, C, S, 0, reduce, pos=pos, window=window, **kw, launch=opts)
    ids_sep = tk.topk_pages(s, k, 1)
    out_sep = tk.sparse_decode_attention(q, kc, vc, ids_sep, valid, C, S, D ** -0.5, 0, pos=pos if window else None,
                                         window=window, **att)
    ws = fs.step_workspace(B, Hkv, DEV)
    args = (q, lo, hi, kc, vc, valid, C, S, k, D ** -0.5, reduce)
    out, ids = fs.quest_step(*args, pos=pos, window=window, **kw, **att, workspace=ws, launch=launch)
    # On Hopper the launches after the first overlap the one before (programmatic dependent launch).
    assert fs.quest_step.overlapped is (launch.launches > 1 and torch.cuda.get_device_capability()[0] >= 9)
    assert torch.equal(ids, ids_sep)
    torch.testing.assert_close(out, out_sep, atol=2e-3, rtol=2e-3)
    ref = tk.sparse_decode_attention_ref(q, kc, vc, ids_sep, valid, C, S, D ** -0.5, 0, pos=pos if window else None,
                                         window=window, **att)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert (ws == 0).all()
    # Graph replays on the same workspace: the same ids and output every time, the workspace zero after each.
    ids_g = torch.full_like(ids, -7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, _ = fs.quest_step(*args, pos=pos, window=window, **kw, **att, workspace=ws, ids_out=ids_g,
                                 launch=launch)
    for _ in range(5):
        ids_g.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids_g, ids_sep) and (ws == 0).all()
        torch.testing.assert_close(out_g, out_sep, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_fused_step_graph_chain_of_layers_on_one_workspace(launch):
    # A captured decode's layers run one after another on one workspace: 12 steps back to back in one graph,
    # each checked against its own separate-kernel step.
    B, H, L, D, k = 1, 32, 16384, 128, 129
    layers = [layer(B, H, L, D, 5, seed=i) for i in range(3)]
    qs = [torch.randn(B, H, D, device=DEV, dtype=torch.float16) for _ in range(3)]
    pos = torch.tensor(L, device=DEV)
    ws = fs.step_workspace(B, H, DEV)
    want = []
    for (kc, vc, kmin, kmax, valid), q in zip(layers, qs):
        ids = tk.topk_pages(tk.score_pages(q, kmin, kmax, kc.shape[2], S, 0, "none", pos=pos), k, 1)
        want.append(tk.sparse_decode_attention(q, kc, vc, ids, valid, kc.shape[2], S, D ** -0.5))
    outs = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(12):
            kc, vc, kmin, kmax, valid = layers[i % 3]
            outs.append(fs.quest_step(qs[i % 3], kmin, kmax, kc, vc, valid, kc.shape[2], S, k, D ** -0.5, "none",
                                      pos=pos, workspace=ws, launch=launch)[0])
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, want[i % 3], atol=2e-3, rtol=2e-3)
        assert (ws == 0).all()


# ----------------------------------------------------------------------------- a patched model's decode through it


def _model(kv_heads, model_type="llama", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=1000,
                               max_position_embeddings=8192, attn_implementation="sdpa", eos_token_id=None,
                               pad_token_id=0, **extra)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg).half().eval()
    with torch.no_grad():  # sharpen attention so that selection matters
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model


def _generate(model, ids, cuda_graph, **options):
    from quest_hf import patch_model

    patch_model(model, budget=256, page_size=16, cuda_graph=cuda_graph, compile_step=False, **options)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         return_dict_in_generate=True, output_scores=True)
    return out, [layer.step_kernels for layer in out.past_key_values.layers[2:]]


@pytest.mark.parametrize("kv_heads, model_type, extra, options", [
    pytest.param(4, "llama", {}, {}, id="mha-auto"),
    # decode_gemv=False: with the GEMV on, one step's scores of the fused and separate kernels differ by 0.64 (every
    # other step <= 0.004, tokens equal; benchmarks/kernels/round21, probe fused_int8c_probe.py); its cause is not
    # established, so this case checks the kernels with cuBLAS's projections, where all steps agree to rounding.
    pytest.param(4, "llama", {}, dict(bounds="int8_channel", decode_gemv=False, fused_step=True), id="mha-int8c-on"),
    pytest.param(2, "llama", {}, dict(gqa_mode="max", fused_step=True), id="gqa-max-on"),
    pytest.param(2, "mistral", dict(sliding_window=1024), dict(gqa_mode="max", fused_step=True), id="window-on"),
])
def test_patched_decode_through_the_fused_step_gives_the_separate_kernels_tokens(kv_heads, model_type, extra,
                                                                                 options):
    model = _model(kv_heads, model_type, **extra)
    ids = torch.randint(2, 1000, (1, 3000), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    sep, sep_kernels = _generate(model, ids, False, **{**options, "fused_step": False})
    assert sep_kernels == ["separate: QuestConfig(fused_step=False)"] * 2
    for cuda_graph in (False, "auto"):
        fused, kernels = _generate(model, ids, cuda_graph, **options)
        pdl = torch.cuda.get_device_capability()[0] >= 9
        if options.get("fused_step") is not True and not pdl:
            assert all(k.startswith("separate: fused_step='auto' needs") for k in kernels)
            continue
        assert kernels == ["fused: three launches " + ("chained by PDL" if pdl else "one after another (no PDL)")] * 2
        assert torch.equal(sep.sequences, fused.sequences), cuda_graph
        for a, b in zip(sep.scores, fused.scores):
            torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)  # attention tiles differ: rounding


def test_auto_keeps_the_separate_kernels_for_batches_gqa_unions_and_8bit_bounds():
    model = _model(2)
    ids = torch.randint(2, 1000, (2, 600), device=DEV, generator=torch.Generator(DEV).manual_seed(2))
    _, kernels = _generate(model, ids, "auto", gqa_mode="max")
    assert kernels == ["separate: fused_step='auto' takes batch 1 only (slower at batch 8 on an H200)"] * 2
    _, kernels = _generate(model, ids[:1], "auto")
    assert kernels == ["separate: the GQA union (one score row a query head) runs as separate kernels"] * 2
    _, kernels = _generate(_model(4), ids[:1], "auto", bounds="int8_channel")  # MHA, one sequence, 8-bit bounds
    assert kernels == ["separate: fused_step='auto' takes key-dtype bounds only (slower with 8-bit bounds at 128K "
                       "on an H100)"] * 2
