"""Fused q/k/v and gate/up projections (`QuestConfig(fuse_projections=True)`): one matmul where HF runs three or two.

At batch 1 a 7B decode step is mostly weight GEMVs (~69% of 5.96 ms on an H200), 7 a layer, each with its own
split-K reduce kernel. Here each decoder layer's `q_proj`/`k_proj`/`v_proj` (and its MLP's `gate_proj`/`up_proj`)
get one weight concatenated along the output dimension, and their own Parameters become views into it (same
Parameter objects, no memory duplicated):

- attention: the first of the three projections called on a tensor `x` computes all three outputs with one
  `F.linear` and keeps the other two for the calls on that same object `x` (identity and version checked); a
  call on any other input runs that projection's own weight, so a caller that projects something else is served
  exactly. The attention itself is never compiled, so this is plain eager Python (run once at capture under a
  CUDA graph; nothing kept crosses a step).
- MLP: only where the class's forward is LlamaMLP's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (read from its
  source); the module's forward becomes `gate_up_forward`, plain tensor ops that `compile_decode`'s torch.compile
  traces (quest_hf/fuse.py compiles it in place of the class's forward).

Each group checks, per call, that its projections still hold their views (a `model.to()`, `.half()`, a deepcopy
or a replaced weight breaks them) and that no gradient is asked for; otherwise the projections run unfused.
Every replacement is recorded in the patch's `Bindings`: restoring it gives each projection a separate contiguous
copy of its weight and its own forward back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from transformers.utils import logging

from . import families
from .binding import Bindings, Method
from .decode_gemv import GemvLinear, gemv_takes, linear

logger = logging.get_logger("quest_hf")

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# LlamaMLP's forward, whitespace and annotations aside: `[name =] self.down_proj(...)` then `return name`, or a return.
_LLAMA_MLP = re.compile(r"defforward\(self,(\w+)(?::[\w.]+)?\)(?:->[\w.]+)?:(?:(\w+)=|return)"
                        r"self\.down_proj\(self\.act_fn\(self\.gate_proj\(\1\)\)\*self\.up_proj\(\1\)\)"
                        r"(?:return\2)?")
_PROJ_CALL = re.compile(r"self\.([qkv])_proj\(\s*(\w+)\s*\)")


@dataclass
class Fusion:
    """What `fuse_projections` fused on one model (`model._quest_state.fused`): decoder layer indices per group,
    and why a group of a layer was left unfused ("layer 3 q/k/v" -> the reason)."""

    qkv: list = field(default_factory=list)
    gate_up: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)  # the FusedLinears, in layer order

    def check(self) -> None:
        """Before a compiled step (quest_hf/compiled.py): note whether each group is intact, which dynamo cannot
        ask in the trace (data pointers); the trace reads the notes and recompiles when one changes."""
        for group in self.groups:
            group.checked = group.intact()


class FusedLinears:
    """Linears of one input whose weights (and biases) are views into one concatenated weight (and bias).

    `function`: for a group whose owner's forward is replaced (the MLP's), the module-level function it runs,
    `function(owner, x, *operands())`; the group's modules are then skipped (and a hook on one unfuses the call)."""

    def __init__(self, modules: list, name: str, function=None, gemv=None):
        self.modules, self.name, self.function, self.gemv = modules, name, function, gemv
        self.sizes = tuple(m.out_features for m in modules)
        self.bypass = function is not None
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in modules])
            self.bias = torch.cat([m.bias for m in modules]) if modules[0].bias is not None else None
        self.last = None  # (x, its version, the outputs not yet handed out): kept between the group's calls on x
        self.checked = False  # `intact()` as `Fusion.check` found it before a compiled step: what a trace reads
        self.views = []  # per projection: the data pointers of its weight's and bias's views (None: no bias)
        start = 0
        for m, n in zip(modules, self.sizes):
            m.weight.data = self.weight[start:start + n]
            if self.bias is not None:
                m.bias.data = self.bias[start:start + n]
            self.views.append((m.weight.data_ptr(), m.bias.data_ptr() if self.bias is not None else None))
            start += n

    def intact(self) -> bool:
        """Whether the fused weight still is every projection's (each weight still its view; no gradient asked
        for; for the MLP also no hook on a projection that the fused call skips). In a compiled step: `checked`."""
        if torch.compiler.is_compiling():
            return self.checked
        if self.weight is None:
            return False
        grad = torch.is_grad_enabled()
        for m, ptrs in zip(self.modules, self.views):
            for own, ptr in zip((m.weight, m.bias), ptrs):
                if ptr is not None and (own is None or own.data_ptr() != ptr or (grad and own.requires_grad)):
                    return False
            if self.bypass and (m._forward_hooks or m._forward_pre_hooks):
                return False
        return True

    def take(self, i: int, x):
        """Projection `i` of `x`: kept from the group's matmul on this very `x`, else that matmul now (keeping the
        others for their calls); None when the group is no longer intact (the caller runs its own weight)."""
        last = self.last
        # dynamo traces neither is_inference() nor _version; in a traced step x is not changed between the calls
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        if last is not None and last[0] is x and last[1] == version and last[2][i] is not None:
            out = last[2][i]
            last[2][i] = None
            if all(o is None for o in last[2]):
                self.last = None
            return out
        if not self.intact() or (self.gemv is not None and not gemv_takes(x, self.weight)):
            return None  # under the GEMV, what it does not take runs each projection's own matmul (bitwise unfused)
        outs = list(linear(x, self.weight, self.bias, self.gemv).split(self.sizes, dim=-1))
        out, outs[i] = outs[i], None
        self.last = (x, version, outs)
        return out

    def operands(self, traced: bool = False) -> tuple:
        """`function`'s arguments after `(owner, x)`; `traced`: for a call that `compile_decode` compiles, where the
        GEMV's record becomes True (`linear`)."""
        gemv = self.gemv if not traced or self.gemv is None else True
        return self.weight, self.bias, self.sizes, gemv

    def unfuse(self) -> None:
        """Give every projection still on its view a separate contiguous copy; drop the fused weight."""
        if self.weight is None:
            return
        fused = {t.untyped_storage().data_ptr() for t in (self.weight, self.bias) if t is not None}
        for m in self.modules:
            for p in (m.weight, m.bias):
                if p is not None and p.untyped_storage().data_ptr() in fused:
                    p.data = p.data.clone(memory_format=torch.contiguous_format)
        self.weight = self.bias = self.last = None


