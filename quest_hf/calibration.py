"""Per-layer budgets from a short offline measurement (Quest, arXiv 2406.10774, with budgets per layer).

    config = quest_hf.calibrate(model, tokenizer, budget=1024)   # same bytes per step as a flat budget 1024
    quest_hf.patch_model(model, config=config)

A flat budget and "the first two layers dense" spend bytes where they are not needed: on SmolLM2-135M most layers'
Top-K pages hold nearly all of the attention at small budgets while a few (18, 23, 26, 27) miss it at any budget
(benchmarks/accuracy/recall_smollm2.md). `calibrate` measures that on text the caller supplies (default: a window of
the built-in stdlib text that the perplexity benchmark does not score), then spends the same bytes per decode step
where they buy the most attention:

    text ─dense prefill─► cache ─a few decode queries─► per layer l, candidate budget b (and "dense"):
        mass[l][b]   attention (dense softmax) on the tokens the policy's selection at b reads, mean over heads
        recall[l][b] fraction of each head's true top-k tokens inside them
        bytes[l][b]  K/V + metadata one step reads there (quest_hf.eval.accounting, pages read as measured)
    ─most summed mass within the flat config's bytes (a knapsack)─► one option per layer ─► QuestConfig

Queries are exact: every layer attends densely during the measurement (a probe policy scores each candidate's
selection and returns dense attention), so a layer's queries do not depend on the other layers' choices.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from .config import QuestConfig
from .eval.accounting import dense_bytes, step_bytes
from .eval.ppl import DENSE_BUDGET, fork_cache, prefill_cache, stdlib_text, step_tokens
from .eval.recall import oracle_token_sets, page_token_sets, top_recall, true_top_tokens
from .patch import patched
from .selectors import SELECTORS, Selector, attend_pages, register_selector, selector_for
from .selectors.codes import QCodeSelector

DENSE = "dense"  # the option of a layer that decodes dense
CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096)
# Where the built-in calibration text starts (tokens into `stdlib_text`): past the perplexity benchmark's window
# (scripts/ppl.py scores its first 8193 tokens), so calibration never reads what is evaluated.
CALIBRATION_OFFSET = 16384
_PROBE = "_calibration_probe"
STEPS = 4096  # cost resolution of `allocate`: 1/STEPS of the byte limit


@dataclass
class LayerMeasurement:
    """What `measure` found: per layer (list index = layer index) and option (a budget, or "dense"), means over
    the decode queries and query heads. `context`: tokens in the cache at the queries; `seconds`: wall time."""

    options: list
    mass: list[dict] = field(default_factory=list)
    recall: list[dict] = field(default_factory=list)
    bytes: list[dict] = field(default_factory=list)
    context: int = 0
    queries: int = 0
    policy: str = "quest"
    page_size: int = 16
    gqa_mode: str = "union"
    seconds: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.mass)

    def table(self, metric: str = "mass") -> str:
        """Markdown: one row per layer, one column per option."""
        rows = getattr(self, metric)
        head = "| layer | " + " | ".join(str(o) for o in self.options) + " |"
        lines = [head, "|---|" + "---|" * len(self.options)]
        for i, r in enumerate(rows):
            lines.append(f"| {i} | " + " | ".join(f"{r[o]:.3f}" for o in self.options) + " |")
        return "\n".join(lines)


class _Probe(Selector):
    """Scores every candidate's selection on the exact query, then attends densely (the measurement's policy)."""

    def __init__(self, meter: _Meter):
        self.meter = meter

    def attend(self, layer, q, scale, window, on_select, softcap=0.0, sinks=None):
        self.meter.measure(layer, q, scale, window, softcap)
        return attend_pages(layer, q, layer.dense_pages(window), scale, window, softcap, sinks)


class _Meter:
    def __init__(self, base: QuestConfig, budgets, layers: dict, topk: int):
        self.base, self.budgets, self.layers, self.topk = base, budgets, layers, topk
        n = len(layers)
        self.sums = {m: [dict.fromkeys(budgets, 0.0) for _ in range(n)] for m in ("mass", "recall", "pages")}
        self.steps = [0] * n

    def measure(self, layer, q, scale, window, softcap):
        idx = self.layers[id(layer)]
        L, S = layer.seq_len, layer.page_size
        ws = max(0, L - window) if window else 0
        keys = layer.keys[:, :, :L]
        B, Hq, D = q.shape
        H = keys.shape[1]
        ok = layer.valid[:, :L].clone()
        ok[:, :ws] = False
        logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, Hq // H, D), keys.float()) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        probs = torch.softmax(logits.masked_fill(~ok[:, None, None], float("-inf")), -1).nan_to_num(0.0)
        top = true_top_tokens(q, keys, layer.valid, self.topk, ws)
        P = -(-L // S)
        for b in self.budgets:
            if self.base.policy == "oracle":
                sets = oracle_token_sets(q, keys, layer.valid, b, ws)
                pages = float(sets.sum()) / (B * S)
            else:
                view = copy.copy(layer)  # shares the pages; only the budget differs
                view.config = dataclasses.replace(self.base, budget=b)
                sel = selector_for(self.base.policy)
                if isinstance(sel, QCodeSelector):  # codes of pages completed since the prefill
                    sel._sync(view, L)
                ids = sel.select(view, q, window)
                ids = torch.where(ids < P, ids, -1)  # the spare page holds no token
                sets = page_token_sets(ids, L, S, layer.valid, ws)
                pages = float((ids >= 0).sum()) / B
            s = self.sums
            s["mass"][idx][b] += float((probs * sets[:, :, None]).sum(-1).mean())
            s["recall"][idx][b] += float(top_recall(sets, top).mean())
            s["pages"][idx][b] += pages
        self.steps[idx] += 1


def token_ids(texts_or_tokenizer, tokenizer, tokens: int, offset: int) -> torch.Tensor:
    """`[1, tokens]` ids: from a tokenizer (the built-in text), ids, or text(s) with `tokenizer=`."""
    src = texts_or_tokenizer
    if src is None or callable(getattr(src, "encode", None)) and not isinstance(src, str):
        tokenizer = src if src is not None else tokenizer
        if tokenizer is None:
            raise ValueError("calibrate needs a tokenizer (for the built-in text), token ids, or texts with tokenizer=")
        ids = tokenizer(stdlib_text()[0], add_special_tokens=False).input_ids[offset:offset + tokens]
    elif isinstance(src, torch.Tensor) or isinstance(src, (list, tuple)) and src and isinstance(src[0], int):
        ids = torch.as_tensor(src).reshape(-1).tolist()[:tokens]
    else:
        if tokenizer is None:
            raise ValueError("texts need tokenizer=: calibrate(model, texts, tokenizer=tok)")
        text = src if isinstance(src, str) else "\n\n".join(src)
        ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    return torch.tensor([ids], dtype=torch.long)


def measure(model, ids: torch.Tensor, *, budgets=CANDIDATES, queries: int = 32, policy: str = "quest",
            page_size: int = 16, gqa_mode: str = "union", topk: int = 10) -> LayerMeasurement:
    """Prefill `ids [1, T]` but the last `queries` tokens densely, decode those one by one (dense), and measure for
    every layer and budget in `budgets` the policy's selection on each exact query (module docstring). Budgets
    at or above the context are dropped (the layer would decode dense); "dense" is always an option."""
    start = time.perf_counter()
    T = ids.shape[1]
    if not 0 < queries < T - 1:
        raise ValueError(f"queries={queries} must leave a prefix: the text has {T} tokens")
    context = T  # the cache holds T - 1 .. T - 1 + queries - 1 tokens at the queries: about T
    budgets = sorted({b for b in budgets if 2 * page_size <= b < context and b % page_size == 0})
    if not budgets:
        raise ValueError(f"no candidate budget in [{2 * page_size}, {context}) that is a multiple of {page_size}")
    text = model.config.get_text_config()
    num_layers, kv_heads = text.num_hidden_layers, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    group = text.num_attention_heads // kv_heads
    elt = next(model.parameters()).element_size()
    ids = ids.to(next(model.parameters()).device)
    sel = QuestConfig(budget=budgets[0], page_size=page_size, gqa_mode=gqa_mode, policy=policy)  # validates
    base = QuestConfig(budget=DENSE_BUDGET, page_size=page_size, gqa_mode=gqa_mode, dense=(), cuda_graph=False,
                       compile_decode=False)
    if _PROBE in SELECTORS:
        raise RuntimeError("calibrate is already running in this process")
    meter = None
    register_selector(_PROBE, Selector())  # the probe config must name a registered policy
    try:
        with patched(model, config=base):
            cache, _ = prefill_cache(model, ids[:, :T - queries])
            # The probe's own budget is the smallest possible: every layer reaches the selector on every query.
            probe_cfg = dataclasses.replace(base, budget=2 * page_size, policy=_PROBE)
            fork = fork_cache(cache, probe_cfg)
            del cache
            meter = _Meter(sel, budgets, {id(layer): i for i, layer in enumerate(fork.layers)}, topk)
            SELECTORS[_PROBE] = _Probe(meter)
            step_tokens(model, fork, ids[:, T - queries:])
    finally:
        SELECTORS.pop(_PROBE, None)
    out = LayerMeasurement(options=budgets + [DENSE], context=context, queries=queries, policy=policy,
                           page_size=page_size, gqa_mode=gqa_mode)
    full = dense_bytes(context, kv_heads, head_dim, elt)
    for i in range(num_layers):
        n = max(meter.steps[i], 1)
        out.mass.append({b: meter.sums["mass"][i][b] / n for b in budgets} | {DENSE: 1.0})
        out.recall.append({b: meter.sums["recall"][i][b] / n for b in budgets} | {DENSE: 1.0})
        out.bytes.append({b: step_bytes(policy, context, kv_heads, head_dim, elt, page_size,
                                        meter.sums["pages"][i][b] / n, b, group) for b in budgets} | {DENSE: full})
    out.seconds = time.perf_counter() - start
    return out


def flat_bytes(m: LayerMeasurement, budget: int, dense_layers: int = 2) -> float:
    """Bytes per step of the flat config (`budget` in every layer, the first `dense_layers` dense), as measured."""
    if budget not in m.options:
        raise ValueError(f"budget {budget} was not measured; measure it (budgets=...) among {m.options[:-1]}")
    return sum(m.bytes[i][DENSE if i < dense_layers else budget] for i in range(m.num_layers))


def allocate(m: LayerMeasurement, budget: int | None = None, *, dense_layers: int = 2, target: float | None = None,
             objective: str = "mass") -> list:
    """One option (a budget or "dense") per layer.

    With `budget`: the options with the largest summed `objective` ("mass" or "recall") whose bytes per step are
    at most those of the flat config (`budget` everywhere, the first `dense_layers` dense); the flat config is
    one such choice, so the result never has less. (Greedy by marginal gain per byte can end below the flat
    config's total; the knapsack is small enough to solve exactly.) With `target`: each layer the cheapest option
    whose `objective` reaches `target` (dense where none does); bytes as they come.
    """
    if objective not in ("mass", "recall"):
        raise ValueError(f"objective must be 'mass' or 'recall', got {objective!r}")
    gain, cost, opts = getattr(m, objective), m.bytes, m.options
    if target is not None:
        if budget is not None:
            raise ValueError("pass budget= (equal bytes) or target= (an accuracy), not both")
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target}")
        return [min((o for o in opts if gain[i][o] >= target), key=lambda o: cost[i][o]) for i in range(m.num_layers)]
    if budget is None:
        raise ValueError("pass budget= (the flat budget whose bytes to match) or target=")
    limit = flat_bytes(m, budget, dense_layers) * (1 + 1e-9)
    # A multiple-choice knapsack over costs in units of 1/STEPS of the limit, rounded up; STEPS + n units of room
    # (rounding adds less than one a layer), then the best choice whose true bytes fit. best[c]: the most summed
    # gain of the layers so far within c units.
    n, unit = m.num_layers, limit / STEPS
    room = STEPS + n
    units = [{o: math.ceil(cost[i][o] / unit - 1e-9) for o in opts} for i in range(n)]
    best = torch.zeros(room + 1, dtype=torch.float64)
    picks = []
    for i in range(n):
        new = torch.full_like(best, float("-inf"))
        pick = torch.full((room + 1,), -1, dtype=torch.long)
        for k, o in enumerate(opts):
            w = units[i][o]
            if w > room:
                continue
            cand = torch.full_like(best, float("-inf"))
            cand[w:] = best[:room + 1 - w] + gain[i][o]
            better = cand > new
            new, pick = torch.where(better, cand, new), torch.where(better, k, pick)
        best = new
        picks.append(pick)

    def back(c: int) -> list:
        choice = []
        for i in reversed(range(n)):
            o = opts[int(picks[i][c])]
            choice.append(o)
            c -= units[i][o]
        return choice[::-1]

    def score(choice):
        fits = sum(cost[i][o] for i, o in enumerate(choice)) <= limit
        return sum(gain[i][o] for i, o in enumerate(choice)) if fits else float("-inf")

    flat = [DENSE if i < dense_layers else budget for i in range(n)]
    found = [back(c) for c in range(STEPS, room + 1) if math.isfinite(float(best[c]))]
    return max(found + [flat], key=score)


def to_config(choice: list, budget: int, *, policy: str = "quest", page_size: int = 16, gqa_mode: str = "union",
              **options) -> QuestConfig:
    """The QuestConfig of an allocation: `dense` = the layers given "dense", `layer_budgets` the others' (a dense
    layer's entry is `budget`, unused)."""
    return QuestConfig(budget=budget, page_size=page_size, gqa_mode=gqa_mode, policy=policy,
                       layer_budgets=tuple(budget if c == DENSE else c for c in choice),
                       dense=tuple(i for i, c in enumerate(choice) if c == DENSE), **options)


def calibrate(model, texts_or_tokenizer=None, *, tokenizer=None, budget: int = 1024, policy: str = "quest",
              tokens: int = 8192, queries: int = 32, page_size: int = 16, gqa_mode: str = "union",
              dense_layers: int = 2, target: float | None = None, objective: str = "mass", budgets=CANDIDATES,
              offset: int = CALIBRATION_OFFSET, topk: int = 10, **options) -> QuestConfig:
    """A QuestConfig with a budget per layer and the layers to keep dense, measured on `model`.

    `texts_or_tokenizer`: a tokenizer (the built-in text: `tokens` tokens of the stdlib docstrings from token
    `offset` on, past what scripts/ppl.py scores), token ids (`[1, T]` or a list), or a text / list of texts with
    `tokenizer=`; at most `tokens` tokens are used, the last `queries` of them decoded as measured queries.

    Equal bytes (default): per-layer budgets and dense layers whose bytes per decode step at this context are at
    most those of `QuestConfig(budget=budget, dense_layers=dense_layers)`. `target=0.99`: each layer the cheapest
    option holding that fraction of the attention (`objective`: "mass", or "recall" of the true top-`topk`).
    `budgets`: candidate budgets (`budget` is added). `options`: other QuestConfig settings (backend, ...).
    Under 2 minutes for SmolLM2-135M on 8K tokens on a 2-core CPU (README, "Calibrated budgets").
    """
    ids = token_ids(texts_or_tokenizer, tokenizer, tokens, offset)
    cands = tuple(budgets) + ((budget,) if target is None else ())
    m = measure(model, ids, budgets=cands, queries=queries, policy=policy, page_size=page_size, gqa_mode=gqa_mode,
                topk=topk)
    if target is None and budget >= m.context:
        raise ValueError(f"budget={budget} covers the {m.context}-token calibration text: every layer would decode "
                         "dense; calibrate on a longer text (tokens=...) or a smaller budget")
    choice = allocate(m, None if target is not None else budget, dense_layers=dense_layers, target=target,
                      objective=objective)
    flat = budget if target is None else max((c for c in choice if c != DENSE), default=budget)
    return to_config(choice, flat, policy=policy, page_size=page_size, gqa_mode=gqa_mode, **options)


def config_bytes(m: LayerMeasurement, config: QuestConfig) -> float:
    """Bytes per step of `config` at the measurement's context, from the measured pages (budgets not measured are
    interpolated linearly in pages between the measured ones)."""
    total = 0.0
    for i in range(m.num_layers):
        if config.is_dense(i):
            total += m.bytes[i][DENSE]
            continue
        b = config.layer_budget(i)
        if b in m.bytes[i]:
            total += m.bytes[i][b]
            continue
        known = sorted(o for o in m.options if o != DENSE)
        lo = max((o for o in known if o <= b), default=known[0])
        hi = min((o for o in known if o >= b), default=known[-1])
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        total += (1 - w) * m.bytes[i][lo] + w * m.bytes[i][hi]
    return total if math.isfinite(total) else float("nan")
