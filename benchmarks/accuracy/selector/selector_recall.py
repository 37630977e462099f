#!/usr/bin/env python
"""Top-10 recall vs bytes read per step, for page selectors (quest, qcode, ...) on the passkey prompt.

One dense prefill of a passkey prompt (quest_hf.eval.passkey, needle at `--depth`), then for each policy and
budget the question tail is decoded token by token through the real sparse path; at every sparse layer and
step a selection hook scores the chosen pages: the fraction of each query head's true top-10 tokens (by
exact q.k over the whole context) inside the pages its KV head reads, and the bytes that step read
(quest_hf.eval.accounting). The oracle reads the exact top tokens: recall 1 by construction, at its bytes.

    python benchmarks/accuracy/selector/selector_recall.py          # 4K, budgets 64..512, quest/qcode/qcode1/qcode_topp
    python benchmarks/accuracy/selector/selector_recall.py --lengths 2048 --budgets 64 128

Writes --out (default results/selector_recall/selector_recall.json) and a .md beside it. The committed
selector_recall*.{json,md} beside this file were written by it when it lived in scripts/ (benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

from quest_hf import QuestConfig, patch_model
from quest_hf.bench import results_dir
from quest_hf.eval.accounting import dense_bytes, step_bytes
from quest_hf.eval.decode import feed, prefill
from quest_hf.eval.passkey import make_case
from quest_hf.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--policies", nargs="+", default=["quest", "qcode", "qcode1", "qcode_topp"])
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--bytes-dtype", default="float16", help="KV dtype the byte fractions assume (default float16)")
    p.add_argument("--out", default=None, help="JSON path (default results/selector_recall/selector_recall.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(results_dir("selector_recall") / "selector_recall.json")
    return args


def recall_hook(cache, topk, records, acct):
    """Selection hook: per (layer, step) top-k recall of the chosen pages and the bytes read."""
    def hook(i, q, ids):
        layer = cache.layers[i]
        L, S = layer.seq_len, layer.page_size
        B, H, _ = ids.shape
        G = q.shape[1] // H
        keys = layer.keys[:, :, :L].float()
        logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, G, -1), keys)
        logits = logits.masked_fill(~layer.valid[:, None, None, :L], float("-inf"))
        top = logits.topk(min(topk, L), -1).indices  # [B, H, G, k]
        P = -(-L // S)
        chosen = torch.zeros(B, H, P + 1, dtype=torch.bool)
        chosen.scatter_(-1, torch.where(ids >= 0, ids, P).long(), True)
        hit = torch.gather(chosen[:, :, None, :P].expand(B, H, G, P), -1, top // S)
        pages = int((ids >= 0).sum()) / B
        records.append(dict(layer=i, recall=hit.float().mean().item(), pages=pages,
                            bytes_frac=acct(L, pages)))
    return hook


def main(argv=None):
    args = parse_args(argv)
    model, tok = load_model(args.model)
    cfg = model.config.get_text_config()
    H = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    G = cfg.num_attention_heads // H
    elt = torch.finfo(getattr(torch, args.bytes_dtype)).bits // 8
    base = QuestConfig(budget=1 << 30, page_size=args.page_size, backend="torch")
    patch_model(model, config=base)
    rows = []
    for n in args.lengths:
        case = make_case(tok, n, args.depth, seed=args.seed)
        cache, _ = prefill(model, case.prefix)
        for policy in args.policies:
            for budget in args.budgets:
                run = cache.copy(dataclasses.replace(base, budget=budget, policy=policy))
                recs = []

                def acct(L, pages, policy=policy, budget=budget):
                    read = step_bytes(policy, L, H, D, elt, args.page_size, pages, budget, G)
                    return read / dense_bytes(L, H, D, elt)

                run.selection_hooks.append(recall_hook(run, args.topk, recs, acct))
                feed(model, run, case.tail)
                layers = sorted({r["layer"] for r in recs})
                per_layer = {li: sum(r["recall"] for r in recs if r["layer"] == li)
                             / sum(r["layer"] == li for r in recs) for li in layers}
                row = dict(length=n, policy=policy, budget=budget, recall=sum(per_layer.values()) / len(per_layer),
                           bytes_frac=sum(r["bytes_frac"] for r in recs) / len(recs),
                           pages_per_kv_head=sum(r["pages"] for r in recs) / len(recs) / H,
                           per_layer={str(k): round(v, 4) for k, v in per_layer.items()})
                rows.append(row)
                print(f"{n} {policy:11s} {budget:5d}  recall {row['recall']:.3f}  bytes {row['bytes_frac']:.3f}  "
                      f"pages/kv-head {row['pages_per_kv_head']:.1f}", flush=True)
            L = case.num_tokens
        for budget in args.budgets:
            rows.append(dict(length=n, policy="oracle", budget=budget, recall=1.0,
                             bytes_frac=step_bytes("oracle", L, H, D, elt, args.page_size, 0, budget, G)
                             / dense_bytes(L, H, D, elt)))
    command = " ".join(["python benchmarks/accuracy/selector/selector_recall.py",
                        *(argv if argv is not None else sys.argv[1:])])
    md = [f"# Selector recall@{args.topk} vs bytes read per step ({datetime.date.today().isoformat()})\n",
          f"- command: `{command}`",
          f"- passkey prompt, depth {args.depth}, seed {args.seed}; page size {args.page_size}; "
          f"bytes as {args.bytes_dtype} KV",
          "- cells: mean top-10 recall over the sparse layers and tail steps (bytes fraction of dense KV per step)\n"]
    for n in args.lengths:
        md += [f"\n### {n} tokens\n", "| policy | " + " | ".join(f"budget {b}" for b in args.budgets) + " |",
               "|---|" + "---|" * len(args.budgets)]
        for policy in ["oracle", *args.policies]:
            cells = []
            for b in args.budgets:
                r = next(r for r in rows if r["length"] == n and r["policy"] == policy and r["budget"] == b)
                cells.append(f"{r['recall']:.3f} ({r['bytes_frac']:.3f})")
            md.append(f"| {policy} | " + " | ".join(cells) + " |")
        layers = sorted(int(k) for k in next(r for r in rows if r["length"] == n and "per_layer" in r)["per_layer"])
        second = args.budgets[1 % len(args.budgets)]
        md += [f"\n#### {n} tokens: recall per layer at budget {args.budgets[0]} / {second}\n",
               "| layer | " + " | ".join(args.policies) + " |", "|---|" + "---|" * len(args.policies)]
        for li in layers:
            cells = []
            for policy in args.policies:
                rs = [r for r in rows if r["length"] == n and r["policy"] == policy and r["budget"] in args.budgets[:2]]
                cells.append(" / ".join(f"{r['per_layer'][str(li)]:.2f}" for r in rs))
            md.append(f"| {li} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
