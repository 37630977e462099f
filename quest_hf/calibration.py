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
        output[l][b] 1 - |o_proj(sparse out) - o_proj(dense out)| / |o_proj(dense out)|
        error[l][b]  1 - |o_proj(sparse out) - o_proj(dense out)| / |residual stream entering layer l|
        bytes[l][b]  K/V + metadata one step reads there (quest_hf.eval.accounting, pages read as measured)
    ─most summed objective within the flat config's bytes (a knapsack)─► one option per layer ─► QuestConfig

The objective (`objective=`) is one of those; `"error"` (the default) measured best: at flat 1024's bytes on
SmolLM2 at 8K, perplexity +0.3% over dense against +4.2% for "mass" and +4.1% for "output" (README, "Calibrated
budgets"). A reading consistent with that: mass alone misjudges layers whose attention output is small next
to the residual stream (an error there barely moves the next layer) and layers where a little missed mass carries
a large share of the output.

Queries are exact: every layer attends densely during the measurement (a probe selector scores each candidate's
selection and returns dense attention), so a layer's queries do not depend on the other layers' choices. The probe is
handed to the measured cache's layers directly (`fork_cache(..., selector=)`), never registered: calibration leaves
the selector registry as it found it, and several calibrations may run at once.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from . import families
from .config import QuestConfig
from .eval.accounting import dense_bytes, step_bytes
from .eval.ppl import DENSE_BUDGET, fork_cache, prefill_cache, stdlib_text, step_tokens
from .eval.recall import oracle_token_sets, page_token_sets, top_recall, true_top_tokens
from .patch import patched
from .selectors import Selector, attend_pages, check_config, selector_for
from .selectors.codes import QCodeSelector

DENSE = "dense"  # the option of a layer that decodes dense
CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096)
# Where the built-in calibration text starts (tokens into `stdlib_text`): past the perplexity benchmark's window
# (scripts/ppl.py scores its first 8193 tokens), so calibration never reads what is evaluated.
CALIBRATION_OFFSET = 16384
_PROBE = "_calibration_probe"  # the policy name of the probe config (the probe itself is never registered)
STEPS = 4096  # cost resolution of `allocate`: 1/STEPS of the byte limit
# Per layer and option, each "higher is better" and 1.0 for a dense layer: attention mass read; recall of the true
# top-k tokens; 1 - |error of the layer's output| / |its output|; 1 - |that error| / |the residual stream entering
# the layer| (error: the output projection of sparse attention's output minus dense attention's).
METRICS = ("mass", "recall", "output", "error")


@dataclass
class LayerMeasurement:
    """What `measure` found: per layer (list index = layer index) and option (a budget, or "dense"), means over
    the decode queries and query heads. `context`: tokens in the cache at the queries; `seconds`: wall time."""

    options: list
    mass: list[dict] = field(default_factory=list)
    recall: list[dict] = field(default_factory=list)
    output: list[dict] = field(default_factory=list)
    error: list[dict] = field(default_factory=list)
    bytes: list[dict] = field(default_factory=list)
    flat: list[dict] = field(default_factory=list)  # bytes under the default bounds (a flat config's), = bytes if so
    context: int = 0
    queries: int = 0
    policy: str = "quest"
    page_size: int = 16
    gqa_mode: str = "union"
    bounds: str = "key_dtype"
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

    def __init__(self, meter: _Meter | None = None):
        self.meter = meter  # set once the measured cache exists (the meter keys its layers)

    def attend(self, layer, q, scale, window, on_select, softcap=0.0, sinks=None):
        self.meter.measure(layer, q, scale, window, softcap)
        return attend_pages(layer, q, layer.dense_pages(window), scale, window, softcap, sinks)