def _projection_forward(method: Method, x, *args, **kwargs):
    """`q_proj`/`k_proj`/`v_proj`'s forward (bound by `fuse_projections`): served by the group's one matmul."""
    group, i = method.data
    out = group.take(i, x) if not (args or kwargs) else None
    return out if out is not None else method.original(x, *args, **kwargs)


def gate_up_forward(mlp, x, weight, bias, sizes, gemv=None):
    """LlamaMLP's `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, gate and up from one matmul over [W_gate; W_up].

    The product is taken in place in `act_fn(gate)`'s output: the [gate | up] output lives until the product is
    done (both halves are views of it), so a fresh product would hold one more up-sized tensor than HF's unfused
    forward at its peak (a 128K-token Llama-3-8B prefill: 3.5 GiB, benchmarks/e2e/run18). Where autograd records
    the activation (an input that requires grad) the product is a fresh tensor, as autograd may need it; where
    act_fn returns its input, that input is a view of this call's own buffer, so nothing else sees the change.
    `gemv` (where the batch-1 decode GEMV is bound, `decode_gemv`: its record, or True in a compiled call; see
    `linear`): one row goes through it over the fused weight; other
    inputs (prefill, batches) take gate and up by separate matmuls over the weight's halves, as the unfused MLP."""
    if gemv is not None and not gemv_takes(x, weight):
        parts = zip(weight.split(sizes), (None, None) if bias is None else bias.split(sizes))
        gate, up = (F.linear(x, w, b) for w, b in parts)
    else:
        gate, up = linear(x, weight, bias, gemv).split(sizes, dim=-1)
    act = mlp.act_fn(gate)
    return mlp.down_proj(act * up if act.requires_grad else act.mul_(up))


