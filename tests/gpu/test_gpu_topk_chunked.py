"""GPU-marked: the split union's chunk-parallel pass 2 (`TopKLaunch.chunked_union_min_pages`, and in one launch:
`TopKLaunch.onepass_union`) compiled at the 128K Llama-3-8B size it was built for, against the serial pass 2
(exact ids, -1 tail and the reuse flag); the
tail tile (`TopKLaunch.tail_tile`) against the widened tile at the captured decode's row lengths.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_topk_chunked.py`.
"""
import pytest
import torch

import triton_kernels as tk
from triton_kernels import topk as topk_mod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def test_chunked_union_equals_serial_at_128k():
    # B = 1, 32 query heads in groups of 4, P = 8197 pages (128K tokens + 128 + a spare page), k = 129; one row
    # set with random scores, one with heavy ties at the k-th score (so `need` ranks ties across chunks).
    B, R, P, k, group = 1, 32, 8197, 129, 4
    g = torch.Generator(DEV).manual_seed(0)
    rand = torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20
    ties = rand.round()
    for s in (rand, ties):
        s.masked_fill_(torch.rand(B, 1, P, generator=g, device=DEV) < 0.1, float("-inf"))
        s[..., -1] = float("inf")
        s[..., 5000] = float("inf")
        serial = tk.topk_pages(s, k, group, launch=topk_mod.TopKLaunch(chunked_union_min_pages=None,
                                                                       onepass_union=False))
        for chunk, onepass in [(256, False), (1024, False), (4096, False), (256, True), (512, True), (4096, True)]:
            launch = topk_mod.TopKLaunch(chunked_union_min_pages=1, union_chunk=chunk, onepass_union=onepass)
            out = torch.full_like(serial, 0x7FC00000)
            assert torch.equal(tk.topk_pages(s, k, group, launch=launch, out=out), serial), chunk
            tk.topk_pages(s, k, group, launch=launch, due=torch.zeros((), dtype=torch.bool, device=DEV),
                          out=out.fill_(7))
            assert (out == 7).all()
    ref = tk.topk_pages_ref(rand, k, group)  # no ties in the random rows: the reference's own choice
    assert torch.equal(tk.topk_pages(rand, k, group, launch=topk_mod.TopKLaunch(chunked_union_min_pages=1)), ref)


@pytest.mark.parametrize("P, group, split", [(2053, 1, True), (2053, 4, True), (2053, 4, False), (8197, 1, True),
                                             (8197, 4, True)])
def test_tail_tile_equals_the_widened_tile_at_real_sizes(P, group, split):
    # TopKLaunch(tail_tile): the captured decode's rows (32K / 128K + 128 tokens + a spare page) as a power-of-two
    # tile and a tail tile, compiled: the ids of the one widened tile, with heavy ties at the k-th score.
    B, R, k = 1, 32, 129
    g = torch.Generator(DEV).manual_seed(P + group)
    for s in (torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20,
              (torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20).round()):
        s.masked_fill_(torch.rand(B, 1, P, generator=g, device=DEV) < 0.1, float("-inf"))
        s[..., -1] = float("inf")
        base = dict(split_union=split)
        want = tk.topk_pages(s, k, group, launch=topk_mod.TopKLaunch(**base, tail_tile=0))
        got = tk.topk_pages(s, k, group, launch=topk_mod.TopKLaunch(**base, tail_tile=64))
        assert torch.equal(got, want)


@pytest.mark.parametrize("P, group, shared", [(2048, 1, False), (2053, 1, False), (2053, 1, True), (8197, 1, False),
                                              (2053, 4, False), (8197, 4, False)])
def test_lean_path_equals_the_grouped_path_at_real_sizes(P, group, shared):
    # TopKLaunch(lean), compiled at the decode's sizes (32 MHA rows, 8 shared-score rows, unions of 4 query heads
    # through the lean thresholds pass): the ids of the grouped path, random and heavily tied scores, mask_rest.
    B, k = 1, 129
    R = 8 if shared else 32
    g = torch.Generator(DEV).manual_seed(P + group + R)
    for s in (torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20,
              (torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20).round()):
        s.masked_fill_(torch.rand(B, 1, P, generator=g, device=DEV) < 0.1, float("-inf"))
        s[..., -1] = float("inf")
        old, lean = topk_mod.TopKLaunch(lean=0), topk_mod.TopKLaunch(lean=16384)  # (8192-key tiles: off by default)
        assert torch.equal(tk.topk_pages(s, k, group, launch=lean), tk.topk_pages(s, k, group, launch=old))
        if group == 1:
            s_lean, s_old = s.clone(), s.clone()
            assert torch.equal(tk.topk_pages(s_lean, k, 1, mask_rest=True, launch=lean),
                               tk.topk_pages(s_old, k, 1, mask_rest=True, launch=old))
            assert torch.equal(s_lean, s_old)


@pytest.mark.parametrize("B, P", [(1, 2053), (8, 2048), (1, 8197)])
def test_onepass_union_replays_in_a_cuda_graph(B, P):
    # TopKLaunch.onepass_union in a captured graph, as the decode runs it: its state (tickets, published counts) is
    # zeroed by the thresholds pass of the same replay, so every replay over new scores gives the serial union's
    # ids; B = 8 runs 8 x 8 groups' chunks at once.
    R, k, group = 32, 129, 4
    g = torch.Generator(DEV).manual_seed(B * P)
    s = torch.empty(B, R, P, device=DEV)
    out = torch.empty(B, R // group, group * k, dtype=torch.int32, device=DEV)
    serial = topk_mod.TopKLaunch(chunked_union_min_pages=None, onepass_union=False)

    def fill(round_ties):
        x = torch.randn(B, R, P, generator=g, device=DEV) * 3 + 20
        s.copy_(x.round() if round_ties else x)
        s.masked_fill_(torch.rand(B, 1, P, generator=g, device=DEV) < 0.1, float("-inf"))
        s[..., -1] = float("inf")

    fill(False)
    tk.topk_pages(s, k, group, out=out)  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            tk.topk_pages(s, k, group, out=out)
    for i in range(4):
        fill(i % 2 == 1)
        out.fill_(0x7FC00000)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tk.topk_pages(s, k, group, launch=serial)), i
