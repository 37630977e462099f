"""A second probe of 8-bit page-bound encodings (issue #16, "8-bit page bounds"), emulated as bounds8_encodings.py
does: a selector registered under its own name computes each page's bounds from emulated codes (fp64, rounded
outward to fp32) and scores them with the reference score (tk.score_pages_ref). Not kernels; the bytes columns of
the results count quest's key-dtype metadata, not each encoding's own (see the .md notes for those).

    OMP_NUM_THREADS=1 python benchmarks/accuracy/bounds8_encodings2.py selfcheck
    OMP_NUM_THREADS=1 python benchmarks/accuracy/bounds8_encodings2.py passkey --lengths 4096 --budgets 128 \
        --policies quest_fp16 quest_pc8 --out /tmp/x.json           # (passkey.py's arguments)
    OMP_NUM_THREADS=1 python benchmarks/accuracy/bounds8_encodings2.py ppl --budgets 512,1024 \
        --policies quest_fp16 --out /tmp/p.json                      # (ppl.py's arguments)

Encodings (bounds lo <= kmin, hi >= kmax element-wise, asserted on every call; a q.k check runs every CHECK_EVERY
calls: the score of the emulated bounds >= the exact max q.k over each page's keys, fp64):
  fp16   the key min/max rounded outward to fp16 (the issue's reference; the model runs fp32 on CPU).
  pc8    int8 lo/hi codes on per-channel scales shared by all pages of a (layer, KV head): s_c = max |k_c| / 127
         over the keys at the layer's first selection (the prefill). Codes beyond +-127 saturate; a page with any
         saturated code keeps its fp16 bounds instead (a per-page flag + an fp16 side table for those pages).
  a8g8   per page and group of 8 channels an fp16 offset (the group's min, rounded down) and fp16 step (range/255,
         rounded up): uint8 lo/hi codes, lo rounded down, hi up.
  pce8   pc8 without the fallback: a saturating page's codes on its per-channel scales times 2^e (e >= 0 the page's
         smallest exponent that fits every code; one byte a page).
  pcg16  per-channel normalisation by pc8's s_c, then g16 (bounds8_encodings.py: one fp32 scale per page and 16
         channels, lo/hi int8 codes on it, outward). No saturation: the page scale adapts.
  pccr8  per-channel normalisation by s_c, then cr8 (bounds8_encodings.py: int8 centre on one fp32 scale, uint8
         radius on another, a page and KV head).
  i8     the built layout (QuestConfig(bounds="int8")) emulated: one fp32 scale a page and KV head, max |bound| / 127,
         linear int8 lo/hi codes, outward.
  mu15, mu63  the same layout with mu-law companded codes (`mu_codes`): finer near 0, coarser near the page's
         largest channel (bounds8_mu15.md).
"""
import sys
from pathlib import Path

import torch

import triton_kernels as tk
from quest_hf.selectors import QuestSelector, register_selector

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
TINY = 2.0 ** -126
CHECK_EVERY = 97
STATS = dict(calls=0, checks=0, pages_checked=0, saturated_pages=0, pages=0)


def down(x, dtype):
    """x (fp64) rounded toward -inf into `dtype`, returned as fp64."""
    y = x.to(dtype)
    y = torch.where(y.double() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)
    return y.double()


def up(x, dtype):
    y = x.to(dtype)
    y = torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.double()


def floor_code(x, s):
    """The largest integer code c with c * s <= x (fp64; guards the division's rounding)."""
    c = torch.floor(x / s)
    return torch.where(c * s > x, c - 1, c)


def ceil_code(x, s):
    c = torch.ceil(x / s)
    return torch.where(c * s < x, c + 1, c)


def channel_scale(layer, lo, hi):
    """pc8's per-(layer, KV head, channel) scale, fixed at the layer's first selection (the prefill's keys)."""
    st = layer.side_state
    if "emu_sc" not in st:
        empty = (lo > hi)
        m = torch.where(empty, 0.0, torch.maximum(lo.abs(), hi.abs())).amax(2, keepdim=True)  # [B, H, 1, D]
        st["emu_sc"] = up((m / 127).clamp_min(TINY), torch.float32)
    return st["emu_sc"]


