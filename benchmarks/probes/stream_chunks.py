"""Probe: does a Quest layer step get faster when its KV heads run as C independent chains (score -> Top-K ->
attention per chunk of heads) on C streams of one CUDA graph, so that one chunk's latency-bound Top-K overlaps
another chunk's bandwidth-bound score or attention?

Every chunk is exact on its own (selection is per KV head, the union per KV group), so the chained outputs must
equal the one-chain step; the probe checks that before timing. Variants:
- `par`: every chunk forked from the capture stream at once;
- `stagger`: chunk i's score also waits for chunk i - 1's score (scores run one after another at full bandwidth,
  each chunk's Top-K and attention overlap the next chunks' scores).

    python benchmarks/probes/stream_chunks.py --out results/probes
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import triton_kernels as tk  # noqa: E402
from quest_hf.bench import LAYER_SHAPES, copy_bandwidth, time_graph  # noqa: E402

PAGE = 16


def make(shape, L, B, dtype, seed):
    H_q, H_kv, D = LAYER_SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(B, H_kv, L, D, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(B, H_kv, L, D, device="cuda", dtype=dtype, generator=g)
    pages = kc.view(B, H_kv, L // PAGE, PAGE, D)
    kmin, kmax = pages.amin(3), pages.amax(3)
    valid = torch.ones(B, L, dtype=torch.bool, device="cuda")
    q = torch.randn(B, H_q, D, device="cuda", dtype=dtype, generator=g)
    return q, kc, vc, kmin, kmax, valid


class Chained:
    def __init__(self, inputs, budget, mode, chunks, variant):
        self.q, self.kc, self.vc, self.kmin, self.kmax, self.valid = inputs
        B, H, L, D = self.kc.shape
        self.G = self.q.shape[1] // H
        self.L, self.k = L, budget // PAGE
        self.reduce, self.group = ("none", self.G) if mode == "union" else ("max", 1)
        self.scale = D ** -0.5
        self.chunks, self.variant = chunks, variant
        step = H // chunks
        self.spans = [(i * step, (i + 1) * step) for i in range(chunks)]
        self.out = torch.empty_like(self.q)
        self.streams = [torch.cuda.Stream() for _ in range(chunks)]
        self.events = [torch.cuda.Event() for _ in range(chunks)]

    def chunk(self, i, after=None):
        h0, h1 = self.spans[i]
        G = self.G
        q = self.q[:, h0 * G:h1 * G]
        s = tk.score_pages(q, self.kmin[:, h0:h1], self.kmax[:, h0:h1], self.L, PAGE, 0, self.reduce)
        self.events[i].record()
        ids = tk.topk_pages(s, self.k, self.group)
        o = tk.sparse_decode_attention(q, self.kc[:, h0:h1], self.vc[:, h0:h1], ids, self.valid, self.L, PAGE,
                                       self.scale)
        self.out[:, h0 * G:h1 * G].copy_(o)

    def __call__(self):
        if self.chunks == 1:
            self.chunk(0)
            return self.out
        cur = torch.cuda.current_stream()
        for i, st in enumerate(self.streams):
            st.wait_stream(cur)
            if self.variant == "stagger" and i:
                st.wait_event(self.events[i - 1])
            with torch.cuda.stream(st):
                self.chunk(i)
        for st in self.streams:
            cur.wait_stream(st)
        return self.out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/probes")
    ap.add_argument("--sets", type=int, default=3)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    rows = []
    cases = [("llama2-7b", 32768, 1, "union"), ("llama2-7b", 131072, 1, "union"), ("llama3-8b", 32768, 1, "union"),
             ("llama3-8b", 32768, 1, "max"), ("llama3-8b", 131072, 1, "union"), ("llama2-7b", 32768, 8, "union")]
    for shape, L, B, mode in cases:
        sets = [make(shape, L, B, torch.float16, s) for s in range(a.sets)]
        ref = Chained(sets[0], 2048, mode, 1, "par")()
        ref = ref.clone()
        H_kv = LAYER_SHAPES[shape][1]
        for chunks in (1, 2, 4, 8):
            if H_kv % chunks:
                continue
            for variant in (("par",) if chunks == 1 else ("par", "stagger")):
                fns = [Chained(x, 2048, mode, chunks, variant) for x in sets]
                got = fns[0]()
                torch.cuda.synchronize()
                same = bool(torch.equal(got, ref))
                t = time_graph(fns)
                row = dict(shape=shape, L=L, B=B, mode=mode, chunks=chunks, variant=variant, us=t, same_as_one=same)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_GBps=bw / 1e9)
    (out / "stream_chunks.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
