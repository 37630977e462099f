"""GPU-marked: the captured decode's compiled norms / MLPs / rotary (inductor) past dynamo's recompile limit.

Every patched model shares one compiled function per norm / MLP class and the rotary; each batch size is a new shape.
With the limit lowered to 2, batches 1-3 take fresh copies (quest_hf/recompile.py) and stay compiled: no failure, the
modules' compiled calls counted, and the batch-3 logits bitwise those of a run under dynamo's default limit.

Skipped without CUDA; run on the device: `python -m pytest -q -m gpu tests/gpu/test_gpu_recompile.py`.
"""
import pytest
import torch

from quest_hf import QuestCache, fuse, patch_model, release_cache, unpatch_model
from quest_hf.bench import random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _run(model, batch: int):
    ids = torch.randint(2, 1000, (batch, 200), device=DEV, generator=torch.Generator(DEV).manual_seed(batch))
    cache = QuestCache.from_model(model, max_length=ids.shape[1] + 12)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert cache.decode_path == "captured"
    release_cache(model)
    return torch.stack(out.logits)


def test_captured_decode_stays_compiled_past_the_recompile_limit(monkeypatch):
    monkeypatch.setattr(fuse, "_compiled", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = random_llama("tiny", torch.float16, torch.device(DEV), 4096)
    patch_model(model, budget=64, page_size=16)
    compiled = model._quest_state.compiled
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch in (1, 2, 3):
            before = [m._quest_compiled_calls for m in compiled.modules]
            low = _run(model, batch)
            assert not compiled.failed, compiled.failed
            assert all(m._quest_compiled_calls > b for m, b in zip(compiled.modules, before))
    copies = {key[0].__qualname__: fn.copies for key, fn in fuse._compiled.items()}
    assert any(n >= 1 for n in copies.values()), copies
    assert all(fn.graph_break is None for fn in fuse._compiled.values())
    torch._dynamo.reset()
    monkeypatch.setattr(fuse, "_compiled", {})
    default = _run(model, 3)
    assert not compiled.failed
    assert torch.equal(low, default)
    unpatch_model(model)
