"""A probe: two other 8-bit encodings of the page bounds, emulated in a selector (not kernels; bytes are not
accounted), on the protocols of scripts/passkey.py and scripts/ppl.py.

    OMP_NUM_THREADS=1 python benchmarks/accuracy/bounds8_encodings.py passkey   # 4K/8K x 5 depths x 64..1024
    OMP_NUM_THREADS=1 python benchmarks/accuracy/bounds8_encodings.py ppl       # budget 256
Encodings: 'cr8' (int8 centre on one scale + uint8 radius on another, the radius from the rounded centre so the
interval still encloses [min, max]); 'g16' (lo/hi int8 codes as bounds8.py, one scale per 16 channels).
"""
import sys
from pathlib import Path

import torch

import triton_kernels as tk
from quest_hf.selectors import QuestSelector, register_selector

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))


def cr8(lo, hi):
    lo, hi = lo.double(), hi.double()  # emulation: exact enough that the fp32 score's rounding is all that is left
    empty = lo > hi
    lo0, hi0 = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    c = (lo0 + hi0) / 2
    sc = (c.abs().amax(-1, keepdim=True) / 127).clamp_min(2 ** -126)
    cq = torch.round(c / sc) * sc
    r = torch.maximum(hi0 - cq, cq - lo0).clamp_min(0)
    sr = (r.amax(-1, keepdim=True) / 254).clamp_min(2 ** -126)
    rq = torch.ceil(r / sr)
    rq = torch.where(rq * sr < r, rq + 1, rq) * sr
    # enclosure (float64 check, the prototype only)
    assert ((cq - rq <= lo0 + 1e-12) | empty).all() and ((cq + rq >= hi0 - 1e-12) | empty).all()
    return torch.where(empty, lo, cq - rq).float(), torch.where(empty, hi, cq + rq).float()


def g16(lo, hi, gs=16):
    B, H, P, D = lo.shape
    empty = lo > hi
    lo0 = torch.where(empty, 0.0, lo).reshape(B, H, P, D // gs, gs)
    hi0 = torch.where(empty, 0.0, hi).reshape(B, H, P, D // gs, gs)
    s = (torch.maximum(lo0.abs(), hi0.abs()).amax(-1, keepdim=True) / 126).clamp_min(2 ** -126)
    lq = torch.floor(lo0 / s)
    lq = torch.where(lq * s > lo0, lq - 1, lq) * s
    hq = torch.ceil(hi0 / s)
    hq = torch.where(hq * s < hi0, hq + 1, hq) * s
    return torch.where(empty, lo, lq.reshape(lo.shape)), torch.where(empty, hi, hq.reshape(hi.shape))


class Emulated(QuestSelector):
    def __init__(self, enc):
        self.enc = enc

    def select(self, layer, q, window):
        cfg = layer.config
        lo, hi = self.enc(layer.kmin.float(), layer.kmax.float())
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        s = tk.score_pages_ref(q, lo, hi, layer.keys.shape[2], cfg.page_size, 0, reduce, pos=layer.pos, window=window,
                               rows=layer.rows)
        group = q.shape[1] // layer.kmin.shape[1] if reduce == "none" else 1
        return layer.ops.topk_pages(s, cfg.num_pages + 1, group)


register_selector("quest_cr8", Emulated(cr8))
register_selector("quest_g16", Emulated(g16))

if sys.argv[1] == "passkey":
    import passkey
    passkey.ORDER += ["quest_cr8", "quest_g16"]
    args = passkey.parse_args(["--lengths", "4096", "8192", "--depths", "5", "--policies", "quest",
                               "--out", str(OUT / "bounds8_encodings_passkey.json")])
    args.policies = ["quest_cr8", "quest_g16"]
    rows, lengths = passkey.run(args, on_case=lambda rows, lengths: passkey.save(args, [], rows, lengths))
    print(passkey.save(args, [], rows, lengths))
else:
    import ppl
    sys.argv = ["ppl.py", "--threads", "1", "--budgets", "256", "--policies", "quest,quest_cr8,quest_g16",
                "--out", str(OUT / "bounds8_encodings_ppl.json"), "--no-plot"]
    ppl.main()
