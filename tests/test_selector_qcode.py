"""The "qcode" selector (quest_hf/selectors/codes.py) and its kernels (triton_kernels/key_codes.py)."""
import dataclasses

import pytest
import torch

import triton_kernels as tk
from quest_hf import QuestCache, QuestConfig, patch_model
from quest_hf.patch import cache_arg_name
from quest_hf.selectors import SELECTORS, QCodeSelector, register_selector

from . import testing
from .conftest import tiny_model
from .testing import BF16, F16, F32, nan_empty

CodeScoreLaunch = tk.key_codes.CodeScoreLaunch

top_p_scores = tk.top_p_mask_ref

# Code scores sum D products of estimated keys: fp32 needs a little more room than one kernel output.
CODE_TOL = {F32: (1e-4, 1e-4), F16: (2e-3, 2e-3), BF16: (2e-2, 2e-2)}


def assert_close(actual, expected, dtype=F32):
    testing.assert_close(actual, expected, dtype, tol=CODE_TOL)


def filled_layer(B, H, D, S, lengths, dtype, extra=0, seed=0, policy="qcode", backend="torch"):
    """One QuestLayer holding a left-padded prefill (`lengths` real tokens per row) + `extra` decode appends."""
    g = torch.Generator().manual_seed(seed)
    cfg = QuestConfig(budget=2 * S, page_size=S, dense_layers=0, backend=backend, policy=policy)
    cache = QuestCache(cfg, num_layers=1)
    T = max(lengths)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    layer = cache.layers[0]
    # Channel scales spread over 30x, like the outlier channels of real keys.
    chan = torch.logspace(-1, 0.5, D)[torch.randperm(D, generator=g)]
    cache.begin_step(mask, T)
    layer.update((torch.randn(B, H, T, D, generator=g) * chan).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype))
    for i in range(extra):
        cache.begin_step(torch.ones(B, T + i + 1), 1)
        layer.update((torch.randn(B, H, 1, D, generator=g) * chan).to(dtype), torch.randn(B, H, 1, D, generator=g).to(dtype))
    return cache, layer


def unpack(codes, bits):
    per = 8 // bits
    return ((codes.long()[..., None] >> (torch.arange(per) * bits)) & ((1 << bits) - 1)).flatten(-2)


# ------------------------------------------------------------------------------------------------ kernels
CASES = [  # B, Hq, Hkv, D, S, lengths, extra, window_start, bits, dtype
    pytest.param(1, 1, 1, 16, 4, (1,), 0, 0, 2, F32, id="len1-G1"),
    pytest.param(1, 3, 1, 64, 16, (15,), 0, 0, 2, F16, id="len15-G3"),
    pytest.param(2, 9, 3, 64, 16, (17, 5), 0, 0, 2, F32, id="len17-G3-ragged"),
    pytest.param(2, 8, 2, 32, 8, (70, 30), 3, 0, 1, F16, id="pad-pages-G4-1bit"),
    pytest.param(1, 8, 1, 128, 16, (97,), 2, 40, 4, BF16, id="window-G8-4bit"),
    pytest.param(1, 4, 4, 64, 16, (200,), 5, 0, 2, F16, id="len205-G1"),
]


