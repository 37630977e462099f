"""patch_model on tiny models of every decoder family (tests/family_models.py): exact at a budget covering the
context, equal to HF's own eager attention under the same page selection at a small budget, undone by unpatch.

Each family's specifics reach the sparse path, the dense fallback and the prefill: Gemma 2's soft-cap, GPT-OSS's
sinks, Gemma 2/3 and Granite's scaling, Qwen2-MoE's window that only the mask carries, windows shorter than the
prompt. The small-budget reference (`masked_reference_logits`) runs the family's own `eager_attention_forward`
with the pages the selection hooks report as a mask, every decode step teacher-forced in one forward.
"""
import pytest
import torch
import transformers as tf

import quest_hf
from quest_hf import QuestCache, describe_patch, layer_plan, patch_model, patched, unpatch_model
from quest_hf.patch import cache_arg_name
from tests.family_models import (
    FAMILIES,
    left_padded,
    masked_reference_logits,
    missing_reason,
    tiny_family_model,
    tiny_mla_model,
)

LENGTHS = (40, 33)  # left-padded, past every tiny window (8, 16)
NEW = 6  # decode steps


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add overhead
    yield
    torch.set_num_threads(n)


def _param(family, overrides=None, name=None):
    reason = missing_reason(family)
    return pytest.param(family, overrides or {}, id=name or family,
                        marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


# Every family as tests/family_models.py builds it, plus sliding settings its defaults leave off (Qwen2-MoE: the
# window only in the mask) and windows longer than the small budget on the capped / sink families (their sliding
# layers then select pages too).
CASES = [_param(f) for f in FAMILIES] + [
    _param("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=4), "qwen2_moe-window"),
    _param("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "qwen3_moe-window"),
    _param("smollm3", dict(use_sliding_window=True, sliding_window=16), "smollm3-window"),
    _param("mixtral", dict(sliding_window=16), "mixtral-window"),
    _param("gemma2", dict(sliding_window=16), "gemma2-window16"),
    _param("gpt_oss", dict(sliding_window=16), "gpt_oss-window16"),
]
# One family of each kind: full attention, one window for all layers, windows by layer type with a soft-cap,
# sinks, a window the attention keyword does not carry.
BEAM_CASES = [_param("llama"), _param("mistral"), _param("gemma2"), _param("gpt_oss"),
              _param("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=4),
                     "qwen2_moe-window")]

_MODELS = {}


def model_of(family, overrides):
    key = (family, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_family_model(family, **overrides)
    return _MODELS[key]


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family,overrides", CASES)
def test_full_budget_generates_the_unpatched_tokens(family, overrides):
    model = model_of(family, overrides)
    ids, mask = left_padded(lengths=LENGTHS)
    want = _generate(model, ids, mask)
    with patched(model, budget=64, page_size=8, dense_layers=0):  # 64 >= prompt 40 + 6 new: every layer dense
        got = _generate(model, ids, mask)
        assert isinstance(got.past_key_values, QuestCache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,overrides", BEAM_CASES)
def test_full_budget_beams_give_the_unpatched_beams(family, overrides):
    model = model_of(family, overrides)
    ids, mask = left_padded(lengths=LENGTHS)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_beams=3, do_sample=False)
        with patched(model, budget=64, page_size=8, dense_layers=0):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_beams=3, do_sample=False)
    assert torch.equal(got, want)


def _decode_by_hand(model, ids, mask, steps):
    """Prefill + `steps` greedy decode steps over a QuestCache; returns (decode logits [B, steps, V], the tokens fed
    [B, steps], position_ids of prompt + fed tokens, the page ids each step's sparse layers chose {layer: ids})."""
    cache = QuestCache.from_model(model)
    chosen = {}
    cache.selection_hooks.append(lambda i, q, page_ids: chosen.__setitem__(i, page_ids.clone()))
    arg = cache_arg_name(model)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits, fed, picks = [], [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **{arg: cache})
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            pos = torch.cat([pos, pos[:, -1:] + 1], 1)
            chosen.clear()
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos[:, -1:], **{arg: cache})
            logits.append(out.logits[:, -1].float())
            fed.append(tok)
            picks.append(dict(chosen))
    return torch.stack(logits, 1), torch.cat(fed, 1), pos, picks


def _keep_from_pages(picks, B, H, L, S, layers):
    """keep[i] bool [B, H_kv, steps, L]: the tokens of the pages layer i chose at each step (-1 unused); a step
    without a selection (the layer ran dense) keeps everything (the model's own mask then applies)."""
    keep = []
    for i in range(layers):
        rows = torch.ones(B, H, len(picks), L, dtype=torch.bool)
        for r, chosen in enumerate(picks):
            if i not in chosen:
                continue
            ids = chosen[i].long()
            slots = (ids[..., None] * S + torch.arange(S)).masked_fill(ids[..., None] < 0, L)  # [B, H, K, S]
            row = torch.zeros(B, H, L + 1, dtype=torch.bool).scatter_(-1, slots.reshape(B, H, -1).clamp(max=L), True)
            rows[:, :, r] = row[..., :L]
        keep.append(rows)
    return keep


@pytest.mark.parametrize("family,overrides", CASES)
def test_small_budget_equals_eager_attention_over_the_chosen_pages(family, overrides):
    model = model_of(family, overrides)
    ids, mask = left_padded(lengths=LENGTHS)
    S, layers, H = 4, model.config.num_hidden_layers, model.config.num_key_value_heads
    with patched(model, budget=8, page_size=S, dense_layers=1):
        plan = layer_plan(model)
        got, fed, pos, picks = _decode_by_hand(model, ids, mask, NEW)
    sparse = [p.layer_idx for p in plan if p.mode == "sparse"]
    assert sparse and all(set(chosen) == set(sparse) for chosen in picks)  # hooks: every sparse layer, every step
    seq, full_mask = torch.cat([ids, fed], 1), torch.cat([mask, torch.ones_like(fed)], 1)
    keep = _keep_from_pages(picks, 2, H, seq.shape[1], S, layers)
    want = masked_reference_logits(model, seq, full_mask, keep, position_ids=pos)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    everything = [torch.ones(2, H, NEW, seq.shape[1], dtype=torch.bool)] * layers
    dense = masked_reference_logits(model, seq, full_mask, everything, position_ids=pos)
    assert (got - dense).abs().max() > 1e-3  # the selection mattered: the test could fail


@pytest.mark.parametrize("family,overrides", CASES)
def test_unpatch_restores(family, overrides):
    model = model_of(family, overrides)
    ids, mask = left_padded(lengths=(12, 9))
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        patch_model(model, budget=8, page_size=4)
        assert model.config._attn_implementation == "quest" and "generate" in model.__dict__
        assert all(getattr(m, "_quest_state", None) is not None for m in quest_hf.families.attention_modules(model))
        unpatch_model(model)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == impl and "_quest_state" not in model.__dict__
    assert "generate" not in model.__dict__ and "forward" not in model.__dict__
    assert all("_quest_state" not in m.__dict__ for m in model.modules())
    assert torch.equal(before, after)


def test_describe_patch_names_dense_sparse_and_windowed_layers():
    if missing_reason("gemma2"):
        pytest.skip(missing_reason("gemma2"))
    model = model_of("gemma2", {})  # sliding (window 8), full, sliding, full; soft-cap 20
    with patched(model, budget=8, page_size=4, dense_layers=1):
        plan = layer_plan(model)
        text = describe_patch(model)
    assert [p.mode for p in plan] == ["dense", "sparse", "dense", "sparse"]
    assert "dense_layers=1" in plan[0].reason and "window 8 fits" in plan[2].reason
    lines = text.splitlines()
    assert lines[0].startswith("quest-hf on gemma2: 4 layers") and len(lines) == 5  # a line per run of alike layers
    assert "softcap 20" in text and "scaling 0.1768" in text
    with pytest.raises(ValueError, match="not patched"):
        describe_patch(model)


# ------------------------------------------------------------------------------------------------ refusals

def test_patch_refuses_hybrid_models_with_the_reason():
    model = tf.Lfm2ForCausalLM(tf.Lfm2Config(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"], pad_token_id=0))
    with pytest.raises(ValueError, match=r"hybrid: layers 0,2 are linear-attention / recurrent"):
        patch_model(model, budget=8, page_size=4)
    assert "_quest_state" not in model.__dict__ and model.config._attn_implementation != "quest"


def test_patch_refuses_latent_attention_and_encoder_decoder():
    with pytest.raises(ValueError, match=r"latent attention \(MLA"):
        patch_model(tiny_mla_model(), budget=8, page_size=4)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                   num_heads=4))
    with pytest.raises(ValueError, match="encoder-decoder"):
        patch_model(t5, budget=8, page_size=4)


# ----------------------------------------------------------------------------------------------- GPU-marked

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,overrides", [c for c in CASES if c.id in (
    "gemma2", "gpt_oss", "gemma2-window16", "gpt_oss-window16", "qwen2_moe-window", "granite", "mistral")])
def test_captured_step_gives_the_eager_tokens(family, overrides):
    """The captured decode step (Triton kernels, soft-cap / sinks as constexpr flags) against the same step run
    eagerly, on the GPU, at a small budget (sparse layers) and at a covering one (against unpatched HF)."""
    model = tiny_family_model(family, **overrides).cuda()
    ids, mask = (t.cuda() for t in left_padded(lengths=LENGTHS))
    want = _generate(model, ids, mask).sequences
    for budget in (8, 64):
        with patched(model, budget=budget, page_size=4, dense_layers=0, cuda_graph=False, compile_decode=False,
                     compile_step=False):
            eager = _generate(model, ids, mask).sequences
        with patched(model, budget=budget, page_size=4, dense_layers=0, cuda_graph=True, compile_decode=False):
            out = _generate(model, ids, mask)
            assert out.past_key_values.decode_path == "captured"
            assert model._quest_state.graph.replays > 0
        assert torch.equal(out.sequences, eager)
        if budget == 64:
            assert torch.equal(out.sequences, want)
