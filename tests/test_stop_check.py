"""QuestConfig.defer_stop_check: generate() on CUDA stops one step late, with the same tokens and cache."""
import pytest
import torch
from transformers import DynamicCache
from transformers.generation.utils import DeferredStopCheck

import quest_hf.patch as patch_mod
from quest_hf import QuestCache, QuestConfig, patch_model

from .conftest import left_padded_batch, tiny_model

CUDA = torch.device("cuda")  # a device object only: is_supported reads its type, no GPU needed


def test_deferral_is_asked_only_by_quest_caches_that_want_it():
    assert patch_mod.DEFERRED_STOP_AVAILABLE
    patch_model(tiny_model("llama"))  # the first patched model installs the check (the last unpatch removes it)
    quest = QuestCache(QuestConfig(), num_layers=2)
    assert DeferredStopCheck.is_supported(CUDA, quest, cache_is_returned=True, is_assistant=False)
    assert quest.stop_check == "deferred"
    assert not DeferredStopCheck.is_supported(CUDA, quest, cache_is_returned=False, is_assistant=True)
    assert quest.stop_check == "per-token"
    assert not DeferredStopCheck.is_supported(torch.device("cpu"), quest, cache_is_returned=False, is_assistant=False)
    off = QuestCache(QuestConfig(defer_stop_check=False), num_layers=2)
    assert not DeferredStopCheck.is_supported(CUDA, off, cache_is_returned=False, is_assistant=False)
    assert off.stop_check == "per-token"
    # Any other cache gets transformers' own answer (CUDA: no deferral).
    assert not DeferredStopCheck.is_supported(CUDA, DynamicCache(), cache_is_returned=False, is_assistant=False)
    with pytest.raises(TypeError, match="defer_stop_check must be True or False"):
        QuestConfig(defer_stop_check="yes")


class _HostEvent:
    """Stands in for torch.Event on CPU (which has no events; CPU ops are synchronous anyway)."""

    def __init__(self, device=None, blocking=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("cuda_graph", [False, "auto"], ids=["eager", "auto"])
def test_deferred_stop_gives_the_same_tokens_and_cache(cuda_graph, monkeypatch, single_thread):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch(lengths=(90, 71))
    ids, mask = ids[:1], mask[:1]
    patch_model(model, budget=32, cuda_graph=cuda_graph)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    # An EOS that first appears mid-way, on a token whose page is not full: the deferred check runs one more
    # forward after it, which transformers must undo in the tokens and in the cache (crop of the extra token).
    stop = next(i for i in range(4, 12) if free[i] not in free[:i])
    eos = free[stop]

    def run():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        return out, out.past_key_values

    ref, ref_cache = run()
    assert ref_cache.stop_check == "per-token"  # CPU: transformers' per-token check
    assert ref.sequences.shape[1] == ids.shape[1] + stop + 1
    patch_model(model, budget=32, cuda_graph=cuda_graph, _defer_devices=("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", _HostEvent)
    got, cache = run()
    assert cache.stop_check == "deferred"
    assert torch.equal(got.sequences, ref.sequences)
    assert len(got.scores) == len(ref.scores)
    # The extra forward wrote one more token; after the undo both caches hold the same tokens and pages.
    n = ref_cache.get_seq_length()
    assert cache.get_seq_length() == n == ids.shape[1] + stop
    for a, b in zip(ref_cache.layers, cache.layers):
        assert torch.equal(a.keys[:, :, :n], b.keys[:, :, :n]) and torch.equal(a.valid[:, :n], b.valid[:, :n])
        assert not b.valid[:, n:].any()
        P = -(-n // a.page_size)
        assert torch.equal(a.kmin[:, :, :P], b.kmin[:, :, :P]) and torch.equal(a.kmax[:, :, :P], b.kmax[:, :, :P])
        assert int(b.pos) == n  # the device position follows the undo
