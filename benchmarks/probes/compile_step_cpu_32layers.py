#!/usr/bin/env python
"""How long `compile_step` takes to compile a 32-layer model (Llama-2-7B's layer count, MHA) on CPU, and whether
later generate() calls compile again. A narrow random Llama (hidden 128, 8 heads), 4096-token prompt, budget 512,
8 new tokens a call, three calls (each a new cache of the same capacity bucket).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCH_LOGS=recompiles PYTHONPATH=. \\
        python benchmarks/probes/compile_step_cpu_32layers.py

(an empty inductor cache: with a warm one the first call took 21 s here instead of ~90)

Output committed beside it (`compile_step_cpu_32layers.txt`): the wall time of each call and the step counters.
"""
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quest_hf import patch_model


def main():
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=32,
                               num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
                               max_position_embeddings=length + 64, attn_implementation="sdpa", eos_token_id=None,
                               pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    patch_model(model, budget=512, cuda_graph=False, compile_step=True)
    ids = torch.randint(2, 1000, (1, length))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {length}", flush=True)
    for i in range(3):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False)
        st = model._quest_state.compiled_step
        print(f"call {i}: {time.perf_counter() - t:.1f} s, steps {st.calls}, traced {st.traced_calls}, "
              f"failed {st.failed}", flush=True)


if __name__ == "__main__":
    main()