def enc_fp16(lo, hi, empty, layer):
    return down(lo, torch.float16), up(hi, torch.float16)


def enc_pc8(lo, hi, empty, layer):
    s = channel_scale(layer, lo, hi)
    lq, hq = floor_code(lo, s), ceil_code(hi, s)
    sat = ((lq < -127) | (hq > 127)).any(-1, keepdim=True) & ~empty  # [B, H, P, 1]
    STATS["saturated_pages"] += int(sat.sum())
    f_lo, f_hi = enc_fp16(lo, hi, empty, layer)
    return torch.where(sat, f_lo, lq * s), torch.where(sat, f_hi, hq * s)


def enc_pce8(lo, hi, empty, layer):
    """pc8 without the fp16 fallback: the codes of a page whose bounds leave the prefill's range sit on its per-channel
    scales times 2^e, e >= 0 the page's smallest exponent that keeps every code within +-127 (one byte a page)."""
    s = channel_scale(layer, lo, hi)
    e = torch.zeros_like(lo[..., :1])
    for _ in range(64):
        se = s * torch.exp2(e)
        lq, hq = floor_code(lo, se), ceil_code(hi, se)
        over = ((lq < -127) | (hq > 127)).any(-1, keepdim=True) & ~empty
        if not bool(over.any()):
            break
        e = e + over.double()
    STATS["saturated_pages"] += int(((e > 0) & ~empty).sum())
    return lq * se, hq * se


def enc_a8g8(lo, hi, empty, layer, gs=8):
    B, H, P, D = lo.shape
    l5, h5 = lo.reshape(B, H, P, D // gs, gs), hi.reshape(B, H, P, D // gs, gs)
    off = down(l5.amin(-1, keepdim=True), torch.float16)
    step = up(((h5.amax(-1, keepdim=True) - off) / 255).clamp_min(2.0 ** -24), torch.float16)
    lq, hq = floor_code(l5 - off, step), ceil_code(h5 - off, step)
    while bool((hq > 255).any()):  # fp16 step too fine for the range: widen it one ulp where needed
        step = torch.where((hq > 255).any(-1, keepdim=True), up(step * (1 + 2.0 ** -11), torch.float16), step)
        lq, hq = floor_code(l5 - off, step), ceil_code(h5 - off, step)
    assert (lq >= 0).all() and (hq <= 255).all()
    return (off + lq * step).reshape(lo.shape), (off + hq * step).reshape(hi.shape)


def g16(lo, hi, gs=16):
    B, H, P, D = lo.shape
    l5, h5 = lo.reshape(B, H, P, D // gs, gs), hi.reshape(B, H, P, D // gs, gs)
    s = up((torch.maximum(l5.abs(), h5.abs()).amax(-1, keepdim=True) / 126).clamp_min(TINY), torch.float32)
    return (floor_code(l5, s) * s).reshape(lo.shape), (ceil_code(h5, s) * s).reshape(hi.shape)


def cr8(lo, hi):
    c = (lo + hi) / 2
    sc = up((c.abs().amax(-1, keepdim=True) / 127).clamp_min(TINY), torch.float32)
    cq = torch.round(c / sc) * sc
    r = torch.maximum(hi - cq, cq - lo).clamp_min(0)
    sr = up((r.amax(-1, keepdim=True) / 255).clamp_min(TINY), torch.float32)
    rq = ceil_code(r, sr)
    assert (rq <= 255).all()
    return cq - rq * sr, cq + rq * sr


def enc_pcg16(lo, hi, empty, layer):
    s = channel_scale(layer, lo, hi)
    a, b = g16(lo / s, hi / s)  # fp64: the normalised bounds are exact enough; the product below is outward-rounded
    return a * s, b * s


def enc_pccr8(lo, hi, empty, layer):
    s = channel_scale(layer, lo, hi)
    a, b = cr8(lo / s, hi / s)
    return a * s, b * s


def mu_codes(lo, hi, mu):
    """muNN: the built int8 layout (one fp32 scale a page and KV head, int8 lo/hi codes) with mu-law companded codes,
    fine near 0 and coarse near the page's largest channel: v = s * sign(c) * ((1 + mu)^(|c| / 127) - 1) / mu,
    lo's code rounded down and hi's up in the companded domain, then stepped outward until the decoded value
    encloses (fp64)."""
    s = up((torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True)).clamp_min(TINY), torch.float32)
    lm = torch.log1p(torch.tensor(float(mu), dtype=torch.float64))

    def comp(x):
        return torch.sign(x) * torch.log1p(mu * x.abs().clamp(max=1.0)) / lm * 127

    def dec(c):
        return s * torch.sign(c) * torch.expm1(c.abs() / 127 * lm) / mu

    lq, hq = torch.floor(comp(lo / s)).clamp(-127, 127), torch.ceil(comp(hi / s)).clamp(-127, 127)
    for _ in range(3):  # the decode's rounding: step a code outward where it fails to enclose
        lq = torch.where(dec(lq) > lo, (lq - 1).clamp(min=-127), lq)
        hq = torch.where(dec(hq) < hi, (hq + 1).clamp(max=127), hq)
    return dec(lq), dec(hq)


def enc_mu15(lo, hi, empty, layer):
    return mu_codes(lo, hi, 15)


def enc_mu63(lo, hi, empty, layer):
    return mu_codes(lo, hi, 63)


def enc_i8(lo, hi, empty, layer):
    """The built layout emulated linearly (mu -> 0): one scale a page and KV head, max |bound| / 127."""
    s = up((torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True) / 127).clamp_min(TINY), torch.float32)
    return floor_code(lo, s) * s, ceil_code(hi, s) * s


