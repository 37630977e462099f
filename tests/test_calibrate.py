"""quest_hf.calibrate on a tiny random model: a valid config, the promised bytes, usable by patch_model."""
import pytest
import torch

from quest_hf import QuestConfig, calibrate, patch_model
from quest_hf.calibration import DENSE, allocate, config_bytes, flat_bytes, measure, resolve_bounds, to_config
from quest_hf.selectors import SELECTORS, policy_names

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
    assert "_calibration_probe" not in policy_names()  # the probe is never registered
    for i in range(4):
        assert m.mass[i][DENSE] == m.recall[i][DENSE] == 1.0
        mass = [m.mass[i][b] for b in (32, 64, 128)]
        assert all(0.0 < x <= 1.0 + 1e-6 for x in mass) and mass == sorted(mass)  # more pages, more attention
        cost = [m.bytes[i][o] for o in m.options]
        assert cost[:3] == sorted(cost[:3])


def test_measure_never_registers_its_probe(monkeypatch):
    # The probe selector is handed to the measured cache, not put in the registry: during the measurement too, the
    # registry holds what it held before.
    from quest_hf import calibration

    seen, attend = [], calibration._Probe.attend

    def watched(self, *args, **kwargs):
        seen.append(dict(SELECTORS))
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(calibration._Probe, "attend", watched)
    before = dict(SELECTORS)
    model = tiny_model("llama", heads=4, kv_heads=2, layers=2)
    with pytest.raises(ValueError, match="unknown policy 'h2o'; choose one of quest"):
        measure(model, IDS[:, :96], budgets=(32,), queries=2, policy="h2o")
    with pytest.raises(ValueError, match="bounds='int8' is read by policy 'quest' only; policy 'streaming'"):
        measure(model, IDS[:, :96], budgets=(32,), queries=2, policy="streaming", bounds="int8")
    with one_thread():
        m = measure(model, IDS[:, :96], budgets=(32,), queries=2)
    assert m.num_layers == 2 and seen and all(s == before for s in seen) and SELECTORS == before


@pytest.mark.parametrize("budget", [32, 64])
def test_equal_bytes_allocation_is_a_valid_config(measured, budget):
    model, m = measured
    choice = allocate(m, budget)
    cfg = to_config(choice, budget)
    cfg.check_layers(4)
    assert cfg.budget == budget and len(cfg.layer_budgets) == 4 and all(0 <= i < 4 for i in cfg.dense)
    assert all(b in (32, 64, 128) or cfg.is_dense(i) for i, b in enumerate(cfg.layer_budgets))
    # Bytes per step as promised: at most the flat budget's (first 2 layers dense), and it gains on the default
    # objective ("error") and, allocated by mass, on mass.
    flat = flat_bytes(m, budget)
    assert config_bytes(m, cfg) <= flat * (1 + 1e-9)
    for metric, pick in (("error", choice), ("mass", allocate(m, budget, objective="mass"))):
        gain = getattr(m, metric)
        assert sum(gain[i][c] for i, c in enumerate(pick)) >= sum(gain[i][DENSE if i < 2 else budget]
                                                                  for i in range(4)) - 1e-9
    patch_model(model, config=cfg)  # patch_model takes it (the layer count matches)
    assert model._quest_state.config == cfg


def test_target_allocation(measured):
    _, m = measured
    for metric, target in (("mass", 0.9), ("error", 0.99)):
        choice, gain = allocate(m, target=target, objective=metric), getattr(m, metric)
        for i, c in enumerate(choice):
            assert gain[i][c] >= target
            assert all(m.bytes[i][o] >= m.bytes[i][c] for o in m.options if gain[i][o] >= target)


