"""`torch.compile` past dynamo's recompile limit.

Dynamo keeps at most `torch._dynamo.config.recompile_limit` (8 by default) compiled versions of one code object in a
process. The next new shape either raises (`fullgraph=True`: `FailOnRecompileLimitHit`, out of the caller's
`generate()`) or runs the function uncompiled, which only dynamo's own log line says. Every model quest-hf patches
shares a few code objects: the compiled decode step (quest_hf/compiled.py), each norm / MLP class's forward and the
rotary function (quest_hf/fuse.py). So a process that patches several models, or decodes at several batch sizes or
capacity buckets, reaches the limit.

`Compiled` compiles with `fullgraph=True`; at the limit it compiles a copy of the function (the same body under a new
code object: dynamo caches per code object), which takes the new shapes, up to `max_copies` copies, each logged and
counted (`copies`). Past that the limit error propagates (`limit_hit(e)` tells it apart), for the caller to run the
function eagerly and say so. With `fullgraph="prefer"`, a function that breaks the graph (a data-dependent branch in a
mixture-of-experts MLP) compiles without fullgraph instead (`graph_break` says why); dynamo then runs such a function's
shapes past the limit uncompiled, as it would without this class.
"""
from __future__ import annotations

import types

import torch
from transformers.utils import logging

logger = logging.get_logger("quest_hf")

MAX_COPIES = 8  # copies of one function at most: 9 x recompile_limit shapes (72 at dynamo's default)
_LIMIT_ERRORS = ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")  # across torch versions


def limit_hit(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) is dynamo's recompile-limit error."""
    seen = set()
    while e is not None and id(e) not in seen:
        if type(e).__name__ in _LIMIT_ERRORS:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _graph_break(e: BaseException) -> bool:
    unsupported = getattr(torch._dynamo.exc, "Unsupported", None)
    return unsupported is not None and isinstance(e, unsupported) and not limit_hit(e)


def fresh_copy(fn):
    """`fn` under a new code object (same body, globals, defaults, closure; a bound method stays bound to its
    object), or None for a callable that is not a Python function."""
    if isinstance(fn, types.MethodType):
        func = fresh_copy(fn.__func__)
        return None if func is None else types.MethodType(func, fn.__self__)
    if not isinstance(fn, types.FunctionType):
        return None
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


class Compiled:
    """`torch.compile(fn, fullgraph=True, **kwargs)` that outlives dynamo's recompile limit (module docstring).

    name: what the log lines call it. fullgraph: True, or "prefer" (True until a graph break, then False).
    Attributes visible to users and tests: `copies` (fresh copies compiled at the limit), `graph_break` (why it
    compiles without fullgraph, or None)."""

    def __init__(self, fn, name: str, *, fullgraph: bool | str = True, max_copies: int | None = None, **kwargs):
        if fullgraph not in (True, "prefer"):
            raise ValueError(f"fullgraph must be True or 'prefer', got {fullgraph!r}")
        self.fn, self.name, self.kwargs = fn, name, kwargs
        self.max_copies = MAX_COPIES if max_copies is None else max_copies
        self.fullgraph = True
        self.prefer = fullgraph == "prefer"
        self.copies = 0
        self.graph_break: str | None = None
        self._fn = torch.compile(fn, fullgraph=True, **kwargs)

    def __call__(self, *args, **kwargs):
        while True:
            try:
                return self._fn(*args, **kwargs)
            except Exception as e:  # dynamo raises these before the function runs: calling again is safe
                if self.fullgraph and self.prefer and _graph_break(e):
                    self.fullgraph = False
                    self.graph_break = f"{type(e).__name__}: {e}"[:500]
                    logger.info(f"quest-hf: {self.name} breaks torch.compile's graph, it compiles in pieces: "
                                f"{self.graph_break[:300]}")
                    self._fn = torch.compile(self.fn, fullgraph=False, **self.kwargs)
                    continue
                copy = fresh_copy(self.fn) if limit_hit(e) and self.copies < self.max_copies else None
                if copy is None:
                    raise
                self.copies += 1
                limit = getattr(torch._dynamo.config, "recompile_limit", None)
                logger.warning(
                    f"quest-hf: {self.name} reached dynamo's recompile limit ({limit} compiled shapes of one function "
                    f"in this process); a fresh copy compiles this shape ({self.copies} of at most {self.max_copies} "
                    f"copies). Raising torch._dynamo.config.recompile_limit keeps them in one.")
                self._fn = torch.compile(copy, fullgraph=self.fullgraph, **self.kwargs)
