#!/usr/bin/env python
"""On a CUDA device: the patched decode path end to end, Triton vs the PyTorch reference, graph vs growing.

For a small random GQA Llama and a MHA one, fp16 and bf16, batch 2 left-padded, budget small enough that
selection matters: greedy tokens and logits of backend="triton" vs backend="torch", and of
cuda_graph=True vs the growing cache, compile_decode (the default) vs eager norms/MLPs/rotary; which
backend ran and how many graphs were captured/replayed; and a generation stopped by EOS mid-way with the
deferred stop check (the default on CUDA) vs transformers' per-token check: same tokens, same cache length;
a second generate() of the same shapes over the kept cache and graph vs a fresh cache: same tokens.

    python scripts/gpu_check.py                                   # quest, page 16
    python scripts/gpu_check.py --policy qcode1_2s --page-size 32 --out results/gpu_check/gpu_check_qcode1_2s.json
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quest_hf.static
from quest_hf import patch_model, release_cache, unpatch_model
from quest_hf.bench import results_dir


def model_of(heads, kv_heads, dtype):
    cfg = LlamaConfig(vocab_size=512, hidden_size=64 * heads, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(dtype).eval()
    m.generation_config.eos_token_id = None
    return m


def gen(model, ids, mask, n=24):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores).float(), out.past_key_values


def stop_case(model, ids, mask, **kw):
    """EOS mid-way, one row: the deferred check (one extra forward, undone) against the per-token check."""
    ids, mask = ids[:1], mask[:1]
    patch_model(model, **kw)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    # The last token that is new when it appears (random tiny models fall into short loops): stopping there
    # leaves at least one step for the deferred check to run past and undo.
    stop = max(i for i in range(1, 24) if free[i] not in free[:i])
    res = {}
    for defer in (False, True):
        patch_model(model, defer_stop_check=defer, **kw)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=free[stop],
                             pad_token_id=0, return_dict_in_generate=True)
        cache = out.past_key_values
        res[defer] = (out.sequences, cache.get_seq_length(), cache.stop_check)
    unpatch_model(model)
    return dict(stop_check=[res[False][2], res[True][2]], stopped_at=stop,
                stopped_early=res[True][0].shape[1] == ids.shape[1] + stop + 1,
                tokens_deferred_eq_per_token=bool(torch.equal(res[True][0], res[False][0])),
                cache_len_deferred_eq_per_token=res[True][1] == res[False][1])


def reuse_case(model, ids, mask, **kw):
    """A second generate() of the same shapes replays the first one's kept cache and graph (no new capture);
    its tokens equal a fresh cache's."""
    patch_model(model, **kw)
    run = lambda x: model.generate(x, attention_mask=mask, max_new_tokens=24, do_sample=False)  # noqa: E731
    run(ids)
    kept = model._quest_state.kept
    other = torch.roll(ids, 7, dims=1) * mask  # other tokens, same padding
    second = run(other)
    reused = model._quest_state.kept is kept and kept.reused
    captures = kept.graph.captures
    release_cache(model)
    fresh = run(other)
    unpatch_model(model)
    return dict(reused=reused, captures_after_reuse=captures, tokens_reused_eq_fresh=bool(torch.equal(second, fresh)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="quest")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", default=None, help="JSON path (default results/gpu_check/gpu_check.json)")
    args = p.parse_args(argv)
    rows = []
    g = torch.Generator("cuda").manual_seed(1)
    for heads, kv in ((8, 2), (4, 4)):
        for dtype in (torch.float16, torch.bfloat16):
            model = model_of(heads, kv, dtype)
            ids = torch.randint(1, 512, (2, 1500), device="cuda", generator=g)
            mask = torch.ones_like(ids)
            mask[1, :311] = 0
            ids[1, :311] = 0
            res = {}
            for name, kw in (("torch", dict(backend="torch", cuda_graph=False)),
                             ("triton", dict(backend="triton", cuda_graph=False)),
                             ("triton_graph", dict(backend="triton", cuda_graph=True)),
                             ("triton_graph_eager_modules", dict(backend="triton", cuda_graph=True, compile_decode=False))):
                patch_model(model, budget=128, policy=args.policy, page_size=args.page_size, **kw)
                seq, scores, cache = gen(model, ids, mask)
                res[name] = (seq, scores, cache)
                if name == "triton_graph":  # the same fixed-shape step, uncaptured: isolates the capture
                    compiled_calls = sum(getattr(m, "_quest_compiled_calls", 0) for m in model.modules())
                    quest_hf.static.CAPTURE = False
                    res["triton_static_eager"] = gen(model, ids, mask)
                    quest_hf.static.CAPTURE = True
                unpatch_model(model)
            dense_seq, _, _ = gen(model, ids, mask)
            row = dict(policy=args.policy, page_size=args.page_size, heads=heads, kv_heads=kv,
                       dtype=str(dtype).split(".")[-1],
                       backends={k: sorted(v[2].backends) for k, v in res.items()},
                       tokens_triton_eq_torch=bool(torch.equal(res["triton"][0], res["torch"][0])),
                       tokens_graph_eq_triton=bool(torch.equal(res["triton_graph"][0], res["triton"][0])),
                       tokens_quest_eq_dense=bool(torch.equal(res["triton"][0], dense_seq)),
                       graph_eq_static_eager_bitwise=bool(torch.equal(res["triton_graph"][1],
                                                                      res["triton_static_eager"][1])),
                       tokens_compiled_eq_eager_modules=bool(torch.equal(res["triton_graph"][0],
                                                                         res["triton_graph_eager_modules"][0])),
                       max_logit_diff_compiled_eager_modules=float(
                           (res["triton_graph"][1] - res["triton_graph_eager_modules"][1]).abs().max()),
                       compiled_module_calls=compiled_calls,
                       max_logit_diff_triton_torch=float((res["triton"][1] - res["torch"][1]).abs().max()),
                       max_logit_diff_graph_triton=float((res["triton_graph"][1] - res["triton"][1]).abs().max()),
                       # the first decode step (scores[0] comes from the prefill), before any token can differ
                       first_decode_logit_diff_graph_triton=float((res["triton_graph"][1][1] - res["triton"][1][1])
                                                                .abs().max()),
                       graph_captures=res["triton_graph"][2].graph.captures,
                       graph_replays=res["triton_graph"][2].graph.replays,
                       reuse=reuse_case(model, ids, mask, budget=128, policy=args.policy,
                                        page_size=args.page_size, backend="triton", cuda_graph=True),
                       eos_stop=stop_case(model, ids, mask, budget=128, policy=args.policy,
                                          page_size=args.page_size, backend="triton", cuda_graph=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out) if args.out else results_dir("gpu_check") / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