def test_calibrate_end_to_end_and_refusals():
    model = tiny_model("llama", heads=4, kv_heads=2, layers=3)
    with one_thread():
        cfg = calibrate(model, IDS, budget=64, budgets=(32, 128), queries=4, tokens=256)
    assert isinstance(cfg, QuestConfig) and cfg.budget == 64 and len(cfg.layer_budgets) == 3
    assert cfg.bounds == "key_dtype"  # the default; bounds="auto" / "int8": test_int8_bounds_buy_pages_...
    assert [resolve_bounds(p) for p in ("quest", "streaming", "qcode1_2s")] == ["int8", "key_dtype", "key_dtype"]
    assert resolve_bounds("quest", "key_dtype") == "key_dtype"
    with pytest.raises(ValueError, match="covers the 256-token calibration text"):
        calibrate(model, IDS, budget=256, queries=4, tokens=256)
    with pytest.raises(ValueError, match="tokenizer="):
        calibrate(model, "some text")


def test_error_metrics_follow_the_selection(measured):
    # "output" / "error" are 1 - |error of the layer's output| over |its output| / |the residual stream|: exactly 1
    # where the selection holds every token (sparse attention is then exact), below 1 where it misses attention.
    _, m = measured
    assert m.bounds == "key_dtype" and m.flat == m.bytes
    exact = missed = 0
    for i in range(m.num_layers):
        assert m.output[i][DENSE] == m.error[i][DENSE] == 1.0
        for b in (32, 64, 128):
            if m.mass[i][b] > 1 - 1e-6:
                assert m.output[i][b] == pytest.approx(1.0, abs=1e-4) and m.error[i][b] == pytest.approx(1.0, abs=1e-4)
                exact += 1
            else:
                assert m.output[i][b] < 1 - 1e-6 and m.error[i][b] < 1 - 1e-6
                assert m.error[i][b] > m.output[i][b] - 1.0  # an error relative to a larger norm (|h| >> 0 here)
                missed += 1
    assert missed > 0


@pytest.mark.parametrize("objective", ["error", "output", "recall"])
def test_every_objective_gives_an_equal_bytes_config(measured, objective):
    _, m = measured
    choice = allocate(m, 32, objective=objective)
    gain = getattr(m, objective)
    assert sum(m.bytes[i][c] for i, c in enumerate(choice)) <= flat_bytes(m, 32) * (1 + 1e-9)
    assert sum(gain[i][c] for i, c in enumerate(choice)) >= sum(gain[i][DENSE if i < 2 else 32] for i in range(4)) - 1e-9
    with pytest.raises(ValueError, match="objective must be one of"):
        allocate(m, 32, objective="loss")


@pytest.mark.parametrize("kind", ["int8", "int8_channel"])
def test_int8_bounds_buy_pages_at_the_flat_configs_bytes(kind):
    # 8-bit bounds read fewer metadata bytes: the measurement's bytes drop, the flat reference (key-dtype bounds)
    # does not, so the same byte limit buys at least as much.
    model = tiny_model("llama", heads=6, kv_heads=2, layers=4)
    with one_thread():
        m8 = measure(model, IDS, budgets=(32, 64, 128), queries=4, bounds=kind)
        m16 = measure(model, IDS, budgets=(32, 64, 128), queries=4)
        cfg = calibrate(model, IDS, budget=32, budgets=(64, 128), queries=4, bounds=kind, objective="error")
    assert m8.bounds == kind and cfg.bounds == kind
    for i in range(4):
        for b in (32, 64, 128):
            assert m8.bytes[i][b] < m8.flat[i][b]
            assert m8.flat[i][b] == pytest.approx(m16.bytes[i][b], rel=0.1)  # pages as chosen from int8 bounds
    assert flat_bytes(m8, 32) == pytest.approx(flat_bytes(m16, 32), rel=0.1)
    gain8 = sum(m8.error[i][c] for i, c in enumerate(allocate(m8, 32, objective="error")))
    gain16 = sum(m16.error[i][c] for i, c in enumerate(allocate(m16, 32, objective="error")))
    assert gain8 >= gain16 - 0.02
