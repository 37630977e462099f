"""QuestConfig: every knob of quest-hf, a pure value.

Creation checks the fields' own types and ranges only, never the selector registry: a config built before or after
`quest_hf.selectors.register_selector` is the same value (equal, same hash). What depends on the policy's selector
(the name is registered, whole-page budgets, `bounds="int8"`, `reselect_every`, `cuda_graph=True`) is checked by
`quest_hf.selectors.check_config` where the config is bound: `patch_model`, `QuestCache`, `calibrate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GQA_MODES = ("union", "max", "sum")
BOUNDS = ("key_dtype", "int8", "int8_channel")
BACKENDS = ("auto", "torch", "triton")
MAX_PAGE_SIZE = 256
OFFLOAD_TARGETS = ("cpu",)  # QuestConfig.offload
OFFLOAD_POLICIES = ("quest", "streaming")  # selectors that read pages only through attend_pages (offload's pool)


@dataclass(frozen=True)
class QuestConfig:
    """Settings of Quest query-aware sparse decode attention (arXiv 2406.10774).

    Args:
        budget: tokens each query head may attend to per decode step; `budget // page_size` pages
            (the current page included). A layer whose context (or sliding window) is no longer than
            the budget runs dense. Under `gqa_mode="union"` each query head of a KV group picks its own
            pages, so a KV head reads at most `group_size * budget` tokens; `"max"`/`"sum"` share one
            choice per KV head and read at most `budget` tokens.
        page_size: tokens per page (power of two, 4 to 256); each page keeps the element-wise min and
            max of its keys per KV head.
        dense_layers: the first layers stay dense (the paper keeps 2).
        gqa_mode: `"union"` (default): union of the query heads' Top-K per KV group; `"max"` / `"sum"`:
            rank pages by the group's max / summed bound, one Top-K per KV head.
        backend: `"auto"` (Triton kernels on CUDA, PyTorch elsewhere), `"torch"`, `"triton"`.
        cuda_graph: `"auto"` (default): on a model on CUDA, every decode step (greedy, sampling,
            beams, streamers, left padding, sliding windows, selection hooks) replays a captured CUDA graph of the
            one-token forward (quest_hf/graph.py: removes the per-step launch cost of ~150 kernels; under a
            `device_map` one graph per device segment of decoder layers); elsewhere
            (CPU, tensor parallelism, weights offloaded off the GPUs, a policy that needs host lengths) the same
            fixed-shape step runs eagerly and `cache.decode_path` says why. After a captured `generate()` the model
            keeps its cache and graph (as HF keeps its static cache): a later call with the same settings, batch
            size and a capacity within 1/8 above its need resets and replays them from the first decode step; a
            cache returned to the caller (`return_dict_in_generate=True`) is not kept;
            `quest_hf.release_cache(model)` frees it. `True`: capture or raise. `False`: never capture.
        compile_decode: `True` (default): one-token CUDA forwards run the model's norms, MLPs and
            rotary embedding through `torch.compile` (fusing HF's elementwise code, as HF's compiled
            static path does): on an H200, 7B at 32K decodes in 6.5 instead of 8.5 ms a token. The first
            decode step of a new batch size pays the compile (seconds to tens of seconds); a compile
            error is logged and that module runs eagerly (`model._quest_state.compiled.failed` says what).
            Prefill, CPU and the attention are never compiled. `False`: plain eager modules.
        compile_backend: the `torch.compile` backend of `compile_decode` and `compile_step` (default `"inductor"`;
            `"eager"` or `"aot_eager"` to debug the wrapping without code generation).
        compile_step: `"auto"` (default): on CUDA with `cuda_graph=False` and no offload the decode step compiles whole
            (below); elsewhere it does not (CPU steps, and CUDA steps whose capture was refused, run eagerly). `True`:
            every decode step that is not captured (CPU, `cuda_graph=False`, a refused capture) compiles whole. `False`:
            uncaptured steps run eagerly. A compiled step is the model's whole one-token forward as one
            `torch.compile(fullgraph=True)` graph, no CUDA graph (quest_hf/compiled.py): HF's layers become a few fused
            kernels with no Python between them. Quest's part of each layer is traced into the graph where the step is
            plain device work (policy quest, no selection hooks, no offload, no selection reuse;
            `compiled_step.traced_calls`), else called from it as one op a layer. The first step compiles (H200,
            Llama-2-7B shape with the Python wrapper: ~2 min; with the C++ wrapper, the CUDA default: 16 layers 119 s,
            the whole 7B 258 s, run16; SmolLM2's 30 layers on CPU: ~55 s), and again for each new batch size
            and as `compile_capacity` says for a new capacity. A compile error is logged and the steps run eagerly
            (`cache.decode_path` says which path ran). H200, Llama-2-7B shape, 32K, `generate()` with
            `cuda_graph=False`, exact capacity and the Python wrapper: 15.45 ms/token vs HF DynamicCache's 21.39
            (1.38x, benchmarks/e2e/run15; bucket capacity: 12.91 vs 21.16 in run13; the eager step: 0.70x); with
            the C++ wrapper (default) 16.04 vs 28.37 (1.77x) on one host, 8.27 vs 29.00 on a faster one (run16); fp16
            greedy tokens part from the eager step's where fused rounding flips a near-tie (benchmarks/e2e/run13).
        compile_capacity: how a compiled step (`compile_step`) meets caches of other capacities. `"auto"` (default):
            `"exact"` on CUDA, `"bucket"` elsewhere (resolved in `capacity_mode`). `"exact"`: the cache allocates what
            the sequence needs (as HF's static cache does) and the graph takes its capacity as a symbolic size, so a
            prompt of another length compiles nothing new unless its page count crosses a power of two (the Top-K
            tile) or the budget. `"bucket"`: static shapes, the capacity rounded up to an eighth of an octave (at most
            12.5% more K/V slots) so that prompts of similar lengths share one compile. Peak at Llama-2-7B/32K: exact
            32.6 GiB (HF static's 31.6 + the page bounds), bucket 34.7 (benchmarks/e2e/run14). On CPU inductor's C++
            for a symbolic size runs slower (a tiny 3-layer Llama at 512 tokens: 3.9 vs 1.2 ms a step, its dense
            layers' fused attention 645 vs 138 us), hence bucket there. A captured or eager step's capacity is always
            exact.
        compile_wrapper: the code that runs a compiled step's kernels (`compile_step`; backend "inductor"). `"auto"`
            (default): `"cpp"` on CUDA, `"python"` elsewhere (`wrapper_mode`). `"cpp"`: inductor's C++ wrapper
            (`cpp_wrapper`), which launches the kernels from compiled code; `"python"`: its Python wrapper. An
            uncaptured step on CUDA is bound by the host's work around its ~20 kernel launches a layer, not by the
            GPU: H200, Llama-2-7B shape cut to 16 layers, 32K, a hand-driven loop (benchmarks/e2e/run15): exact
            capacity 10.22 ms a step with the Python wrapper (whose own code computes sizes from the symbolic
            capacity around each launch), 3.76 with the C++ one, against 3.14 ms of kernel time (bucket: 6.17 vs
            3.62); the C++ wrapper's compile takes longer (first step 119 vs 48 s at 16 layers; the whole 7B 258 s with
            its entry compiled apart at -O1, `compiled.cpp_wrapper_options`, 506 s built whole: run16). Under "auto"
            a C++ wrapper that cannot compile gives way to the Python one, with a warning (`compiled_step.cpp_failed`).
        fuse_projections: `"auto"` (default): on where `decode_gemv` is (then exact, below); `True` / `False`. At
            patch time each decoder layer's `q_proj`/`k_proj`/`v_proj` (plain `nn.Linear`s of one input) and its
            LlamaMLP-style `gate_proj`/`up_proj` get one concatenated weight (and bias), their own Parameters
            becoming views into it (no memory duplicated), so a decode step runs one matmul per group instead of
            three and two (quest_hf/fuse_proj.py; with `compile_decode` the fused MLP is what compiles). With the
            decode GEMV bound, only a one-row input takes the fused matmul, through the GEMV, whose outputs equal
            the separate projections' bitwise; every other input (prefill, batches, beams) runs the separate
            matmuls over the weight's parts: the model computes exactly what it computes unfused. Without the GEMV
            (`decode_gemv=False`, `fuse_projections=True`) every input takes one cuBLAS GEMM over the concatenated
            weight, which does not round as the separate ones (an H200, benchmarks/e2e/run18: Llama-2-7B/32K 6.00 ->
            5.52 ms/token, and the greedy tokens of random-weight models differed from the unfused run's). Layers
            whose modules do not fit are left unfused; `model._quest_state.fused` lists what was fused and why the
            rest was not. While patched the q/k/v (gate/up) weights share one storage (transformers 5.24's
            `save_pretrained` still writes and reloads them exactly); `unpatch_model`, or re-patching with
            `False`, gives each its own contiguous copy back.
        decode_gemv: `"auto"` (default): on where the model's weights are on CUDA with Triton there (and `backend`
            is not "torch"); `True` / `False`. Each decoder layer's plain-`nn.Linear` attention and MLP projections
            send an input of one row (a one-sequence decode token) to a Triton GEMV (triton_kernels/gemv.py,
            quest_hf/decode_gemv.py) instead of cuBLAS, which reads the weights below the copy bandwidth at batch 1
            (an H100: 5-37% faster a shape, benchmarks/kernels/round21); prefill, batches and beams keep cuBLAS.
            Rounding differs from cuBLAS's (one fp16 ulp at most on 7B/8B shapes): greedy tokens can part where two
            logits nearly tie. With `fuse_projections` a fused group's outputs equal the unfused GEMV's bitwise.
            `model._quest_state.gemv` lists what was bound, what not and why.
        fuse_residual: `True` (default): with `compile_decode`, a one-token CUDA step of a decoder layer of the
            plain pre-norm form (the layer's forward reads as Llama's: `residual + attention`, post-attention norm,
            MLP, `residual + MLP`; Mistral, Qwen2/3, Gemma, SmolLM3 and others share it) runs each residual add in the
            compiled kernel of the norm that reads the sum: the layer's post-attention norm, and the next layer's
            input norm (or the model's final norm), whose output is handed to it (quest_hf/fuse.py). Two kernels a
            layer fewer in a captured step; the sum is rounded to the model's dtype before the norm reads it, as in
            HF's forward. A layer of another form keeps HF's forward; `model._quest_state.compiled.residual` says
            which layers fused and why the others did not. `False`: HF's decoder-layer forward.
        defer_stop_check: `True` (default): `generate()` on CUDA decides whether to stop one step late,
            so the host queues the next step instead of waiting for the GPU after every token (HF's own
            `DeferredStopCheck`, which transformers turns on only for "mps"; 7B at 32K on an H200: 6.38
            instead of 6.49 ms a token). A generation that ends on EOS runs one extra forward, which HF
            undoes (tokens and cache); a streamer receives each token one step late. `cache.stop_check`
            says which check ran. `False`: HF's per-token check.
        policy: `"quest"` (default); code selectors beyond the paper (docs/selector.md), e.g.
            `"qcode1_2s"` with `page_size=32`: Quest's candidates re-ranked by 1-bit key codes;
            `"streaming"` (first page + most recent pages, query-agnostic baseline) and `"oracle"`
            (top-budget tokens by exact q.k per head; reads every key, for evaluation only) go through the
            same decode path for comparisons. Any name is accepted here; it must name a registered selector
            (`quest_hf.selectors.register_selector`) when the config is bound to a model or cache, which is where
            the settings that depend on the selector are checked (`quest_hf.selectors.check_config`: budgets in
            whole pages unless the selector counts tokens, as the oracle does; `bounds="int8"`, `reselect_every > 1`
            and `cuda_graph=True` only where the selector supports them).

        layer_budgets: None (default: every sparse layer uses `budget`) or one budget per model layer, e.g. from
            `quest_hf.calibrate(model, ...)`; each must be valid as `budget` is (at least 2 pages; a multiple of
            `page_size`, checked where bound). `budget` then names the flat budget they were chosen against (their
            bytes per step match it). The length must equal the model's layer count (checked by `patch_model` /
            `QuestCache`).
        dense: None (default: the first `dense_layers` decode dense) or the indices of the layers that decode dense,
            overriding `dense_layers` (`dense=()`: none).
        bounds: how the page min/max that the score reads are stored. `"key_dtype"` (default): in the keys' dtype
            (4 * head_dim bytes a page and KV head at fp16). `"int8"`: int8 codes on one fp32 scale a page and KV
            head, min rounded down and max rounded up (triton_kernels/bounds8.py), so the score stays an upper bound
            of q.k; it reads 2 * head_dim + 4 bytes a page (about half). The exact key-dtype bounds are still kept
            (the open page is requantized from them after each append), so memory grows by that half.
            `"int8_channel"`: the same bytes, codes on per-(KV head, channel) scales fixed from the prefill's keys
            times a power of two a page (a page past the prefill's range takes a larger exponent, never clips):
            each channel keeps its own step, so small channels are not coarsened by a page's largest one.
        reselect_every: 1 (default): pages are chosen at every decode step. `k > 1` (selection reuse, as in LServe):
            a sparse layer scores and chooses pages every `k` decode steps and reuses that choice in between, adding
            the pages started since it was made (no page read twice). The step counter and the stored choice live
            on the device, so captured steps reuse too; a step that reuses reads no bound and no score: the score and
            Top-K launches read the device flag and return at once (captured steps too).
            Growth, crop, reset and batch edits choose afresh at the next step.
        fused_step: how a sparse layer's decode step launches its kernels under policy "quest". `False`: three
            separate kernels and their merge (`score_pages`, `topk_pages`, `sparse_decode_attention`). `True`: the
            three-launch step (`triton_kernels.fused_step.quest_step`, `DECODE_STEP_LAUNCH`): a resident scoring grid
            walking heads in order, each head's Top-K and attention starting as soon as that head's scores are done,
            chained by programmatic dependent launch (Hopper); same pages chosen. `"auto"` (default): the
            three-launch step where it measured faster on an H200 (benchmarks/kernels/round19): one sequence, one
            score row a KV head without a GQA group (MHA), key-dtype bounds (with 8-bit bounds the separate kernels
            were faster at 128K on an H100: 60-61 vs 66-67 µs a layer, benchmarks/kernels/round33), PDL available;
            elsewhere the separate kernels. Steps it cannot take (beam search's page table, the GQA union,
            `reselect_every > 1`, offload, the PyTorch path, a traced compiled step, rows wider than its Top-K tile)
            run the separate kernels under any setting;
            `layer.step_kernels` says which ran and why; `cache.step_kernels` and `model._quest_state.step_kernels`
            sum them up by layers.
        offload: None (default: every page on the layer's device) or `"cpu"`: each sparse layer keeps its K/V pages in
            page-locked host memory and on the GPU only the page bounds, the current page, a pool of resident pages
            and the page table; each decode step fetches the chosen pages that are not resident (quest_hf/offload.py:
            contexts larger than GPU memory). The dense layers stay on the GPU. Policies "quest" and "streaming";
            no beam search, no attention sinks.
        offload_pages: resident pages per (sequence, KV head) of each offloaded layer (None: twice what one step can
            choose, `2 * (budget // page_size + 1)`, times the GQA group under `gqa_mode="union"`). A pool smaller
            than one step's selection is refused.
        offload_bytes: or the device bytes of all the offloaded layers' pools together (split evenly; K and V).

    Creation checks each field's own type and range only; it never reads the selector registry, so equal
    settings make equal (and equally hashed) configs whatever is registered when.

    Two settings are for tests only (they let the CPU suite run what is CUDA-only): `_compile_devices`, the
    device types whose one-token inputs `compile_decode` compiles, and `_defer_devices`, those where a QuestCache
    asks for the deferred stop check (transformers' check needs device events, which CPU lacks); both `("cuda",)`.
    """

    budget: int = 2048
    page_size: int = 16
    dense_layers: int = 2
    gqa_mode: str = "union"
    backend: str = "auto"
    policy: str = "quest"
    cuda_graph: bool | str = "auto"
    compile_decode: bool = True
    defer_stop_check: bool = True
    compile_backend: str = "inductor"
    compile_step: bool | str = "auto"
    compile_capacity: str = "auto"
    compile_wrapper: str = "auto"
    fuse_projections: bool | str = "auto"
    decode_gemv: bool | str = "auto"
    fuse_residual: bool = True
    layer_budgets: tuple[int, ...] | None = None
    dense: tuple[int, ...] | None = None
    bounds: str = "key_dtype"
    reselect_every: int = 1
    offload: str | None = None
    fused_step: bool | str = "auto"
    offload_pages: int | None = None
    offload_bytes: int | None = None
    _compile_devices: tuple[str, ...] = field(default=("cuda",), repr=False)
    _defer_devices: tuple[str, ...] = field(default=("cuda",), repr=False)

    def __post_init__(self):
        for name in ("budget", "page_size", "dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                default = {"budget": 2048, "page_size": 16, "dense_layers": 2}[name]
                raise TypeError(f"QuestConfig.{name} must be an int, got {type(value).__name__} {value!r}; leave it "
                                f"out for the default {default}")
        ps = self.page_size
        if ps < 4 or ps > MAX_PAGE_SIZE or ps & (ps - 1):
            raise ValueError(
                f"page_size must be a power of two between 4 and {MAX_PAGE_SIZE} (the kernels tile pages by it), "
                f"got {ps}; the default is 16"
            )
        if self.budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {self.budget}; try budget=2048")
        if self.budget < 2 * ps:
            raise ValueError(
                f"budget={self.budget} is smaller than 2 pages of {ps} tokens: Quest needs the current page "
                f"plus at least one chosen page; use budget >= {2 * ps}"
            )
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers must be >= 0, got {self.dense_layers}")
        self._check_per_layer()
        for name, allowed in (("gqa_mode", GQA_MODES), ("backend", BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if not isinstance(self.policy, str) or not self.policy:  # registered? checked where bound (check_config)
            raise (ValueError if isinstance(self.policy, str) else TypeError)(
                f"QuestConfig.policy must name a selector (a non-empty str such as 'quest'), got {self.policy!r}")
        for i, b in enumerate(self.layer_budgets or ()):
            if b < 2 * ps:
                raise ValueError(f"layer_budgets[{i}]={b} must be a multiple of page_size={ps} and at least 2 pages "
                                 f"({2 * ps} tokens), as budget must; use {max(2 * ps, b // ps * ps)}")
        self._check_bounds_and_reuse()
        if self.cuda_graph not in (True, False, "auto"):
            raise ValueError(f"cuda_graph must be True, False or 'auto', got {self.cuda_graph!r}")
        if not (isinstance(self.compile_step, bool) or self.compile_step == "auto"):
            raise TypeError(f"compile_step must be True, False or 'auto', got {self.compile_step!r}")
        if self.compile_capacity not in ("auto", "bucket", "exact"):
            raise ValueError(f"compile_capacity must be 'auto', 'bucket' or 'exact', got {self.compile_capacity!r}")
        if self.compile_wrapper not in ("auto", "cpp", "python"):
            raise ValueError(f"compile_wrapper must be 'auto', 'cpp' or 'python', got {self.compile_wrapper!r}")
        for name in ("fused_step", "decode_gemv", "fuse_projections"):
            if getattr(self, name) not in (True, False, "auto") or getattr(self, name) in (0, 1) and not isinstance(
                    getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        for name in ("compile_decode", "defer_stop_check", "fuse_residual"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise TypeError(f"compile_backend must name a torch.compile backend, got {self.compile_backend!r}")
        for name in ("_compile_devices", "_defer_devices"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(d, str) for d in value):
                raise TypeError(f"{name} must be a tuple of device types such as ('cuda',), got {value!r}")
        self._check_offload()

    def _check_bounds_and_reuse(self) -> None:
        if self.bounds not in BOUNDS:
            raise ValueError(f"unknown bounds {self.bounds!r}; choose 'key_dtype' (the default: min/max in the keys' "
                             "dtype), 'int8' (8-bit codes on one fp32 scale a page, about half the bytes) or "
                             "'int8_channel' (8-bit codes on per-channel scales fixed at the prefill, the same bytes)")
        k = self.reselect_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"reselect_every must be an int >= 1 (1: choose pages at every decode step), got {k!r}")

    def _check_offload(self) -> None:
        if self.offload is not None and self.offload not in OFFLOAD_TARGETS:
            raise ValueError(f"offload must be None (every page on the GPU) or 'cpu' (sparse layers' K/V pages in host "
                             f"memory), got {self.offload!r}")
        for name in ("offload_pages", "offload_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
            if self.offload is None:
                raise ValueError(f"{name} sizes the resident pool of offload='cpu': set offload='cpu' too, or drop it")
        if self.offload_pages is not None and self.offload_bytes is not None:
            raise ValueError("give the resident pool in pages (offload_pages) or in bytes (offload_bytes), not both")
        if self.offload is None:
            return
        if self.policy not in OFFLOAD_POLICIES:
            raise ValueError(f"offload='cpu' serves the policies {', '.join(OFFLOAD_POLICIES)} (they read pages only "
                             f"through the resident pool), got policy={self.policy!r}")
        for name, default in (("bounds", "key_dtype"), ("reselect_every", 1)):
            if getattr(self, name, default) != default:
                raise ValueError(f"offload='cpu' is not built for {name}={getattr(self, name)!r}: use "
                                 f"{name}={default!r}")
        most = max(self.layer_budgets or (self.budget,)) // self.page_size + 1
        if self.offload_pages is not None and self.offload_pages < most:
            raise ValueError(f"offload_pages={self.offload_pages} is smaller than one decode step's selection ({most} "
                             f"pages a KV head: budget // page_size + 1, times the GQA group under gqa_mode='union'); "
                             f"use offload_pages >= {most}")

    def _check_per_layer(self) -> None:
        """Types of `layer_budgets` / `dense` (lists become tuples); their length is checked by `check_layers`."""
        for name in ("layer_budgets", "dense"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, name, value)  # frozen: normalised once, so the config stays hashable
            if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise TypeError(f"QuestConfig.{name} must be a tuple of ints or None, got {value!r}")
        if self.layer_budgets is not None and not self.layer_budgets:
            raise ValueError("layer_budgets=() gives no layer a budget: pass one budget per model layer, or None")
        if self.dense is not None:
            if any(i < 0 for i in self.dense) or len(set(self.dense)) != len(self.dense):
                raise ValueError(f"dense must list distinct layer indices >= 0, got {self.dense!r}")
            object.__setattr__(self, "dense", tuple(sorted(self.dense)))

    def check_layers(self, num_layers: int) -> None:
        """Raise ValueError unless `layer_budgets` / `dense` fit a model of `num_layers` layers."""
        if self.layer_budgets is not None and len(self.layer_budgets) != num_layers:
            raise ValueError(f"layer_budgets has {len(self.layer_budgets)} entries for a model of {num_layers} "
                             f"layers: give one budget per layer (dense layers included), e.g. from "
                             "quest_hf.calibrate(model, ...) on this model")
        if self.dense and self.dense[-1] >= num_layers:
            raise ValueError(f"dense names layer {self.dense[-1]}, but the model has layers 0-{num_layers - 1}")

    def compiles_step(self, device_type: str) -> bool:
        """Whether a decode step on a `device_type` device that is not captured runs compiled whole (`compile_step`:
        the one place "auto" is resolved)."""
        if self.compile_step == "auto":  # offload's host reads stay eager unless asked (not timed compiled)
            return device_type == "cuda" and self.cuda_graph is False and self.offload is None
        return self.compile_step

    def capacity_mode(self, device_type: str) -> str:
        """How a compiled step on a `device_type` device sizes its cache: "exact" or "bucket" (`compile_capacity`: the
        one place "auto" is resolved)."""
        if self.compile_capacity == "auto":
            return "exact" if device_type == "cuda" else "bucket"
        return self.compile_capacity

    def wrapper_mode(self, device_type: str) -> str:
        """Which inductor wrapper a compiled step on a `device_type` device runs its kernels from: "cpp" or "python"
        (`compile_wrapper`: the one place "auto" is resolved)."""
        if self.compile_wrapper == "auto":
            return "cpp" if device_type == "cuda" else "python"
        return self.compile_wrapper

    def buckets_capacity(self, device_type: str) -> bool:
        """Whether a cache on a `device_type` device rounds its capacity up to a compile bucket
        (quest_hf.compiled.bucket): where its uncaptured step compiles with a static capacity (`capacity_mode`
        "bucket") and a step is not captured (CPU, or CUDA with `cuda_graph=False`; a captured step never compiles).
        The patch narrows it to models that compile."""
        return (self.compiles_step(device_type) and self.capacity_mode(device_type) == "bucket"
                and (device_type != "cuda" or self.cuda_graph is False))

    def is_dense(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` decodes dense: listed in `dense`, else one of the first `dense_layers`."""
        return layer_idx in self.dense if self.dense is not None else layer_idx < self.dense_layers

    def layer_budget(self, layer_idx: int) -> int:
        """The budget of layer `layer_idx`: `layer_budgets[layer_idx]`, else `budget`."""
        return self.budget if self.layer_budgets is None else self.layer_budgets[layer_idx]

    def for_layer(self, layer_idx: int) -> QuestConfig:
        """The config layer `layer_idx` runs under (its selector and kernels read `budget` / `num_pages`): this one
        with `budget` set to the layer's own."""
        budget = self.layer_budget(layer_idx)
        return self if budget == self.budget else replace(self, budget=budget)

    @property
    def num_pages(self) -> int:
        """Pages chosen per query head (or per KV head in the shared modes): `budget // page_size`."""
        return self.budget // self.page_size
