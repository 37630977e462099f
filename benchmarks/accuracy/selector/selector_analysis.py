#!/usr/bin/env python
"""Why Quest's min/max bound mis-ranks pages on SmolLM2, and what per-token sketches would rank instead.

Captures the decode queries of a passkey prompt's question tail (quest at budget 1024, near dense) and every
layer's keys, then per sparse layer: per-channel key magnitude (max/median over channels, share of the top 4),
the bound's slack over each page's true best q.k in units of the std of q.k (vs the spread of the true page
maxima), which channels the slack comes from, the Spearman correlation of each page score with the true page
maximum, and the top-10 recall of pages chosen (union per KV group) by: quest's bound, a PCA-8 sketch, SparQ
(8 largest |q| channels), 8 fixed largest-|k| channels, 2-bit / 1-bit codes on the page's min/max grid
(= qcode / qcode1), 1-/2-bit codes on a global per-channel grid, and the exact page maximum (the ceiling).

    python benchmarks/accuracy/selector/selector_analysis.py --length 4096     # ~5 min on 2 CPU cores

Writes --out (default results/selector_analysis/selector_analysis.json; per layer) and prints the table quoted
in docs/selector.md. The committed selector_analysis.json beside this file was written by this script when it
lived in scripts/ and wrote to benchmarks/ (benchmarks/README.md).
"""

import argparse
import json
import time

import torch

from quest_hf import QuestConfig, patch_model
from quest_hf.bench import results_dir
from quest_hf.eval.decode import feed, prefill
from quest_hf.eval.passkey import make_case
from quest_hf.models import load_smollm2

S = 16  # page size
D = 64  # SmolLM2-135M head_dim
G = 3  # query heads per KV head


def capture(N):
    """(decode queries of the tail as (layer, q, seq_len), every layer's keys) of an N-token passkey prompt."""
    t0 = time.time()
    model, tok = load_smollm2()
    patch_model(model, config=QuestConfig(budget=1 << 30, backend="torch"))
    case = make_case(tok, N, 0.5, seed=0)
    cache, _ = prefill(model, case.prefix)
    print("prefill", time.time() - t0)
    run = cache.copy(QuestConfig(budget=1024, backend="torch"))
    caps = []
    run.selection_hooks.append(lambda i, q, ids: caps.append((i, q.clone(), run.layers[i].seq_len)))
    feed(model, run, case.tail)
    print("feed", time.time() - t0, len(caps))
    return caps, [layer.keys[:, :, : layer.seq_len].clone() for layer in run.layers]


