"""Page selectors: how a sparse layer chooses the pages one decode query reads (`QuestConfig.policy`).

One file a policy; `SELECTORS` maps each policy name to its selector (`register_selector` adds one).
"""
from __future__ import annotations

from .base import Selector, attend_pages, top_pages
from .codes import QCodeSelector, TwoStageCodeSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .streaming import StreamingSelector

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
    """Make `QuestConfig(policy=name)` use `selector`."""
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be a quest_hf.selectors.Selector, got {type(selector).__name__}")
    SELECTORS[name] = selector


def selector_for(policy: str) -> Selector:
    try:
        return SELECTORS[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(SELECTORS)}") from None


def policy_names() -> tuple[str, ...]:
    return tuple(SELECTORS)


def captured_policies() -> tuple[str, ...]:
    """Policies whose decode steps run inside a captured CUDA graph."""
    return tuple(name for name, sel in SELECTORS.items() if sel.captured)


__all__ = ["SELECTORS", "Selector", "QuestSelector", "StreamingSelector", "OracleSelector", "QCodeSelector",
           "TwoStageCodeSelector", "attend_pages", "top_pages", "register_selector", "selector_for", "policy_names",
           "captured_policies"]
