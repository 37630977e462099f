"""Shared by the benchmark and evaluation scripts: one CUDA timer, one copy-bandwidth probe, the results block.

Every GPU time a benchmark script reports comes from `time_calls` / `time_graph` (the "clean timer" that
`scripts/bench_kernels.py`'s committed figures were taken with): after a warm-up, each timed call is preceded by
~20 us of GPU spinning (no memory traffic) so the CPU has queued it before the GPU gets there, bracketed by
two CUDA events, and the median over the calls is reported in microseconds. Nothing flushes L2 (a flush
leaves dirty lines the timed call must write back); callers rotate over enough input sets instead
(`rotating`, or several callables to `time_graph`) that no timed call finds its inputs in L2.

`copy_bandwidth` is the byte limit every "fraction of the byte limit" column divides by: a 1 GiB
device-to-device copy, bytes read + written, timed by the same clock.

Imports torch and the standard library only (transformers lazily, in `environment` and `random_llama`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["time_calls", "time_graph", "capture", "rotating", "copy_bandwidth", "wall_time_us", "Clock",
           "LAYER_SHAPES", "MODEL_SHAPES", "random_llama", "results_dir", "environment", "model_tag", "DTYPES",
           "ints", "add_model_args", "write_report", "set_topk_launch", "topk_launch_fields"]

SPIN_CYCLES = 40000  # torch.cuda._sleep cycles before each timed call: ~20 us on an H200

# One decode-attention layer of a real model: (H_q, H_kv, D).
LAYER_SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}

# Random-weight Llama models (speed does not depend on the weights' values), and a tiny one for CPU smoke runs.
MODEL_SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # SmolLM2-135M's shape (GQA 9/3, head dim 64, 30 layers): the model the calibrated configs were measured on.
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
    # Sliding-window GQA (every layer windowed): what the captured step must serve with window masking.
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=8192),
    "tiny-mistral": dict(model_type="mistral", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, sliding_window=128),
}


# --------------------------------------------------------------------------------------------------- timing


def time_calls(fn: Callable[[], object], *, warmup: int = 3, rep_ms: float = 12.0, iters: int | None = None,
               before: Callable[[], object] | None = None, spin_cycles: int = SPIN_CYCLES) -> float:
    """Median microseconds of `fn()` on the current CUDA device.

    `warmup` calls first; then `iters` timed calls, or (default) as many as fit in about `rep_ms` of GPU
    time (estimated from 5 calls), clamped to [10, 400]. Each timed call: `before()` if given (not timed),
    `spin_cycles` of GPU spinning (0: launch onto whatever the GPU is doing), a CUDA event, `fn()`, a
    CUDA event. `fn` may be a graph's `replay` (see `time_graph`) or plain launches."""
    def call():
        if before is not None:
            before()
        return fn()

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    if iters is None:
        t0 = time.perf_counter()
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        per_call = max((time.perf_counter() - t0) / 5, 1e-6)
        iters = max(10, min(400, int(rep_ms * 1e-3 / per_call)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        if before is not None:
            before()
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in events)[iters // 2] * 1e3


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after one eager call on a side stream (compiles, allocates)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that calls `fns` in turn (input sets rotated so that no call finds its inputs in L2)."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fns[state["i"] % len(fns)]()

    return call


def time_graph(fns: Callable[[], object] | Sequence[Callable[[], object]], **kw) -> float:
    """Median microseconds of one CUDA-graph replay: each callable (one per input set) captured in its own
    graph, the replays rotated over them and timed by `time_calls` (same keywords)."""
    fns = [fns] if callable(fns) else list(fns)
    graphs = [capture(f) for f in fns]
    try:
        return time_calls(rotating([g.replay for g in graphs]), **kw)
    finally:
        del graphs


def time_graph_chain(fns: Callable[[], object] | Sequence[Callable[[], object]], n: int = 20, **kw) -> float:
    """Median microseconds a call when `n` calls run back to back in one CUDA graph, rotating over `fns` (one per
    input set): a model's layers follow one another so in a captured decode step, and the graph's own launch is
    paid once for the `n` calls (`time_graph` pays it on every call). Timed by `time_calls` (same keywords)."""
    fns = [fns] if callable(fns) else list(fns)
    graph = capture(lambda: [fns[i % len(fns)]() for i in range(n)])
    try:
        return time_calls(graph.replay, **kw) / n
    finally:
        del graph


def kernel_durations(fn: Callable[[], object], reps: int = 20) -> dict[str, float]:
    """Each CUDA kernel's mean device time a call of `fn` (us, the torch profiler's), by kernel name: what the
    time of a step is spent on, without the launch gaps between kernels."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.count}


def copy_bandwidth(device="cuda", nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, bytes read + written, of one `nbytes` copy (timed by
    `time_calls`, ~100 ms of repeats): the byte limit that "fraction of the byte limit" divides by."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    y = torch.empty_like(x)
    t = time_calls(lambda: y.copy_(x), rep_ms=100)
    return 2 * nbytes / (t * 1e-6)


def decode_floor_bytes(model, length: int, batch: int = 1, config=None) -> float:
    """Bytes one decode step of `model` must read at the least, at `length` tokens of context and `batch` sequences:
    every weight once (the input embedding's one row aside, unless tied to the head) plus the K/V the step attends,
    for `config=None` (dense) every layer's K/V, else what a QuestConfig reads (`model_step_bytes`: dense layers' K/V,
    sparse layers' page metadata and `budget` tokens of K and V per KV head, the fewest a GQA union can read). A
    sliding window caps the context read. Its time at the copy bandwidth is the step's byte floor (`bench_e2e.py`)."""
    from .eval.accounting import model_step_bytes

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)
    cfg = model.config.get_text_config()
    n, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // kv
    elt = next(model.parameters()).element_size()
    L = min(length, getattr(cfg, "sliding_window", None) or length)
    if config is None:
        kv_bytes = n * L * kv * 2 * D * elt
    else:
        S = config.page_size
        least = [kv * min(-(-L // S), config.layer_budget(i) // S) for i in range(n)]  # the group agrees
        kv_bytes = model_step_bytes(config, n, L, kv, D, elt, group, pages_read=least)
    return weights + batch * kv_bytes


def wall_time_us(fn: Callable[[], object], *, warmup: int = 2, iters: int = 5) -> float:
    """Median wall-clock microseconds of `fn()`: only for CPU smoke runs (`--tiny`) of the GPU benchmarks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return sorted(times)[len(times) // 2]


class Clock:
    """A `generate()` streamer that timestamps the prompt and every new token (per-token latency as a user sees it).

    It does not synchronise: generate() hands it tokens already copied to the host (`.cpu()` after the step,
    or, with the deferred stop check, after waiting on the step's event), so the timestamps are spaced by
    the per-token time the user sees; a sync here would undo the deferred check's overlap."""

    def __init__(self, device=None):
        self.device, self.t = device, []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


def random_llama(shape: str, dtype, device, max_len: int):
    """A random-weight causal LM of `MODEL_SHAPES[shape]` (Llama unless it names a `model_type`; SDPA attention,
    no EOS), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(MODEL_SHAPES[shape])
    cfg = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw, max_position_embeddings=max(max_len, 4096),
                               attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


# --------------------------------------------------------------------------------------------------- results


def results_dir(name: str) -> Path:
    """`results/<name>` under the current folder (created): where a script writes unless told `--out`.
    `results/` is untracked; committed results under `benchmarks/` are written with an explicit `--out`."""
    path = Path("results", name)
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_tag(name):
    return "smollm2" if name is None else os.path.basename(name.rstrip("/")).lower()


def environment(device):
    """Date, versions, machine and command, for the header of a results file."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    machine = f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    if str(device).startswith("cuda") and torch.cuda.is_available():
        machine = f"{torch.cuda.get_device_name(device)} ({machine})"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, machine=machine,
                device=str(device), command=_env_prefix() + "python " + " ".join(sys.argv))


def sm90_report(kernel, signature: dict, constexprs: dict, num_warps: int = 4, divisible=()) -> dict:
    """Compile a Triton kernel for sm_90 without a GPU (Triton's bundled ptxas and cuobjdump) and report what it
    became: `registers`, `spilled` (bytes of spill stores), `shared` (bytes), `sass` [(address, instruction text)]
    and `ops` {opcode: count} (predicates and modifiers stripped). Offline figures of the local triton, which may be
    newer than a device's (benchmarks/kernels/round28/score_regs.py, round30/topk_sass.py).

    What a launch specializes on, give too, or the loads compile unvectorized: integer arguments equal to 1 (unit
    strides) as `constexprs`, and `divisible` the names of the pointers and integers divisible by 16, as the JIT marks
    them (benchmarks/kernels/round34/score_issue.py)."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # under TRITON_INTERPRET=1 `triton.jit` made an interpreted function
        kernel = JITFunction(kernel.fn)
    binaries = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sig = dict(signature) | {c: "constexpr" for c in constexprs}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        log = subprocess.run([f"{binaries}/ptxas", "-v", "-arch=sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        dump = subprocess.run([f"{binaries}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    sass = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    ops = {}
    for _, text in sass:
        words = text.split()
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return dict(registers=int(regs[0]) if regs else None, spilled=int(spill[0]) if spill else None,
                shared=k.metadata.shared, sass=sass, ops=ops)


def top_ops(ops: dict, n: int = 10) -> str:
    """`sm90_report`'s opcode counts, the n commonest: "IMAD 207, PRMT 166, ..."."""
    return ", ".join(f"{op} {c}" for op, c in sorted(ops.items(), key=lambda x: -x[1])[:n])


GPU_STATE_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu")
GPU_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer name first


def gpu_state(device) -> dict | None:
    """The GPU's clocks, power and temperature now, from `nvidia-smi` (None: not a CUDA device, or no nvidia-smi), so
    that two runs of one command on different machines can be told apart by their clocks. Keys are nvidia-smi's
    field names; a field it cannot report reads as it prints it ("[N/A]"); a failed query gives {"error": ...}.
    `clocks_reasons` is the active clock-limiting reasons bitmask where the driver reports one."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    target = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}") if uuid else str(index)

    def query(fields):
        r = subprocess.run(["nvidia-smi", "-i", target, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        values = [v.strip() for v in r.stdout.strip().split(",")]
        if r.returncode != 0 or len(values) != len(fields):
            raise RuntimeError((r.stderr or r.stdout).strip()[:200] or f"nvidia-smi exited {r.returncode}")
        return dict(zip(fields, values))

    try:
        state = query(GPU_STATE_FIELDS)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    for field in GPU_REASON_FIELDS:
        try:
            state["clocks_reasons"] = query((field,))[field]
            break
        except (OSError, subprocess.SubprocessError, RuntimeError):
            continue
    return state


def gpu_state_line(state: dict | None) -> str:
    """`gpu_state` in a few words: "SM 1980/1980 MHz, mem 3201 MHz, 412 W of 700 W, 51 C, reasons 0x...";
    "" for None."""
    if not state:
        return ""
    if "error" in state:
        return f"nvidia-smi: {state['error']}"
    g = state.get
    words = [f"SM {g('clocks.sm')}/{g('clocks.max.sm')}", f"mem {g('clocks.mem')}",
             f"{g('power.draw')} of {g('power.limit')}", f"{g('temperature.gpu')} C"]
    if "clocks_reasons" in state:
        words.append(f"reasons {state['clocks_reasons']}")
    return ", ".join(words)


def _env_prefix() -> str:
    """The environment settings that change what a run measures (allocator, Triton), as `NAME=value ` prefixes."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
    return "".join(f"{n}={os.environ[n]} " for n in names if os.environ.get(n))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def launch_fields(cls, settings: Sequence[str]) -> dict:
    """Fields of the launch dataclass `cls` from `NAME=VALUE` strings (names in any case; values ints, `None`, `True`
    or `False`), e.g. `["tail_tile=64"]`; an unknown name or a missing value exits with what to write instead."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    fields = {}
    for kv in settings:
        key, sep, value = kv.partition("=")
        key = key.lower()
        if not sep or key not in names:
            raise SystemExit(f"launch settings are {cls.__name__} fields as NAME=VALUE ({', '.join(sorted(names))}), "
                             f"got {kv!r}")
        fields[key] = None if value == "None" else (value == "True" if value in ("True", "False") else int(value))
    return fields


def topk_launch_fields(settings: Sequence[str]) -> dict:
    """`TopKLaunch` fields from `NAME=VALUE` strings (`launch_fields`)."""
    from triton_kernels import topk as topk_mod

    return launch_fields(topk_mod.TopKLaunch, settings)


def set_topk_launch(settings: Sequence[str]):
    """Replace the Top-K kernels' module default (`triton_kernels.topk.TOPK_LAUNCH`, which every `topk_pages`
    call without `launch=` reads) by one with these `TopKLaunch` fields (`topk_launch_fields`): a benchmark's
    `--topk-launch`, to time a launch setting inside a whole decode. Returns the launch now in force."""
    import dataclasses

    from triton_kernels import topk as topk_mod

    topk_mod.TOPK_LAUNCH = dataclasses.replace(topk_mod.TOPK_LAUNCH, **topk_launch_fields(settings))
    return topk_mod.TOPK_LAUNCH


def set_gemv_launch(settings: Sequence[str]):
    """Replace the decode GEMV's module default (`triton_kernels.gemv.GEMV_LAUNCH`, read at every `gemv` call without
    `launch=`) by one with these `GemvLaunch` fields: a benchmark's `--gemv-launch` (e.g. `pdl=False`). Returns the
    launch now in force."""
    import dataclasses

    from triton_kernels import gemv as gemv_mod

    gemv_mod.GEMV_LAUNCH = dataclasses.replace(gemv_mod.GEMV_LAUNCH, **launch_fields(gemv_mod.GemvLaunch, settings))
    return gemv_mod.GEMV_LAUNCH


def ints(s: str) -> list[int]:
    """`"64,128"` -> `[64, 128]`."""
    return [int(x) for x in s.split(",") if x]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model / device / dtype / threads arguments every evaluation script takes."""
    p.add_argument("--model", default=None, help="local folder or Hub id (default: SmolLM2-135M-Instruct, offline)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy box)")


def write_report(out: str, report: dict, title: str, notes: list[str], lines: list[str]) -> None:
    """`report` as JSON at `out`, and beside it a markdown file: title, the environment block
    (`report["env"]`), `notes` (bullet lines) and the table `lines`."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
    env = report["env"]
    md = [f"# {title}", "", f"- command: `{env['command']}`", f"- date: {env['date']}",
          f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
          f"- machine: {env['machine']} (device {env['device']})", *notes, "", *lines, ""]
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("\n".join(md))
