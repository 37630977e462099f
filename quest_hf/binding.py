"""One way to bind, one way to undo (STYLE.md 16): every attribute quest-hf replaces is recorded once, put back in
reverse.

`Bindings` is one record: `set` replaces an attribute of a model, a module, a class or a Python module (keeping
what was there, or that nothing was), `method` binds a function as a method, `set_class` gives an object a subclass,
`item` replaces a mapping's entry, `call` undoes what a call did, `hook` keeps a hook handle, `child` nests a record
that can be undone on its own (`compile_decode` toggles), and `restore` replays it all backwards. Process-wide
replacements (the attention registration, a class attribute of transformers, a modeling file's global) are `shared`:
installed by their first holder, removed by the last.

A patched model's record survives `copy.deepcopy` and pickling as the copy's own: `Method` is bound to the object it
was set on (a closure would keep calling the original model), the "nothing was there" marker stays one object, and
a copy of a `SharedUse` is one more holder (installing the replacement in a fresh process).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch


class _Missing:
    """The marker of "there was no such attribute": one object, also after deepcopy and pickle."""

    def __repr__(self):
        return "MISSING"

    def __reduce__(self):
        return "MISSING"  # pickle and deepcopy: this module's global of that name


MISSING = _Missing()


class Method:
    """`obj.name = Method(fn, obj, name, previous)`: calling it calls `fn(method, *args, **kwargs)`.

    `method.__self__` is the object, `method.original` what it replaced (the class's method bound to the object
    when `previous` is MISSING). `fn` must be a module-level function, so that a copy of `obj` (deepcopy, pickle)
    gets a Method bound to the copy. `__wrapped__` lets `inspect.signature` see the original's parameters.

    Dynamo guards a Method set as a module's `forward` by its identity: a function compiled once for every layer
    must not call such modules (it would recompile for each layer up to dynamo's recompile limit). What compiled
    regions call on every layer (the decode GEMV's projections) is bound by class instead (`Bindings.set_class`).
    """

    def __init__(self, fn: Callable, obj, name: str, previous, data=None):
        self.__func__, self.__self__, self.name, self.previous, self.data = fn, obj, name, previous, data
        self.__doc__ = getattr(self.original, "__doc__", None)

    @property
    def original(self):
        if self.previous is MISSING:
            fn = getattr(type(self.__self__), self.name)
            if torch.compiler.is_compiling():  # a partial, not `__get__`: what dynamo traces (quest_hf/compiled.py)
                return functools.partial(fn, self.__self__)
            return fn.__get__(self.__self__)  # the bound method itself (restored as such, e.g. accelerate's hooks)
        return self.previous

    @property
    def __wrapped__(self):
        return self.original

    def __call__(self, *args, **kwargs):
        return self.__func__(self, *args, **kwargs)

    def __repr__(self):
        return f"<quest-hf {self.__func__.__name__} over {type(self.__self__).__name__}.{self.name}>"


class Bindings:
    """A record of replacements, undone newest first by `restore` (which empties it)."""

    def __init__(self):
        self._undo: list[tuple] = []

    def __len__(self):
        return len(self._undo)

    def set(self, obj, name: str, value) -> None:
        """`setattr(obj, name, value)`, remembering the attribute it shadows (an instance's, a class's own)."""
        self._undo.append(("attr", obj, name, vars(obj).get(name, MISSING)))
        setattr(obj, name, value)

    def method(self, obj, name: str, fn: Callable, data=None) -> Method:
        """Bind `fn(method, *args, **kwargs)` as `obj.name` (see `Method`); returns the Method."""
        bound = Method(fn, obj, name, vars(obj).get(name, MISSING), data)
        self.set(obj, name, bound)
        return bound

    def set_class(self, obj, cls: type) -> None:
        """`obj.__class__ = cls` (a subclass whose methods replace the class's: dynamo guards those by the class, where
        it guards a forward set on the instance by that object's identity)."""
        self._undo.append(("class", obj, type(obj)))
        obj.__class__ = cls

    def item(self, mapping: dict, key, value) -> None:
        self._undo.append(("item", mapping, key, mapping.get(key, MISSING)))
        mapping[key] = value

    def call(self, fn: Callable, *args) -> None:
        """Call `fn(*args)` on restore (what was done by a call, e.g. `model.set_attn_implementation`)."""
        self._undo.append(("call", fn, args))

    def hook(self, handle) -> None:
        """A `torch.utils.hooks.RemovableHandle` (or anything with `remove()`), removed on restore."""
        self._undo.append(("hook", handle))

    def child(self) -> Bindings:
        """A nested record: `restore` undoes it in its place, and it can be restored earlier on its own."""
        child = Bindings()
        self._undo.append(("child", child))
        return child

    def shared(self, kind: str, arg: str | None = None) -> SharedUse:
        """Hold the process-wide replacement `kind` (of `arg`) until restore."""
        use = SharedUse(kind, arg)
        self._undo.append(("shared", use))
        return use

    def restore(self) -> None:
        while self._undo:
            kind, *entry = self._undo.pop()
            if kind == "attr":
                obj, name, previous = entry
                if previous is MISSING:
                    if name in vars(obj):
                        delattr(obj, name)
                else:
                    setattr(obj, name, previous)
            elif kind == "class":
                obj, previous = entry
                obj.__class__ = previous
            elif kind == "item":
                mapping, key, previous = entry
                if previous is MISSING:
                    mapping.pop(key, None)
                else:
                    mapping[key] = previous
            elif kind == "call":
                entry[0](*entry[1])
            elif kind == "hook":
                entry[0].remove()
            elif kind == "child":
                entry[0].restore()
            else:
                entry[0].release()


# kind -> install(bindings, arg): the process-wide replacements; _held: (kind, arg) -> [their record, holders]
_KINDS: dict[str, Callable] = {}
_held: dict[tuple, list] = {}


def shared_kind(kind: str):
    """Register `install(bindings, arg)` as the process-wide replacement `kind` (a decorator)."""
    def register(install):
        _KINDS[kind] = install
        return install

    return register


def holders(kind: str, arg: str | None = None) -> int:
    """How many patched models (or other holders) hold the process-wide replacement `kind` of `arg` now."""
    entry = _held.get((kind, arg))
    return entry[1] if entry else 0


class SharedUse:
    """One holder of a process-wide replacement: the first installs it, the last one's `release` removes it."""

    def __init__(self, kind: str, arg: str | None = None, held: bool = True):
        self.key, self.held = (kind, arg), False
        if held:
            self._acquire()

    def _acquire(self) -> None:
        entry = _held.get(self.key)
        if entry is None:
            kind, arg = self.key
            if kind not in _KINDS:  # a copy unpickled in a process that has not imported the installer yet
                importlib.import_module("quest_hf.patch")
            record = Bindings()
            try:
                _KINDS[kind](record, arg)
            except BaseException:
                record.restore()
                raise
            entry = _held[self.key] = [record, 0]
        entry[1] += 1
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        entry = _held[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.key]
            entry[0].restore()

    def __deepcopy__(self, memo):
        return SharedUse(*self.key, held=self.held)

    def __reduce__(self):
        return SharedUse, (*self.key, self.held)
