"""Which layers of a patched model decode sparse (arXiv 2406.10774's Top-K over pages) and which dense, and why.

    print(quest_hf.describe_patch(model))

Read from the patch state: the config (`budget`, `dense_layers`) and each layer's `families.LayerAttention`
(kind, window, soft-cap, sinks, scaling) as `patch_model` found them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .families import LayerAttention, _ranges


@dataclass(frozen=True)
class LayerPlan:
    """One attention layer of a patched model: `mode` "dense" or "sparse", `reason` in words, what it applies."""

    layer_idx: int
    mode: str
    reason: str
    attention: LayerAttention


def layer_plan(model) -> list[LayerPlan]:
    """One `LayerPlan` per attention layer of a patched `model`, in layer order.

    "dense": listed in `dense` (or one of the first `dense_layers`), or a sliding layer whose window fits the
    layer's budget (every token of the window, exact). "sparse": Quest's page selection once the context (or, on a
    sliding layer, the window) holds more than the layer's budget (`QuestConfig.layer_budget`); below that the
    layer attends to everything, exactly.
    """
    state = getattr(model, "_quest_state", None)
    if state is None:
        raise ValueError("the model is not patched: call quest_hf.patch_model(model, ...) first")
    cfg = state.config
    plans = []
    for idx in sorted(state.attention):
        a, budget = state.attention[idx], cfg.layer_budget(idx)
        if cfg.is_dense(idx):
            mode, reason = "dense", ("listed in dense" if cfg.dense is not None
                                     else f"one of the first dense_layers={cfg.dense_layers}")
        elif a.kind == "sliding" and a.window <= budget:
            mode, reason = "dense", f"sliding window {a.window} fits the budget {budget}"
        elif a.kind == "sliding":
            mode, reason = "sparse", f"pages of its sliding window {a.window}, budget {budget}"
        else:
            mode, reason = "sparse", f"full attention, budget {budget} once the context passes it"
        plans.append(LayerPlan(idx, mode, reason, a))
    return plans


def describe_patch(model) -> str:
    """Which layers of a patched `model` decode sparse and which dense, one line per run of alike layers, e.g.

        quest-hf on gemma2: 4 layers, policy quest, budget 64, page_size 16
        layers 0-1: dense (one of the first dense_layers=2); softcap 20, scaling 0.1768
        layer 2: dense (sliding window 8 fits the budget 64); softcap 20, scaling 0.1768
        layer 3: sparse (full attention, budget 64 once the context passes it); softcap 20, scaling 0.1768
    """
    plans = layer_plan(model)  # raises on an unpatched model
    state = model._quest_state
    cfg = state.config
    head = (f"quest-hf on {model.config.model_type}: {state.num_layers} layers, policy {cfg.policy}, "
            f"budget {cfg.budget}{' (per layer below)' if cfg.layer_budgets else ''}, page_size {cfg.page_size}")
    lines, run = [head], []

    def line(p: LayerPlan) -> str:
        a = p.attention
        extra = ([f"softcap {a.softcap:g}"] if a.softcap else []) + [f"scaling {a.scaling:.4g}"]
        extra += (["sinks"] if a.has_sinks else []) + ([] if a.rope else ["NoPE"])
        return f"{p.mode} ({p.reason}); " + ", ".join(extra)

    for p in plans + [None]:
        if run and (p is None or line(p) != line(run[-1]) or p.layer_idx != run[-1].layer_idx + 1):
            idx = [r.layer_idx for r in run]
            lines.append(f"layer{'s' if len(idx) > 1 else ''} {_ranges(idx)}: {line(run[-1])}")
            run = []
        if p is not None:
            run.append(p)
    return "\n".join(lines)