@pytest.mark.parametrize("B, Hq, Hkv, D, S, lengths, extra, ws, bits, dtype", CASES)
def test_encode_matches_reference(B, Hq, Hkv, D, S, lengths, extra, ws, bits, dtype):
    _, layer = filled_layer(B, Hkv, D, S, lengths, dtype, extra)
    full = layer.seq_len // S
    C = layer.capacity
    mine = torch.full((B, Hkv, C, D * bits // 8), 0xA5, dtype=torch.uint8)
    ref = mine.clone()
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, ref, 0, full, bits)
    tk.encode_codes(layer.keys, layer.kmin, layer.kmax, mine, 0, full, bits)
    # Exact but for values on a rounding tie, where the kernel's fp32 may land one level off.
    a, b = unpack(mine[:, :, :full * S], bits), unpack(ref[:, :, :full * S], bits)
    assert a.numel() == 0 or ((a - b).abs().max() <= 1 and (a != b).float().mean() < 1e-3)
    assert (mine[:, :, full * S:] == 0xA5).all(), "wrote past the pages asked for"


@pytest.mark.parametrize("fn", ["encode_codes_at_ref", "encode_codes_at"])
@pytest.mark.parametrize("bits", [1, 2])
def test_encode_at_device_position_writes_only_a_completed_page(fn, bits):
    # The captured step: after each append, the page ending at pos (if any) is encoded; nothing else moves.
    S, D = 16, 64
    _, layer = filled_layer(2, 2, D, S, (70, 50), F16, extra=0, seed=bits)
    C = layer.capacity
    want = torch.full((2, 2, C, D * bits // 8), 0xA5, dtype=torch.uint8)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, want, 3, 1, bits)  # page 3 = slots 48..63
    for pos in (0, 1, 47, 49, 63, 65):  # no page ends at these: untouched
        got = torch.full_like(want, 0xA5)
        getattr(tk, fn)(layer.keys, layer.kmin, layer.kmax, got, torch.tensor(pos), bits)
        assert (got == 0xA5).all(), pos
    got = torch.full_like(want, 0xA5)
    getattr(tk, fn)(layer.keys, layer.kmin, layer.kmax, got, torch.tensor(64), bits)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["max", "lse"])
@pytest.mark.parametrize("B, Hq, Hkv, D, S, lengths, extra, ws, bits, dtype", CASES)
def test_code_scores_match_reference(B, Hq, Hkv, D, S, lengths, extra, ws, bits, dtype, mode, monkeypatch):
    _, layer = filled_layer(B, Hkv, D, S, lengths, dtype, extra)
    L = layer.seq_len
    ws = min(ws, L - 1)
    codes = torch.zeros(B, Hkv, layer.capacity, D * bits // 8, dtype=torch.uint8)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, codes, 0, L // S, bits)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid, L, S, ws, bits, mode, D ** -0.5)
    ref = tk.code_scores_ref(*args)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    mine = tk.code_scores(*args)
    monkeypatch.undo()
    assert mine.shape == ref.shape == (B, Hq, -(-L // S))
    fin = ref.isfinite()
    assert torch.equal(fin, mine.isfinite()) and torch.equal(ref[~fin], mine[~fin])
    assert_close(mine[fin], ref[fin], F32)


@pytest.mark.parametrize("mode", ["max", "lse"])
@pytest.mark.parametrize("variant, bits, D, block_p, num_warps, ws", [
    ("bytes", 2, 32, 4, 4, 30),  # 19 complete pages: blocks of 4, the last one partial (3 pages); window inside a block
    ("bytes", 1, 32, 8, 2, 0),
    ("bytes", 4, 32, 2, 1, 57),
    ("bytes", 1, 16, 16, 4, 0),  # 2 bytes a token; one block wider than the pages
    ("bytes", 2, 64, 1, 4, 8),  # one page a program
    ("words", 2, 32, 4, 4, 30),  # 1 word pair a token: 32 pages a warp, fewer here (lanes repeat pages)
    ("words", 2, 64, None, 1, 57),  # the default blocks: 16 pages a warp, one a thread
    ("words", 1, 64, 8, 1, 8),  # 1 word pair a token, 8 codes a segment of 4
    ("words", 4, 32, 32, 2, 0),  # one block wider than the pages; 2 segments of 4 codes a word
    ("words", 1, 32, 4, 4, 0),  # half a word pair a token: falls back to "bytes"
])
@pytest.mark.parametrize("S", [8, 32], ids=["page8", "page32-units"])
def test_code_scores_blocks(variant, bits, D, block_p, num_warps, ws, mode, S):
    """Many pages per program, a partial last block, G = 3, left padding (whole padding pages), a window; pages
    of 32 are scored in units of 16 tokens by the "words" kernel."""
    B, Hq, Hkv = 2, 6, 2
    _, layer = filled_layer(B, Hkv, D, S, (150, 61), F16, extra=3, seed=bits)
    L = layer.seq_len  # 153: 19 complete pages + the current one
    codes = torch.zeros(B, Hkv, layer.capacity, D * bits // 8, dtype=torch.uint8)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, codes, 0, L // S, bits)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(2)).to(F16)
    args = (q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid, L, S, ws, bits, mode, D ** -0.5)
    ref = tk.code_scores_ref(*args)
    mine = tk.code_scores(*args, launch=CodeScoreLaunch(variant=variant, block_p=block_p, num_warps=num_warps))
    fin = ref.isfinite()
    assert (~fin).any() and fin.any()
    assert torch.equal(fin, mine.isfinite()) and torch.equal(ref[~fin], mine[~fin])
    assert_close(mine[fin], ref[fin], F32)


@pytest.mark.parametrize("variant", ["words", "bytes"])
@pytest.mark.parametrize("bits, S, lengths, extra", [(2, 16, (70, 30), 3), (1, 8, (64, 17), 0), (4, 16, (33,), 15)])
def test_lse_scores_at_the_device_position_equal_the_host_lengths(variant, bits, S, lengths, extra, monkeypatch):
    """Top-p's captured scores: over the whole allocation with pos=, each page's log mass equals the host-length
    scores' (the current page exact from its keys, whether partial or just completed), every later page -inf;
    the kernels match the reference (NaN-poisoned outputs)."""
    D, Hq, Hkv = 32, 6, 2
    B = len(lengths)
    _, layer = filled_layer(B, Hkv, D, S, lengths, F16, extra=extra, seed=bits)
    L, C = layer.seq_len, layer.capacity
    codes = torch.full((B, Hkv, C, D * bits // 8), 0x5A, dtype=torch.uint8)  # stale bytes past the written pages
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, codes, 0, L // S, bits)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(4)).to(F16)
    common = (q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid)
    host = tk.code_scores_ref(*common, L, S, 0, bits, "lse", D ** -0.5)
    pos = torch.tensor(L)
    ref = tk.code_scores_ref(*common, C, S, 0, bits, "lse", D ** -0.5, pos=pos)
    P = host.shape[-1]
    assert ref.shape[-1] == C // S > P and (ref[..., P:] == float("-inf")).all()
    fin = host.isfinite()
    assert torch.equal(fin, ref[..., :P].isfinite()) and fin[..., P - 1].all()
    assert_close(ref[..., :P][fin], host[fin], F32)
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    mine = tk.code_scores(*common, C, S, 0, bits, "lse", D ** -0.5, pos=pos, launch=CodeScoreLaunch(variant=variant))
    monkeypatch.undo()
    fin = ref.isfinite()
    assert torch.equal(fin, mine.isfinite()) and torch.equal(ref[~fin], mine[~fin])
    assert_close(mine[fin], ref[fin], F32)
    with pytest.raises(ValueError, match="pos= with mode='lse' scores whole rows"):
        tk.code_scores_ref(*common, C, S, 0, bits, "lse", 1.0, torch.zeros(B, Hq, 1, dtype=torch.int32), pos=pos)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["qcode_topp", "qcode1_topp"])
def test_topp_selection_at_the_device_position_equals_the_host_lengths(name, backend):
    """The top-p selectors choose over the whole allocation from the device position (capturable) the pages the
    host-length rule chooses: scores over ceil(seq_len / S) pages, the last one the current page."""
    S, D = 16, 32
    cache, layer = filled_layer(2, 2, D, S, (150, 90), F32, extra=5, backend=backend)
    for budget in (32, 64, 256):
        cfg = dataclasses.replace(layer.config, budget=budget, policy=name)
        lay = cache.copy(cfg).layers[0]
        sel = SELECTORS[name]
        g = torch.Generator().manual_seed(budget)
        q = torch.randn(2, 6, D, generator=g) * 3
        got = sel.select(lay, q, 0)
        codes = lay.side[sel.key]
        host = tk.code_scores_ref(q, lay.keys, lay.kmin, lay.kmax, codes, lay.valid, lay.seq_len, S, 0, sel.bits,
                                  "lse", D ** -0.5)
        want = tk.topk_pages_ref(tk.top_p_mask_ref(host, sel.top_p, cfg.num_pages), cfg.num_pages, 3)
        for b in range(2):
            for h in range(2):
                assert set(got[b, h][got[b, h] >= 0].tolist()) == set(want[b, h][want[b, h] >= 0].tolist()), \
                    (budget, b, h)


def test_codes_track_keys_better_than_the_bound():
    """2-bit codes on the page grid estimate q.k within a quarter of the page's range per channel."""
    _, layer = filled_layer(1, 2, 64, 16, (256,), F32)
    codes = torch.zeros(1, 2, layer.capacity, 16, dtype=torch.uint8)
    tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, codes, 0, 16, 2)
    q = torch.randn(1, 2, 64)
    est = tk.code_scores_ref(q, layer.keys, layer.kmin, layer.kmax, codes, layer.valid, 256, 16)[..., :-1]
    true = torch.einsum("bhd,bhnd->bhn", q, layer.keys[:, :, :256]).reshape(1, 2, 16, 16).amax(-1)[..., :-1]
    bound = tk.score_pages_ref(q, layer.kmin, layer.kmax, 256, 16)[..., :-1]
    assert (est - true).abs().mean() < 0.5 * (bound - true).abs().mean()


# --------------------------------------------------------------------------------------------- selector
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chosen_pages_hold_current_page_and_never_padding_only(backend):
    cache, layer = filled_layer(2, 2, 32, 8, (70, 30), F32, extra=3, backend=backend)
    cfg = dataclasses.replace(layer.config, budget=24)
    for name in ("qcode", "qcode1", "qcode_topp") if backend == "torch" else ("qcode_topp",):
        c = cache.copy(dataclasses.replace(cfg, policy=name))
        lay = c.layers[0]
        q = torch.randn(2, 6, 32)
        ids = SELECTORS[name].select(lay, q, 0)
        L, S = lay.seq_len, 8
        spare = lay.capacity // S - 1  # the fixed-budget selectors also name the spare page (it holds no token)
        assert ids.dtype == torch.int32 and ids.shape[:2] == (2, 2)
        empty = ~lay.valid.reshape(2, -1, S).any(-1)  # [B, P]
        for b in range(2):
            for h in range(2):
                chosen = ids[b, h][ids[b, h] >= 0].tolist()
                assert (spare in chosen) == (name != "qcode_topp")
                chosen = [p for p in chosen if p != spare]
                assert (L - 1) // S in chosen
                assert len(set(chosen)) == len(chosen)
                assert not any(empty[b, p] for p in chosen), f"{name} chose a padding-only page"


def test_topp_picks_fewer_pages_when_attention_is_concentrated():
    S, D = 16, 64
    cache, layer = filled_layer(1, 1, D, S, (512,), F32, extra=1)
    cfg = dataclasses.replace(layer.config, budget=256, policy="qcode_topp")  # at most 16 pages
    sel = SELECTORS["qcode_topp"]
    g = torch.Generator().manual_seed(3)
    spread = cache.copy(cfg)
    spread.layers[0].keys[:, :, :513] = 0.01 * torch.randn(1, 1, 513, D, generator=g)  # flat attention
    peaked = cache.copy(cfg)
    q = torch.randn(1, 1, D, generator=g)
    peaked.layers[0].keys[:, :, 200] = 40 * q[:, 0] / q.norm()  # one token takes nearly all the mass
    for c in (spread, peaked):  # rebuild min/max and codes from the edited keys
        lay = c.layers[0]
        lay.kmin.fill_(float("inf")), lay.kmax.fill_(float("-inf"))
        k = lay.keys[:, :, :513].clone()
        lay.valid.zero_()
        c.begin_step(None, 513)
        lay.ops.append_kv(lay.keys, lay.values, lay.kmin, lay.kmax, lay.valid, k, lay.values[:, :, :513].clone(), None, 0)
        lay.side.clear()
    n_spread = int((sel.select(spread.layers[0], q, 0) >= 0).sum())
    ids = sel.select(peaked.layers[0], q, 0)
    n_peaked = int((ids >= 0).sum())
    assert 200 // S in ids.tolist()[0][0]
    assert n_peaked <= 3 < n_spread == 16


def test_top_p_scores_cut():
    lm = torch.log(torch.tensor([[[0.5, 0.3, 0.1, 0.05, 0.05]]]))
    s = top_p_scores(lm, 0.7, k=4)  # current page (0.05) forced; 0.5 + 0.3 reach 0.7
    assert (s > float("-inf")).sum() == 3 and s[0, 0, -1] == float("inf")
    # At 1.0 every page with mass is kept here; topk_pages caps the choice at k (2 + the current page).
    s = top_p_scores(lm, 1.0, k=2)
    assert (s > float("-inf")).sum() == 5
    assert (tk.topk_pages_ref(s, 3, 1) >= 0).sum() == 3


def test_codes_built_lazily_after_copy_from_quest_equal_incremental():
    _, inc = filled_layer(1, 2, 64, 16, (100,), F32, extra=30, policy="qcode")
    cache, _ = filled_layer(1, 2, 64, 16, (100,), F32, extra=30, policy="quest")
    lazy = cache.copy(dataclasses.replace(cache.quest_config, policy="qcode")).layers[0]
    assert "qcode2" not in lazy.side
    q = torch.randn(1, 6, 64)
    assert torch.equal(SELECTORS["qcode"].select(lazy, q, 0), SELECTORS["qcode"].select(inc, q, 0))
    full = inc.seq_len // 16 * 16
    assert torch.equal(lazy.side["qcode2"][:, :, :full], inc.side["qcode2"][:, :, :full])


@pytest.fixture
def topp_all():
    """A top-p variant that must keep every page with any mass (p = 1)."""
    register_selector("qcode_topp_all", QCodeSelector(top_p=1.0))
    yield
    SELECTORS.pop("qcode_topp_all")


@pytest.mark.parametrize("policy, backend", [("qcode", "torch"), ("qcode1", "torch"), ("qcode_topp_all", "torch"),
                                             ("qcode", "triton")])
def test_patched_model_equals_dense_when_every_page_fits(policy, backend, monkeypatch, topp_all):
    """Top-K wide enough for every written page, narrower than the allocation (the sparse path runs): exact dense."""
    model = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 97, (2, 83), generator=g)
    mask = torch.ones(2, 83, dtype=torch.long)
    mask[1, :37] = 0  # left padding over whole pages
    base = QuestConfig(budget=1 << 20, page_size=8, dense_layers=0, backend="torch")
    patch_model(model, config=base)
    arg = cache_arg_name(model)
    cache = QuestCache.from_model(model)
    with torch.no_grad():
        model(input_ids=ids[:, :80], attention_mask=mask[:, :80], **{arg: cache})
    dense = cache.copy()
    # 82 tokens = 11 pages of 8; the allocation holds 80 + a growth step of 256 tokens (42 pages).
    sparse = cache.copy(dataclasses.replace(base, budget=12 * 8, policy=policy, backend=backend))
    calls = []
    sparse.selection_hooks.append(lambda i, q, p: calls.append(int((p >= 0).sum())))
    outs = []
    for c in (dense, sparse):
        with torch.no_grad():
            logits = []
            for t in range(80, 82):
                logits.append(model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **{arg: c}).logits)
        outs.append(torch.cat(logits, 1))
    assert calls, "the sparse path never ran"
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits must be one of"):
        QCodeSelector(bits=3)
    with pytest.raises(ValueError, match="top_p must be in"):
        QCodeSelector(top_p=0.0)
    _, layer = filled_layer(1, 1, 16, 4, (9,), F32)
    with pytest.raises(ValueError, match="codes must be uint8"):
        tk.encode_codes_ref(layer.keys, layer.kmin, layer.kmax, torch.zeros(1, 1, layer.capacity, 3, dtype=torch.uint8), 0, 2)
    codes = torch.zeros(1, 1, layer.capacity, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="variant must be one of"):
        CodeScoreLaunch(variant="x")
    with pytest.raises(ValueError, match="kmin and kmax must share strides"):  # one set of strides in the kernel
        tk.code_scores(torch.randn(1, 1, 16), layer.keys, layer.kmin, layer.kmax.transpose(2, 3).contiguous().transpose(2, 3),
                       codes, layer.valid, 9, 4)
