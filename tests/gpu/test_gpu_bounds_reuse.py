"""GPU-marked: 8-bit page bounds and selection reuse (#16 points 3, 4) compiled at real sizes against their twins,
and captured decode steps against the same steps run eagerly (a reusing step's score and Top-K launches write
nothing: checked inside a captured graph).

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_bounds_reuse.py`.
"""
import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, QuestLayer, patch_model
from quest_hf.attention import decode_attention
from quest_hf.bench import random_llama
from triton_kernels.bounds8 import empty_bounds8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _bounds(B, H, D, L, C, S=16, dtype=torch.float16, seed=0):
    g = torch.Generator(DEV).manual_seed(seed)
    keys = torch.zeros(B, H, C, D, dtype=dtype, device=DEV)
    kmin = torch.full((B, H, C // S, D), float("inf"), dtype=dtype, device=DEV)
    kmax = torch.full_like(kmin, float("-inf"))
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    k = (torch.randn(B, H, L, D, generator=g, device=DEV) * 4).to(dtype)
    tk.append_kv(keys, keys.clone(), kmin, kmax, valid, k, k, None, 0)
    return kmin, kmax


# Real layer sizes: Llama-3-8B at 32K, Llama-2-7B at 128K, Llama-2-7B at batch 8 (a few tokens past whole pages).
REAL_SIZES = [
    pytest.param(1, 32, 8, 32768 + 5, id="llama3-8b-32K"),
    pytest.param(1, 32, 32, 131072 + 3, id="llama2-7b-128K"),
    pytest.param(8, 32, 32, 8192 + 3, id="llama2-7b-B8-8K"),
]


@pytest.mark.parametrize("B, Hq, H, L", REAL_SIZES)
def test_compiled_int8_and_flagged_kernels_match_their_twins_at_real_sizes(B, Hq, H, L):
    D, S = 128, 16
    C = -(-(L + 64) // S) * S + S
    kmin, kmax = _bounds(B, H, D, L, C)
    mine, ref = empty_bounds8(*kmin.shape, DEV), empty_bounds8(*kmin.shape, DEV)
    tk.quantize_bounds(kmin, kmax, *mine)
    tk.quantize_bounds_ref(kmin, kmax, *ref)
    for a, b in zip(mine, ref):  # correctly rounded division on both sides: bit for bit
        assert torch.equal(a, b)
    lo, hi = mine[0].float() * mine[2][..., None], mine[1].float() * mine[2][..., None]
    live = kmin <= kmax
    assert (lo[live] <= kmin.float()[live]).all() and (hi[live] >= kmax.float()[live]).all()
    pos = torch.tensor(L, device=DEV)
    tk.quantize_bounds_at(kmin, kmax, *mine, pos, S)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.float16)
    for reduce in ("none", "max"):
        s = tk.score_pages(q, mine[0], mine[1], C, S, 0, reduce, pos=pos, scale=mine[2])
        s_ref = tk.score_pages_ref(q, mine[0], mine[1], C, S, 0, reduce, pos=pos, scale=mine[2])
        fin = s_ref.isfinite()
        assert torch.equal(fin, s.isfinite()) and torch.equal(s_ref[~fin], s[~fin])
        torch.testing.assert_close(s[fin], s_ref[fin], atol=1e-2, rtol=1e-3)
        exact = tk.score_pages_ref(q, kmin, kmax, C, S, 0, reduce, pos=pos)
        assert (s_ref[fin] >= exact[fin]).all()
        for due in (torch.tensor(True, device=DEV), torch.tensor(1, device=DEV)):
            got = tk.score_pages(q, mine[0], mine[1], C, S, 0, reduce, pos=pos, scale=mine[2], due=due)
            want = tk.score_pages_ref(q, mine[0], mine[1], C, S, 0, reduce, pos=pos, scale=mine[2], due=due)
            fin = want.isfinite()
            assert torch.equal(fin, got.isfinite()) and torch.equal(want[~fin], got[~fin])
            torch.testing.assert_close(got[fin], want[fin], atol=1e-2, rtol=1e-3)
        for due in (torch.tensor(False, device=DEV), torch.tensor(0, device=DEV)):  # a reusing step: no write
            out = torch.full_like(s, 7.0)
            tk.score_pages(q, mine[0], mine[1], C, S, 0, reduce, pos=pos, scale=mine[2], due=due, out=out)
            assert (out == 7.0).all()


@pytest.mark.parametrize("B, Hq, H, L", REAL_SIZES)
def test_compiled_channel_code_kernels_match_their_twins_at_real_sizes(B, Hq, H, L):
    # QuestConfig(bounds="int8_channel"): scales from the first 4K keys, later keys up to 8x larger (exponents).
    D, S = 128, 16
    C = -(-(L + 64) // S) * S + S
    g = torch.Generator(DEV).manual_seed(3)
    keys = torch.zeros(B, H, C, D, dtype=torch.float16, device=DEV)
    kmin = torch.full((B, H, C // S, D), float("inf"), dtype=torch.float16, device=DEV)
    kmax = torch.full_like(kmin, float("-inf"))
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    k = torch.randn(B, H, L, D, generator=g, device=DEV) * 4
    k[:, :, 4096:] *= torch.rand(B, H, L - 4096, 1, generator=g, device=DEV) * 8
    k = k.half()
    chan = tk.bounds8.channel_scales(k[:, :, :4096])
    mine, ref = [*empty_bounds8(*kmin.shape, DEV), chan], [*empty_bounds8(*kmin.shape, DEV), chan]
    tk.append_kv(keys, keys.clone(), kmin, kmax, valid, k, k, None, 0, bounds8=tuple(mine))
    tk.quantize_bounds_ref(kmin, kmax, *ref[:3], chan=chan)
    for a, b in zip(mine, ref):  # the append launch's codes: bit for bit
        assert torch.equal(a, b)
    assert ref[2].max() >= 4  # pages past the prefill's range took exponents
    se = chan[None, :, None, :] * mine[2][..., None]
    lo, hi = mine[0].float() * se, mine[1].float() * se
    live = kmin <= kmax
    assert (lo[live] <= kmin.float()[live]).all() and (hi[live] >= kmax.float()[live]).all()
    pos = torch.tensor(L, device=DEV)
    again = [t.clone() for t in mine[:3]]
    tk.quantize_bounds(kmin, kmax, *again, chan=chan)
    tk.quantize_bounds_at(kmin, kmax, *again, pos, S, chan=chan)
    assert all(torch.equal(a, b) for a, b in zip(again, ref[:3]))
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.float16)
    for reduce in ("none", "max"):
        kw = dict(pos=pos, scale=mine[2], chan=chan)
        s = tk.score_pages(q, mine[0], mine[1], C, S, 0, reduce, **kw)
        s_ref = tk.score_pages_ref(q, mine[0], mine[1], C, S, 0, reduce, **kw)
        fin = s_ref.isfinite()
        assert torch.equal(fin, s.isfinite()) and torch.equal(s_ref[~fin], s[~fin])
        torch.testing.assert_close(s[fin], s_ref[fin], atol=1e-2, rtol=1e-3)
        exact = tk.score_pages_ref(q, kmin, kmax, C, S, 0, reduce, pos=pos)
        assert (s_ref[fin] >= exact[fin]).all()


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = random_llama("tiny", torch.float16, torch.device(DEV), 4096)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


@pytest.mark.parametrize("options, kw", [
    pytest.param(dict(bounds="int8"), dict(do_sample=False), id="int8-greedy"),
    pytest.param(dict(reselect_every=4), dict(do_sample=False), id="reuse4-greedy"),
    pytest.param(dict(reselect_every=20), dict(do_sample=False), id="reuse20-two-new-pages"),
    pytest.param(dict(bounds="int8", reselect_every=3), dict(do_sample=False, num_beams=3), id="int8-reuse3-beams"),
    pytest.param(dict(bounds="int8_channel"), dict(do_sample=False), id="int8-channel-greedy"),
    pytest.param(dict(bounds="int8_channel"), dict(do_sample=False, num_beams=3), id="int8-channel-beams"),
])
def test_captured_steps_with_int8_bounds_and_reuse_give_the_eager_tokens(llama, options, kw):
    ids = torch.randint(2, 1000, (2, 300), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    results = {}
    for cuda_graph in (False, "auto"):
        patch_model(llama, budget=64, page_size=16, cuda_graph=cuda_graph, compile_step=False, **options)
        graph = llama._quest_state.graph
        before = graph.captures, graph.replays
        cache = QuestCache.from_model(llama, max_length=ids.shape[1] + 24)
        seen = []
        cache.selection_hooks.append(lambda i, q, page_ids, seen=seen: seen.append((i, page_ids.clone())))
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                             return_dict_in_generate=True, output_scores=True, **kw)
        results[cuda_graph] = out, cache, seen, (graph.captures - before[0], graph.replays - before[1])
    (eager, c_e, seen_e, _), (capt, c_c, seen_c, (captures, replays)) = results[False], results["auto"]
    assert c_e.decode_path == "eager: cuda_graph=False" and c_c.decode_path == "captured"
    assert captures == 1 and replays >= 20
    assert torch.equal(eager.sequences, capt.sequences)
    for a, b in zip(eager.scores, capt.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    # The device counter advanced inside the graph as eagerly, and each step read the same pages.
    assert len(seen_e) == len(seen_c) > 0
    for (i, p), (j, o) in zip(seen_e, seen_c):
        assert i == j and torch.equal(p, o)
    if "reselect_every" in options:
        sparse = [layer for layer in c_c.layers if layer.reuse]
        assert sparse and all(int(la.reuse["step"]) == int(sparse[0].reuse["step"]) for la in sparse)


SENTINEL = 0x5A5A5A5A


@pytest.mark.parametrize("B, Hq, H, reduce", [
    pytest.param(1, 32, 32, "none", id="llama2-7b-union"),
    pytest.param(1, 32, 8, "none", id="llama3-8b-union"),
    pytest.param(1, 32, 8, "max", id="llama3-8b-max"),
    pytest.param(8, 32, 32, "none", id="llama2-7b-B8-union"),
])
def test_captured_reusing_step_score_and_topk_write_nothing_at_32k(B, Hq, H, reduce):
    # One captured score + Top-K at 32K, budget 2048, replayed with the device flag at 1 (a due step: today's
    # scores and ids) and at 0 (a reusing step: every program returns at once, both outputs untouched).
    D, S, L, k = 128, 16, 32768 + 5, 2048 // 16 + 1
    C = -(-(L + 64) // S) * S + S
    kmin, kmax = _bounds(B, H, D, L, C)
    q = (torch.randn(B, Hq, D, device=DEV, generator=torch.Generator(DEV).manual_seed(2)) * 4).half()
    pos = torch.tensor(L, device=DEV)
    group = Hq // H if reduce == "none" else 1
    want_s = tk.score_pages(q, kmin, kmax, C, S, 0, reduce, pos=pos)
    want = tk.topk_pages(want_s, k, group)
    due = torch.ones((), dtype=torch.int32, device=DEV)
    scores, ids = torch.full_like(want_s, 7.0), torch.full_like(want, SENTINEL)

    def flagged():
        tk.score_pages(q, kmin, kmax, C, S, 0, reduce, pos=pos, due=due, out=scores)
        tk.topk_pages(scores, k, group, due=due, out=ids)

    def same_as_unflagged():
        fin = want_s.isfinite()
        assert torch.equal(scores.isfinite(), fin) and torch.equal(scores[~fin], want_s[~fin])
        torch.testing.assert_close(scores[fin], want_s[fin], atol=1e-3, rtol=1e-4)
        assert torch.equal(ids, tk.topk_pages(scores.clone(), k, group))  # the flag at 1: unflagged Top-K's ids

    flagged()  # compiles the flagged variants outside the capture
    same_as_unflagged()
    assert torch.equal(ids, want) or not torch.equal(scores, want_s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flagged()
    for flag in (0, 1, 0, 0, 1):
        scores.fill_(7.0)
        ids.fill_(SENTINEL)
        due.fill_(flag)
        graph.replay()
        torch.cuda.synchronize()
        if flag:
            same_as_unflagged()
        else:
            assert (scores == 7.0).all(), "a reusing step's score launch wrote its output"
            assert (ids == SENTINEL).all(), "a reusing step's Top-K launch wrote its output"


def _decode(layer, k, v, q):
    """One decode step of a sparse layer as the patched model runs it: append, select (reuse), attend."""
    layer.update(k, v)
    seen = []
    out = decode_attention(layer, q, q.shape[-1] ** -0.5, False, 0, seen.append)
    return seen[0], out


@pytest.mark.parametrize("Hq, H", [pytest.param(32, 32, id="llama2-7b"), pytest.param(32, 8, id="llama3-8b")])
def test_captured_reuse_step_at_32k_gives_the_eager_pages_and_outputs(Hq, H):
    # Two identical layers at 32K, budget 2048, reselect_every=4: one stepped eagerly, one through a hand-captured
    # CUDA graph of the same step (append at the device position, flagged score + Top-K, reuse merge, attention),
    # replayed over three intervals: each step's page ids and attention output equal the eager ones.
    B, D, S, L, every, steps = 1, 128, 16, 32768, 4, 13
    g = torch.Generator(DEV).manual_seed(0)
    prompt = [(torch.randn(B, H, L, D, generator=g, device=DEV) * 4).half() for _ in range(2)]
    toks = [((torch.randn(B, H, 1, D, generator=g, device=DEV) * 4).half(),
             torch.randn(B, H, 1, D, generator=g, device=DEV).half(),
             (torch.randn(B, Hq, D, generator=g, device=DEV) * 4).half()) for _ in range(steps + 1)]
    cfg = QuestConfig(budget=2048, page_size=S, reselect_every=every, backend="triton")
    eager, capt = QuestLayer(cfg, capacity=L + 64), QuestLayer(cfg, capacity=L + 64)
    for layer in (eager, capt):
        layer.update(*prompt)
    want, chose = [], []
    for x in toks:
        chose.append(int(eager.reuse["due"]) if eager.reuse else 1)  # whether this step chooses afresh
        want.append(tuple(t.clone() for t in _decode(eager, *x)))
    assert chose == [int(t % every == 0) for t in range(steps + 1)]
    first = _decode(capt, *toks[0])  # eager: compiles the kernels, allocates the reuse state (a due step)
    assert torch.equal(first[0], want[0][0])
    static = [t.clone() for t in toks[1]]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, out = _decode(capt, *static)
    for t in range(1, steps + 1):
        for buf, x in zip(static, toks[t]):
            buf.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, want[t][0]), f"step {t}: pages"
        torch.testing.assert_close(out, want[t][1], atol=1e-3, rtol=1e-3, msg=f"step {t}: output")
    assert int(capt.reuse["step"]) == int(eager.reuse["step"]) == steps + 1
    assert int(capt.reuse["due"]) == int(eager.reuse["due"])
    assert torch.equal(capt.reuse["ids"], eager.reuse["ids"]) and torch.equal(capt.pos, eager.pos)


@pytest.mark.parametrize("B, H, K, every", [pytest.param(8, 32, 129, 4, id="llama2-B8"),
                                            pytest.param(1, 8, 516, 20, id="llama3-union-k20")])
def test_compiled_reuse_kernel_matches_its_twin_over_intervals(B, H, K, every):
    # Many programs race on the shared scalars: only the last one (atomic ticket) may write them.
    S = 16
    state = [torch.full((B, H, K), -1, dtype=torch.int32, device=DEV), torch.zeros((), dtype=torch.long, device=DEV),
             torch.zeros((), dtype=torch.long, device=DEV), torch.ones((), dtype=torch.int32, device=DEV)]
    mine, ticket = [t.clone() for t in state], torch.zeros((), dtype=torch.int32, device=DEV)
    g = torch.Generator(DEV).manual_seed(K)
    for t in range(3 * every):
        pos = torch.tensor(max(2048, K * S) + 7 + t, device=DEV)  # enough pages written for K - 1 chosen ones
        c0 = (int(pos) - 1) // S
        fresh = torch.rand(B, H, c0 + 1, generator=g, device=DEV).argsort(-1)[..., : K - 1].sort(-1).values
        fresh = torch.cat([fresh, torch.full((B, H, 1), 4096, device=DEV)], -1).to(torch.int32)
        want = tk.reuse_pages_ref(fresh, *state, pos, S, every)
        got = tk.reuse_pages(fresh, *mine, pos, S, every, ticket)
        assert torch.equal(got, want) and int(ticket) == 0
        assert all(torch.equal(a, b) for a, b in zip(mine, state))


def test_compiled_append_requantizes_the_page_it_writes_bit_for_bit():
    B, H, D, S, L = 2, 8, 128, 16, 4096 + 7
    C = -(-(L + 40) // S) * S + S
    kmin, kmax = _bounds(B, H, D, L, C)
    keys = torch.zeros(B, H, C, D, dtype=torch.float16, device=DEV)
    valid = torch.zeros(B, C, dtype=torch.bool, device=DEV)
    ref = [keys, keys.clone(), kmin, kmax, valid]
    mine = [t.clone() for t in ref]
    ref8, mine8 = empty_bounds8(*kmin.shape, DEV), empty_bounds8(*kmin.shape, DEV)
    tk.quantize_bounds_ref(kmin, kmax, *ref8)
    tk.quantize_bounds(kmin, kmax, *mine8)
    pos = torch.tensor(L, device=DEV)
    g = torch.Generator(DEV).manual_seed(5)
    for _ in range(40):
        k = (torch.randn(B, H, 1, D, generator=g, device=DEV) * 4).half()
        tk.append_token_at_ref(*ref, k, k, None, pos, bounds8=ref8)
        tk.append_token_at(*mine, k, k, None, pos, bounds8=mine8)
        pos += 1
    for a, b in zip(mine8, ref8):
        assert torch.equal(a, b)
    assert torch.equal(mine[2], ref[2]) and torch.equal(mine[3], ref[3])
