"""Benchmark the Quest decode step (score -> Top-K -> sparse attention) against dense SDPA on one GPU.

Per configuration it times each stage and the whole step (plain launches and one CUDA-graph replay), dense
`scaled_dot_product_attention` over the full cache on the same q/K/V, and relates the Quest step to the
bytes it must read (all pages' kmin/kmax + the chosen pages' K/V + the fp32 scores written and read back)
over the device-to-device copy bandwidth measured in the same run.

    python scripts/bench_kernels.py --quick        # a subset
    python scripts/bench_kernels.py --check        # launchers vs references first
    python scripts/bench_kernels.py --tune         # a few block sizes at 32K
    python scripts/bench_kernels.py --quick --bounds key_dtype int8 --reselect-every 1 4   # #16: 8-bit bounds, reuse
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --dry --bounds int8 --reselect-every 4  # CPU: runs, no timing

`--bounds int8` rows score 8-bit page bounds (QuestConfig(bounds="int8"); the layer requantizes the page it wrote
inside its append launch, which no row here times, as for the key-dtype bounds). `--reselect-every K` rows
(QuestConfig(reselect_every=K)) add the step between selections ("skip": the score and Top-K launches read their
device flag and return at once, reading and writing nothing, the reuse kernel merges the stored selection and
the pages started since, attention) and the amortised step `(full + (K - 1) * skip) / K`.

"chain" columns: the whole step 20 times back to back in one CUDA graph, rotating over the input sets, time / 20
(`quest_hf.bench.time_graph_chain`; SDPA the same way): how a captured decode runs its layers, where the graph's own
launch is paid once a token, not once a layer as in the one-step "graph" column. "kernels": the step's kernels'
own durations (torch profiler, plain launches rotating over the sets), without the gaps between them.

Timer: quest_hf.bench (CUDA events per call after a GPU spin, median, no L2 flush), rotating over input sets
that together exceed L2 three times. Round 1's figures (benchmarks/kernels/round1/) were taken with
triton.testing.do_bench instead, whose flush leaves L2 full of dirty lines (benchmarks/kernels/NOTES.md, round 2).

Writes <name>.json and <name>.md into --out-dir (default results/bench_kernels/).
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

import torch

import triton_kernels as tk
from quest_hf.bench import (
    LAYER_SHAPES,
    copy_bandwidth,
    gpu_state,
    kernel_durations,
    launch_fields,
    results_dir,
    rotating,
    set_topk_launch,
    time_calls,
    time_graph,
    time_graph_chain,
)
from quest_hf.selectors.base import reused_pages
from triton_kernels import score as score_mod
from triton_kernels import sparse_attention as attn_mod
from triton_kernels import topk as topk_mod

SHAPES = LAYER_SHAPES  # (H_q, H_kv, D)
PAGE = 16
L2_BYTES = 60e6
DEV = "cuda"
VARIANTS = False
EXTRA_PAGES = 0  # --extra-pages
TUNE_STAGES = ()


def make_layer(B, H, L, D, dtype, seed, extra_pages=0):
    """A layer cache of L tokens (every page filled, all valid), metadata reduced from the keys; `extra_pages` empty
    pages after them (bounds +inf / -inf, slots invalid), as a captured decode allocates room for its new tokens."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    kc = torch.randn(B, H, L, D, device=DEV, dtype=dtype, generator=g)
    vc = torch.randn(B, H, L, D, device=DEV, dtype=dtype, generator=g)
    pages = kc.view(B, H, L // PAGE, PAGE, D)
    kmin, kmax = pages.amin(3), pages.amax(3)
    valid = torch.ones(B, L, dtype=torch.bool, device=DEV)
    if extra_pages:
        empty = torch.zeros(B, H, extra_pages * PAGE, D, device=DEV, dtype=dtype)
        kc, vc = torch.cat([kc, empty], 2), torch.cat([vc, empty], 2)
        bound = torch.full((B, H, extra_pages, D), float("inf"), device=DEV, dtype=dtype)
        kmin, kmax = torch.cat([kmin, bound], 2), torch.cat([kmax, -bound], 2)
        valid = torch.cat([valid, torch.zeros(B, extra_pages * PAGE, dtype=torch.bool, device=DEV)], 1)
    return kc, vc, kmin, kmax, valid


# The launch configuration of each stage: the library's defaults, replaced by --tune's choice for the sweep.
CHAIN = 20  # steps back to back in the chained timing (the reference floor probe's graphs hold 20)
LAUNCH = dict(score=score_mod.SCORE_LAUNCH, topk=topk_mod.TOPK_LAUNCH, attn=attn_mod.ATTENTION_LAUNCH)


class Step:
    """One Quest decode step on one input set; mode 'union' (reduce none + union) or 'max'."""

    def __init__(self, layer, q, k, mode, launch=None, bounds="key_dtype", every=1):
        self.launch = dict(LAUNCH, **(launch or {}))
        self.kc, self.vc, self.kmin, self.kmax, self.valid = layer
        self.q, self.k, self.mode = q, k, mode
        # Filled tokens L, capacity C: past L the captured decode's layout (scored over C, the current page forced
        # from the device position, the empty pages -inf, attended over C with their slots invalid).
        self.C = self.kc.shape[2]
        self.L = int(self.valid[0].sum().item())
        H_kv, H_q = self.kc.shape[1], q.shape[1]
        self.G = H_q // H_kv
        self.reduce = "none" if mode == "union" else "max"
        self.group = self.G if mode == "union" else 1
        self.scale = q.shape[-1] ** -0.5
        self.bounds, self.every = bounds, every
        self.pos = torch.tensor(self.L, device=q.device)  # the decode step's device position
        self.bounds8 = self.chan = None
        if bounds != "key_dtype":  # QuestConfig(bounds="int8"...): codes + scale quantized from the exact bounds
            self.bounds8 = tk.bounds8.empty_bounds8(*self.kmin.shape, q.device)
            if bounds == "int8_channel":  # channel scales of the whole layer's keys (its prefill)
                self.chan = tk.bounds8.channel_scales(self.kc)
            tk.quantize_bounds(self.kmin, self.kmax, *self.bounds8, chan=self.chan)
        self.scores = self.score()
        self.ids = self.topk()
        if every > 1:  # the stored selection of QuestConfig(reselect_every): a due step's, reused
            self.reuse_layer = _ReuseState(self.ids, self.pos)
            self.not_due = self.reuse_layer.reuse["due"]

    def score(self, due=None):
        lo, hi, kw = self.kmin, self.kmax, {}
        if self.bounds8 is not None:
            lo, hi, kw = *self.bounds8[:2], dict(scale=self.bounds8[2], chan=self.chan)
        if self.C > self.L:
            kw["pos"] = self.pos
        return tk.score_pages(self.q, lo, hi, self.C, PAGE, 0, self.reduce, due=due, launch=self.launch["score"], **kw)

    def topk(self):
        return tk.topk_pages(self.scores, self.k, self.group, launch=self.launch["topk"])

    def attn(self):
        return tk.sparse_decode_attention(self.q, self.kc, self.vc, self.ids, self.valid, self.C, PAGE, self.scale,
                                          launch=self.launch["attn"])

    def full(self):
        s = self.score()
        ids = tk.topk_pages(s, self.k, self.group, launch=self.launch["topk"])
        return tk.sparse_decode_attention(self.q, self.kc, self.vc, ids, self.valid, self.C, PAGE, self.scale,
                                          launch=self.launch["attn"])

    def skip(self):
        """A step between selections (reselect_every > 1): flagged score and Top-K (both return at once), the reuse
        merge, attention. (+ one 4-byte fill the layer's step has not: the merge sets the next step's flag, and
        every timed step must skip)"""
        self.not_due.zero_()
        s = self.score(due=self.not_due)
        fresh = tk.topk_pages(s, self.k, self.group, launch=self.launch["topk"], due=self.not_due)
        ids = reused_pages(self.reuse_layer, fresh, self.not_due, self.every)
        return tk.sparse_decode_attention(self.q, self.kc, self.vc, ids, self.valid, self.C, PAGE, self.scale,
                                          launch=self.launch["attn"])

    def bytes_read(self):
        B, H, P, D = self.kmin.shape
        es = self.kmin.element_size()
        meta = 2 * B * H * P * D * es if self.bounds8 is None else B * H * P * (2 * D + 4)
        scores = 2 * self.scores.numel() * 4  # written by score, read by topk
        chosen = int((self.ids >= 0).sum().item())
        kv = chosen * PAGE * D * es * 2
        return meta + scores + kv, chosen

    def skip_bytes_read(self):
        """A reusing step: no bounds, no scores (neither written nor read), the same chosen K/V (no new page here)."""
        chosen = int((self.ids >= 0).sum().item())
        return chosen * PAGE * self.kmin.shape[-1] * self.kmin.element_size() * 2


class _ReuseState:
    """What `reused_pages` reads of a layer: the stored selection, chosen at this position."""

    def __init__(self, ids, pos):
        dev = pos.device
        self.reuse = dict(ids=ids.clone(), since=pos.clone(), step=torch.zeros((), dtype=torch.long, device=dev),
                          due=torch.zeros((), dtype=torch.int32, device=dev),
                          ticket=torch.zeros((), dtype=torch.int32, device=dev))
        self.pos, self.page_size, self.ops = pos, PAGE, tk  # the launchers (tk.reuse_pages), as Ops carries them


def graph_time(steps, stage):
    """Median us of one CUDA-graph replay of `stage` ("score", "topk", "attn" or "full"), rotated over the steps."""
    return time_graph([getattr(s, stage) for s in steps])


def run_config(shape, L, B, budget, dtype, modes, bw, sdpa_cache, variants=(("key_dtype", 1),)):
    H_q, H_kv, D = SHAPES[shape]
    # Input sets to rotate over: enough that what one Quest step touches (all pages' kmin/kmax, the chosen
    # pages' K/V) exceeds L2 three times over, so no timed call finds its inputs in L2.
    touched = 2 * B * H_kv * D * torch.tensor([], dtype=dtype).element_size() * (L // PAGE + min(L, budget))
    n_sets = max(1, min(4, math.ceil(3 * L2_BYTES / touched)))
    layers = [make_layer(B, H_kv, L, D, dtype, seed, EXTRA_PAGES) for seed in range(n_sets)]
    qs = [torch.randn(B, H_q, D, device=DEV, dtype=dtype) for _ in range(n_sets)]
    key = (shape, L, B, dtype)
    if key not in sdpa_cache:
        import torch.nn.functional as F

        def sdpa(i):
            kc, vc = layers[i][0][:, :, :L], layers[i][1][:, :, :L]
            return lambda: F.scaled_dot_product_attention(qs[i][:, :, None], kc, vc, enable_gqa=H_q != H_kv)

        sdpa_cache[key] = (time_calls(rotating([sdpa(i) for i in range(n_sets)])),
                           time_graph_chain([sdpa(i) for i in range(n_sets)], CHAIN))
    t_sdpa, t_sdpa_chain = sdpa_cache[key]
    rows = []
    k = budget // PAGE
    for mode, (bounds, every) in [(m, v) for m in modes for v in variants]:
        if mode == "max" and H_q == H_kv:
            continue  # group of one: identical to union
        steps = [Step(layers[i], qs[i], k, mode, bounds=bounds, every=every) for i in range(n_sets)]
        t_score, t_topk, t_attn = (graph_time(steps, st) for st in ("score", "topk", "attn"))
        t_total = time_calls(rotating([s.full for s in steps]))
        t_graph = graph_time(steps, "full")
        # Steps back to back in one graph, as a captured decode runs its layers (SDPA the same way), and the
        # step's kernels' own durations (profiler): the launch gaps are what the chain's time has beyond them.
        t_chain = time_graph_chain([s.full for s in steps], CHAIN)
        kernels = kernel_durations(rotating([s.full for s in steps]))
        extra = dict(bounds=bounds, reselect_every=every, chain_us=t_chain, sdpa_chain_us=t_sdpa_chain,
                     speedup_chain=t_sdpa_chain / t_chain, kernels_us=sum(kernels.values()), kernels=kernels)
        if every > 1:  # the step between selections, and the mean over one interval
            t_skip = graph_time(steps, "skip")
            amort = (t_graph + (every - 1) * t_skip) / every
            amort_bytes = (steps[0].bytes_read()[0] + (every - 1) * steps[0].skip_bytes_read()) / every
            extra.update(skip_us=t_skip, amortized_us=amort, speedup_amortized=t_sdpa / amort,
                         amortized_frac_of_limit=amort_bytes / bw * 1e6 / amort)
        if VARIANTS:  # the attention with its merge always fused into the split kernel, and never
            for name, limit in (("attn_fused_merge_us", 1 << 30), ("attn_merge_kernel_us", 0)):
                attn = dataclasses.replace(LAUNCH["attn"], fuse_merge_max_splits=limit)
                extra[name] = graph_time([Step((s.kc, s.vc, s.kmin, s.kmax, s.valid), s.q, s.k, mode, dict(attn=attn))
                                          for s in steps], "attn")
        nbytes, chosen = steps[0].bytes_read()
        limit_us = nbytes / bw * 1e6
        best = min(t_total, t_graph)
        rows.append(dict(
            shape=shape, L=L, B=B, budget=budget, dtype=str(dtype).replace("torch.", ""), mode=mode,
            score_us=t_score, topk_us=t_topk, attn_us=t_attn, total_us=t_total, graph_us=t_graph,
            sdpa_us=t_sdpa, speedup_plain=t_sdpa / t_total, speedup_graph=t_sdpa / t_graph,
            bytes=nbytes, chosen_pages=chosen, achieved_GBps=nbytes / (best * 1e-6) / 1e9,
            byte_limit_us=limit_us, frac_of_limit=limit_us / best, n_input_sets=n_sets, timer="clean", **extra,
        ))
        rows[-1]["frac_of_limit_chain"] = limit_us / t_chain
        print(fmt_row(rows[-1]), flush=True)
        del steps
    layers = qs = None  # the input sets go before empty_cache (a del would leave sdpa's closure unbound)
    torch.cuda.empty_cache()
    return rows


HEADER = ("| shape | L | B | budget | dtype | mode | bounds | k | score us | topk us | attn us | total us | graph us "
          "| SDPA us | x (plain) | x (graph) | GB/s | limit us | frac | skip us | amortised us | x (amortised) "
          "| chain us | SDPA chain us | x (chain) | kernels us | frac (chain) |\n|" + "---|" * 27)


def fmt_row(r):
    k = r.get("reselect_every", 1)
    reuse = (f" {r['skip_us']:.1f} | {r['amortized_us']:.1f} | {r['speedup_amortized']:.2f} |" if k > 1
             else " - | - | - |")
    return (f"| {r['shape']} | {r['L']} | {r['B']} | {r['budget']} | {r['dtype']} | {r['mode']} "
            f"| {r.get('bounds', 'key_dtype')} | {k} | {r['score_us']:.1f} "
            f"| {r['topk_us']:.1f} | {r['attn_us']:.1f} | {r['total_us']:.1f} | {r['graph_us']:.1f} "
            f"| {r['sdpa_us']:.1f} "
            f"| {r['speedup_plain']:.2f} | {r['speedup_graph']:.2f} | {r['achieved_GBps']:.0f} "
            f"| {r['byte_limit_us']:.1f} | {r['frac_of_limit']:.2f} |" + reuse
            + (f" {r['chain_us']:.1f} | {r['sdpa_chain_us']:.1f} | {r['speedup_chain']:.2f} | {r['kernels_us']:.1f} "
               f"| {r['frac_of_limit_chain']:.2f} |" if "chain_us" in r else " - | - | - | - | - |")
            + (f" attn: merge fused {r['attn_fused_merge_us']:.1f}, merge kernel {r['attn_merge_kernel_us']:.1f}"
               if "attn_merge_kernel_us" in r else ""))


def check():
    """Launchers vs references on random data at real sizes (CUDA, fp16/bf16); raises on mismatch."""
    torch.manual_seed(0)
    report = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1
    sizes = [((32, 8, 128), 32768, 1), ((32, 32, 128), 8192 + 37, 2), ((28, 4, 64), 4097, 3)]
    if dev == "cpu":
        sizes = [((8, 2, 128), 1000, 1), ((4, 4, 64), 300 + 37, 2), ((6, 2, 64), 97, 3)]
    for dtype in (torch.float16, torch.bfloat16):
        for (H_q, H_kv, D), L, B in sizes:
            C = -(-L // 64) * 64
            kc = torch.zeros(B, H_kv, C, D, device=dev, dtype=dtype)
            vc = torch.zeros_like(kc)
            kmin = torch.full((B, H_kv, C // PAGE, D), float("inf"), device=dev, dtype=dtype)
            kmax = -kmin
            valid = torch.zeros(B, C, dtype=torch.bool, device=dev)
            ref_cache = [t.clone() for t in (kc, vc, kmin, kmax, valid)]
            T0 = L - 3
            kn = torch.randn(B, H_kv, T0, D, device=dev, dtype=dtype)
            vn = torch.randn_like(kn)
            vnew = torch.ones(B, T0, dtype=torch.bool, device=dev)
            vnew[0, : T0 // 3] = False  # left padding in row 0
            tk.append_kv(kc, vc, kmin, kmax, valid, kn, vn, vnew, 0)
            tk.append_kv_ref(*ref_cache, kn, vn, vnew, 0)
            for t in range(T0, L):
                kn = torch.randn(B, H_kv, 1, D, device=dev, dtype=dtype)
                vn = torch.randn_like(kn)
                tk.append_kv(kc, vc, kmin, kmax, valid, kn, vn, None, t)
                tk.append_kv_ref(*ref_cache, kn, vn, None, t)
            for a, b in zip((kc, vc, kmin, kmax, valid), ref_cache, strict=True):
                assert torch.equal(a, b), "append mismatch"
            q = torch.randn(B, H_q, D, device=dev, dtype=dtype)
            G = H_q // H_kv
            for reduce, group in (("none", G), ("max", 1), ("sum", 1)):
                ws = L // 5
                s = tk.score_pages(q, kmin, kmax, L, PAGE, ws, reduce)
                s_ref = tk.score_pages_ref(q, kmin, kmax, L, PAGE, ws, reduce)
                fin = s_ref.isfinite()
                assert torch.equal(fin, s.isfinite()) and torch.equal(s[~fin], s_ref[~fin]), "score inf mask"
                err = ((s - s_ref)[fin].abs().max() / s_ref[fin].abs().max()).item()
                assert err < 1e-5, f"score err {err}"
                for k, tie in ((1, False), (64, False), (128, False), (100000, False), (128, True), (7, True)):
                    src = s_ref.round() if tie else s_ref  # rounded scores: many ties at the k-th
                    if tie and group != 1:
                        continue
                    ids = tk.topk_pages(src, k, group)
                    ids_ref = tk.topk_pages_ref(src, k, group)
                    assert ids.shape == ids_ref.shape, "topk shape"
                    assert torch.equal((ids < 0).sum(-1), (ids_ref < 0).sum(-1)), "topk count"
                    srt = ids.clone()
                    srt[srt < 0] = 1 << 30
                    assert torch.equal(srt.sort(-1).values, srt), "topk not ascending"
                    if not torch.equal(ids, ids_ref):  # ties: compare multisets of chosen scores per row
                        assert group == 1, "union differs (ties are unlikely on random data)"
                        va = torch.where(ids >= 0, src.gather(-1, ids.clamp(min=0).long()), 0.0).sort(-1).values
                        vb = torch.where(ids_ref >= 0, src.gather(-1, ids_ref.clamp(min=0).long()), 0.0).sort(-1).values
                        assert torch.equal(va, vb), "topk chosen scores differ"
                if reduce == "none":
                    ids_ref = tk.topk_pages_ref(s_ref, 128, group)
                    o_ref = tk.sparse_decode_attention_ref(q, kc, vc, ids_ref, valid, L, PAGE, D ** -0.5, ws)
                    for limit in (0, 1 << 30, 1 << 30, 1 << 30):  # merge kernel; fused merge 3x (a race varies)
                        attn = attn_mod.AttentionLaunch(fuse_merge_max_splits=limit)
                        o = tk.sparse_decode_attention(q, kc, vc, ids_ref, valid, L, PAGE, D ** -0.5, ws, launch=attn)
                        rel = ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
                        assert not o.isnan().any() and rel < 2e-2, \
                            f"attn rel err {rel} {dtype} {H_q} {H_kv} {D} {L} {B} {limit}"
                    report.append(f"{dtype} Hq{H_q}/Hkv{H_kv} D{D} L{L} B{B}: "
                                  f"attn rel err {rel:.2e}, score err {err:.1e}")
            del kc, vc, kmin, kmax, valid, ref_cache
    for line in report:
        print("check:", line)
    print("check: all launchers match their references", flush=True)


TUNE_SPACE = {
    "score": ("score", ("block_p", "num_warps"), [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (32, 2)]),
    "topk": ("topk", ("keys_per_thread", "max_tile"),
             [(32, 16384), (16, 16384), (64, 16384), (8, 16384), (128, 16384), (32, 8192)]),
    "attn": ("attn", ("block_n", "num_warps", "programs_per_sm"),
             [(32, 4, 4), (64, 4, 4), (64, 4, 8), (64, 8, 4), (128, 8, 4), (64, 4, 2), (32, 2, 8), (32, 4, 8),
              (32, 4, 3), (32, 4, 2), (32, 4, 6), (16, 4, 4), (16, 2, 8)]),
    "attn_stages": ("attn", ("num_stages", "block_n"), [(3, 32), (1, 32), (2, 32), (4, 32), (2, 64), (3, 64)]),
}


def check_topk_large():
    """Top-K alone at P = 8192 and 16384 (ties, many -inf, unions of 4 and 8) on the device."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for B, R, P, k, group, dead in ((1, 32, 8192, 128, 1, 0.3), (2, 32, 8192, 128, 4, 0.5), (1, 16, 16384, 256, 8, 0.1),
                                    (1, 8, 8192, 2000, 1, 0.9)):
        s = torch.randn(B, R, P, device=dev) * 10
        s = s.round() if group == 1 else s
        s.masked_fill_(torch.rand(B, 1, P, device=dev) < dead, float("-inf"))
        s[..., -1] = float("inf")
        ids, ids_ref = tk.topk_pages(s, k, group), tk.topk_pages_ref(s, k, group)
        assert torch.equal((ids < 0).sum(-1), (ids_ref < 0).sum(-1)), "topk count (large P)"
        if group > 1:
            assert torch.equal(ids, ids_ref), "topk union (large P)"
        else:
            va = torch.where(ids >= 0, s.gather(-1, ids.clamp(min=0).long()), 0.0).sort(-1).values
            vb = torch.where(ids_ref >= 0, s.gather(-1, ids_ref.clamp(min=0).long()), 0.0).sort(-1).values
            assert torch.equal(va, vb), "topk chosen scores differ (large P)"
    print("check: topk at P = 8192/16384 with ties and -inf matches", flush=True)


def check_bounds_reuse(sizes=((32, 8, 128, 32768 + 5, 1), (32, 32, 128, 8192 + 37, 2)), variants=None):
    """The 8-bit bounds step and the reuse step against their references (quantize, int8 / flagged score, the
    reused selection's attention); `sizes` (H_q, H_kv, D, L, B). Raises on mismatch."""
    dev = DEV
    variants = variants or [("int8", 1), ("int8_channel", 1), ("key_dtype", 4), ("int8", 4)]
    for H_q, H_kv, D, L, B in sizes:
        L = L // PAGE * PAGE
        layer = make_layer(B, H_kv, L, D, torch.float16, 0)
        q = torch.randn(B, H_q, D, device=dev, dtype=torch.float16)
        for bounds, every in variants:
            for mode in ("union", "max"):
                st = Step(layer, q, 17, mode, bounds=bounds, every=every)
                if st.bounds8 is not None:
                    ref8 = tk.bounds8.empty_bounds8(*st.kmin.shape, dev)
                    tk.quantize_bounds_ref(st.kmin, st.kmax, *ref8, chan=st.chan)
                    assert all(torch.equal(a, b) for a, b in zip(st.bounds8, ref8)), "int8 codes differ"
                    lo, hi, kw = (*ref8[:2], dict(scale=ref8[2], chan=st.chan))
                else:
                    lo, hi, kw = st.kmin, st.kmax, {}
                s_ref = tk.score_pages_ref(q, lo, hi, L, PAGE, 0, st.reduce, **kw)
                fin = s_ref.isfinite()
                assert torch.equal(fin, st.scores.isfinite()), "score inf mask"
                torch.testing.assert_close(st.scores[fin], s_ref[fin], atol=1e-3, rtol=1e-4)
                out = st.full()
                ids = tk.topk_pages_ref(s_ref, 17, st.group)
                o_ref = tk.sparse_decode_attention_ref(q, st.kc, st.vc, ids, st.valid, L, PAGE, st.scale)
                assert not out.isnan().any(), "attention NaN"
                torch.testing.assert_close(out.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
                if every > 1:  # a reusing step attends the stored selection: the same output here
                    torch.testing.assert_close(st.skip().float(), o_ref.float(), atol=2e-2, rtol=2e-2)
                    st.not_due.zero_()  # a reusing step's score and Top-K launches write nothing
                    poisoned = torch.full_like(st.scores, 7.0)
                    tk.score_pages(q, lo, hi, L, PAGE, 0, st.reduce, due=st.not_due, out=poisoned, **kw)
                    assert (poisoned == 7.0).all(), "a reusing step's score launch wrote its output"
                    untouched = torch.full_like(st.ids, 0x5A5A)
                    tk.topk_pages(st.scores, 17, st.group, due=st.not_due, out=untouched)
                    assert (untouched == 0x5A5A).all(), "a reusing step's Top-K launch wrote its output"
    print("check: 8-bit bounds and reuse steps match their references", flush=True)


def tune(bw):
    """Time each stage's candidate block sizes (CUDA-graph replays) on llama2 union / llama3 max at 32K and
    128K, batch 1, fp16; keep the candidate with the lowest summed time in LAUNCH (this script's sweep)."""
    cases = []
    for shape, mode in (("llama2-7b", "union"), ("llama3-8b", "max")):
        H_q, H_kv, D = SHAPES[shape]
        for L in (32768, 131072):
            layer = make_layer(1, H_kv, L, D, torch.float16, 0)
            q = torch.randn(1, H_q, D, device=DEV, dtype=torch.float16)
            cases.append((f"{shape}/{mode}/{L}", (layer, q, mode)))
    cases = [(name, Step(layer, q, 128, mode)) for name, (layer, q, mode) in cases]
    results = {"full_graph_us": {name: graph_time([st], "full") for name, st in cases}}
    print(f"tune: whole step (graph) {results['full_graph_us']}", flush=True)
    for stage, (key, names, cands) in TUNE_SPACE.items():
        if TUNE_STAGES and stage not in TUNE_STAGES:
            continue
        default = tuple(getattr(LAUNCH[key], n) for n in names)
        best = None
        for cand in cands:
            launch = {key: dataclasses.replace(LAUNCH[key], **dict(zip(names, cand, strict=True)))}
            try:
                times = {name: graph_time([Step((st.kc, st.vc, st.kmin, st.kmax, st.valid), st.q, st.k, st.mode,
                                                launch)], stage.split("_")[0]) for name, st in cases}
            except Exception as e:  # a candidate that does not compile is skipped, not fatal
                print(f"tune: {stage} {cand} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tot = sum(times.values())
            config = dict(zip(names, cand, strict=True))
            results.setdefault(stage, []).append(dict(config=config, us=times, total_us=tot))
            print(f"tune: {stage} {config} total {tot:.1f} us {times}", flush=True)
            if best is None or tot < best[0]:
                best = (tot, cand)
        chosen = best[1] if best else default
        LAUNCH[key] = dataclasses.replace(LAUNCH[key], **dict(zip(names, chosen, strict=True)))
        results[stage + "_chosen"] = dict(zip(names, chosen, strict=True))
        print(f"tune: {stage} chosen {dict(zip(names, chosen, strict=True))}", flush=True)
    del cases
    torch.cuda.empty_cache()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4K/32K/128K, batch 1/8, budget 2048, fp16 only")
    ap.add_argument("--check", action="store_true", help="compare launchers with references first")
    ap.add_argument("--tune", action="store_true", help="pick block sizes at 32K/128K first (CUDA graphs)")
    ap.add_argument("--tune-stages", nargs="*", default=[], help="tune only these stages (default: all)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the benchmark sweep")
    ap.add_argument("--full", action="store_true", help="bf16 at every budget too (default: bf16 at 2048 only)")
    ap.add_argument("--lengths", type=int, nargs="*", default=None,
                    help="context lengths (default 4096 16384 32768 65536 131072; --quick: 4096 32768 131072)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--topk-launch", nargs="*", default=[], metavar="NAME=VALUE",
                    help="TopKLaunch fields for the sweep's Top-K (e.g. tail_tile=64; default: the library's)")
    ap.add_argument("--score-mma", choices=["auto", "on", "off"], default="auto",
                    help="the score kernel's tensor-core form (ScoreLaunch.mma: auto = GQA only, the default)")
    ap.add_argument("--score-launch", nargs="*", default=[], metavar="NAME=VALUE",
                    help="ScoreLaunch fields for the score kernel, e.g. block_p=64 num_warps=8 packed_codes=True "
                         "trunc_parts=True (after --score-mma)")
    ap.add_argument("--variants", action="store_true", help="also time the attention with its merge always/never fused")
    ap.add_argument("--bounds", nargs="+", default=["key_dtype"], choices=["key_dtype", "int8", "int8_channel"],
                    help="page bounds of each row (QuestConfig.bounds; int8: 8-bit codes + a scale a page; "
                         "int8_channel: on channel scales of the layer's keys times 2^e a page)")
    ap.add_argument("--reselect-every", type=int, nargs="+", default=[1], metavar="K",
                    help="rows choosing pages every K steps (QuestConfig.reselect_every): skip and amortised columns")
    ap.add_argument("--dry", action="store_true",
                    help="no GPU: run the 8-bit and reuse steps at tiny sizes against their references and exit "
                         "(needs TRITON_INTERPRET=1 without CUDA)")
    ap.add_argument("--extra-pages", type=int, default=0, metavar="N",
                    help="N empty pages after the L tokens, scored and attended as the captured decode does over its "
                         "allocation (the captured 32K decode of benchmarks/kernels/bench_topk.py: 2053 pages, N = 5)")
    ap.add_argument("--name", default="bench_kernels", help="output file stem")
    ap.add_argument("--out-dir", default=None, help="output folder (default results/bench_kernels/)")
    args = ap.parse_args(argv)
    variants = [(b, k) for b in args.bounds for k in args.reselect_every]
    if args.dry:
        dry_run(variants)
        return
    import triton

    out_dir = args.out_dir or str(results_dir("bench_kernels"))
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv))
    t0 = time.time()
    global VARIANTS, TUNE_STAGES, EXTRA_PAGES
    VARIANTS, TUNE_STAGES, EXTRA_PAGES = args.variants, tuple(args.tune_stages), args.extra_pages
    meta["extra_pages"] = EXTRA_PAGES
    if args.score_mma != "auto":
        LAUNCH["score"] = dataclasses.replace(LAUNCH["score"], mma=args.score_mma == "on")
    meta["score_mma"] = args.score_mma
    if args.score_launch:
        fields = launch_fields(score_mod.ScoreLaunch, args.score_launch)
        LAUNCH["score"] = dataclasses.replace(LAUNCH["score"], **fields)
        meta["score_launch"] = " ".join(args.score_launch)
    if args.topk_launch:
        LAUNCH["topk"] = set_topk_launch(args.topk_launch)
        meta["topk_launch"] = " ".join(args.topk_launch)
    meta["timer"] = "clean (quest_hf.bench.time_calls)"
    if args.check:
        check()
        check_topk_large()
        check_bounds_reuse()
        meta["check_s"] = time.time() - t0
    bw = copy_bandwidth(DEV)
    meta["copy_bandwidth_GBps"] = bw / 1e9
    meta["gpu_state_start"] = gpu_state(DEV)  # nvidia-smi's clocks / power, here and at the end
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    meta["tune"] = tune(bw) if args.tune else None
    rows, sdpa_cache = [], {}
    if not args.no_sweep:
        print(HEADER, flush=True)
        if args.quick:
            grid = [(s, L, B, 2048, torch.float16) for s in SHAPES for B in args.batches
                    for L in args.lengths or (4096, 32768, 131072)]
        else:
            grid = [(s, L, B, bud, dt) for dt in (torch.float16, torch.bfloat16) for s in SHAPES for B in args.batches
                    for L in args.lengths or (4096, 16384, 32768, 65536, 131072) for bud in (512, 2048, 4096)
                    if args.full or dt == torch.float16 or bud == 2048]
        for shape, L, B, bud, dt in grid:
            rows += run_config(shape, L, B, bud, dt, ("union", "max"), bw, sdpa_cache, variants)
            write(out_dir, args.name, meta, rows)
    meta["wall_s"] = time.time() - t0
    meta["gpu_state_end"] = gpu_state(DEV)
    write(out_dir, args.name, meta, rows)
    print(f"done in {meta['wall_s']:.0f} s", flush=True)


def dry_run(variants):
    """Tiny sizes, no timing: each asked-for step runs and matches its reference (CPU under TRITON_INTERPRET=1)."""
    global DEV
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("error: --dry without CUDA needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
        DEV = "cpu"
    check_bounds_reuse(sizes=((8, 2, 64, 16 * 40, 1), (4, 4, 64, 16 * 23, 2)), variants=variants)
    print(f"dry: {len(variants)} variant(s) ran on {DEV}: {variants}", flush=True)


def write(out_dir, name, meta, rows):
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(f"# Quest kernels vs dense SDPA\n\n{json.dumps({k: v for k, v in meta.items() if k != 'tune'})}\n\n")
        f.write("score/topk/attn/graph: CUDA-graph replays; total: plain launches from Python. Timer: "
                f"{meta.get('timer')} (see scripts/bench_kernels.py).\n\n")
        f.write(HEADER + "\n" + "\n".join(fmt_row(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
