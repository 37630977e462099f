#!/usr/bin/env python
"""Quest under transformers' tensor parallelism (tp_plan="auto", torchrun): heads are sharded, selection is
per KV head, so each rank selects over its own heads. Compares greedy tokens with the unsharded model.

    python scripts/tp_check.py --save /tmp/tp_model          # random model + single-GPU reference tokens
    torchrun --nproc_per_node 2 scripts/tp_check.py --load /tmp/tp_model
"""
import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from quest_hf import patch_model
from quest_hf.bench import results_dir

LENGTH, NEW, BUDGET = 4096, 16, 256


def tokens(model, device):
    ids = torch.randint(1, 32000, (1, LENGTH), generator=torch.Generator().manual_seed(3)).to(device)
    patch_model(model, budget=BUDGET, cuda_graph=False)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, return_dict_in_generate=True)
    return out.sequences[0, LENGTH:].tolist(), out.past_key_values


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--out", default=None, help="rank 0's JSON (default results/tp_check/tp_check.json)")
    a = p.parse_args()
    if a.save:
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, eos_token_id=None)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.float16)
        model.save_pretrained(a.save)
        model = model.cuda().eval()
        model.generation_config.eos_token_id = None
        ref, _ = tokens(model, "cuda")
        Path(a.save, "reference_tokens.json").write_text(json.dumps(ref))
        print("saved; reference tokens", ref)
        return
    model = AutoModelForCausalLM.from_pretrained(a.load, tp_plan="auto", dtype=torch.float16).eval()
    model.generation_config.eos_token_id = None
    rank = int(os.environ.get("RANK", 0))
    got, cache = tokens(model, model.device)
    ref = json.loads(Path(a.load, "reference_tokens.json").read_text())
    local_heads = cache.layers[-1].keys.shape[1]
    print(json.dumps(dict(rank=rank, same_tokens=got == ref, local_kv_heads=local_heads,
                          backends=sorted(cache.backends), tokens=got)), flush=True)
    if rank == 0:
        out = Path(a.out) if a.out else results_dir("tp_check") / "tp_check.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(rank=rank, same_tokens=got == ref, ref=ref, got=got,
                                       local_kv_heads=local_heads), indent=1))


if __name__ == "__main__":
    main()
