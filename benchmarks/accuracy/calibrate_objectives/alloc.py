"""Queue jobs for evalppl.py: the equal-bytes allocations of a scripts/calibrate.py JSON, per objective and budget.

    python alloc.py CALIBRATE_JSON QUEUE TAG error,output 512,1024      # QUEUE '-': print only
"""
import dataclasses
import json
import sys

from quest_hf import calibration as cal

src, qdir, tag = sys.argv[1], sys.argv[2], sys.argv[3]
objectives = sys.argv[4].split(",")
budgets = [int(b) for b in sys.argv[5].split(",")]
r = json.load(open(src))


def conv(rows):
    return [{(k if k == "dense" else int(k)): v for k, v in d.items()} for d in rows]


opts = [o if o == "dense" else int(o) for o in r["options"]]
m = cal.LayerMeasurement(options=opts, context=r["tokens"], queries=r["queries"], policy=r["policy"],
                         page_size=r["page_size"], gqa_mode=r["gqa_mode"], bounds=r.get("bounds", "key_dtype"))
for k in (*cal.METRICS, "bytes", "flat"):
    setattr(m, k, conv(r[k]))
for obj in objectives:
    for b in budgets:
        ch = cal.allocate(m, b, objective=obj)
        cfg = cal.to_config(ch, b, policy=m.policy, page_size=m.page_size, gqa_mode=m.gqa_mode, bounds=m.bounds)
        spent, flat = sum(m.bytes[i][c] for i, c in enumerate(ch)), cal.flat_bytes(m, b)
        d = {k: v for k, v in dataclasses.asdict(cfg).items() if not k.startswith("_")}
        name = f"{tag}_{obj}_{b}"
        print(name, f"{spent / 2**20:.2f}/{flat / 2**20:.2f} MiB", "dense", list(cfg.dense), ch)
        if qdir != "-":
            json.dump(dict(name=name, config=d), open(f"{qdir}/{name}.json", "w"))
