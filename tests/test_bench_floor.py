"""`quest_hf.bench.decode_floor_bytes`: the least bytes a decode step reads, by hand for a tiny model."""
import math

import torch

from quest_hf import QuestConfig
from quest_hf.bench import decode_floor_bytes, random_llama


def test_floor_bytes_count_weights_once_and_the_attended_kv():
    model = random_llama("tiny", torch.float16, torch.device("cpu"), 4096)
    cfg = model.config
    n, kv, heads = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is emb
    weights = sum(p.numel() * 2 for p in model.parameters() if tied or p is not emb)
    L, B = 3000, 2
    assert decode_floor_bytes(model, L, B) == weights + B * n * L * kv * 2 * D * 2

    qc = QuestConfig(budget=256, page_size=16, dense_layers=1)
    pages = math.ceil(L / 16)
    sparse = pages * kv * 2 * D * 2 + kv * (256 // 16) * 16 * 2 * D * 2  # every page's min/max + budget of K and V
    dense = L * kv * 2 * D * 2
    assert decode_floor_bytes(model, L, B, qc) == weights + B * (dense + (n - 1) * sparse)
    # a context within the budget reads all of it, as dense
    assert decode_floor_bytes(model, 200, 1, qc) == decode_floor_bytes(model, 200, 1)
