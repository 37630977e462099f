#!/usr/bin/env python
"""Contexts larger than GPU memory (#20): QuestConfig(offload="cpu") on a Llama-3-8B shape under an emulated card.

Random weights (speed does not depend on them), fp16, batch 1, budget 2048, page 16. A card of `--cap-gib` GiB is
emulated with `torch.cuda.set_per_process_memory_fraction(cap / total)` (the caching allocator refuses past it).
Every Quest run prefills with `quest_hf.prefill` (chunks of `--chunk` tokens, each attending to its past
in blocks of `--block`), then decodes `--new-tokens` greedy tokens through `generate()` (captured steps); per-token
times come from a streamer's timestamps (quest_hf.bench.Clock), the median after the first three (eager step,
capture). Rows (`--rows`, any subset, in this order):

  cap      at `--cap-length` (128K) under the cap: offload (ms/token, peak memory, hit rate, bytes per step);
           transformers' own offloaded cache (`DynamicCache(offloading=True)`, what generate's
           cache_implementation="offloaded" builds) under the same cap, chunked prefill, `--hf-tokens` decode
           forwards timed; then the all-GPU Quest path WITHOUT the cap, same settings: its tokens against offload's
  longest  each of `--lengths` (256K, 512K) under the cap, offload: ms/token, peak; stops at the first that fails
  nocap    without the cap, offload vs the all-GPU captured path at each of `--nocap-lengths` (32K, 128K)
  pools    without the cap at `--cap-length`, LRU eviction with pools of `--pool-factors` x one step's selection:
           hit rate, MB per step, ms/token (the default pool is 2x)

One GPU call is limited to 10 minutes: run the rows in separate calls (progress lines carry timestamps).

    python scripts/bench_offload.py --rows cap                                  # ~5 min on an H200
    python scripts/bench_offload.py --rows longest --lengths 262144             # ~4 min
    python scripts/bench_offload.py --rows longest --lengths 524288             # ~8 min
    python scripts/bench_offload.py --rows nocap                                # ~5 min
    python scripts/bench_offload.py --rows pools                                # ~5 min
    python scripts/bench_offload.py --tiny                                      # CPU smoke run, every row
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import os
import time
import traceback

import torch

from quest_hf import QuestConfig, patch_model, prefill, unpatch_model
from quest_hf.bench import Clock, environment, results_dir, write_report
from quest_hf.bench import random_llama as build
from quest_hf.patch import cache_arg_name

ROWS = ("cap", "longest", "nocap", "pools")


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def set_cap(device, gib: float | None) -> None:
    """Emulate a card of `gib` GiB (None: the whole device)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else min(1.0, gib * 2**30 / total), device)


def fresh(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device) -> dict:
    if device.type != "cuda":
        return {}
    return dict(peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30)


