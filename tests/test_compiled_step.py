"""`QuestConfig(compile_step=True)`: the uncaptured decode step as one torch.compile graph (quest_hf/compiled.py), on
CPU. Each test compiles (seconds to tens of seconds on the CI box), so they are few and each checks much."""
import logging

import pytest
import torch

from quest_hf import QuestCache, patch_model, unpatch_model
from quest_hf.patch import cache_arg_name

from .conftest import left_padded_batch, tiny_model

NEW = 6


def _generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_traced_step_gives_the_eager_tokens_and_reuses_its_graph():
    """Batch 2, left padding, GQA, a sparse budget: the traced graph's tokens are the eager step's; prompts of other
    lengths whose capacity falls in the same bucket reuse the graph (no recompile)."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    prompts = [left_padded_batch(lengths=n) for n in ((90, 71), (60, 75), (50, 97))]
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    eager = [_generate(model, ids, mask) for ids, mask in prompts]
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True)
    out = _generate(model, *prompts[0], return_dict_in_generate=True)
    assert torch.equal(out.sequences, eager[0])
    cache = out.past_key_values
    assert cache.decode_path.startswith("compiled, uncaptured: ") and model._quest_state.decode_path == cache.decode_path
    assert cache.layers[0].capacity == 1024 + 16  # the bucket, plus the spare page
    step = model._quest_state.compiled_step
    assert step.failed is None and step.calls == step.traced_calls == NEW - 1
    graphs = counters["stats"]["unique_graphs"]
    for (ids, mask), want in zip(prompts[1:], eager[1:]):
        assert torch.equal(_generate(model, ids, mask), want)
    assert counters["stats"]["unique_graphs"] == graphs  # the same bucket: the same graph
    assert step.traced_calls == 3 * (NEW - 1)
    unpatch_model(model)
    assert not hasattr(model, "_quest_state")


def test_beams_and_seeded_sampling_give_the_eager_tokens():
    """Beam search (its reorders permute the page table between compiled steps) and seeded sampling."""
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    beams = _generate(model, ids, mask, num_beams=3)
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True)
    assert torch.equal(_generate(model, ids, mask, num_beams=3), beams)
    step = model._quest_state.compiled_step
    assert step.failed is None and step.traced_calls == NEW - 1
    torch.manual_seed(0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True), sampled)


def test_fused_projections_and_the_gemv_trace_into_the_step(monkeypatch):
    """fuse_projections with the decode GEMV (the CUDA defaults; here the GEMV runs in the interpreter) inside the
    compiled step: the fused matmuls are traced (no graph break on the checks dynamo cannot ask), the tokens are the
    eager step's; a group whose view is broken between generates recompiles to the unfused projections, same tokens."""
    from quest_hf import decode_gemv, fuse_proj

    def spy(module):  # (in a trace, rows) of each call: a set, whose size settles (a guard)
        real, seen = module.linear, set()

        def linear(x, weight, *args):
            seen.add((torch.compiler.is_compiling(), weight.shape[0]))
            return real(x, weight, *args)
        monkeypatch.setattr(module, "linear", linear)
        return seen

    # Each spy closes over its own set: under torch 2.13 the traced adds to a set reached through a dict were lost
    traced = {fuse_proj: spy(fuse_proj), decode_gemv: spy(decode_gemv)}
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90,))  # batch 1: the row the GEMV takes
    kw = dict(budget=32, page_size=16, dense_layers=1, fuse_projections=True, decode_gemv=True)
    patch_model(model, **kw)
    eager = _generate(model, ids, mask)
    patch_model(model, **kw, compile_step=True)
    assert torch.equal(_generate(model, ids, mask), eager)
    state = model._quest_state
    step = state.compiled_step
    assert step.failed is None and step.traced_calls == NEW - 1
    cfg = model.config
    kv = cfg.num_key_value_heads * cfg.head_dim
    qkv, gate_up = cfg.num_attention_heads * cfg.head_dim + 2 * kv, 2 * cfg.intermediate_size
    assert {(True, qkv), (True, gate_up)} <= traced[fuse_proj]  # both fused matmuls inside the trace
    assert (True, kv) not in traced[decode_gemv]  # no k_proj of its own
    assert all(g.checked for g in state.fused.groups) and len(state.fused.groups) == 6
    k = model.model.layers[1].self_attn.k_proj
    k.weight.data = k.weight.data.clone()  # no longer a view of the fused weight: the group must not run
    assert torch.equal(_generate(model, ids, mask), eager)
    assert step.failed is None and step.traced_calls == 2 * (NEW - 1)
    assert not state.fused.groups[2].checked and sum(g.checked for g in state.fused.groups) == 5
    assert (True, kv) in traced[decode_gemv]  # layer 1's k_proj (and q, v) ran their own GEMV in the new trace
    unpatch_model(model)


