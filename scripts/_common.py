"""Shared by the evaluation scripts: the environment block every results file records."""
import datetime
import os
import platform
import sys

import torch


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
                device=str(device), command="python " + " ".join(sys.argv))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ints(s: str) -> list[int]:
    """`"64,128"` -> `[64, 128]`."""
    return [int(x) for x in s.split(",") if x]


def add_model_args(p) -> None:
    """The model / device / dtype / threads arguments every evaluation script takes."""
    p.add_argument("--model", default=None, help="local folder or Hub id (default: SmolLM2-135M-Instruct, offline)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy box)")


def write_report(out: str, report: dict, title: str, notes: list[str], lines: list[str]) -> None:
    """`report` as JSON at `out`, and beside it a markdown file: title, the environment block
    (`report["env"]`), `notes` (bullet lines) and the table `lines`."""
    import json

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
    env = report["env"]
    md = [f"# {title}", "", f"- command: `{env['command']}`", f"- date: {env['date']}",
          f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
          f"- machine: {env['machine']} (device {env['device']})", *notes, "", *lines, ""]
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("\n".join(md))