ENCODINGS = dict(fp16=enc_fp16, pc8=enc_pc8, pce8=enc_pce8, a8g8=enc_a8g8, pcg16=enc_pcg16, pccr8=enc_pccr8, i8=enc_i8,
                 mu15=enc_mu15, mu63=enc_mu63)


def emulate(enc, layer, kmin, kmax):
    """Emulated fp32 bounds [B, H, P, D] (empty pages keep +inf/-inf), checked to enclose [kmin, kmax]."""
    lo, hi = kmin.double(), kmax.double()
    empty = lo[..., :1] > hi[..., :1]
    lo0, hi0 = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    a, b = enc(lo0, hi0, empty, layer)
    a, b = down(a, torch.float32), up(b, torch.float32)  # the fp32 bound the score reads, rounded outward
    assert ((a <= lo0) | empty).all() and ((b >= hi0) | empty).all(), "an emulated bound does not enclose"
    STATS["pages"] += int((~empty).sum())
    return torch.where(empty, kmin, a.float()), torch.where(empty, kmax, b.float())


def check_qk(layer, q, lo, hi):
    """fp64: sum_d max(q lo, q hi) >= max over each written page's keys of q.k (every query head, every page)."""
    S, n = layer.config.page_size, layer.seq_len
    keys = layer.keys[:, :, :n].double()  # [B, H, n, D]
    B, H, _, D = keys.shape
    G = q.shape[1] // H
    qd = q.double().reshape(B, H, G, D)
    P = n // S  # full pages
    if P == 0:
        return
    qk = torch.einsum("bhgd,bhnd->bhgn", qd, keys[:, :, :P * S]).reshape(B, H, G, P, S).amax(-1)
    lo_, h = lo[:, :, None, :P].double(), hi[:, :, None, :P].double()
    bound = torch.maximum(qd[..., None, :] * lo_, qd[..., None, :] * h).sum(-1)
    tol = 1e-9 * (qd.abs()[..., None, :] * torch.maximum(lo_.abs(), h.abs())).sum(-1)
    assert (bound >= qk - tol).all(), f"bound below q.k: {float((qk - bound).max())}"
    STATS["checks"] += 1
    STATS["pages_checked"] += B * H * G * P


