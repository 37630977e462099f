"""One table and one plot of accuracy against bytes per decode step, flat vs calibrated, from results already made.

Reads scripts/ppl.py JSONs (perplexity at 8K) and scripts/passkey.py JSONs (passkey at 4K / 8K) and joins them by
policy (with its page size), flat or calibrated, and the flat budget whose bytes a row matches. Runs nothing.

    python scripts/calibration_report.py --ppl benchmarks/accuracy/ppl_policies_smollm2.json \\
        --passkey benchmarks/accuracy/passkey_calibrated_error_4k_smollm2.json --out /tmp/report.json

A passkey file's `calibrated` rows belong to the one policy its flat rows ran (scripts/passkey.py --policies P).
Writes JSON (--out), a Markdown table and a PNG beside it.
"""
import argparse
import json
import os

from quest_hf.bench import environment, write_report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ppl", nargs="+", default=[], help="scripts/ppl.py JSON files")
    p.add_argument("--ppl-flat", nargs="+", default=[], help="scripts/ppl.py JSON files read for their flat rows only")
    p.add_argument("--passkey", nargs="+", default=[], help="scripts/passkey.py JSON files")
    p.add_argument("--out", required=True, help="JSON path (+ .md, .png)")
    return p.parse_args(argv)


def ppl_rows(path):
    """{(policy label, kind, budget): row} and the dense row of one ppl.py file."""
    r = json.load(open(path))
    page, out, dense = r["page_size"], {}, None
    for row in r["rows"]:
        if row["budget"] is None:
            dense = row
            continue
        kind = "calibrated" if row["name"].startswith("calibrated") else "flat"
        if row["name"] not in (f"{row['policy']} {row['budget']}", f"calibrated {row['policy']} ={row['budget']}"):
            continue  # variants (bounds=int8, reselect_every=k) are not part of this table
        out[(f"{row['policy']}/{page}", kind, row["budget"])] = row
    return out, dense, r


def passkey_rows(path):
    """{(policy label, kind, budget, length): (correct, cases, whole-model bytes fraction)} of one passkey.py file."""
    r = json.load(open(path))
    page = r["meta"]["page_size"]
    flat = sorted({x["policy"] for x in r["rows"]} - {"dense", "calibrated"})
    owner = flat[0] if len(flat) == 1 else None
    cells = {}
    for x in r["rows"]:
        if x.get("variant"):
            continue
        policy = owner if x["policy"] == "calibrated" else x["policy"]
        if policy is None:
            raise SystemExit(f"{path}: calibrated rows beside several flat policies {flat}: run one policy a file")
        kind = "calibrated" if x["policy"] == "calibrated" else ("dense" if policy == "dense" else "flat")
        key = ("dense" if kind == "dense" else f"{policy}/{page}", kind, x["budget"], x["length"])
        c = cells.setdefault(key, [0, 0, 0.0])
        c[0] += bool(x["correct"])
        c[1] += 1
        c[2] += x.get("model_bytes_frac", float("nan"))
    return {k: (a, n, f / n) for k, (a, n, f) in cells.items()}, r["meta"]