def test_cpp_wrapper_gives_the_eager_tokens():
    """compile_wrapper="cpp" (the CUDA default, here on CPU): inductor's C++ wrapper runs the traced step's kernels;
    batch 2, left padding, GQA, a sparse budget give the eager step's tokens."""
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    eager = _generate(model, ids, mask)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True, compile_wrapper="cpp")
    assert torch.equal(_generate(model, ids, mask), eager)
    step = model._quest_state.compiled_step
    assert step.wrapper == "cpp" and step.failed is None and step.traced_calls == NEW - 1
    assert step.options["cpp_wrapper_build_separate"] and step.options["aot_inductor.compile_wrapper_opt_level"] == "O1"
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True)  # CPU default: Python wrapper
    assert torch.equal(_generate(model, ids, mask), eager)
    assert model._quest_state.compiled_step.wrapper == "python"


def test_cpp_wrapper_options_keep_the_environments_choice(monkeypatch):
    """The C++ wrapper's entry is compiled apart at -O1 unless the environment chose for inductor."""
    import torch._inductor.config as inductor_config

    from quest_hf.compiled import cpp_wrapper_options

    for var in ("TORCHINDUCTOR_CPP_WRAPPER_BUILD_SEPARATE", "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    options = cpp_wrapper_options()
    assert options == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                       "aot_inductor.compile_wrapper_opt_level": "O1"}
    with inductor_config.patch(options):  # every key is one this torch's inductor knows (patch raises otherwise)
        assert inductor_config.cpp_wrapper_build_separate and inductor_config.aot_inductor.compile_wrapper_opt_level == "O1"
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER_BUILD_SEPARATE", "0")
    monkeypatch.setenv("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O2")
    assert cpp_wrapper_options() == {"cpp_wrapper": True}


def test_cpp_wrapper_failure_falls_back_to_the_python_wrapper(monkeypatch, caplog):
    """Where the C++ wrapper (the CUDA default) cannot compile, the step compiles with the Python wrapper, says so in
    a warning and in `cpp_failed`, and keeps it for later steps; asked for explicitly, the failure runs eager steps."""
    from quest_hf.config import QuestConfig

    real = torch.compile

    def fake_compile(fn, backend="inductor", options=None, **kw):
        if options and options.get("cpp_wrapper"):
            def broken(*a, **k):
                raise RuntimeError("no C++ compiler here")
            return broken
        return real(fn, backend="eager", **kw)  # the Python wrapper's stand-in: no code generation, same graph

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(QuestConfig, "wrapper_mode", lambda self, device_type: "cpp"
                        if self.compile_wrapper in ("auto", "cpp") else "python")
    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    ids, mask = left_padded_batch(lengths=(90, 71))
    patch_model(model, budget=32, page_size=16, dense_layers=1)
    eager = _generate(model, ids, mask)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True)
    with caplog.at_level(logging.WARNING, logger="quest_hf"):
        out = _generate(model, ids, mask, return_dict_in_generate=True)
    assert torch.equal(out.sequences, eager)
    step = model._quest_state.compiled_step
    assert step.wrapper == "python" and "no C++ compiler here" in step.cpp_failed and step.failed is None
    assert step.calls == NEW - 1  # every step compiled (one failed attempt, no rebuild per step)
    assert out.past_key_values.decode_path.startswith("compiled, uncaptured: ")
    assert "C++ wrapper could not compile the decode step" in caplog.text and "run eagerly" not in caplog.text
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True, compile_wrapper="cpp")
    out = _generate(model, ids, mask, return_dict_in_generate=True)  # asked for: no silent swap, eager steps
    assert torch.equal(out.sequences, eager)
    assert out.past_key_values.decode_path.startswith("eager: ") and "no C++ compiler here" in \
        out.past_key_values.decode_path
    assert model._quest_state.compiled_step.wrapper == "cpp"