def spearman(a, b):
    ra = a.argsort(-1).argsort(-1).float()
    rb = b.argsort(-1).argsort(-1).float()
    ra -= ra.mean(-1, keepdim=True)
    rb -= rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def analyse(caps, keys):
    """Per sparse layer (2..29): the channel statistics, and per candidate score the mean rank correlation and
    top-10 recall at budgets 64/128/256 over the captured steps."""
    res = {}
    for layer in range(2, 30):
        K_ = keys[layer][0].float()  # [H, L, D]
        H = K_.shape[0]
        steps = [(q[0].float(), L) for (i, q, L) in caps if i == layer]
        # channel stats (prefill keys)
        mag = K_.abs().mean(1)  # [H,D]
        med = mag.median(-1).values
        outl = mag.max(-1).values / med
        top4 = mag.sort(-1, descending=True).values[:, :4].sum(-1) / mag.sum(-1)
        # PCA basis per head (centered)
        Kc = K_ - K_.mean(1, keepdim=True)
        cov = Kc.transpose(1, 2) @ Kc / K_.shape[1]
        ev, evec = torch.linalg.eigh(cov)
        evr = ev.flip(-1).cumsum(-1) / ev.sum(-1, keepdim=True)
        r = 8
        basis = evec[..., -r:]  # [H, D, r]
        stat = dict(outlier=outl.tolist(), top4=top4.tolist(), pca8_var=evr[:, r - 1].tolist())
        acc = {}
        for q, L in steps:
            Kl = K_[:, :L]
            P = -(-L // S)
            pad = P * S - L
            qg = q.reshape(H, G, D)
            true = torch.einsum("hgd,hnd->hgn", qg, Kl)  # [H,G,L]
            tp = torch.nn.functional.pad(true, (0, pad), value=-1e30).reshape(H, G, P, S).amax(-1)
            Kp = torch.nn.functional.pad(Kl, (0, 0, 0, pad)).reshape(H, P, S, D)
            # kmin/kmax with padding handled
            valid = torch.arange(P * S) < L
            vm = valid.reshape(P, S)[None, :, :, None]
            kmin = torch.where(vm, Kp, torch.tensor(1e30)).amin(2)
            kmax = torch.where(vm, Kp, torch.tensor(-1e30)).amax(2)
            bound = torch.maximum(qg[:, :, None] * kmin[:, None], qg[:, :, None] * kmax[:, None]).sum(-1)  # [H,G,P]
            # sketches
            pk = torch.einsum("hnd,hdr->hnr", Kl - K_.mean(1, keepdim=True), basis)
            pq = torch.einsum("hgd,hdr->hgr", qg, basis)
            s_pca = torch.einsum("hgr,hnr->hgn", pq, pk)
            # sparq: top r |q| channels per query head
            idx = qg.abs().topk(r, -1).indices
            qm = torch.zeros_like(qg).scatter(-1, idx, qg.gather(-1, idx))
            s_sparq = torch.einsum("hgd,hnd->hgn", qm, Kl)
            # fixed channels by key magnitude (doublesparse-like)
            cidx = mag.topk(r, -1).indices  # [H,r]
            cm = torch.zeros(H, D).scatter(-1, cidx, 1.0)
            s_ds = torch.einsum("hgd,hnd->hgn", qg * cm[:, None], Kl)
            # 2-bit codes per channel on the page's own min/max grid (KIVI-like; = qcode)
            lo = kmin[:, :, None]
            hi = kmax[:, :, None]
            qk = ((Kp - lo) / (hi - lo + 1e-6) * 3).round().clamp(0, 3)
            deq = (lo + qk * (hi - lo) / 3).reshape(H, P * S, D)[:, :L]
            s_q2 = torch.einsum("hgd,hnd->hgn", qg, deq)
            mu = K_.mean(1, keepdim=True)
            dev = (K_ - mu).abs().mean(1, keepdim=True)
            Kcen = Kl - mu
            s_g1 = torch.einsum("hgd,hnd->hgn", qg, torch.sign(Kcen) * dev)
            # 2-bit global per-channel: quantiles-ish grid at +-0.5sd, +-1.5sd using std
            sd_c = Kcen.std(1, keepdim=True)
            code = torch.bucketize(Kcen / sd_c, torch.tensor([-1.0, 0.0, 1.0]))
            lv = torch.tensor([-1.5, -0.5, 0.5, 1.5])
            s_g2 = torch.einsum("hgd,hnd->hgn", qg, lv[code] * sd_c)
            qk1 = (Kp > (lo + hi) / 2).float()
            deq1 = (lo + (qk1 * 2 + 1) * (hi - lo) / 4).reshape(H, P * S, D)[:, :L]
            s_p1 = torch.einsum("hgd,hnd->hgn", qg, deq1)
            top10 = true.topk(10, -1).indices  # [H,G,10]

            def tokpage(s, pad=pad, H=H, P=P):
                return torch.nn.functional.pad(s, (0, pad), value=-1e30).reshape(H, G, P, S).amax(-1)

            cands = dict(
                quest=bound,
                pca8=tokpage(s_pca),
                sparq8=tokpage(s_sparq),
                chan8=tokpage(s_ds),
                q2bit=tokpage(s_q2),
                p1bit=tokpage(s_p1),
                g1bit=tokpage(s_g1),
                g2bit=tokpage(s_g2),
                truemax=tp,
            )
            for name, ps in cands.items():
                ps = ps.clone()
                ps[..., P - 1] = float("inf")
                rho = spearman(ps[..., : P - 1], tp[..., : P - 1]).mean().item()
                acc.setdefault(name + "_rho", []).append(rho)
                for bud in (64, 128, 256):
                    kk = bud // S
                    sel = ps.topk(kk, -1).indices  # [H,G,kk]
                    chosen = torch.zeros(H, G, P, dtype=torch.bool).scatter(-1, sel, True).any(1)  # union [H,P]
                    pg = top10 // S
                    rec = chosen[torch.arange(H)[:, None, None].expand_as(pg), pg].float().mean().item()
                    acc.setdefault(f"{name}_{bud}", []).append(rec)
            # looseness: mean (bound - truemax)/std(true) over pages, and slack share from top4-range channels
            sd = true.std(-1, keepdim=True)
            acc.setdefault("slack_sd", []).append(((bound - tp) / sd)[..., : P - 1].mean().item())
            acc.setdefault("spread_sd", []).append((tp[..., : P - 1].std(-1) / sd[..., 0]).mean().item())
            rng = (kmax - kmin)[:, : P - 1]  # [H,P,D]
            contrib = qg.abs()[:, :, None] * rng[:, None] / 2  # slack bound per channel
            c = contrib.mean(2)  # [H,G,D]
            acc.setdefault("slack_top4ch", []).append(
                (c.sort(-1, descending=True).values[..., :4].sum(-1) / c.sum(-1)).mean().item()
            )
        res[layer] = dict(stat, **{k: sum(v) / len(v) for k, v in acc.items()})
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="passkey prompt length in tokens (default 4096)")
    p.add_argument("--out", default=None, help="JSON path (default results/selector_analysis/selector_analysis.json)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = args.out or str(results_dir("selector_analysis") / "selector_analysis.json")
    torch.manual_seed(0)
    N = args.length
    res = analyse(*capture(N))
    with open(out, "w") as f:
        json.dump(dict(length=N, layers=res), f, indent=1)
    names = ["quest", "sparq8", "q2bit", "p1bit", "g1bit", "g2bit", "truemax"]
    print(
        "layer outl(max/med) top4share pca8var slack/sd spread/sd slacktop4 | rho: "
        + " ".join(names)
        + " | rec64: "
        + " ".join(names)
        + " | rec128 ..."
    )
    for layer, r in res.items():
        print(
            layer,
            f"{max(r['outlier']):5.1f} {sum(r['top4']) / 3:.2f} {sum(r['pca8_var']) / 3:.2f} {r['slack_sd']:5.2f} "
            f"{r['spread_sd']:.2f} {r['slack_top4ch']:.2f} |",
            " ".join(f"{r[n + '_rho']:.2f}" for n in names),
            "|",
            " ".join(f"{r[n + '_64']:.2f}" for n in names),
            "|",
            " ".join(f"{r[n + '_128']:.2f}" for n in names),
            "|",
            " ".join(f"{r[n + '_256']:.2f}" for n in names),
        )
    for b in (64, 128, 256):
        print("mean", b, {n: round(sum(r[f"{n}_{b}"] for r in res.values()) / len(res), 3) for n in names})


if __name__ == "__main__":
    main()
