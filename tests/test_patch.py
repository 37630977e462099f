"""Patched vs unpatched models through generate(): every family, padding, beams, sampling, streaming, unpatch."""
import pytest
import torch
from transformers import DynamicCache, TextStreamer

from quest_hf import QuestCache, QuestLayer, patch_model, patched
from quest_hf.patch import cache_arg_name

from .conftest import left_padded_batch, tiny_model

FAMILIES = [
    pytest.param("llama", dict(heads=4, kv_heads=4), id="llama-mha"),
    pytest.param("llama", dict(heads=8, kv_heads=2), id="llama-gqa4"),
    pytest.param("llama", dict(heads=6, kv_heads=2), id="llama-gqa3"),
    pytest.param("mistral", dict(sliding_window=24), id="mistral-window24"),
    pytest.param("mistral", dict(sliding_window=None), id="mistral-nowindow"),
    pytest.param("qwen2", dict(), id="qwen2"),
    pytest.param("qwen3", dict(), id="qwen3"),
]


def _gen(model, ids, mask, **kw):
    kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True) | kw
    return model.generate(ids, attention_mask=mask, **kw)


def _assert_same(ref, out, atol=2e-4):
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b))
        torch.testing.assert_close(a[fin], b[fin], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("family, extra", FAMILIES)
def test_budget_covering_context_equals_dense(family, extra):
    model = tiny_model(family, **extra)
    ids, mask = left_padded_batch()
    ref = _gen(model, ids, mask)
    ref_beam = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    patch_model(model, budget=256, page_size=16)
    out = _gen(model, ids, mask)
    _assert_same(ref, out)
    cache = out.past_key_values
    assert isinstance(cache, QuestCache) and cache.backends == {"torch"}
    assert cache.get_seq_length() == ids.shape[1] + 11
    beam = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(ref_beam, beam)


@pytest.mark.parametrize("family, extra", [FAMILIES[1], FAMILIES[3]])
def test_cpu_dense_layers_attend_the_prefix_in_place(family, extra, monkeypatch):
    """On CPU a dense decode layer attends its filled prefix (or window) in place instead of gathering every page of
    the allocation; the tokens and logits stay the unpatched ones (left padding, a window the prompt outgrows)."""
    import quest_hf.attention as attention

    model = tiny_model(family, **extra)
    ids, mask = left_padded_batch()
    ref = _gen(model, ids, mask)
    calls = []
    prefix = attention.tk.prefix_decode_attention_ref
    monkeypatch.setattr(attention.tk, "prefix_decode_attention_ref",
                        lambda *a, **k: calls.append(a[6]) or prefix(*a, **k))
    patch_model(model, budget=256, page_size=16)
    _assert_same(ref, _gen(model, ids, mask))
    assert len(calls) == 11 * model.config.num_hidden_layers  # every decode step of every (dense) layer
    if extra.get("sliding_window"):
        assert max(calls) > 0  # the window's start, past the prompt's first token


@pytest.mark.parametrize("family, extra", FAMILIES)
def test_sparse_decode_runs_selection_only_in_sparse_layers(family, extra):
    model = tiny_model(family, **extra)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    cache = QuestCache.from_model(model)
    seen = []
    cache.selection_hooks.append(lambda layer, q, page_ids: seen.append((layer, page_ids.clone())))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         **{cache_arg_name(model): cache})
    assert out.shape == (2, ids.shape[1] + 6)
    window = extra.get("sliding_window")
    if window is not None and window <= 32:  # the window fits in the budget: dense, nothing to select
        assert seen == []
        return
    assert {layer for layer, _ in seen} == {1, 2, 3}  # layer 0 is dense
    S, L = 16, ids.shape[1]
    for _, page_ids in seen:
        K = 2 * (model.config.num_attention_heads // model.config.num_key_value_heads)  # union of 2 pages a head
        assert page_ids.dtype == torch.int32
        real = page_ids >= 0
        assert ((real.sum(-1) >= 2) & (real.sum(-1) <= K)).all()  # the current page and at least one more
        assert (page_ids[real] < -(-(L + 6) // S)).all()  # only written pages; never the spare page
        n = real.sum(-1, keepdim=True)
        assert torch.equal(real, torch.arange(real.shape[-1]) < n)  # the real ids first, then -1
        assert ((page_ids[..., 1:] > page_ids[..., :-1]) | ~real[..., 1:]).all()  # ascending


def test_sampling_streamer_repeat_and_continue(capsys):
    model = tiny_model("llama", heads=8, kv_heads=2)
    ids, mask = left_padded_batch()
    torch.manual_seed(3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=20)
    patch_model(model, budget=256)
    torch.manual_seed(3)
    assert torch.equal(ref, model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=20))

    patch_model(model, budget=32)  # re-configure: selection now matters
    one = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(one, model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    # Continue from a returned cache: same tokens as one longer call.
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    mask2 = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    cont = model.generate(first.sequences, attention_mask=mask2, max_new_tokens=6, do_sample=False,
                          **{cache_arg_name(model): cache})
    assert torch.equal(one, cont)

    class Tok:  # the smallest tokenizer TextStreamer needs
        def decode(self, tokens, **kw):
            return " ".join(str(int(t)) for t in tokens)

    model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=5, do_sample=False, streamer=TextStreamer(Tok()))
    printed = capsys.readouterr().out.split()
    assert len(printed) == ids.shape[1] + 5


def test_unpatch_restores_everything():
    model = tiny_model("qwen2")
    ids, mask = left_padded_batch()
    original_generate = model.generate
    ref = _gen(model, ids, mask)
    decoder = model.base_model
    with patched(model, budget=32):
        assert model.config._attn_implementation == "quest"
        sparse = _gen(model, ids, mask)
    assert model.config._attn_implementation == "sdpa"
    assert model.generate == original_generate and "generate" not in model.__dict__
    assert not decoder._forward_pre_hooks and not decoder._forward_hooks
    assert not any(hasattr(m, "_quest_state") for m in model.modules())
    _assert_same(ref, _gen(model, ids, mask), atol=0)
    assert not torch.equal(ref.sequences, sparse.sequences) or any(
        not torch.equal(a, b) for a, b in zip(ref.scores, sparse.scores))  # the patch did change decoding


def test_context_manager_restores_on_error():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with patched(model, budget=64):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__


def test_plain_forward_loop_gets_a_quest_cache():
    model = tiny_model("llama", heads=8, kv_heads=2)
    patch_model(model, budget=32)
    ids, mask = left_padded_batch()
    out = model(input_ids=ids, attention_mask=mask)
    assert isinstance(out.logits, torch.Tensor)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, QuestCache)
    assert cache.get_seq_length() == ids.shape[1]
    # Padding never enters the metadata: row 1's leading pad tokens fill no page.
    layer = cache.layers[2]
    assert not layer.valid[1, : ids.shape[1] - 38].any() and layer.valid[1, ids.shape[1] - 38:ids.shape[1]].all()


@pytest.mark.parametrize("make_cache", [lambda m: DynamicCache(config=m.config), lambda m: "not a cache"],
                         ids=["dynamic-cache", "string"])
def test_wrong_cache_kind_is_refused(make_cache):
    model = tiny_model("llama")
    patch_model(model, budget=64)
    ids, mask = left_padded_batch()
    with pytest.raises(TypeError, match="needs a QuestCache"):
        model(input_ids=ids, attention_mask=mask, **{cache_arg_name(model): make_cache(model)})


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    # Support is read from the model (quest_hf.families): GPT-2 keeps its blocks in `h`, not a `layers` list.
    with pytest.raises(ValueError, match=r"quest-hf: cannot find the 1 decoder layers of this GPT2LMHeadModel"):
        patch_model(model, budget=64)


def test_config_and_keywords_together_is_refused():
    from quest_hf import QuestConfig

    with pytest.raises(TypeError, match="either config= or keyword"):
        patch_model(tiny_model("llama"), budget=64, config=QuestConfig())


def test_triton_backend_on_cpu_is_refused_by_patch_model(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="backend='triton' cannot run on this model: .*backend='auto'"):
        patch_model(model, budget=64, backend="triton")
    assert "_quest_state" not in vars(model)
    patch_model(model, budget=64)
    with pytest.raises(ValueError, match="backend='triton' cannot run"):  # nor by a re-configure
        patch_model(model, budget=64, backend="triton")
    assert model._quest_state.config.backend == "auto"


@pytest.mark.parametrize("cuda_graph, every", [(False, 1), ("auto", 1), (False, 2), ("auto", 4)],
                         ids=["eager", "auto", "eager-reuse2", "auto-reuse4"])
def test_triton_backend_interpreted_gives_the_torch_backends_tokens(cuda_graph, every, single_thread):
    # The kernels (interpreted on CPU) inside a patched GQA model at a budget that selects 2 of ~6 pages:
    # the same greedy tokens and near-equal logits as the PyTorch twins. The static step (cuda_graph=True, run
    # uncaptured on CPU) forces the current page from the device position inside the score kernel. With
    # selection reuse (reselect_every=k) a reusing step's score and Top-K launches return at once, writing nothing.
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(80, 57))
    kw = dict(max_new_tokens=5 if every == 1 else 2 * every + 1, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    dense = model.generate(ids, attention_mask=mask, **kw)
    out = {}
    for backend in ("torch", "triton"):
        patch_model(model, budget=32, backend=backend, cuda_graph=cuda_graph, reselect_every=every)
        out[backend] = model.generate(ids, attention_mask=mask, **kw)
        if every > 1:  # every decode step of the sparse layer went through the reuse path
            reusing = [la for la in out[backend].past_key_values.layers if la.reuse]
            assert reusing and all(int(la.reuse["step"]) == kw["max_new_tokens"] - 1 for la in reusing)
        cache = out[backend].past_key_values
        assert cache.backends == {backend} and all(type(x) is QuestLayer for x in cache.layers)
    assert torch.equal(out["torch"].sequences, out["triton"].sequences)
    for a, b in zip(out["torch"].scores, out["triton"].scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Selection matters at this budget: the logits move away from dense attention's.
    assert max((a - b).abs().max().item() for a, b in zip(out["torch"].scores, dense.scores)) > 1e-2
