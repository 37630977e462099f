"""Round 25 probe: round 21's unexplained step of the int8_channel fused-step token test (one step's logits 0.64
apart from the separate kernels', with the decode GEMV on only). Same model and prompt as
tests/gpu/test_gpu_fused_step.py; each case decodes with the separate kernels and with the fused step (eager steps),
and prints the largest logit difference of every step. Cases: int8_channel and key-dtype bounds, the GEMV off, on
(launched dependently, the default) and on without its dependent launch (`GemvLaunch.pdl=False`)."""
import dataclasses
import sys

import torch

sys.path.insert(0, ".")
import triton_kernels.gemv as gemv_mod  # noqa: E402
from tests.gpu.test_gpu_fused_step import DEV, _generate, _model  # noqa: E402

DEFAULT = gemv_mod.GEMV_LAUNCH
model = _model(4, "llama")
ids = torch.randint(2, 1000, (1, 3000), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
for bounds in ("int8_channel", "key_dtype"):
    for gemv, pdl in ((False, True), (True, True), (True, False)):
        gemv_mod.GEMV_LAUNCH = dataclasses.replace(DEFAULT, pdl=pdl)
        runs = {}
        for fused in (False, "auto"):
            runs[fused], kernels = _generate(model, ids, False, bounds=bounds, decode_gemv=gemv, fused_step=fused)
        sep, fus = runs[False], runs["auto"]
        diffs = [(a - b).abs().max().item() for a, b in zip(sep.scores, fus.scores)]
        over = [i for i, d in enumerate(diffs) if d > 5e-3]
        print(f"bounds={bounds} decode_gemv={gemv} gemv_pdl={pdl}: tokens equal "
              f"{torch.equal(sep.sequences, fus.sequences)}; steps over 5e-3: {over}; max {max(diffs):.4f}; "
              f"{kernels[0]}", flush=True)
gemv_mod.GEMV_LAUNCH = DEFAULT
