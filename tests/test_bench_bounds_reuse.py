"""scripts/bench_kernels.py's 8-bit bounds / reuse rows: the options parse and the CPU dry path runs the steps
against their references (the timing itself needs a GPU: the lead runs it on the device)."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_names_the_new_options(capsys):
    with pytest.raises(SystemExit) as e:
        _load().main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--bounds" in out and "--reselect-every" in out and "--dry" in out


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the dry path runs the Triton kernels: a GPU or TRITON_INTERPRET=1")
def test_dry_path_runs_the_int8_and_reuse_steps(capsys, single_thread):
    _load().main(["--dry", "--bounds", "int8", "--reselect-every", "3"])  # int8 and reuse in one step: the slow part
    out = capsys.readouterr().out
    assert "8-bit bounds and reuse steps match their references" in out
    assert "1 variant(s)" in out and "('int8', 3)" in out
