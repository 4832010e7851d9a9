import pytest

from trainer.schedules import Phase, ScheduleConfig, check_phases, get_lr, get_momentum, get_phase
from trainer.config import ConfigError

pytestmark = pytest.mark.unit


def test_warmup_then_linear_decay_at_boundaries():
    cfg = ScheduleConfig(warmup_epochs=2, warmup_start_factor=0.1, decay="linear", final_lr=0.2)
    assert get_lr(0, cfg, 10.0, 12) == pytest.approx(1.0)
    assert get_lr(1, cfg, 10.0, 12) == pytest.approx(5.5)          # halfway through warm-up
    assert get_lr(2, cfg, 10.0, 12) == pytest.approx(10.0)         # peak at the end of warm-up
    assert get_lr(7, cfg, 10.0, 12) == pytest.approx(5.1)          # halfway down to final_lr
    assert get_lr(12, cfg, 10.0, 12) == pytest.approx(0.2)


def test_cosine_poly_step_constant():
    assert get_lr(5, ScheduleConfig(decay="cosine"), 1.0, 10) == pytest.approx(0.5)
    assert get_lr(5, ScheduleConfig(decay="poly", poly_power=2), 1.0, 10) == pytest.approx(0.25)
    step = ScheduleConfig(decay="step", step_milestones=[3, 6], step_gamma=0.1)
    assert [get_lr(e, step, 1.0, 10) for e in (2.99, 3, 5.99, 6)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert get_lr(9, ScheduleConfig(decay="constant"), 0.3, 10) == 0.3


def test_schedule_length_can_differ_from_run_length():
    cfg = ScheduleConfig(decay="linear", total_epochs=100)
    assert get_lr(50, cfg, 1.0, 10) == pytest.approx(0.5)


def test_cyclic_momentum_is_inverse_to_lr():
    cfg = ScheduleConfig(momentum_min=0.9)
    assert get_momentum(0.0, 10.0, cfg, 0.98) == pytest.approx(0.98)
    assert get_momentum(10.0, 10.0, cfg, 0.98) == pytest.approx(0.9)
    assert get_momentum(5.0, 10.0, cfg, 0.98) == pytest.approx(0.94)
    assert get_momentum(5.0, 10.0, ScheduleConfig(), 0.9) == 0.9


def test_phase_lookup_and_contiguity():
    phases = [Phase(0, 3, 96, 64), Phase(3, 5, 128, 32)]
    check_phases(phases, 5)
    assert [get_phase(phases, e).image_size for e in range(5)] == [96, 96, 96, 128, 128]
    with pytest.raises(ConfigError, match=r"phases\[1\]\.start_epoch: expected 3"):
        check_phases([Phase(0, 3, 96, 64), Phase(4, 5, 128, 32)], 5)
    with pytest.raises(ConfigError, match="last phase ends at epoch 5 but train.epochs is 6"):
        check_phases(phases, 6)
    with pytest.raises(ConfigError, match="start_epoch 3 must be >= 0 and < end_epoch 3"):
        Phase(3, 3, 96, 64)


def test_inverse_sqrt_warmup_then_decay():
    # fairseq's inverse_sqrt: linear warm-up from warmup_init_lr, then peak * sqrt(warmup / t); with 100 steps per
    # epoch, 4,000 warm-up updates are 40 epochs and the shape is the same in epochs as in updates.
    cfg = ScheduleConfig(warmup_epochs=40, warmup_start_factor=1e-4, decay="inverse_sqrt", final_lr=0.5)
    assert get_lr(0, cfg, 1e-3, 100) == pytest.approx(1e-7)
    assert get_lr(20, cfg, 1e-3, 100) == pytest.approx(1e-7 + (1e-3 - 1e-7) / 2)
    assert get_lr(40, cfg, 1e-3, 100) == pytest.approx(1e-3)                     # peak at the end of warm-up
    assert get_lr(160, cfg, 1e-3, 100) == pytest.approx(0.5e-3)                  # 4x the warm-up: half the peak
    assert get_lr(360, cfg, 1e-3, 100) == pytest.approx(1e-3 / 3)                # past train.epochs: no clamp
    with pytest.raises(ConfigError, match="inverse_sqrt needs schedule.warmup_epochs > 0"):
        ScheduleConfig(decay="inverse_sqrt")
