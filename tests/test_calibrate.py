"""quest_hf.calibrate on a tiny random model: a valid config, the promised bytes, usable by patch_model."""
import pytest
import torch

from quest_hf import QuestConfig, calibrate, patch_model
from quest_hf.calibration import DENSE, allocate, config_bytes, flat_bytes, measure, to_config
from quest_hf.selectors import policy_names

from .conftest import one_thread, tiny_model

IDS = torch.randint(2, 97, (1, 320), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def measured():
    model = tiny_model("llama", heads=6, kv_heads=2, layers=4)
    with one_thread():
        return model, measure(model, IDS, budgets=(32, 64, 128), queries=6)


def test_measurement_is_consistent(measured):
    _, m = measured
    assert m.options == [32, 64, 128, DENSE] and m.num_layers == 4 and m.context == 320 and m.queries == 6
    assert "_calibration_probe" not in policy_names()  # the probe policy is gone afterwards
    for i in range(4):
        assert m.mass[i][DENSE] == m.recall[i][DENSE] == 1.0
        mass = [m.mass[i][b] for b in (32, 64, 128)]
        assert all(0.0 < x <= 1.0 + 1e-6 for x in mass) and mass == sorted(mass)  # more pages, more attention
        cost = [m.bytes[i][o] for o in m.options]
        assert cost[:3] == sorted(cost[:3])


@pytest.mark.parametrize("budget", [32, 64])
def test_equal_bytes_allocation_is_a_valid_config(measured, budget):
    model, m = measured
    choice = allocate(m, budget)
    cfg = to_config(choice, budget)
    cfg.check_layers(4)
    assert cfg.budget == budget and len(cfg.layer_budgets) == 4 and all(0 <= i < 4 for i in cfg.dense)
    assert all(b in (32, 64, 128) or cfg.is_dense(i) for i, b in enumerate(cfg.layer_budgets))
    # Bytes per step as promised: at most the flat budget's (first 2 layers dense), and it gains attention.
    flat = flat_bytes(m, budget)
    assert config_bytes(m, cfg) <= flat * (1 + 1e-9)
    flat_mass = sum(m.mass[i][DENSE if i < 2 else budget] for i in range(4))
    assert sum(m.mass[i][c] for i, c in enumerate(choice)) >= flat_mass - 1e-9
    patch_model(model, config=cfg)  # patch_model takes it (the layer count matches)
    assert model._quest_state.config == cfg


def test_target_allocation(measured):
    _, m = measured
    choice = allocate(m, target=0.9)
    for i, c in enumerate(choice):
        assert m.mass[i][c] >= 0.9
        assert all(m.bytes[i][o] >= m.bytes[i][c] for o in m.options if m.mass[i][o] >= 0.9)


def test_calibrate_end_to_end_and_refusals():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    with one_thread():
        cfg = calibrate(model, IDS, budget=64, budgets=(32, 128), queries=4, tokens=256)
    assert isinstance(cfg, QuestConfig) and cfg.budget == 64 and len(cfg.layer_budgets) == 3
    with pytest.raises(ValueError, match="covers the 256-token calibration text"):
        calibrate(model, IDS, budget=256, queries=4, tokens=256)
    with pytest.raises(ValueError, match="tokenizer="):
        calibrate(model, "some text")
