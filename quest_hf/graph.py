"""The captured decode step: one CUDA graph per patched model, applied where the step is called.

Decode is host-bound in HF: a 7B model spends more time launching kernels than reading bytes. A Quest decode step
has fixed shapes and no host state (quest_hf/cache.py), so the patched model's one-token forward is captured once
and replayed, as gpt-fast wraps `decode_one_token` in its `generate`: the cache and its layers know nothing of
graphs. The first decode step over a new cache (or batch shape, or allocation) runs eagerly (compiles the Triton
kernels, warms cuBLAS and torch.compile), the second is captured, later ones copy their token ids, positions and
padding column into the graph's inputs and replay. Selection hooks are recorded inside the graph (the query and
page ids of each sparse layer, as graph outputs) and called after each replay with that step's tensors.

A model whose decoder layers sit on several GPUs (`device_map`) is captured per segment (`SegmentGraph`): each
contiguous run of layers on one device is one graph on that device, and HF's own forward keeps running eagerly
around them (embedding, rotary, masks, the final norm and head, the hidden-state hop from GPU to GPU).
"""
from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


def selected(graph: DecodeGraph | None, layer_idx: int, q: torch.Tensor, ids: torch.Tensor, layer, hooks) -> None:
    """A sparse layer chose `ids`: call the hooks now, or record the tensors while `graph` captures a step."""
    # The spare page holds no token: drop it (always the last id chosen, so the last column is then free).
    ids = ids.masked_fill(ids == layer.keys.shape[2] // layer.page_size - 1, -1)[..., :-1]
    if graph is not None and graph._recording is not None:
        graph._recording.append((layer_idx, q.clone(), ids))
        return
    for hook in hooks:
        hook(layer_idx, q, ids)


class DecodeGraph:
    """Captures one decode forward of a patched model over one QuestCache and replays it."""

    def __init__(self):
        self.captures = 0  # visible to users and tests: graphs captured, steps replayed
        self.replays = 0
        self._forget()

    def _forget(self):
        self.graph = None
        self.warm = False
        self._cache = None
        self._key = None
        self._records: list = []
        self._recording: list | None = None
        self._out = None

    def release(self) -> None:
        """Drop the graph (and its memory pool); the next decode step captures anew."""
        self._forget()

    def step(self, forward, eager, cache, cache_arg: str, input_ids, position_ids, attention_mask, fixed=None):
        """One decode token: `eager()` runs it uncaptured; `forward(**kw)` is the model's forward to capture, with
        the constant arguments `fixed` (e.g. `logits_to_keep`), which are part of the graph's key."""
        fixed = fixed or {}
        for layer in cache.layers:
            layer.reserve(layer.seq_len + 1)  # a replay cannot grow: grow (and re-capture) before it
        key = (cache.storage, tuple(input_ids.shape), input_ids.device, bool(cache.selection_hooks),
               tuple(sorted(fixed.items())))
        if self._cache is None or self._cache() is not cache or self._key != key:
            self._forget()
            self._cache, self._key = weakref.ref(cache), key
        if not self.warm:
            self.warm = True
            return eager()
        if position_ids is None:
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        if self.graph is None:
            self._capture(forward, cache, cache_arg, input_ids, position_ids, attention_mask, fixed)
        else:
            self._ids.copy_(input_ids)
            self._positions.copy_(position_ids)
            self._set_valid(attention_mask)
            cache.replayed(1)
        self.graph.replay()
        self.replays += 1
        for layer_idx, q, ids in self._records:
            for hook in cache.selection_hooks:
                hook(layer_idx, q, ids)
        out_type, fields, cache_field = self._out
        fields = dict(fields, logits=fields["logits"].clone())  # the next replay overwrites it
        if cache_field is not None:
            fields[cache_field] = cache
        return out_type(**fields)

    def _set_valid(self, attention_mask):
        if attention_mask is None:
            self._valid.fill_(True)
        else:
            self._valid.copy_(attention_mask[:, -1:])

    def _capture(self, forward, cache, cache_arg, input_ids, position_ids, attention_mask, fixed):
        self._ids, self._positions = input_ids.clone(), position_ids.clone()
        self._valid = torch.ones(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        self._set_valid(attention_mask)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(input_ids.device)
        cache._step.pinned = self._valid  # the padding column is read from the graph's own input
        self._recording = []
        try:
            with torch.cuda.graph(graph):  # records only; Python advanced the host lengths once
                out = forward(input_ids=self._ids, position_ids=self._positions, attention_mask=None, use_cache=True,
                              return_dict=True, **fixed, **{cache_arg: cache})
        finally:
            cache._step.pinned = None
            self._records, self._recording = self._recording, None
        # Keep the output's tensors, never the cache it names: cache -> graph -> output -> cache would be a
        # reference cycle.
        self._out = (type(out), {k: v for k, v in out.items() if v is not cache},
                     next((k for k, v in out.items() if v is cache), None))
        self.graph = graph
        self.captures += 1


# ------------------------------------------------------------------------------------------- device segments


@dataclass
class Segment:
    """A contiguous run of decoder layers (indices, ascending) that execute on one device."""

    device: torch.device
    layers: list[int]

    def __str__(self):
        from .families import _ranges

        return f"{self.device} layer{'s' if len(self.layers) > 1 else ''} {_ranges(self.layers)}"


def describe_segments(segments: Sequence[Segment]) -> str:
    """"2 segments (cuda:0 layers 0-15, cuda:1 layers 16-31)": what `cache.decode_path` names."""
    return f"{len(segments)} segment{'s' if len(segments) > 1 else ''} ({', '.join(map(str, segments))})"


def layer_device(layer: torch.nn.Module, index: int) -> torch.device:
    """Where decoder layer `index` executes: accelerate's execution device when it is hooked (device_map), else the
    one device of its parameters and buffers (ValueError when they are on several)."""
    hook = getattr(layer, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:  # an AlignDevicesHook, or one inside a SequentialHook
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    devices = {t.device for t in itertools.chain(layer.parameters(), layer.buffers())}
    if len(devices) != 1:
        raise ValueError(f"decoder layer {index} has its parameters on {', '.join(sorted(map(str, devices)))}")
    return devices.pop()


def plan_segments(model, split_at: Sequence[int] = ()) -> list[Segment]:
    """The decoder layers of `model` as segments: contiguous runs on one device, in layer order; a segment also
    starts at each layer index in `split_at` (tests and benchmarks: several segments on one device).

    Raises ValueError for a layer whose parameters are on several devices, or a `split_at` outside 1..n-1."""
    from .families import _decoder_layers

    _, layers = _decoder_layers(model)
    bad = [k for k in split_at if not (isinstance(k, int) and 0 < k < len(layers))]
    if bad:
        raise ValueError(f"split_at takes layer indices in 1..{len(layers) - 1}, got {bad}")
    segments: list[Segment] = []
    for i, layer in enumerate(layers):
        dev = layer_device(layer, i)
        if segments and segments[-1].device == dev and i not in split_at:
            segments[-1].layers.append(i)
        else:
            segments.append(Segment(dev, [i]))
    return segments


class _Refused(Exception):
    """A decoder layer's call that a segment cannot replay: the reason becomes `cache.decode_path`'s."""


# Argument values a captured segment keeps as they were at capture (the cache is the key's own).
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, Cache)


class _Template:
    """How one decoder layer was called in the observed step, with every tensor replaced by a static slot."""

    def __init__(self, run: _Run, j: int, fn, args: tuple, kwargs: dict, out, slots: dict, sources: list,
                 check_device: bool):
        self.nargs, self.keys, self.hidden_kw = len(args), tuple(kwargs), not args
        self.copies: list[tuple[tuple, int]] = []  # (path, slot) of the tensors first seen in this layer's call
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []

        def spec(x, path):
            if isinstance(x, torch.Tensor):
                if check_device and x.device.type != run.segment.device.type:
                    raise _Refused(f"decoder layer {j} takes a {x.device} tensor ({_name(path)})")
                if id(x) not in slots:
                    slots[id(x)] = len(sources)
                    sources.append(x)
                    self.copies.append((path, slots[id(x)]))
                return ("t", slots[id(x)])
            if isinstance(x, _CONSTANTS):
                return ("c", x)
            if type(x) in (tuple, list):
                return ("seq", type(x), [spec(v, (*path, k)) for k, v in enumerate(x)])
            if type(x) is dict:
                return ("map", [(k, spec(v, (*path, k))) for k, v in x.items()])
            raise _Refused(f"decoder layer {j} takes a {type(x).__name__} ({_name(path)}), which a captured segment "
                           "cannot copy in")

        # The decode attention reads padding from the cache, never HF's mask (which grows every step): None.
        mask = ("c", None)
        self.args = [mask if k + 1 < len(names) and names[k + 1] == "attention_mask" else spec(a, ("a", k + 1))
                     for k, a in enumerate(args[1:])]
        self.kwargs = [(k, mask if k == "attention_mask" else spec(v, ("k", k)))
                       for k, v in kwargs.items() if k != "hidden_states"]
        if isinstance(out, torch.Tensor):
            self.out = None
        elif type(out) is tuple and out and isinstance(out[0], torch.Tensor) and all(o is None for o in out[1:]):
            self.out = len(out)
        else:
            raise _Refused(f"decoder layer {j} returns a {type(out).__name__}, not its hidden states")

    def hidden_out(self, out):
        return out if self.out is None else out[0]

    def passed(self, hidden):
        """What a layer inside a segment returns for the step (the segment's input, unchanged)."""
        return hidden if self.out is None else (hidden,) + (None,) * (self.out - 1)

    def call(self, fn, hidden, statics):
        args = [_build(s, statics) for s in self.args]
        kwargs = {k: _build(s, statics) for k, s in self.kwargs}
        return fn(hidden_states=hidden, **kwargs) if self.hidden_kw else fn(hidden, *args, **kwargs)


def _name(path) -> str:
    where, key, *sub = path
    return (f"argument {key}" if where == "a" else repr(key)) + "".join(f"[{k!r}]" for k in sub)


def _at(args, kwargs, path):
    where, key, *sub = path
    x = args[key] if where == "a" else kwargs[key]
    for k in sub:
        x = x[k]
    return x


def _build(spec, statics):
    kind = spec[0]
    if kind == "t":
        return statics[spec[1]]
    if kind == "c":
        return spec[1]
    if kind == "seq":
        return spec[1](_build(s, statics) for s in spec[2])
    return {k: _build(s, statics) for k, s in spec[1]}


class _Run:
    """One segment's captured step: its layers' templates, static inputs, padding column, graph and output."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.first, self.last = segment.layers[0], segment.layers[-1]
        self.stream = None
        self.forget()

    def forget(self):
        self.templates: dict[int, _Template] = {}
        self.statics: list[torch.Tensor] = []  # [0]: the segment's hidden-state input, then each distinct tensor
        self.valid = None
        self.graph = self.out = None
        self.records: list = []
        self.clear()

    def clear(self):
        """Drop what the step in flight handed in."""
        self.input, self.ok, self.calls = None, True, []


class SegmentGraph:
    """Captures one decode step per segment of a patched model's decoder layers and replays them in order.

    HF's forward runs eagerly; each decoder layer's `forward` is intercepted (quest_hf.patch). A decode step over a
    new cache (or batch shape, allocation, hooks) runs eagerly and observes how the decoder calls its layers; from
    then on, inside a segment, each layer copies the tensors of its call that the segment has not seen yet (hidden
    states, rotary cos/sin, positions) into the segment's static inputs on its device and hands its input hidden
    states on unchanged; the last layer of the segment replays the segment's graph (captured at the first such
    step, on that device and a stream of it, running the layers' own forwards in order) and returns its output.
    The host lengths of a segment's cache layers advance after each of its replays, and selection hooks recorded
    inside it are called with that replay's tensors. A call that does not match the observed one runs the segment's
    layers eagerly and the next step observes anew.

    `capture=False` runs the same interception with the segment's layers executed eagerly on the static inputs
    (no graph, any device): what the CPU tests check of the plumbing. `captures` / `replays` count segment graphs
    captured / replayed (one per segment a step); `steps` the decode steps run through the segments.
    """

    def __init__(self, segments: Sequence[Segment], capture: bool = True):
        self.segments = list(segments)
        self.capture = capture
        self.description = describe_segments(self.segments)
        self.captures = self.replays = self.steps = 0
        self.mode: str | None = None  # "observe" or "run" while a decode step through the segments is in flight
        self.refusal: str | None = None  # why the observed step cannot run per segment (then decoding runs eagerly)
        self._runs = [_Run(s) for s in self.segments]
        self._run_of = {j: run for run in self._runs for j in run.segment.layers}
        self._recording: list | None = None
        self._forget()

    def _forget(self):
        for run in self._runs:
            run.forget()
        self.observed = False
        self._stale = False
        self._cache = None
        self._key = None
        self._calls: list = []
        self._expect = 0

    def release(self) -> None:
        """Drop the graphs (and their memory pools) and static inputs; the next decode step observes anew."""
        self._forget()

    # -------------------------------------------------------------------------------------------- a step
    def step(self, forward, cache, input_ids):
        """One decode token: `forward()` runs the model's forward, whose decoder layers call `layer_call`."""
        for layer in cache.layers:
            layer.reserve(layer.seq_len + 1)  # a replay cannot grow: grow (and re-capture) before it
        key = (cache.storage, tuple(input_ids.shape), input_ids.device, bool(cache.selection_hooks))
        if self._stale or self._cache is None or self._cache() is not cache or self._key != key:
            self._forget()
            self._cache, self._key = weakref.ref(cache), key
        if not self.observed:
            self.mode, self._calls = "observe", []
            try:
                out = forward()
            finally:
                self.mode = None
                calls, self._calls = self._calls, []
            self.observed = True
            self.refusal = self._observe(calls)
            return out
        self.mode, self._expect = "run", 0
        try:
            out = forward()
        finally:
            self.mode = None
            for run in self._runs:
                run.clear()
        if self._expect != len(self._run_of):
            raise RuntimeError(f"quest-hf: the decoder called {self._expect} of its {len(self._run_of)} layers in a "
                               "decode step that runs per segment")
        self.steps += 1
        return out

    def _observe(self, calls) -> str | None:
        """Templates and static inputs from the layers' calls of an eager step; or why they cannot be replayed."""
        order = [j for j, *_ in calls]
        if order != sorted(self._run_of):
            return "the decoder did not call each of its layers once, in order"
        by_layer = {j: (fn, args, kwargs, out) for j, fn, args, kwargs, out in calls}
        try:
            for run in self._runs:
                slots, sources, prev = {}, [], None
                for j in run.segment.layers:
                    fn, args, kwargs, out = by_layer[j]
                    hidden = args[0] if args else kwargs.get("hidden_states")
                    if not isinstance(hidden, torch.Tensor):
                        raise _Refused(f"decoder layer {j} takes no hidden_states tensor")
                    if j == run.first:
                        slots[id(hidden)] = 0
                        sources.append(hidden)
                    elif hidden is not prev:
                        raise _Refused(f"decoder layer {j} is not called on layer {j - 1}'s output")
                    t = run.templates[j] = _Template(run, j, fn, args, kwargs, out, slots, sources, self.capture)
                    prev = t.hidden_out(out)
                dev = run.segment.device
                run.statics = [torch.empty_like(x, device=dev) for x in sources]
                run.valid = torch.ones(sources[0].shape[0], 1, dtype=torch.bool, device=dev)
        except _Refused as e:
            for run in self._runs:
                run.forget()
            return str(e)
        return None

    def layer_call(self, j: int, fn, args: tuple, kwargs: dict):
        """Decoder layer `j`'s forward (`fn`, its own) called with `args`/`kwargs` during a segmented step."""
        if self.mode == "observe":
            out = fn(*args, **kwargs)
            self._calls.append((j, fn, args, kwargs, out))
            return out
        if j != self._expect:
            raise RuntimeError(f"quest-hf: decoder layer {j} was called where layer {self._expect} was due, in a "
                               "decode step that runs per segment")
        self._expect = j + 1
        run = self._run_of[j]
        t = run.templates[j]
        hidden = args[0] if args else kwargs.get("hidden_states")
        run.calls.append((fn, args, kwargs))
        if j == run.first:
            run.input = hidden
            run.ok = _copy_in(run.statics[0], hidden)
        elif hidden is not run.input:
            run.ok = False  # not the chain the segment was captured on
        if run.ok:
            if len(args) != t.nargs or tuple(kwargs) != t.keys:
                run.ok = False
            else:
                for path, slot in t.copies:
                    if not _copy_in(run.statics[slot], _at(args, kwargs, path)):
                        run.ok = False
                        break
        if j != run.last:
            return t.passed(hidden)
        return self._finish(run)

    # ----------------------------------------------------------------------------------- the last layer
    def _finish(self, run: _Run):
        cache = self._cache()
        valid = cache._step.valid_new
        if run.ok and valid is not None and valid.shape != run.valid.shape:
            run.ok = False
        if not run.ok:  # the layers as HF called them, chained: right, and the next step observes anew
            self._stale = True
            return self._eager(run)
        if valid is None:
            run.valid.fill_(True)
        else:
            run.valid.copy_(valid)
        if not self.capture:
            with cache._step.holding(run.valid):
                return self._body(run)
        dev = run.segment.device
        captured = run.graph is None
        with torch.cuda.device(dev):
            if captured:
                self._capture(run, cache)
            run.graph.replay()
        self.replays += 1
        if not captured:
            cache.replayed(1, run.segment.layers)  # the capture's Python advanced them once
        for layer_idx, q, ids in run.records:
            for hook in cache.selection_hooks:
                hook(layer_idx, q, ids)
        return run.out

    def _body(self, run: _Run):
        """The segment's layers, in order, on its static inputs (what is captured)."""
        hidden, out = run.statics[0], None
        for (fn, _, _), j in zip(run.calls, run.segment.layers, strict=True):
            t = run.templates[j]
            out = t.call(fn, hidden, run.statics)
            hidden = t.hidden_out(out)
        return out

    def _eager(self, run: _Run):
        hidden, out = run.input, None
        for fn, args, kwargs in run.calls:
            if args:
                args = (hidden, *args[1:])
            else:
                kwargs = dict(kwargs, hidden_states=hidden)
            out = fn(*args, **kwargs)
            hidden = out if isinstance(out, torch.Tensor) else out[0]
        return out

    def _capture(self, run: _Run, cache) -> None:
        dev = run.segment.device
        if run.stream is None:
            run.stream = torch.cuda.Stream(dev)  # torch.cuda.graph's default stream belongs to one device
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(dev)
        self._recording = []
        try:
            with cache._step.holding(run.valid), torch.cuda.graph(graph, stream=run.stream):
                out = self._body(run)  # records only; Python advanced the segment's host lengths once
        finally:
            run.records, self._recording = self._recording, None
        run.graph, run.out = graph, out
        self.captures += 1


def _copy_in(static: torch.Tensor, x) -> bool:
    """Copy `x` into the static input `static` (False, copying nothing, when it is not a tensor of its shape)."""
    if not isinstance(x, torch.Tensor) or x.shape != static.shape or x.dtype != static.dtype:
        return False
    static.copy_(x, non_blocking=True)
    return True
