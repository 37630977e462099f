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
