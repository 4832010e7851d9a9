"""How often the ranks agree on a stop signal under train.preempt_check_every_steps: auto
(trainer/preemption.py): the interval's bound, and real 2-rank gloo groups whose ranks time their steps
differently yet check at the same steps and stop at the same one."""

from __future__ import annotations

import signal
import time

import pytest

from tests.conftest import run_ranks
from trainer.config import ConfigError
from trainer.dist import DistConfig, Topology, setup_distributed
from trainer.preemption import CHECK_SHARE, UNTIMED_CHECKPOINT_SHARE, Preemption, check_interval
from trainer.train_config import TrainConfig


@pytest.mark.unit
@pytest.mark.parametrize("grace_s", [10.0, 25.0, 100.0])
@pytest.mark.parametrize("step_s", [0.003, 0.1, 0.7, 4.0, 30.0])
@pytest.mark.parametrize("checkpoint_s", [None, 0.0, 2.5, 9.0, 60.0])
def test_the_interval_is_the_most_steps_that_fit_half_the_grace_with_the_checkpoint(grace_s, step_s, checkpoint_s):
    n = check_interval(grace_s, step_s, checkpoint_s)
    ckpt = UNTIMED_CHECKPOINT_SHARE * grace_s if checkpoint_s is None else checkpoint_s
    budget = CHECK_SHARE * grace_s
    assert n >= 1
    if n > 1 or step_s + ckpt <= budget:  # it fits (one step always runs: a check needs a step end) ...
        assert n * step_s + ckpt <= budget + 1e-12
        assert (n + 1) * step_s + ckpt > budget  # ... and one step more would not
    else:
        assert n == 1


@pytest.mark.unit
def test_auto_is_the_default_and_a_bad_interval_is_a_config_error():
    assert TrainConfig().preempt_check_every_steps == "auto"
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="train.preempt_check_every_steps: must be auto or > 0"):
            TrainConfig(preempt_check_every_steps=bad)


def _checks(rank: int, world: int, signal_at: int) -> tuple[list[int], int | None]:
    """Up to 40 steps of 20 ms on rank 0 and 60 ms on rank 1 (rank 0 waits for it at each check) under a 1 s
    grace, the ranks' newest checkpoints taking 0.1 s and 0.3 s; rank 1 signals itself during step `signal_at`.
    The steps at whose end this rank took part in a check, and the step the ranks agreed to stop at."""
    topo = setup_distributed(DistConfig())
    preemption = Preemption(topo, grace_s=1.0, check_every_steps=None)
    restore = preemption.install()
    checks, stop = [], None
    try:
        for step in range(1, 41):
            time.sleep(0.02 if rank == 0 else 0.06)
            if rank == 1 and step == signal_at:
                signal.raise_signal(signal.SIGUSR1)
            before = preemption.next_check
            if preemption.agreed(step, checkpoint_s=0.1 if rank == 0 else 0.3):
                stop = step
                break
            if step >= before:
                checks.append(step)
    finally:
        preemption.cancel_watchdog()
        restore()
    return checks, stop


@pytest.mark.dist
def test_ranks_timing_their_steps_differently_check_at_the_same_steps_and_stop_at_the_same_one(tmp_path):
    (checks0, stop0), (checks1, stop1) = run_ranks(_checks, 2, tmp_path, 25, timeout=120)
    assert checks0 == checks1 and stop0 == stop1  # a mismatch would have hung the group in a collective
    assert checks0[:3] == [1, 2, 3]  # the first step's end, then until one interval is timed
    gaps = [b - a for a, b in zip(checks0, checks0[1:])]
    assert max(gaps) > 1, f"auto never went past one step: checks at {checks0}"
    assert all(b <= 2 * a for a, b in zip(gaps, gaps[1:])), f"an interval more than doubled: {checks0}"
    # Half the 1 s grace less the slower rank's 0.3 s checkpoint is 0.2 s: at 60 ms a step (the slower rank's
    # sleep; rank 0 waits for it) no more than 3 steps fit (the ranks' mean checkpoint, 0.2 s, would let 5 fit,
    # rank 0's own 6), so the signal of step 25 is acted on by step 28, inside the grace.
    assert max(gaps) <= 3 and stop0 is not None and 25 <= stop0 <= 28


@pytest.mark.unit
def test_one_process_checks_every_step_and_a_new_epoch_starts_the_intervals_afresh():
    preemption = Preemption(Topology(), grace_s=25.0, check_every_steps=None)
    for step in range(1, 6):  # no process group: a check costs nothing
        assert not preemption.agreed(step, checkpoint_s=1.0) and preemption.next_check == step + 1
    preemption.remeasure(40)
    assert preemption.next_check == 41
