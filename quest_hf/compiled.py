"""The uncaptured decode step, compiled whole (`QuestConfig(compile_step=True)`): one `torch.compile` of the model's
one-token forward, no CUDA graph.

An uncaptured step (CPU, `cuda_graph=False`) is bound by host time in HF: a layer runs ~25 small ops, each a Python
call and a kernel launch, and Quest adds its own. The captured path (quest_hf/graph.py) removes all of it on one GPU;
this path is for a model on one CPU or CUDA device whose steps are not captured: the model's whole one-token forward
(embedding, every decoder layer, norm, head) is one dynamo graph, so HF's code runs as a few fused kernels with no
Python between them. Quest's part of each layer — append the token, select pages, attend — enters the graph in one
of two ways:
- traced (`traceable(cache)`: policy quest, no selection hooks, no offload, no reuse): its device work is traced
  into the graph (the PyTorch twins on CPU, the Triton kernels on CUDA); growth, the dense page list and the uint8
  views happen before the graph runs, and the host lengths advance after it, as after a graph replay;
- otherwise as one opaque op a layer (`quest_hf::decode_attention`): the eager step's append and attention, hooks
  and all, run inside it at run time.

The compiled forward sees no cache (`use_cache=False`, no mask): the attention of layer `i` receives the new
token's key/value from HF's code and appends them to `cache.layers[i]` of the step in flight (`_ACTIVE`); the
padding comes from the cache's valid slots, as in every decode step. The batch and every model shape are
static; the capacity is one of two kinds (`QuestConfig.compile_capacity`, "auto": exact on CUDA, bucket elsewhere):
- exact: the cache allocates what the sequence needs, as HF's static cache does, and the traced graph sees its
  capacity as a symbolic size (`mark_capacity_symbolic`): the launchers' choices from it are range guards
  (`triton_kernels._common.next_pow2` compares, never specializes), so one graph serves every capacity until the
  page count crosses a power of two (a Top-K tile) or the budget;
- bucket: shapes are static and the capacity is rounded up to an eighth of an octave (`bucket`, at least 1024
  tokens; at most 12.5% more slots) so that prompts of similar lengths share a compile: the CPU's default, where
  inductor's C++ for a symbolic size runs slower (a tiny 3-layer Llama at 512 tokens: 3.9 vs 1.2 ms a step).
On CUDA the kernels run from inductor's C++ wrapper (`QuestConfig.compile_wrapper`): the step launches ~20 kernels
a layer, and from Python that host work, not the GPU, set its pace (16 layers of the 7B shape: 10.2 ms a step
against 3.1 ms of kernels; 3.8 ms from C++), its entry compiled apart at -O1 (`cpp_wrapper_options`). The step
stays host-bound: its pace follows the lent host's CPU (the same 16 layers ran 6.4 ms a step on a slower host,
where dynamo's guard check alone took 1.6 ms of it; whole 7B at 32K: 8.3 ms a step on one host, 16.0 on another).
Dynamo compiles at most `recompile_limit` (8) shapes of one function in a process, and every patched model's step is
the same function: past that, a fresh copy of it takes the new shapes (quest_hf/recompile.py; `copies` counts them,
and each is logged); past `MAX_COPIES` copies the steps run eagerly and `failed` says why.

What happened is visible: `cache.decode_path` ("compiled, uncaptured: <why no graph>", or "eager: <why>" with the
compile error when compiling failed), and `calls` / `traced_calls` / `failed` / `wrapper` on
`model._quest_state.compiled_step` (`cpp_failed`: why the C++ wrapper, the CUDA default, gave way to the Python one).
"""
from __future__ import annotations

import os
import weakref

import torch

from .recompile import Compiled, limit_hit

_ACTIVE: list = []  # the QuestCache of the compiled step in flight (a stack: nested models each push their own)


_depth = 0  # len(_ACTIVE), as a plain int: what dynamo reads (and guards on) while tracing
_traced = 0  # 1 while a step runs whose Quest part is traced into the graph (`traceable`), 0 under the op


def compiled_step_active() -> bool:
    """Whether the code running is (traced into) a CompiledStep's forward."""
    return _depth > 0


def compiled_step_traced() -> bool:
    """Whether the step in flight traces Quest's kernels into its graph (else it calls `decode_attention_op`)."""
    return _traced > 0


def traceable(cache) -> bool:
    """Whether a decode step over `cache` can trace Quest's part into the compiled graph: the layers' device work only
    (append at the device position, score, Top-K, attention; host lengths advanced outside, as after a graph
    replay), so no selection hooks (Python at run time), no offload (host reads), no selection reuse, and a selector
    that declares its decode step traceable (`Selector.traced`)."""
    if cache.selection_hooks:
        return False
    for layer in cache.layers:
        if layer.pager is not None or layer.config.reselect_every > 1 or not getattr(layer.selector, "traced", False):
            return False
    return True