class Emulated(QuestSelector):
    def __init__(self, enc):
        self.enc = enc

    def select(self, layer, q, window):
        cfg = layer.config
        lo, hi = emulate(self.enc, layer, layer.kmin, layer.kmax)
        STATS["calls"] += 1
        if STATS["calls"] % CHECK_EVERY == 1:
            check_qk(layer, q, lo, hi)
        reduce = "none" if cfg.gqa_mode == "union" else cfg.gqa_mode
        s = tk.score_pages_ref(q, lo, hi, layer.keys.shape[2], cfg.page_size, 0, reduce, pos=layer.pos, window=window,
                               rows=layer.rows)
        group = q.shape[1] // layer.kmin.shape[1] if reduce == "none" else 1
        return layer.ops.topk_pages(s, cfg.num_pages + 1, group)


NAMES = [f"quest_{k}" for k in ENCODINGS]
for k, fn in ENCODINGS.items():
    register_selector(f"quest_{k}", Emulated(fn))


def selfcheck():
    """Each encoding on real SmolLM2 keys (2K tokens of ppl.py's text): enclosure + q.k over every page, every layer,
    and how much each widens the intervals (mean over written pages and channels, relative to hi - lo)."""
    import ppl

    from quest_hf import QuestConfig, patch_model
    from quest_hf.eval.decode import prefill
    from quest_hf.models import load_model

    global CHECK_EVERY
    CHECK_EVERY = 1
    model, tok = load_model(None, torch.float32, "cpu")
    text, _ = ppl.get_text(ppl.parse_args([]), min_chars=20000)
    ids = tok(text, return_tensors="pt").input_ids[:, :2049]
    patch_model(model, config=QuestConfig(budget=1 << 30, page_size=16, backend="torch"))
    cache, _ = prefill(model, ids[:, :2048])
    q_gen = torch.Generator().manual_seed(0)
    for name, fn in ENCODINGS.items():
        c = cache.copy(QuestConfig(budget=1 << 30, page_size=16, backend="torch"))
        widen = []
        for layer in c.layers[2::6]:
            n = layer.seq_len
            lo, hi = emulate(fn, layer, layer.kmin, layer.kmax)
            P = n // 16
            H = layer.kmin.shape[1]
            q = torch.randn(1, 3 * H, layer.kmin.shape[-1], generator=q_gen)  # random queries: a worst case
            check_qk(layer, q, lo, hi)
            w0 = (layer.kmax[:, :, :P] - layer.kmin[:, :, :P]).double()
            w1 = (hi[:, :, :P] - lo[:, :, :P]).double()
            widen.append(float(((w1 - w0) / w0.clamp_min(1e-6)).mean()))
        print(f"{name:6s} ok; mean interval widening at layers 2/8/14/20/26: "
              + " / ".join(f"{100 * w:.2f}%" for w in widen))
    print("stats", STATS)


