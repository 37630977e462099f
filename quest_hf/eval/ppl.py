"""Perplexity of a long text decoded token by token after a dense prefix: dense vs Quest over budgets.

The prefix is prefilled once (dense, as every Quest prefill is); each configuration then decodes the
rest from its own copy of that cache, one token per forward, so every scored logit went through the
(sparse) decode path. The "dense" row is the same decode with a budget that covers the whole text: every
layer then runs HF's SDPA over the cache, which the tests pin to the unpatched model.

Also home of the prefill-once / fork-per-config helpers that `recall` and `longbench` share.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
import sys

import torch

from ..cache import QuestCache
from ..config import QuestConfig
from ..patch import cache_arg_name, patched
from ..selectors import check_config
from .accounting import dense_bytes, model_step_bytes

# Budget that covers any context: every layer of a config with it decodes densely (HF SDPA).
DENSE_BUDGET = 1 << 30

# Modules whose docstrings make the default text; their own order, members sorted by name.
STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "functools", "itertools", "json",
    "logging", "pathlib", "re", "string", "textwrap", "typing", "unittest", "subprocess", "threading",
    "inspect", "os", "pickle", "random", "statistics", "datetime", "decimal", "fractions", "heapq", "bisect",
    "enum", "io", "shutil", "tempfile", "zipfile", "tarfile", "csv", "difflib", "doctest", "pdb", "timeit",
    "pprint", "copy", "weakref", "operator", "struct", "codecs", "locale", "calendar", "socket", "selectors",
    "queue", "sched", "email.message", "http.client", "urllib.request", "concurrent.futures", "multiprocessing",
)


# --- shared decode helpers ---------------------------------------------------------------------------

def prefill_cache(model, prefix: torch.Tensor) -> tuple[QuestCache, torch.Tensor]:
    """Prefill `prefix [B, n]` (dense) into a fresh QuestCache of the patched `model`; (cache, logits [B, V])."""
    cache = QuestCache.from_model(model)
    with torch.no_grad():
        out = model(input_ids=prefix, use_cache=True, **{cache_arg_name(model): cache})
    return cache, out.logits[:, -1].float()


def fork_cache(cache: QuestCache, config: QuestConfig, *, selector=None) -> QuestCache:
    """A deep copy of `cache` that decodes under `config` (page_size must stay the cache's). `selector`: the
    selector its layers run instead of the registered one of `config.policy` (calibration's probe)."""
    if config.page_size != cache.quest_config.page_size:
        raise ValueError(f"a filled cache keeps its page_size {cache.quest_config.page_size}; got {config.page_size}")
    check_config(config, selector)
    hooks, cache.selection_hooks = cache.selection_hooks, []  # hooks belong to the original's user
    try:
        fork = copy.deepcopy(cache)
    finally:
        cache.selection_hooks = hooks
    config.check_layers(len(fork.layers))
    fork.quest_config = config
    for i, layer in enumerate(fork.layers):
        layer.config = config.for_layer(i)  # the layer's own budget (QuestConfig.layer_budgets)
        layer._selector = selector
        layer.reuse = {}  # another config's stored selection (reselect_every) is not this one's
        layer.sync_bounds()  # 8-bit bounds built (or dropped) for this config's `bounds`
    return fork


def step_tokens(model, cache, tokens: torch.Tensor, on_logits=None) -> torch.Tensor:
    """Feed `tokens [B, m]` one per forward (decode); `on_logits(i, logits [B, V] fp32)` after each. Last logits."""
    name, logits = cache_arg_name(model), None
    with torch.no_grad():
        for i in range(tokens.shape[1]):
            out = model(input_ids=tokens[:, i:i + 1], use_cache=True, **{name: cache})
            logits = out.logits[:, -1].float()
            if on_logits is not None:
                on_logits(i, logits)
    return logits


# --- texts -------------------------------------------------------------------------------------------

def stdlib_text(modules=STDLIB_MODULES) -> tuple[str, str]:
    """(text, source): the docstrings of stdlib `modules` and their public members, in a fixed order.

    Needs no network and no file; the same Python version gives the same text.
    """
    parts, seen, used = [], set(), []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a stripped-down Python; the source line lists what was used
            continue
        used.append(name)
        docs = [inspect.getdoc(mod)]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj))
                if inspect.isclass(obj):
                    docs += [inspect.getdoc(m) for a, m in sorted(vars(obj).items())
                             if not a.startswith("_") and inspect.isfunction(m)]
        for d in docs:
            if d and d not in seen:  # inherited / aliased docstrings once
                seen.add(d)
                parts.append(d)
    version = ".".join(map(str, sys.version_info[:3]))
    return "\n\n".join(parts), f"Python {version} stdlib docstrings ({len(used)} modules: {', '.join(used)})"