def bucket(tokens: int) -> int:
    """The capacity a compile_step cache allocates for `tokens`: rounded up to a multiple of an eighth of the power of
    two at or below it, at least 1024 (e.g. 1024, 1152, ..., 2048, 2304, ...)."""
    n = max(int(tokens), 1024)
    step = (1 << (n.bit_length() - 1)) // 8
    return -(-n // step) * step


def capacity_tensors(layer):
    """(tensor, dim) of every buffer of `layer` that a traced step reads whose size `dim` follows the capacity (slots
    or pages)."""
    found = [(layer.keys, 2), (layer.values, 2), (layer.kmin, 2), (layer.kmax, 2), (layer.valid, 1),
             (layer.valid_u8, 1), (layer.rows, 1), (layer._dense_ids, 2),
             (layer.kmin8, 2), (layer.kmax8, 2), (layer.kscale, 2)]
    found += [(t, 2) for t in layer.side.values()]
    return [(t, dim) for t, dim in found if t is not None]


_MARKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> buffer already marked (alive only)


def mark_capacity_symbolic(cache) -> None:
    """Let the traced graph take the capacity of `cache`'s layers as a symbolic size (exact capacity: no recompile
    for another prompt length). `maybe_mark_dynamic`: where a choice does pin the size (a capacity below the
    budget: dense attention), dynamo specializes instead of raising. Each buffer is marked once (the mark stays on
    the tensor): a mark costs ~10-30 us of host time, ~11 buffers a layer, on every step otherwise."""
    for layer in cache.layers:
        for t, dim in capacity_tensors(layer):
            if _MARKED.get(id(t)) is not t:
                torch._dynamo.maybe_mark_dynamic(t, dim)
                _MARKED[id(t)] = t


def kernel_valid_view(layer) -> torch.Tensor:
    """The uint8 view of `layer.valid` that a traced step's Triton kernels read, the same tensor on every step while
    `valid` stays (so that its mark, and dynamo's guard on it, carry over)."""
    pair = layer.__dict__.get("_valid_u8_of")
    if pair is None or pair[0] is not layer.valid:
        pair = layer._valid_u8_of = (layer.valid, layer.valid.view(torch.uint8))
    return pair[1]


def cpp_wrapper_options() -> dict:
    """inductor's options for a C++-wrapper step: the wrapper's entry (the launch sequence) compiled in a translation
    unit of its own at -O1, apart from the kernels' loader code (`cpp_wrapper_build_separate`). Built whole, torch
    2.11 compiles it all at -O3: one g++ ran ~5 minutes of the 7B step's ~8.5-minute first step; apart at -O1 the
    first step took 258 s and the steps ran as fast (H200, same host, benchmarks/e2e/run16). An environment that
    sets TORCHINDUCTOR_CPP_WRAPPER_BUILD_SEPARATE or AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL keeps its choice."""
    options = {"cpp_wrapper": True}
    if "TORCHINDUCTOR_CPP_WRAPPER_BUILD_SEPARATE" not in os.environ:
        options["cpp_wrapper_build_separate"] = True
    if "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL" not in os.environ:
        options["aot_inductor.compile_wrapper_opt_level"] = "O1"  # -O0: a step 9% slower for 11% less compile
    return options


def active_cache():
    """The QuestCache of the compiled step in flight (what `quest_hf::decode_attention` appends to)."""
    return _ACTIVE[-1]


class CompiledStep:
    """The compiled one-token forward of one patched model (made on its first uncaptured decode step)."""

    def __init__(self, forward, backend: str, wrapper: str = "python"):
        self.backend = backend
        self.wrapper = wrapper if backend == "inductor" else None  # "cpp": inductor's C++ wrapper runs the kernels
        self.calls = 0  # compiled steps run (visible to users and tests)
        self.traced_calls = 0  # of which traced Quest's kernels into the graph (`traceable`); the rest ran the op
        self.failed: str | None = None  # the compile error, when compiling failed (the steps then run eagerly)
        self.cpp_failed: str | None = None  # the C++ wrapper's compile error, when this Python-wrapper step replaced it

        def step(input_ids, position_ids, **fixed):
            return forward(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                           return_dict=True, **fixed)

        self.options = cpp_wrapper_options() if self.wrapper == "cpp" else None  # inductor's, as compiled
        self._fn = Compiled(step, "the compiled decode step", backend=backend, dynamic=False, options=self.options)

    @property
    def copies(self) -> int:
        """Fresh copies of the step compiled at dynamo's recompile limit (quest_hf/recompile.py)."""
        return self._fn.copies

    def step(self, cache, cache_arg: str, input_ids, position_ids, attention_mask, fixed: dict):
        """Run one decode token over `cache`; returns the model output with the cache under `cache_arg`, or None when
        compiling failed (the caller runs the step eagerly; `failed` and the cache's decode_path say why)."""
        if position_ids is None:
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        cache.begin_step(attention_mask, 1)
        lengths = [layer.seq_len for layer in cache.layers]
        traced = traceable(cache)
        if traced:  # what the traced part must not do inside the graph: grow, build the dense page list
            for layer in cache.layers:
                layer.reserve(layer.seq_len + 1)
                layer.dense_pages()
            cache._step.for_graph()  # the padding column as the append kernel reads it, in a tensor of its own
            for layer in cache.layers:  # likewise the valid slots, where the Triton kernels run
                layer.valid_u8 = kernel_valid_view(layer) if layer.ops.name == "triton" else None
            if cache.quest_config.capacity_mode(cache.layers[0].device.type) == "exact":
                mark_capacity_symbolic(cache)
        global _depth, _traced
        _ACTIVE.append(cache)
        _depth += 1
        _traced, was_traced = int(traced), _traced
        try:
            out = self._fn(input_ids, position_ids, **fixed)
        except Exception as e:  # noqa: BLE001 - any compile error: the caller says what runs instead
            if (self.calls and not limit_hit(e)) or lengths != [layer.seq_len for layer in cache.layers]:
                raise  # it ran before, or this step appended already: the error is the step's, not the compiler's
            msg = f"{type(e).__name__}: {e}"
            self.failed = msg if len(msg) < 3000 else f"{msg[:1500]} [...] {msg[-1500:]}"  # the tail names the line
            return None
        finally:
            _ACTIVE.pop()
            _depth -= 1
            _traced = was_traced
            if traced:
                for layer in cache.layers:
                    layer.valid_u8 = None
        if traced:
            cache.replayed(1)  # the graph appended on the device: advance the host lengths
            self.traced_calls += 1
        self.calls += 1
        out[cache_arg] = cache
        return out