class _Meter:
    def __init__(self, base: QuestConfig, selector: Selector, budgets, layers: dict, topk: int, out_proj: list,
                 residual: list):
        self.base, self.selector, self.budgets, self.layers, self.topk = base, selector, budgets, layers, topk
        self.out_proj, self.residual = out_proj, residual  # per layer: o_proj weight or None; |h| of this step
        n = len(layers)
        self.sums = {m: [dict.fromkeys(budgets, 0.0) for _ in range(n)] for m in METRICS + ("pages",)}
        self.steps = [0] * n

    def _view(self, layer, budget: int):
        view = copy.copy(layer)  # shares the pages; only the budget differs
        view.config = dataclasses.replace(self.base, budget=budget)
        return view

    def measure(self, layer, q, scale, window, softcap):
        idx = self.layers[id(layer)]
        L, S = layer.seq_len, layer.page_size
        ws = max(0, L - window) if window else 0
        keys, values = layer.keys[:, :, :L], layer.values[:, :, :L].float()
        B, Hq, D = q.shape
        H = keys.shape[1]
        ok = layer.valid[:, :L].clone()
        ok[:, :ws] = False
        logits = torch.einsum("bhgd,bhnd->bhgn", q.float().reshape(B, H, Hq // H, D), keys.float()) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        probs = torch.softmax(logits.masked_fill(~ok[:, None, None], float("-inf")), -1).nan_to_num(0.0)
        dense_out = self._project(idx, torch.einsum("bhgn,bhnd->bhgd", probs, values))  # [B, hidden]
        top = true_top_tokens(q, keys, layer.valid, self.topk, ws)
        P = -(-L // S)
        base = layer
        if self.base.bounds != "key_dtype" and self.base.policy != "oracle":  # quantized once, read by every budget
            base = self._view(layer, self.budgets[0])
            base.kmin8 = None
            base.sync_bounds()
        for b in self.budgets:
            if self.base.policy == "oracle":
                sets = oracle_token_sets(q, keys, layer.valid, b, ws)
                pages = float(sets.sum()) / (B * S)
            else:
                view = self._view(base, b)
                sel = self.selector
                if isinstance(sel, QCodeSelector):  # codes of pages completed since the prefill
                    sel._sync(view, L)
                ids = sel.select(view, q, window)
                ids = torch.where(ids < P, ids, -1)  # the spare page holds no token
                sets = page_token_sets(ids, L, S, layer.valid, ws)
                pages = float((ids >= 0).sum()) / B
            kept = probs * sets[:, :, None]
            mass = kept.sum(-1, keepdim=True)
            # What sparse attention returns: the kept weights renormalised; its error through the output projection.
            sparse_out = self._project(idx, torch.einsum("bhgn,bhnd->bhgd", kept / mass.clamp_min(1e-30), values))
            err = (sparse_out - dense_out).norm(dim=-1)
            s = self.sums
            s["mass"][idx][b] += float(mass.mean())
            s["recall"][idx][b] += float(top_recall(sets, top).mean())
            s["output"][idx][b] += 1.0 - float((err / dense_out.norm(dim=-1).clamp_min(1e-30)).mean())
            s["error"][idx][b] += 1.0 - float((err / self.residual[idx].clamp_min(1e-30)).mean())
            s["pages"][idx][b] += pages
        self.steps[idx] += 1

    def _project(self, idx: int, out: torch.Tensor) -> torch.Tensor:
        """`[B, H_kv, G, D]` attention output -> `[B, hidden]` through the layer's output projection (if found)."""
        flat = out.reshape(out.shape[0], -1)
        w = self.out_proj[idx]
        return flat if w is None else flat @ w.float().t()


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
            page_size: int = 16, gqa_mode: str = "union", topk: int = 10,
            bounds: str = "key_dtype") -> LayerMeasurement:
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
    sel = QuestConfig(budget=budgets[0], page_size=page_size, gqa_mode=gqa_mode, policy=policy, bounds=bounds)
    selector = check_config(sel)  # the measured policy is registered and takes these bounds
    # Eager steps: the measurement reads every layer through Python hooks at run time (nothing compiled or captured).
    base = QuestConfig(budget=DENSE_BUDGET, page_size=page_size, gqa_mode=gqa_mode, dense=(), cuda_graph=False,
                       compile_decode=False, compile_step=False)
    meter, hooks = None, []
    out_proj = [getattr(getattr(m, "o_proj", None), "weight", None) for m in families.attention_modules(model)]
    residual = [torch.ones(1)] * num_layers
    if len(out_proj) != num_layers:
        raise ValueError("calibrate measures softmax-attention layers only; this model has other layers too")

    def keep_norm(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            residual[i] = h[:, -1].float().norm(dim=-1)
        return hook

    probe = _Probe()
    try:
        for i, decoder_layer in enumerate(families._decoder_layers(model)[1]):
            hooks.append(decoder_layer.register_forward_pre_hook(keep_norm(i), with_kwargs=True))
        with patched(model, config=base):
            cache, _ = prefill_cache(model, ids[:, :T - queries])
            # The probe's own budget is the smallest possible: every layer reaches the selector on every query.
            probe_cfg = dataclasses.replace(base, budget=2 * page_size, policy=_PROBE)
            fork = fork_cache(cache, probe_cfg, selector=probe)
            del cache
            meter = _Meter(sel, selector, budgets, {id(layer): i for i, layer in enumerate(fork.layers)}, topk,
                           out_proj, residual)
            probe.meter = meter
            step_tokens(model, fork, ids[:, T - queries:])
    finally:
        for h in hooks:
            h.remove()
    out = LayerMeasurement(options=budgets + [DENSE], context=context, queries=queries, policy=policy,
                           page_size=page_size, gqa_mode=gqa_mode, bounds=bounds)
    full = dense_bytes(context, kv_heads, head_dim, elt)
    for i in range(num_layers):
        n = max(meter.steps[i], 1)
        for metric in METRICS:
            getattr(out, metric).append({b: meter.sums[metric][i][b] / n for b in budgets} | {DENSE: 1.0})
        for dest, bd in ((out.bytes, bounds), (out.flat, "key_dtype")):
            dest.append({b: step_bytes(policy, context, kv_heads, head_dim, elt, page_size,
                                       meter.sums["pages"][i][b] / n, b, group, bd) for b in budgets} | {DENSE: full})
    out.seconds = time.perf_counter() - start
    return out


def flat_bytes(m: LayerMeasurement, budget: int, dense_layers: int = 2) -> float:
    """Bytes per step of the flat config (`budget` in every layer, the first `dense_layers` dense, default bounds), as
    measured."""
    if budget not in m.options:
        raise ValueError(f"budget {budget} was not measured; measure it (budgets=...) among {m.options[:-1]}")
    cost = m.flat or m.bytes
    return sum(cost[i][DENSE if i < dense_layers else budget] for i in range(m.num_layers))


def allocate(m: LayerMeasurement, budget: int | None = None, *, dense_layers: int = 2, target: float | None = None,
             objective: str = "error", limit: float | None = None) -> list:
    """One option (a budget or "dense") per layer.

    With `budget`: the options with the largest summed `objective` (one of METRICS) whose bytes per step are at
    most those of the flat config (`budget` everywhere, the first `dense_layers` dense, key-dtype bounds; `limit`:
    that many bytes instead); the flat config is one such choice, so the result never has less. (Greedy by
    marginal gain per byte can end below the flat config's total; the knapsack is small enough to solve exactly.)
    With `target`: each layer the cheapest option whose `objective` reaches `target` (dense where none does);
    bytes as they come."""
    if objective not in METRICS:
        raise ValueError(f"objective must be one of {', '.join(METRICS)}, got {objective!r}")
    gain, cost, opts = getattr(m, objective), m.bytes, m.options
    if target is not None:
        if budget is not None:
            raise ValueError("pass budget= (equal bytes) or target= (an accuracy), not both")
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {target}")
        return [min((o for o in opts if gain[i][o] >= target), key=lambda o: cost[i][o]) for i in range(m.num_layers)]
    if budget is None:
        raise ValueError("pass budget= (the flat budget whose bytes to match) or target=")
    limit = (flat_bytes(m, budget, dense_layers) if limit is None else limit) * (1 + 1e-9)
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
    flat = flat if budget in opts else [min(opts[:-1])] * n  # (another page size's budget: the cheapest choice)
    found = [back(c) for c in range(STEPS, room + 1) if math.isfinite(float(best[c]))]
    return max(found + [flat], key=score)


def to_config(choice: list, budget: int, *, policy: str = "quest", page_size: int = 16, gqa_mode: str = "union",
              **options) -> QuestConfig:
    """The QuestConfig of an allocation: `dense` = the layers given "dense", `layer_budgets` the others' (a dense
    layer's entry is `budget`, unused)."""
    return QuestConfig(budget=budget, page_size=page_size, gqa_mode=gqa_mode, policy=policy,
                       layer_budgets=tuple(budget if c == DENSE else c for c in choice),
                       dense=tuple(i for i, c in enumerate(choice) if c == DENSE), **options)


def resolve_bounds(policy: str, bounds: str = "auto") -> str:
    """`"auto"`: `"int8"` where the policy reads 8-bit page bounds (quest), else `"key_dtype"`; others as given."""
    if bounds != "auto":
        return bounds
    return "int8" if getattr(selector_for(policy), "int8_bounds", False) else "key_dtype"


def calibrate(model, texts_or_tokenizer=None, *, tokenizer=None, budget: int = 1024, policy: str = "quest",
              tokens: int = 8192, queries: int = 32, page_size: int = 16, gqa_mode: str = "union",
              dense_layers: int = 2, target: float | None = None, objective: str = "error", budgets=CANDIDATES,
              offset: int = CALIBRATION_OFFSET, topk: int = 10, bounds: str = "key_dtype", **options) -> QuestConfig:
    """A QuestConfig with a budget per layer and the layers to keep dense, measured on `model`.

    `texts_or_tokenizer`: a tokenizer (the built-in text: `tokens` tokens of the stdlib docstrings from token
    `offset` on, past what scripts/ppl.py scores), token ids (`[1, T]` or a list), or a text / list of texts with
    `tokenizer=`; at most `tokens` tokens are used, the last `queries` of them decoded as measured queries.

    Equal bytes (default): per-layer budgets and dense layers whose bytes per decode step at this context are at
    most those of `QuestConfig(budget=budget, dense_layers=dense_layers)` (key-dtype bounds), with the most summed
    `objective` (METRICS: "error", the default, is 1 - the layer's output error relative to its residual stream;
    "mass", "recall" of the true top-`topk`, "output"). `target=0.99`: each layer the cheapest option whose
    `objective` reaches that. `bounds`: "key_dtype" (default), or "auto": 8-bit page bounds where the policy reads
    them (quest: QuestConfig(bounds="int8"), a quarter of fp32 min/max's metadata bytes, so more pages at equal
    bytes: perplexity +0.8% instead of +3.4% at flat 512's bytes on SmolLM2, but 9/10 passkeys at 4K instead of
    10/10), else "key_dtype"; or "int8". `budgets`: candidate budgets (`budget` is added). `options`: other
    QuestConfig settings (backend, ...).
    Under 2 minutes for SmolLM2-135M on 8K tokens on a 2-core CPU (README, "Calibrated budgets").
    """
    ids = token_ids(texts_or_tokenizer, tokenizer, tokens, offset)
    bounds = resolve_bounds(policy, bounds)
    cands = tuple(budgets) + ((budget,) if target is None else ())
    m = measure(model, ids, budgets=cands, queries=queries, policy=policy, page_size=page_size, gqa_mode=gqa_mode,
                topk=topk, bounds=bounds)
    if target is None and budget >= m.context:
        raise ValueError(f"budget={budget} covers the {m.context}-token calibration text: every layer would decode "
                         "dense; calibrate on a longer text (tokens=...) or a smaller budget")
    choice = allocate(m, None if target is not None else budget, dense_layers=dense_layers, target=target,
                      objective=objective)
    flat = budget if target is None else max((c for c in choice if c != DENSE), default=budget)
    config = to_config(choice, flat, policy=policy, page_size=page_size, gqa_mode=gqa_mode, bounds=bounds, **options)
    check_config(config)  # the result is ready for patch_model: checked against its selector (e.g. `options`)
    return config


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