def merge(out, inputs):
    """One passkey JSON/.md from several (the reference rows of passkey_bounds8_smollm2.json among them), plus the
    per-case agreement of each row with the fp16 and the key-dtype (fp32) rows."""
    import json

    import passkey
    passkey.ORDER += NAMES
    rows, seen, metas = [], set(), []
    for path in inputs:
        d = json.loads(Path(path).read_text())
        metas.append(dict(file=path, command=d["meta"]["command"], date=d["meta"]["date"]))
        for r in d["rows"]:
            key = (r["length"], r["depth"], r["policy"], r["backend"], r.get("variant", ""), r["budget"])
            if key not in seen:
                seen.add(key)
                rows.append(r)
    lengths = sorted({r["length"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    md = passkey.table(rows, lengths, budgets)
    cell, text = {}, {}
    for r in rows:
        if r["budget"] is not None:
            label = f"{r['policy']} {r['variant']}".strip()
            cell.setdefault(label, {})[(r["length"], r["depth"], r["budget"])] = r["correct"]
            text.setdefault(label, {})[(r["length"], r["depth"], r["budget"])] = r["answer"]
    agree = ["\n### Per-case agreement (cases both rows ran; which differ)\n",
             "| row | vs quest_fp16 | vs quest (fp32 key dtype) | same answer text as quest_fp16 |",
             "|---|---|---|---|"]
    for label, c in cell.items():
        out_cells = []
        for ref in ("quest_fp16", "quest"):
            common = sorted(set(c) & set(cell.get(ref, {})))
            diff = [f"{n // 1024}K d{d} b{b} ({int(c[(n, d, b)])} vs {int(cell[ref][(n, d, b)])})"
                    for n, d, b in common if c[(n, d, b)] != cell[ref][(n, d, b)]]
            out_cells.append(f"{len(common) - len(diff)}/{len(common)}" + (": " + ", ".join(diff) if diff else ""))
        common = set(c) & set(text.get("quest_fp16", {}))
        same = sum(text[label][k] == text["quest_fp16"][k] for k in common)
        agree.append(f"| {label} | " + " | ".join(out_cells) + f" | {same}/{len(common)} |")
    md += "\n" + "\n".join(agree)
    Path(out).write_text(json.dumps(dict(meta=dict(sources=metas), rows=rows), indent=1))
    header = "# Passkey retrieval: emulated 8-bit bound encodings (bounds8_encodings2.py)\n\n" + "\n".join(
        f"- source: `{m['file']}`: `{m['command']}` ({m['date']})" for m in metas) + "\n"
    Path(out).with_suffix(".md").write_text(header + md + "\n")
    print(md)


def merge_ppl(out, inputs, budgets=(512, 1024)):
    import json

    rows, seen, cmds = [], set(), []
    for path in inputs:
        d = json.loads(Path(path).read_text())
        cmds.append((path, d["env"]["command"], d["env"]["date"]))
        for r in d["rows"]:
            if r["name"] not in seen and (r["budget"] is None or r["budget"] in budgets):
                seen.add(r["name"])
                rows.append({k: v for k, v in r.items() if k != "nlls"})
    by = {r["name"]: r for r in rows}
    lines = ["| config | budget | NLL | ppl | ppl / dense | ppl / quest_fp16 | ppl / quest (fp32) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["budget"]
        ref = [by.get(f"quest_fp16 {b}"), by.get(f"quest {b}")]
        ratio = [f"{r['ppl'] / x['ppl']:.4f}" if x and b else "" for x in ref]
        lines.append(f"| {r['name']} | {'all' if b is None else b} | {r['nll']:.4f} | {r['ppl']:.3f} | "
                     f"{r['ppl'] / rows[0]['ppl']:.4f} | " + " | ".join(ratio) + " |")
    Path(out).write_text(json.dumps(dict(sources=[dict(file=f, command=c, date=t) for f, c, t in cmds], rows=rows),
                                    indent=1))
    md = ("# Perplexity at 8K: emulated 8-bit bound encodings (bounds8_encodings2.py)\n\n"
          + "\n".join(f"- source: `{f}`: `{c}` ({t})" for f, c, t in cmds)
          + "\n- protocol: scripts/ppl.py's (built-in text, 7680 tokens prefilled densely, 512 decoded and scored; "
          "page size 16, first 2 layers dense, gqa_mode union), fp32 model on CPU\n\n" + "\n".join(lines) + "\n")
    Path(out).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "selfcheck":
        selfcheck()
    elif mode == "merge":  # merge OUT.json IN.json...: one table, rows deduplicated (first file wins)
        merge(rest[0], rest[1:])
    elif mode == "mergeppl":  # mergeppl OUT.json IN.json...: ppl rows (first file wins), ratios to fp16 / fp32
        merge_ppl(rest[0], rest[1:])
    elif mode == "passkey":
        import passkey
        passkey.ORDER += NAMES
        args = passkey.parse_args(["--policies", "quest"] + [a for a in rest if a not in NAMES and a != "--policies"])
        args.policies = [a for a in rest if a in NAMES]
        rows, lengths = passkey.run(args, on_case=lambda rows, lengths: passkey.save(args, [], rows, lengths))
        print(passkey.save(args, [], rows, lengths))
        print("stats", STATS)
    else:
        import ppl
        sys.argv = ["ppl.py", "--threads", "1", "--no-plot"] + rest
        ppl.main()
        print("stats", STATS)
