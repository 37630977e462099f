"""quest_hf.eval.ppl: token-by-token perplexity after a dense prefix, against one unpatched forward."""
import math

import pytest
import torch

from quest_hf import QuestConfig, patched
from quest_hf.eval import ppl as ppl_mod
from quest_hf.eval.ppl import fork_cache, perplexity_sweep, prefill_cache, stdlib_text, step_tokens

from .conftest import tiny_model


def reference_nlls(model, ids, prefix_len):
    """NLL of each of ids[0, prefix_len + 1:] from one dense forward of the unpatched model."""
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    targets = ids[0, prefix_len + 1:]
    return -torch.log_softmax(logits[prefix_len:-1], -1).gather(-1, targets[:, None])[:, 0]


def row(result, name):
    return next(r for r in result["rows"] if r["name"] == name)


@pytest.mark.parametrize("family,heads,kv", [("llama", 4, 2), ("qwen2", 6, 2), ("mistral", 4, 4)],
                         ids=["llama-gqa2", "qwen2-gqa3", "mistral-mha"])
def test_tiny_covering_budget_equals_dense_and_a_small_one_does_not(family, heads, kv, single_thread):
    model = tiny_model(family, heads=heads, kv_heads=kv, layers=3)
    ids = torch.randint(2, 97, (1, 181), generator=torch.Generator().manual_seed(5))
    r = perplexity_sweep(model, ids, 140, budgets=(16, 256), page_size=4, dense_layers=1)
    ref_nlls = reference_nlls(model, ids, 140)
    ref = ref_nlls.mean().item()
    assert r["decoded"] == 40 and len(row(r, "quest 256")["nlls"]) == 40
    for name in ("dense", "quest 256"):
        assert row(r, name)["nll"] == pytest.approx(ref, rel=1e-4), name
        assert row(r, name)["ppl"] == pytest.approx(math.exp(ref), rel=1e-4)
        torch.testing.assert_close(torch.tensor(row(r, name)["nlls"]), ref_nlls, rtol=1e-4, atol=1e-4)
    # 16 of ~160 tokens: the sparse path ran and changed the predictions
    assert (torch.tensor(row(r, "quest 16")["nlls"]) - ref_nlls).abs().max() > 1e-2
    assert not hasattr(model, "_quest_state")  # the sweep unpatches what it patched


def test_fork_cache_is_independent_and_keeps_the_page_size(single_thread):
    model = tiny_model("llama")
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = QuestConfig(budget=16, page_size=4, dense_layers=0)
    with patched(model, config=cfg):
        cache, _ = prefill_cache(model, ids[:, :30])
        fork = fork_cache(cache, QuestConfig(budget=8, page_size=4, policy="streaming"))
        step_tokens(model, fork, ids[:, 30:])
        assert cache.get_seq_length() == 30 and fork.get_seq_length() == 40
        assert all(layer.config.policy == "streaming" for layer in fork.layers)
        assert all(layer.config.policy == "quest" for layer in cache.layers)
        with pytest.raises(ValueError, match="page_size"):
            fork_cache(cache, QuestConfig(budget=64, page_size=8))


def test_stdlib_text_is_deterministic_long_and_says_its_source():
    a, src = stdlib_text()
    b, _ = stdlib_text()
    assert a == b and len(a) > 100_000
    assert src.startswith("Python 3.") and "argparse" in src


def test_hub_text_failure_says_what_to_do(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("the Hub is unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="--text-file") as e:
        ppl_mod.load_hub_text("pg19")
    assert "emozilla/pg19-test" in str(e.value)


def test_smollm2_covering_budget_equals_the_unpatched_model(smollm2):
    model, tok = smollm2
    text, _ = stdlib_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :241]
    r = perplexity_sweep(model, ids, 224, budgets=(64, 512))
    ref = reference_nlls(model, ids, 224).mean().item()
    assert row(r, "quest 512")["nll"] == pytest.approx(ref, rel=1e-4)
    assert row(r, "dense")["nll"] == pytest.approx(ref, rel=1e-4)
    sparse = row(r, "quest 64")
    assert math.isfinite(sparse["ppl"]) and abs(sparse["nll"] - ref) > 1e-4 * ref