def plot(rows, dense_ppl, lengths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(lengths), figsize=(5 * (1 + len(lengths)), 4))
    series = sorted({(r["policy"], r["kind"]) for r in rows})
    colors = {p: f"C{i}" for i, p in enumerate(sorted({p for p, _ in series}))}
    for policy, kind in series:
        sub = sorted((r for r in rows if (r["policy"], r["kind"]) == (policy, kind)), key=lambda r: r["budget"])
        style = dict(marker="s" if kind == "calibrated" else "o", ls="-" if kind == "calibrated" else "--",
                     label=f"{policy} {kind}", color=colors[policy])
        pts = [(r["ppl_bytes"], r["ppl"], r["budget"]) for r in sub if r.get("ppl") is not None]
        if pts:
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
            for x, y, b in pts:
                axes[0].annotate(str(b), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for ax, n in zip(axes[1:], lengths):
            pk = [(r[f"pk{n}_bytes"], r[f"pk{n}"][0] / r[f"pk{n}"][1], r["budget"]) for r in sub if r.get(f"pk{n}")]
            if pk:
                ax.plot([p[0] for p in pk], [p[1] for p in pk], **style)
                for x, y, b in pk:
                    ax.annotate(str(b), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if dense_ppl is not None:
        axes[0].axhline(dense_ppl, color="k", ls=":", label=f"dense {dense_ppl:.3f}")
    axes[0].set_ylabel("perplexity at 8K (7680 dense + 512 decoded)")
    for ax, n in zip(axes[1:], lengths):
        d = next((r[f"pk{n}_dense"] for r in rows if r.get(f"pk{n}_dense")), None)
        if d:
            ax.axhline(d[0] / d[1], color="k", ls=":", label=f"dense {d[0]}/{d[1]}")
        ax.set_ylabel(f"passkey at {n // 1024}K: fraction found")
        ax.set_ylim(-0.05, 1.05)
    for ax in axes:
        ax.set_xlabel("KV bytes per decode step, all layers, fraction of dense\n(labels: flat budget of equal bytes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, CPU: flat vs calibrated per-layer budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    table, dense_ppl, sources = {}, None, []
    for path in args.ppl_flat + args.ppl:
        rows, dense, r = ppl_rows(path)
        if path in args.ppl_flat:
            rows = {k: v for k, v in rows.items() if k[1] == "flat"}
        sources.append(f"{path}{' (flat rows)' if path in args.ppl_flat else ''}: `{r['env']['command']}` "
                       f"({r['env']['date']}, {r['env']['machine']})")
        dense_ppl = dense["ppl"] if dense else dense_ppl
        for (policy, kind, budget), row in rows.items():
            table.setdefault((policy, kind, budget), dict(policy=policy, kind=kind, budget=budget)).update(
                ppl=row["ppl"], ppl_rel=row["ppl"] / dense["ppl"], ppl_bytes=row["bytes_frac"])
    lengths, dense_pk = set(), {}
    for path in args.passkey:
        cells, meta = passkey_rows(path)
        sources.append(f"{path}: `{meta['command']}` ({meta['date']}, {meta['device']}, torch {meta['torch']}, "
                       f"transformers {meta['transformers']})")
        for (policy, kind, budget, n), (acc, cases, frac) in cells.items():
            lengths.add(n)
            if kind == "dense":
                dense_pk[n] = (acc, cases)
                continue
            row = table.setdefault((policy, kind, budget), dict(policy=policy, kind=kind, budget=budget))
            row.update({f"pk{n}": (acc, cases), f"pk{n}_bytes": frac})
    lengths = sorted(lengths)
    rows = sorted(table.values(), key=lambda r: (r["policy"], r["budget"], r["kind"] != "flat"))
    for row in rows:
        for n in lengths:
            if dense_pk.get(n):
                row[f"pk{n}_dense"] = dense_pk[n][:2]
    head = ["policy / page size", "flat or calibrated", "equal bytes to flat budget", "ppl 8K (of dense)",
            "bytes/step 8K (of dense)"] + [f"passkey {n // 1024}K (bytes of dense)" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if dense_ppl is not None or dense_pk:
        cells = [f"{dense_ppl:.3f} (1.000)" if dense_ppl is not None else "-", "1.000"]
        cells += [f"{dense_pk[n][0]}/{dense_pk[n][1]} (1.00)" if dense_pk.get(n) else "-" for n in lengths]
        lines.append("| dense | - | - | " + " | ".join(cells) + " |")
    for r in rows:
        cells = [f"{r['ppl']:.3f} ({r['ppl_rel']:.3f})" if "ppl" in r else "-",
                 f"{r['ppl_bytes']:.3f}" if "ppl" in r else "-"]
        cells += [f"{r[f'pk{n}'][0]}/{r[f'pk{n}'][1]} ({r[f'pk{n}_bytes']:.2f})" if f"pk{n}" in r else "-"
                  for n in lengths]
        lines.append(f"| {r['policy']} | {r['kind']} | {r['budget']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    report = dict(env=environment("cpu"), sources=sources, dense_ppl=dense_ppl,
                  dense_passkey={str(n): v for n, v in dense_pk.items()}, rows=rows)
    write_report(args.out, report, "Accuracy against bytes per step, flat vs calibrated: SmolLM2-135M (CPU)",
                 ["- joined from (each file's own command, date, machine):", *[f"  - {s}" for s in sources],
                  "- bytes: K/V + page metadata a decode step reads over all 30 layers (pages as measured, fp32), "
                  "as a fraction of dense; for passkey the mean over its cases"], lines)
    plot(rows, dense_ppl, lengths, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} (+ .md, .png)")


if __name__ == "__main__":
    main()
