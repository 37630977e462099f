"""Batch-1 decode projections through one Triton GEMV (`QuestConfig(decode_gemv=...)`, triton_kernels/gemv.py).

A batch-1 decode step of a 7B model is mostly its weights read once by cuBLAS's GEMV kernels, which read them below
the copy bandwidth (a split-K product plus a reduce kernel for the square and down projections). Here each decoder
layer's attention projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and MLP projections (`gate_proj`, `up_proj`,
`down_proj`), where they are plain `nn.Linear`s, become `GemvLinear`s, whose forward sends an input holding one row
(`x.numel() == in_features`: a one-sequence decode token) on a CUDA device to `quest_hf::gemv` (a custom op over
`triton_kernels.gemv`, so `torch.compile` traces it as one opaque call) and everything else (prefill, batches,
beams, CPU, a gradient) to the module's own forward. Fused groups (`fuse_projections`) send their one matmul through
the same op, whose settings do not depend on N: fused and unfused give bitwise the same outputs.

The kernel sums in another order than cuBLAS: outputs differ by rounding (one fp16 ulp at most on the 7B/8B shapes
measured), so a model's greedy tokens can part from the cuBLAS run's where two logits nearly tie.
`model._quest_state.gemv` lists the projections bound and why others were not; `calls` counts the eager one-row
calls served (a captured decode replays its kernels without calling Python; a compiled region counts none).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from transformers.utils import logging

from triton_kernels.gemv import gemv, gemv_takes

__all__ = ["DecodeGemv", "GemvLinear", "bind_decode_gemv", "gemv_op", "gemv_takes", "linear"]

from . import families
from .binding import Bindings

logger = logging.get_logger("quest_hf")

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class DecodeGemv:
    """What `bind_decode_gemv` bound on one model: `bound` projections ("layer 3 q_proj"), `skipped` ones with the
    reason, and `calls`: eager one-row calls served so far (a fused group's one call for its projections)."""

    bound: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    calls: int = 0


@torch.library.custom_op("quest_hf::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row `x [..., K]` by `triton_kernels.gemv`."""
    return gemv(x, weight, bias)


@gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x, weight, bias=None, gemv=None):
    """`F.linear`, through `quest_hf::gemv` where `gemv` says the GEMV is bound on this model and the GEMV takes the
    call (`gemv_takes`: one row). `gemv`: the model's `DecodeGemv` record (which counts the call outside a compiled
    region), or True in a function that `compile_decode` compiles (a record there would be a dynamo guard on its
    identity: one more compiled graph for each model)."""
    if gemv is not None and gemv_takes(x, weight):
        if isinstance(gemv, DecodeGemv) and not torch.compiler.is_compiling():
            gemv.calls += 1
        return gemv_op(x, weight, bias)
    return F.linear(x, weight, bias)


class GemvLinear(torch.nn.Linear):
    """What `bind_decode_gemv` makes of a plain `nn.Linear` (its class swapped, undone by the bindings' restore): one
    row through the GEMV, the rest through `nn.Linear`'s forward.

    A class rather than a forward set on the instance: dynamo guards a module's class-level forward by the class,
    and one set on the instance by its identity (torch < 2.14), which made `compile_decode`'s one compiled MLP
    recompile for each layer until dynamo's recompile limit. The model's record is the module's `_quest_gemv`, read
    only outside a compiled region (inside, `True` stands for it: see `linear`)."""

    def forward(self, x):
        if gemv_takes(x, self.weight):
            return linear(x, self.weight, self.bias, True if torch.compiler.is_compiling() else self._quest_gemv)
        return F.linear(x, self.weight, self.bias)


def _reason(module) -> str | None:
    """Why `module` cannot take the GEMV (None when it can)."""
    if type(module) is not torch.nn.Linear:  # not a subclass: quantized / LoRA / sharded linears
        return f"{type(module).__name__} is not a plain nn.Linear"
    if "forward" in vars(module):
        return "its forward is replaced on the module"
    params = [p for p in (module.weight, module.bias) if p is not None]
    if not all(type(p) is torch.nn.Parameter for p in params):
        return "a weight is a tensor subclass"
    if any(p.device.type == "meta" for p in params) or hasattr(module, "_hf_hook"):
        return "weights offloaded or hooked by accelerate"
    if module.weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"weight dtype {module.weight.dtype}"
    return None


def bind_decode_gemv(model, bindings: Bindings) -> DecodeGemv:
    """Bind the GEMV forward on every decoder layer's plain-`nn.Linear` projections, recording each replacement in
    `bindings` (whose restore unbinds); returns what was bound."""
    record = DecodeGemv()
    _, layers = families._decoder_layers(model)
    for j, layer in enumerate(layers):
        _, attn = families._mixer(layer)
        for owner, names in ((attn, ATTN), (getattr(layer, "mlp", None), MLP)):
            for name in names:
                module = getattr(owner, name, None) if owner is not None else None
                if module is None:
                    continue
                why = _reason(module)
                if why:
                    record.skipped[f"layer {j} {name}"] = why
                else:
                    bindings.set(module, "_quest_gemv", record)
                    bindings.set_class(module, GemvLinear)
                    record.bound.append(f"layer {j} {name}")
    reasons = sorted(set(record.skipped.values()))
    logger.info(f"quest-hf: batch-1 decode GEMV on {len(record.bound)} projections of {len(layers)} layers"
                + (f"; not on {len(record.skipped)}: {'; '.join(reasons)}" if reasons else ""))
    return record