def test_capacity_buckets():
    from quest_hf.compiled import bucket

    assert [bucket(n) for n in (1, 1024, 1025, 1153, 2048, 2049, 4112, 9000)] == \
        [1024, 1024, 1152, 1280, 2048, 2304, 4608, 9216]
    assert all(n <= bucket(n) <= max(1024, n * 1.125) for n in range(1, 40000, 37))


def test_exact_capacity_compiles_once_for_prompts_of_other_lengths():
    """compile_capacity="exact" (here on CPU): each cache holds exactly its max length (page-rounded,
    plus the spare page), and prompts of other lengths, hence other capacities, run the same graph (the capacity is
    a symbolic size) and give the eager tokens; a hand-driven continuation past the capacity grows it and still
    recompiles nothing."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", heads=8, kv_heads=2, layers=3)
    prompts = [left_padded_batch(lengths=n) for n in ((200, 181), (333, 300), (470, 455))]
    kw = dict(budget=32, page_size=16, dense_layers=1)
    patch_model(model, **kw)
    eager = [_generate(model, ids, mask) for ids, mask in prompts]
    patch_model(model, **kw, compile_step=True, compile_capacity="exact")
    graphs = None
    for (ids, mask), want in zip(prompts, eager):
        out = _generate(model, ids, mask, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        assert out.past_key_values.layers[0].capacity == -(-(ids.shape[1] + NEW) // 16) * 16 + 16  # no bucket
        graphs = graphs or counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs  # one graph for all three capacities
    step = model._quest_state.compiled_step
    assert step.failed is None and step.traced_calls == 3 * (NEW - 1)
    unpatch_model(model)


def test_next_pow2_is_exact_and_guard_friendly():
    """The launchers' power of two (a Top-K tile, split counts) is computed by comparisons, so a symbolic capacity
    gets range guards, not a specialization; it is the least power of two >= n."""
    from triton_kernels._common import next_pow2

    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 2051, 4096, 4097)] == \
        [1, 1, 2, 4, 4, 8, 16, 32, 4096, 4096, 8192]


def test_hooks_run_inside_the_compiled_op_step_and_sliding_windows_hold():
    """Selection hooks make the step call Quest as one op a layer (not traced): the hooks still fire every decode
    step of every sparse layer and the tokens stay the eager ones, on a sliding-window model past its window."""
    model = tiny_model("mistral", heads=4, kv_heads=2, layers=3, sliding_window=48)
    ids, mask = left_padded_batch(lengths=(90, 71))
    seen = {}

    def run(compile_step):
        patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=compile_step)
        cache = QuestCache.from_model(model)
        calls = []
        cache.selection_hooks.append(lambda layer, q, page_ids: calls.append((layer, page_ids.clone())))
        out = _generate(model, ids, mask, **{cache_arg_name(model): cache})
        seen[compile_step] = calls
        return out, cache

    eager, _ = run(False)
    compiled, cache = run(True)
    assert torch.equal(compiled, eager)
    assert cache.decode_path.startswith("compiled, uncaptured: ")
    step = model._quest_state.compiled_step
    assert step.failed is None and step.calls == NEW - 1 and step.traced_calls == 0  # hooks: the op path
    assert len(seen[True]) == len(seen[False]) == 2 * (NEW - 1)  # layers 1 and 2, every decode step
    for (la, a), (lb, b) in zip(seen[True], seen[False]):
        assert la == lb and torch.equal(a, b)


def test_compile_step_resolves_auto_in_one_place():
    """"auto" (the default) compiles uncaptured steps only on CUDA with cuda_graph=False; True and False as asked."""
    from quest_hf import QuestConfig

    assert QuestConfig().compile_step == "auto"
    assert QuestConfig(cuda_graph=False).compiles_step("cuda") is True
    assert QuestConfig(cuda_graph=False).compiles_step("cpu") is False
    assert QuestConfig().compiles_step("cuda") is False  # cuda_graph="auto": a refused capture runs eagerly
    assert QuestConfig(compile_step=True).compiles_step("cpu") is True
    assert QuestConfig(cuda_graph=False, compile_step=False).compiles_step("cuda") is False
    assert QuestConfig(cuda_graph=False, offload="cpu").compiles_step("cuda") is False
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="compile_step must be True, False or 'auto'"):
            QuestConfig(compile_step=bad)
    # compile_capacity "auto" (default): exact on CUDA, bucket elsewhere; buckets only for a compiling, uncaptured step.
    assert QuestConfig().compile_capacity == "auto"
    assert QuestConfig().capacity_mode("cuda") == "exact" and QuestConfig().capacity_mode("cpu") == "bucket"
    assert QuestConfig(compile_capacity="bucket").capacity_mode("cuda") == "bucket"
    assert QuestConfig(compile_capacity="exact").capacity_mode("cpu") == "exact"
    assert not QuestConfig(cuda_graph=False).buckets_capacity("cuda")  # exact on CUDA by default
    assert QuestConfig(cuda_graph=False, compile_capacity="bucket").buckets_capacity("cuda")
    assert not QuestConfig(compile_capacity="bucket").buckets_capacity("cuda")  # captured: never compiles
    assert QuestConfig(compile_step=True).buckets_capacity("cpu") and not QuestConfig().buckets_capacity("cpu")
    assert not QuestConfig(compile_step=True, compile_capacity="exact").buckets_capacity("cpu")
    with pytest.raises(ValueError, match="compile_capacity must be 'auto', 'bucket' or 'exact'"):
        QuestConfig(compile_capacity="static")
    # compile_wrapper "auto" (default): inductor's C++ wrapper on CUDA, its Python wrapper elsewhere.
    assert QuestConfig().wrapper_mode("cuda") == "cpp" and QuestConfig().wrapper_mode("cpu") == "python"
    assert QuestConfig(compile_wrapper="python").wrapper_mode("cuda") == "python"
    assert QuestConfig(compile_wrapper="cpp").wrapper_mode("cpu") == "cpp"
    with pytest.raises(ValueError, match="compile_wrapper must be 'auto', 'cpp' or 'python'"):
        QuestConfig(compile_wrapper="c++")


def test_cpu_default_runs_the_eager_step():
    """On CPU the default ("auto") does not compile: the decode path says eager, no CompiledStep is made."""
    model = tiny_model("llama", heads=8, kv_heads=2, layers=2)
    ids, mask = left_padded_batch(lengths=(40, 33))
    patch_model(model, budget=32, page_size=16, dense_layers=1, cuda_graph=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values.decode_path == model._quest_state.decode_path == "eager: cuda_graph=False"
    assert model._quest_state.compiled_step is None
    assert out.past_key_values.layers[0].capacity < 1024  # an eager step's cache is not rounded to a compile bucket
    unpatch_model(model)


def test_only_a_compiling_model_rounds_its_caches_capacity():
    """The bucket follows whether this model's uncaptured step compiles: after a failed compile (or on several
    devices, tensor parallel) the cache allocates what it needs."""
    from types import SimpleNamespace

    model = tiny_model("llama", heads=8, kv_heads=2, layers=2)
    patch_model(model, budget=32, page_size=16, dense_layers=1, compile_step=True)
    assert QuestCache.from_model(model)._step.bucket is True
    model._quest_state.compiled_step = SimpleNamespace(failed="an earlier compile error", backend="inductor")
    assert QuestCache.from_model(model)._step.bucket is False
    patch_model(model, budget=32, page_size=16, dense_layers=1)  # "auto" on CPU: eager
    assert QuestCache.from_model(model)._step.bucket is False
    unpatch_model(model)


def test_traced_step_reads_a_padding_column_of_its_own():
    """The padding column a traced step's graph reads is a fresh uint8 tensor, not a view into HF's mask: at batch 1
    with a bool mask the view's row stride is the mask's length, which grows every step, and torch 2.11's guards
    compiled the 7B step again on every step of generate() (H200) until dynamo's limit."""
    from quest_hf.cache import _Step

    for batch in (1, 2):
        mask = torch.ones(batch, 300, dtype=torch.bool)
        step = _Step()
        step.set(mask[:, -1:].bool())  # what QuestCache.begin_step holds: a view when the mask is bool
        assert step.valid_new.stride() == (300, 1)
        step.for_graph()
        column = step.valid_new
        assert column.dtype == torch.uint8 and column.stride() == (1, 1) and column._base is None
        assert column.tolist() == [[1]] * batch