def load_hub_text(dataset: str, split: str = "test", field: str = "text", min_chars: int = 0) -> tuple[str, str]:
    """(text, source): the first record of a Hub dataset (`"pg19"` means `emozilla/pg19-test`, Quest's choice)
    with at least `min_chars` characters. Raises RuntimeError saying what to do when the Hub is unreachable."""
    name = {"pg19": "emozilla/pg19-test"}.get(dataset, dataset)
    try:
        import datasets

        for record in datasets.load_dataset(name, split=split, streaming=True):
            if len(record[field]) >= min_chars:
                return record[field], f"{name} ({split}, first record of >= {min_chars} chars)"
    except Exception as e:  # noqa: BLE001 - offline, unknown name, no such field: one clear message
        raise RuntimeError(
            f"could not read dataset {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            "Without a reachable Hub, pass --text-file PATH or drop --dataset to use the built-in text."
        ) from e
    raise RuntimeError(f"no record of {name!r} ({split}) has {min_chars}+ characters in {field!r}")


# --- perplexity --------------------------------------------------------------------------------------

def decode_nlls(model, cache, tokens: torch.Tensor, progress=None) -> torch.Tensor:
    """NLL `[m - 1]` of `tokens[0, 1:]`, each predicted by a decode step that fed the token before it.

    `tokens[0, 0]` is not scored: its logits come from the dense prefill, the same for every configuration.
    """
    nlls = []

    def score(i, step_logits):
        nlls.append(-torch.log_softmax(step_logits[0], -1)[tokens[0, i + 1]])
        if progress is not None:
            progress.update(1)

    step_tokens(model, cache, tokens[:, :-1], score)
    return torch.stack(nlls)


def perplexity_sweep(model, input_ids: torch.Tensor, prefix_len: int, budgets=(64, 128, 256, 512, 1024), *,
                     page_size: int = 16, dense_layers: int = 2, gqa_mode: str = "union",
                     policies=("quest",), backend: str = "auto", extra=(), progress=None) -> dict:
    """Perplexity of `input_ids [1, T]` after a dense prefix of `prefix_len` tokens, dense and per (policy, budget).

    Decodes `T - prefix_len - 1` steps per configuration; scores `input_ids[0, prefix_len + 1:]`. `extra`: more
    rows, `(name, QuestConfig)` pairs (e.g. per-layer budgets from `quest_hf.calibrate`), after the flat ones.
    Returns `{"prefix_len", "decoded", "rows": [{"name", "policy", "budget", "nll", "ppl", "nlls", "bytes",
    "bytes_frac"}]}`; the first row is dense. `bytes`: K/V + metadata bytes of one decode step over all layers at
    the full context (pages read as measured, mean over steps; `accounting.model_step_bytes`), `bytes_frac` that
    over dense. `progress` (e.g. tqdm) is advanced once per decoded token.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    if not 0 < prefix_len <= T - 2:
        raise ValueError(f"prefix_len must leave at least 2 tokens to decode: prefix_len={prefix_len}, T={T}")
    base = QuestConfig(budget=DENSE_BUDGET, page_size=page_size, dense_layers=dense_layers, gqa_mode=gqa_mode,
                       backend=backend)
    configs = [("dense", None, base)] + [(p, b, dataclasses.replace(base, budget=b, policy=p))
                                         for p in policies for b in budgets]
    configs = configs + [(name, cfg.budget, cfg) for name, cfg in extra]
    text = model.config.get_text_config()
    n, kv = text.num_hidden_layers, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    group, elt = text.num_attention_heads // kv, next(model.parameters()).element_size()
    rows = []
    with patched(model, config=base):
        cache, _ = prefill_cache(model, input_ids[:, :prefix_len])
        for name, budget, cfg in configs:
            fork, pages = fork_cache(cache, cfg), {}
            fork.selection_hooks.append(
                lambda i, q, ids, pages=pages: pages.setdefault(i, []).append(float((ids >= 0).sum()) / ids.shape[0]))
            nll = decode_nlls(model, fork, input_ids[:, prefix_len:], progress)
            read = model_step_bytes(cfg, n, T, kv, head_dim, elt, group, {i: sum(v) / len(v) for i, v in pages.items()})
            mean = float(nll.double().mean())
            label, policy = ("dense", None) if budget is None else (f"{name} {budget}", name)
            if cfg.layer_budgets is not None or cfg.dense is not None:
                label, policy = name, cfg.policy
            rows.append(dict(name=label, policy=policy, budget=budget, nll=mean, ppl=math.exp(mean), nlls=nll.tolist(),
                             bytes=read, bytes_frac=read / (n * dense_bytes(T, kv, head_dim, elt))))
    return dict(prefix_len=prefix_len, decoded=T - prefix_len - 1, page_size=page_size, dense_layers=dense_layers,
                gqa_mode=gqa_mode, rows=rows)
