"""Paired comparison of 8-bit channel bounds against key-dtype bounds, token by token, from scripts/ppl.py JSON files
that hold both rows (`--policies quest --bounds int8_channel`): the perplexity ratio and its 95% interval from the
per-token NLL differences (the same tokens, the same prefix).

    python benchmarks/accuracy/bounds8_channel_paired.py benchmarks/accuracy/bounds8_channel_ppl_langref.json ...
"""
import json
import math
import statistics
import sys


def paired(a, b):
    d = [x - y for x, y in zip(a, b, strict=True)]
    m, se = statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))
    return [100 * (math.exp(v) - 1) for v in (m, m - 1.96 * se, m + 1.96 * se)]


def main(paths):
    print("| text | tokens | budget | ppl key dtype | ppl int8_channel | ratio | 95% interval |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        rows = {r["name"]: r for r in report["rows"]}
        for name, row in rows.items():
            if not name.startswith("quest bounds=int8_channel "):
                continue
            base = rows[f"quest {row['budget']}"]
            r, lo, hi = paired(row["nlls"], base["nlls"])
            print(f"| {path.rsplit('/', 1)[-1]} | {len(row['nlls'])} | {row['budget']} | {base['ppl']:.3f} | "
                  f"{row['ppl']:.3f} | {r:+.2f}% | {lo:+.2f} .. {hi:+.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