def fixed_device_gib(model, L: int, cfg: QuestConfig, weights_gib: float) -> float:
    """What an offloaded run keeps on the GPU whatever the prompt's activations: weights, the dense layers' K/V, every
    layer's bounds and valid slots, the sparse layers' pools (default size as the library picks it)."""
    c = model.config
    n, H, D = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    S, elt, tokens = cfg.page_size, 2, L + 2 * cfg.page_size
    dense = sum(cfg.is_dense(i) for i in range(n))
    group = c.num_attention_heads // H
    pool = cfg.offload_pages or 2 * (cfg.num_pages + 1) * (group if cfg.gqa_mode == "union" else 1)
    kv_dense = dense * tokens * H * D * 2 * elt
    bounds = n * (tokens // S) * H * D * 2 * elt + n * tokens
    pools = (n - dense) * (pool + 1) * S * H * D * 2 * elt
    return weights_gib + (kv_dense + bounds + pools) / 2**30


def prompt(model, L: int, device) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(L)
    return torch.randint(1, model.config.vocab_size, (1, L), device=device, generator=g)


def quest_run(model, ids, cfg: QuestConfig, args, device, label: str) -> dict:
    """Prefill in chunks, then greedy decode through generate(); timings, memory, tokens, offload stats."""
    L = ids.shape[1]
    patch_model(model, config=cfg)
    fresh(device)
    t0 = time.perf_counter()
    last = [t0]

    def progress(done, total, s):
        if time.perf_counter() - last[0] > 20 or done == total:
            last[0] = time.perf_counter()
            log(f"  {label}: prefill {done}/{total} tokens, {s:.0f} s")

    row = dict(method=label, length=L, offload=cfg.offload, budget=cfg.budget)
    try:
        cache, _ = prefill(model, ids[:, :-1], chunk=args.chunk, block=args.block, max_length=L + args.new_tokens,
                           progress=progress)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["prefill_s"] = time.perf_counter() - t0
        clock = Clock(device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, streamer=clock,
                             **{cache_arg_name(model): cache})
    except torch.OutOfMemoryError as e:
        row["error"] = f"OOM: {str(e).splitlines()[0]}"
        log(f"  {label}: {row['error']}")
        fresh(device)
        return row
    except Exception as e:  # noqa: BLE001 - one failing configuration is reported, the other rows still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log(f"  {label}: {row['error']}")
        traceback.print_exc()
        fresh(device)
        return row
    intervals = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
    steps = sorted(intervals[3:] if len(intervals) > 3 else intervals)  # after the eager step and the capture
    row.update(ms_per_token=1e3 * steps[len(steps) // 2], ms_per_token_mean=1e3 * sum(steps) / len(steps),
               decode_path=cache.decode_path, prefill_mode=cache.prefill_mode, tokens=out[0, L:].tolist(),
               **peaks(device))
    if cfg.offload:
        st = cache.offload_stats
        row.update(hit_rate=st["hit_rate"], mb_per_step=st["bytes_per_step"] / 1e6, pool_gib=st["pool_bytes"] / 2**30,
                   host_gib=st["host_bytes"] / 2**30)
    pool = f", hit rate {row['hit_rate']:.3f}, {row['mb_per_step']:.1f} MB/step" if cfg.offload else ""
    log(f"  {label}: {row['ms_per_token']:.2f} ms/token, prefill {row['prefill_s']:.1f} s, "
        f"peak {row.get('peak_allocated_gib', 0):.2f} GiB{pool}")
    del cache, out
    fresh(device)
    return row


def hf_offloaded(model, ids, args, device) -> dict:
    """transformers' offloaded DynamicCache (every layer's K/V crosses to the GPU on every forward): chunked prefill,
    then `--hf-tokens` one-token forwards, each timed with a device sync."""
    from transformers import DynamicCache

    L = ids.shape[1]
    row = dict(method="hf_offloaded", length=L)
    unpatch_model(model)
    fresh(device)
    if "offloading" in inspect.signature(DynamicCache.__init__).parameters:
        cache, row["cache"] = DynamicCache(config=model.config, offloading=True), "DynamicCache(offloading=True)"
    else:  # older transformers
        from transformers import OffloadedCache

        cache, row["cache"] = OffloadedCache(), "OffloadedCache()"
    arg = cache_arg_name(model)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            for s in range(0, L - 1, args.chunk):
                e = min(L - 1, s + args.chunk)
                model(input_ids=ids[:, s:e], use_cache=True, logits_to_keep=1, **{arg: cache})
                log(f"  hf_offloaded: prefill {e}/{L - 1} tokens, {time.perf_counter() - t0:.0f} s")
            row["prefill_s"] = time.perf_counter() - t0
            tok, times = ids[:, -1:], []
            for _ in range(args.hf_tokens):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{arg: cache})
                tok = out.logits[:, -1:].argmax(-1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        row["error"] = f"OOM: {str(e).splitlines()[0]}"
        log(f"  hf_offloaded: {row['error']}")
        return row
    except Exception as e:  # noqa: BLE001 - reported in the table (e.g. a CPU run: the offloaded cache needs CUDA)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log(f"  hf_offloaded: {row['error']}")
        return row
    steps = sorted(times[1:] or times)
    row.update(ms_per_token=1e3 * steps[len(steps) // 2], **peaks(device))
    log(f"  hf_offloaded: {row['ms_per_token']:.1f} ms/token, peak {row.get('peak_allocated_gib', 0):.2f} GiB")
    del cache
    fresh(device)
    return row


def save(out_path, args, device, dtype, weights, rows, notes) -> list[str]:
    """Write the JSON and markdown report of the rows so far (after every row: a run cut short keeps them)."""
    report = dict(env=environment(device), args=vars(args), weights_gib=weights, rows=rows)
    lines = ["| row | method | context | cap GiB | ms/token | prefill s | peak GiB | hit rate | MB/step | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def fmt(k, f, r=r):
            return (f % r[k]) if r.get(k) is not None else "-"

        extra = [f"{k}={r[k]}" for k in ("same_tokens_as_gpu", "decode_path", "error") if k in r]
        extra += [f"{k}={r[k]:.2f}" for k in ("speedup_vs_hf_offloaded", "cost_vs_gpu") if k in r]
        lines.append(f"| {r['row']} | {r['method']} | {r['length']} | {fmt('cap_gib', '%g')} | "
                     f"{fmt('ms_per_token', '%.2f')} | {fmt('prefill_s', '%.1f')} | "
                     f"{fmt('peak_allocated_gib', '%.2f')} | "
                     f"{fmt('hit_rate', '%.3f')} | {fmt('mb_per_step', '%.1f')} | {'; '.join(extra)} |")
    notes = notes + [f"- {args.shape}, {dtype}, batch 1, budget {args.budget}, page {args.page_size}, dense layers "
                     f"{args.dense_layers}, pool pages {args.pool_pages or 'default'}, weights {weights:.2f} GiB; "
                     f"prefill chunks {args.chunk}, past blocks {args.block}; {args.new_tokens} new tokens"]
    write_report(out_path, report, "Quest offload (#20)", notes, lines)
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--pool-factors", type=float, nargs="+", default=[1, 2, 4, 8],
                   help="the 'pools' row: pools of these multiples of one step's selection")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--cap-gib", type=float, default=24.0, help="emulated card (GiB)")
    p.add_argument("--cap-length", type=int, default=131072)
    p.add_argument("--lengths", type=int, nargs="+", default=[262144, 524288], help="the 'longest' row")
    p.add_argument("--nocap-lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=None, help="QuestConfig.offload_pages (default: the library's)")
    p.add_argument("--dense-layers", type=int, default=2, help="QuestConfig.dense_layers (they stay on the GPU)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-tokens", type=int, default=4, help="decode forwards timed with transformers' offloaded cache")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    p.add_argument("--block", type=int, default=32768, help="past tokens a chunk attends to per block")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny model and short contexts (a CPU smoke run)")
    p.add_argument("--force", action="store_true",
                   help="run a capped offload row even when its fixed device memory (weights, dense layers' K/V, "
                        "bounds, pools) exceeds the cap (default: skipped with the estimate)")
    p.add_argument("--out", default=None, help="JSON path; a .md beside it (default results/bench_offload/)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.budget, args.chunk, args.block, args.new_tokens = "tiny", 256, 1000, 1500, 8
        args.cap_length, args.lengths, args.nocap_lengths, args.hf_tokens = 4096, [8192], [2048, 4096], 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" or args.dtype != "float16" else torch.float32
    rows_out = args.rows
    out_path = args.out or str(results_dir("bench_offload") / f"offload_{'_'.join(rows_out)}.json")
    longest = max([args.cap_length] * bool({"cap", "pools"} & set(rows_out)) + args.lengths * ("longest" in rows_out)
                  + args.nocap_lengths * ("nocap" in rows_out))
    log(f"building {args.shape} ({dtype}) on {device}")
    model = build(args.shape, dtype, device, longest + args.new_tokens + 64)
    weights = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**30
    log(f"weights {weights:.2f} GiB; rows {', '.join(rows_out)}")
    base = dict(budget=args.budget, page_size=args.page_size, dense_layers=args.dense_layers)
    off = dict(base, offload="cpu", offload_pages=args.pool_pages)
    rows, notes = [], []
    if device.type != "cuda":
        notes.append("- CPU run: no memory cap (the cap emulates a card through the CUDA caching allocator)")

    if "cap" in rows_out:
        L = args.cap_length
        ids = prompt(model, L, device)
        log(f"row cap: {L} tokens under {args.cap_gib} GiB (offload's fixed device memory "
            f"{fixed_device_gib(model, L, QuestConfig(**off), weights):.2f} GiB)")
        set_cap(device, args.cap_gib)
        try:
            r_off = quest_run(model, ids, QuestConfig(**off), args, device, "quest_offload")
            r_off["row"], r_off["cap_gib"] = "cap", args.cap_gib if device.type == "cuda" else None
            rows.append(r_off)
            save(out_path, args, device, dtype, weights, rows, notes)
            r_hf = hf_offloaded(model, ids, args, device)
            r_hf["row"], r_hf["cap_gib"] = "cap", args.cap_gib if device.type == "cuda" else None
            rows.append(r_hf)
            save(out_path, args, device, dtype, weights, rows, notes)
        finally:
            set_cap(device, None)
        r_gpu = quest_run(model, ids, QuestConfig(**base), args, device, "quest_gpu")
        r_gpu["row"], r_gpu["cap_gib"] = "cap", None
        if "tokens" in r_off and "tokens" in r_gpu:
            r_off["same_tokens_as_gpu"] = r_off["tokens"] == r_gpu["tokens"]
            log(f"  offload tokens == all-GPU tokens: {r_off['same_tokens_as_gpu']}")
        if "ms_per_token" in r_hf and "ms_per_token" in r_off:
            r_off["speedup_vs_hf_offloaded"] = r_hf["ms_per_token"] / r_off["ms_per_token"]
        rows.append(r_gpu)

    if "longest" in rows_out:
        set_cap(device, args.cap_gib)
        try:
            for L in args.lengths:
                need = fixed_device_gib(model, L, QuestConfig(**off), weights)
                log(f"row longest: {L} tokens under {args.cap_gib} GiB (fixed device memory {need:.2f} GiB)")
                if device.type == "cuda" and need > args.cap_gib and not args.force:
                    rows.append(dict(row="longest", method="quest_offload", length=L, cap_gib=args.cap_gib,
                                     error=f"skipped: fixed device memory {need:.2f} GiB > cap (try --dense-layers 0 "
                                           "--pool-pages with one step's selection, or --page-size 32; --force)"))
                    log(f"  {rows[-1]['error']}")
                    break
                r = quest_run(model, prompt(model, L, device), QuestConfig(**off), args, device, "quest_offload")
                r["fixed_device_gib"] = need
                r["row"], r["cap_gib"] = "longest", args.cap_gib if device.type == "cuda" else None
                rows.append(r)
                save(out_path, args, device, dtype, weights, rows, notes)
                if "error" in r:
                    break
        finally:
            set_cap(device, None)

    if "nocap" in rows_out:
        for L in args.nocap_lengths:
            ids = prompt(model, L, device)
            log(f"row nocap: {L} tokens")
            pair = [quest_run(model, ids, QuestConfig(**cfg), args, device, name)
                    for name, cfg in (("quest_offload", off), ("quest_gpu", base))]
            for r in pair:
                r["row"], r["cap_gib"] = "nocap", None
            if all("ms_per_token" in r for r in pair):
                pair[0]["cost_vs_gpu"] = pair[0]["ms_per_token"] / pair[1]["ms_per_token"]
                pair[0]["same_tokens_as_gpu"] = pair[0]["tokens"] == pair[1]["tokens"]
            rows.extend(pair)
            save(out_path, args, device, dtype, weights, rows, notes)

    if "pools" in rows_out:
        L = args.cap_length
        ids = prompt(model, L, device)
        c = model.config
        step = (args.budget // args.page_size + 1) * (c.num_attention_heads // c.num_key_value_heads)
        for f in args.pool_factors:
            pages = max(step, int(f * step))
            log(f"row pools: {L} tokens, pool {pages} pages ({f}x one step's {step})")
            r = quest_run(model, ids, QuestConfig(**dict(off, offload_pages=pages)), args, device, "quest_offload")
            r["row"], r["cap_gib"], r["pool_pages"] = f"pools {f}x", None, pages
            rows.append(r)
            save(out_path, args, device, dtype, weights, rows, notes)

    lines = save(out_path, args, device, dtype, weights, rows, notes)
    print("\n".join(lines))
    log(f"wrote {out_path} and {os.path.splitext(out_path)[0]}.md")
    return rows


if __name__ == "__main__":
    main()