def _mlp_forward(method: Method, x, *args, **kwargs):
    """An MLP's forward (bound by `fuse_projections`): `gate_up_forward` while its fused weight is intact."""
    group = method.data
    if args or kwargs or not group.intact():
        return method.original(x, *args, **kwargs)
    return gate_up_forward(method.__self__, x, *group.operands())


def _linears(owner, names) -> tuple[list, str | None]:
    """The `names` children of `owner` as a list, or why they cannot share one weight."""
    mods = [getattr(owner, n, None) for n in names]
    if not all(type(m) in (torch.nn.Linear, GemvLinear) for m in mods):  # not quantized / LoRA / sharded linears
        return [], f"{'/'.join(names)} are not all plain nn.Linear"
    params = [p for m in mods for p in (m.weight, m.bias) if p is not None]
    if not all(type(p) is torch.nn.Parameter for p in params):
        return [], "a weight is a tensor subclass"
    if len({(m.in_features, m.weight.dtype, m.weight.device) for m in mods}) != 1:
        return [], "the projections differ in input size, dtype or device"
    if len({m.bias is None for m in mods}) != 1:
        return [], "some projections have a bias and some do not"
    if any(p.device.type == "meta" for p in params) or any(hasattr(m, "_hf_hook") for m in mods):
        return [], "weights offloaded or hooked by accelerate"
    return mods, None


def _qkv_reason(attn) -> str | None:
    """Why `attn`'s forward does not project one input through q/k/v (None when it does)."""
    calls = _PROJ_CALL.findall(families._code(families._source(type(attn).forward)))
    args = {a for _, a in calls}
    if {p for p, _ in calls} != {"q", "k", "v"} or len(args) != 1:
        return "its forward does not call q_proj, k_proj and v_proj on one input"
    return None


def fuse_projections(model, bindings: Bindings, gemv=None) -> Fusion:
    """Fuse each decoder layer's q/k/v and LlamaMLP-style gate/up projections, recording every replacement in
    `bindings` (whose restore unfuses); returns what was fused. `gemv`: the batch-1 GEMV's `DecodeGemv` record where
    it is bound (`decode_gemv`; the projections' own forwards are then its, bound before): a group's one-row matmul
    goes through it, every other input through the projections' own."""
    fusion = Fusion()
    _, layers = families._decoder_layers(model)
    for j, layer in enumerate(layers):
        _, attn = families._mixer(layer)
        mods, why = _linears(attn, QKV) if attn is not None else ([], "no attention module")
        why = why or _qkv_reason(attn)
        if why:
            fusion.skipped[f"layer {j} q/k/v"] = why
        else:
            group = FusedLinears(mods, "q/k/v", gemv=gemv)
            fusion.groups.append(group)
            bindings.call(group.unfuse)
            for i, m in enumerate(mods):
                bindings.method(m, "forward", _projection_forward, data=(group, i))
            fusion.qkv.append(j)
        mlp = getattr(layer, "mlp", None)
        mods, why = _linears(mlp, GATE_UP) if mlp is not None else ([], "no `mlp` module")
        if not why and not _LLAMA_MLP.search(re.sub(r"\s", "", families._code(families._source(type(mlp).forward)))):
            why = f"{type(mlp).__name__}.forward is not LlamaMLP's down_proj(act_fn(gate_proj(x)) * up_proj(x))"
        if why:
            fusion.skipped[f"layer {j} gate/up"] = why
        else:
            group = FusedLinears(mods, "gate/up", gate_up_forward, gemv=gemv)
            fusion.groups.append(group)
            bindings.call(group.unfuse)
            bindings.set(mlp, "_quest_fused", group)  # quest_hf/fuse.py compiles gate_up_forward over it
            bindings.method(mlp, "forward", _mlp_forward, data=group)
            fusion.gate_up.append(j)
    n = len(layers)
    reasons = sorted(set(fusion.skipped.values()))
    logger.info(f"quest-hf: fused q/k/v projections of {len(fusion.qkv)}/{n} layers and gate/up of "
                f"{len(fusion.gate_up)}/{n}" + (f"; unfused: {'; '.join(reasons)}" if reasons else ""))
    return fusion
