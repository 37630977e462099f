"""Page selectors: how a sparse layer chooses the pages one decode query reads (`QuestConfig.policy`).

One file a policy; `SELECTORS` maps each policy name to its selector (`register_selector` adds one). A
`QuestConfig` names its policy only; `check_config` resolves the name and checks the settings that depend on the
selector, where a config is bound to a model or cache (`patch_model`, `QuestCache`, `calibrate`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Selector, attend_pages, top_pages
from .codes import QCodeSelector, TwoStageCodeSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .streaming import StreamingSelector

if TYPE_CHECKING:
    from ..config import QuestConfig

SELECTORS: dict[str, Selector] = {
    "quest": QuestSelector(),
    "streaming": StreamingSelector(),
    "oracle": OracleSelector(),
    "qcode": QCodeSelector(bits=2),
    "qcode1": QCodeSelector(bits=1),
    "qcode_topp": QCodeSelector(bits=2, top_p=0.9),
    "qcode1_topp": QCodeSelector(bits=1, top_p=0.9),
    # Two-stage: Quest's top 8 x budget pages per query head, re-ranked by the codes of those pages only.
    "qcode2s": TwoStageCodeSelector(bits=2, candidates=8),
    "qcode1_2s": TwoStageCodeSelector(bits=1, candidates=8),
}


def register_selector(name: str, selector: Selector) -> None:
    """Make `QuestConfig(policy=name)` use `selector` (in models and caches it is bound to from now on)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a selector's name must be a non-empty str, got {name!r}")
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a quest_hf.selectors.Selector, got {type(selector).__name__}")
    SELECTORS[name] = selector


def selector_for(policy: str) -> Selector:
    try:
        return SELECTORS[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(SELECTORS)} (or register yours first: "
                         "quest_hf.selectors.register_selector(name, selector))") from None


def policy_names() -> tuple[str, ...]:
    return tuple(SELECTORS)


def captured_policies() -> tuple[str, ...]:
    """Policies whose decode steps run inside a captured CUDA graph."""
    return tuple(name for name, sel in SELECTORS.items() if sel.captured)


def check_config(config: QuestConfig, selector: Selector | None = None) -> Selector:
    """The selector `config` runs with, after checking the settings that depend on it; raises ValueError.

    `QuestConfig` checks its own fields only (it never reads this registry, so it is a pure value); this is the rest,
    run where a config is bound to a model or cache (`patch_model`, `QuestCache`, `QuestCache.copy`, `calibrate`):
    the policy is registered, `budget` / `layer_budgets` are whole pages unless the selector counts tokens
    (`token_budget`, the oracle), `bounds="int8"` only for a selector that reads 8-bit bounds, `reselect_every > 1`
    only for one that reuses its selection, `cuda_graph=True` only for a captured one. `selector`: check against
    this selector instead of the registered one of `config.policy` (a selector that is not registered)."""
    sel = selector_for(config.policy) if selector is None else selector
    policy, ps = config.policy, config.page_size
    if config.budget % ps and not sel.token_budget:
        low, high = config.budget // ps * ps, -(-config.budget // ps) * ps
        raise ValueError(
            f"budget={config.budget} is not a multiple of page_size={ps}: policy {policy!r} chooses whole "
            f"pages and would read {config.budget // ps} pages ({low} tokens) a head; use budget={low} or "
            f"budget={high}"
        )
    for i, b in enumerate(config.layer_budgets or ()):
        if b % ps and not sel.token_budget:
            raise ValueError(f"layer_budgets[{i}]={b} must be a multiple of page_size={ps} and at least 2 pages "
                             f"({2 * ps} tokens), as budget must (policy {policy!r} chooses whole pages); use "
                             f"{max(2 * ps, b // ps * ps)}")
    if config.bounds != "key_dtype" and not sel.int8_bounds:
        raise ValueError(f"bounds={config.bounds!r} is read by policy 'quest' only; policy {policy!r} reads the "
                         "key-dtype bounds: use bounds='key_dtype' or policy='quest'")
    if config.reselect_every > 1 and not sel.reuses_selection:
        raise ValueError(f"reselect_every={config.reselect_every} is supported by policy 'quest' only, got policy "
                         f"{policy!r}; use reselect_every=1 or policy='quest'")
    if config.cuda_graph is True and not sel.captured:
        raise ValueError(f"cuda_graph=True captures the policies {', '.join(captured_policies())}, got "
                         f"policy={policy!r} (its scores need host lengths); use cuda_graph='auto' or False")
    return sel


__all__ = ["SELECTORS", "Selector", "QuestSelector", "StreamingSelector", "OracleSelector", "QCodeSelector",
           "TwoStageCodeSelector", "attend_pages", "top_pages", "register_selector", "selector_for", "policy_names",
           "captured_policies", "check_config"]
