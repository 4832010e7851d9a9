"""The `train` section (epochs, precision, checkpoints, preemption) and the other inputs of a `Trainer`: the
root config sections it reads and the runtime components it drives (trainer/loop.py).

The keys are documented field by field below and in docs/reliability.md (checkpoints, resume, preemption).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from trainer.comm import Communicator
from trainer.config import require
from trainer.dist import ReplicaGuard
from trainer.metrics import LogConfig, MetricsLogger
from trainer.schedules import ScheduleConfig


@dataclass
class TrainConfig:
    epochs: int = 10
    """Training epochs (the phase table must end here)."""
    stop_at_target: bool = True
    """Stop as soon as every set target is reached (DAWNBench style)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (and always after the last one)."""
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    """Mixed precision: auto = measured at start-up (trainer/choices.py) among fp32 and bf16 on the CPU, bf16
    and fp16 (with loss scaling) on CUDA; off = fp32; a pinned value this device cannot run is a config
    error."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    max_steps_per_epoch: int = 0
    """Cap on steps per epoch for debugging; 0 = the whole epoch."""
    checkpoint_every_epochs: int = 1
    """Write a checkpoint every this many epochs (and at the end); 0 = never."""
    checkpoint_every_steps: int = 0
    """Also write a checkpoint every this many optimizer steps, inside epochs (a resume continues mid-epoch):
    bounds the work a crash loses; 0 = at epoch ends only."""
    checkpoint_in_background: bool = False
    """Snapshot checkpoints to host memory and write them on a background thread (training goes on during
    the write; a failed write stops the run at the next checkpoint or at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool | Literal["auto"] = "auto"
    """Resume from the newest valid checkpoint in log.dir/checkpoints: true (also --resume); false = a fresh
    run (what log.dir held is archived); auto = when the job was restarted: by torchrun after a failure or a
    preemption (torchrun --max-restarts N sets TORCHELASTIC_RESTART_COUNT) or by a Slurm requeue
    (SLURM_RESTART_COUNT), else fresh."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms): with the same world size and thread
    count, a run killed and resumed ends bitwise equal to an uninterrupted one."""
    loss_scale: Literal["auto", "dynamic", "off"] = "auto"
    """Loss scaling: auto = dynamic with fp16, else off; dynamic = a dynamic scaler at any precision (a step
    with non-finite gradients is skipped and counted in train/skipped_steps); off = none, and a non-finite
    gradient stops the run naming the step."""
    nonfinite_check: Literal["auto", "host", "device"] = "auto"
    """Without a loss scaler, how a non-finite gradient is found: host = a read of the gradients' sum before
    every update (the run stops at that step; one host sync a step); device = a device-side flag that makes the
    optimizer skip its update there, read at log steps and before checkpoints, where the run stops naming the
    first such step (no host sync in a step; needs an optimizer that takes `found_inf`: FusedLARS, fused Adam
    or AdamW); auto = device on CUDA where the optimizer takes it, else host (trainer/nonfinite.py)."""
    compile: Literal["off", "on", "auto"] = "off"
    """torch.compile of the training model (trainer/compiling.py): on = inductor's default mode, compiled at each
    training shape before the clock; auto = measured against eager with the other choices; evaluation stays
    eager."""
    cuda_graphs: Literal["off", "on", "auto"] = "off"
    """Forward and backward replayed as CUDA graphs (torch.compile's reduce-overhead mode; one CUDA rank): on = a
    config error where it cannot run; auto = one more candidate of the measured `compile` choice where it can
    (needs train.compile on or auto)."""
    max_skipped_steps: int = 50
    """Stop when the loss scaler skips this many steps in a row (the weights or the data are broken: not an
    fp16 overflow, which one or two skips fix)."""
    threads: int = 0
    """torch CPU threads per rank; 0 = leave the launcher's setting (torchrun sets 1 per rank)."""
    preempt_grace_s: float = 25.0
    """Seconds between SIGTERM/SIGUSR1 and the forced exit: the ranks finish their step, write a checkpoint
    together and exit with status 75 (restartable); a rank still running after this many seconds exits at
    once with that status, without a checkpoint. Keep it below the platform's notice (30 s on GCP spot, the
    `--signal` time on Slurm) and, when torchrun itself is signalled, below its --shutdown-timeout (30 s by
    default), after which torchrun SIGKILLs the ranks (scripts/slurm/ pass 100 s and 110 s)."""
    calibration_rounds: int = 3
    """Measured choices (train.amp, train.channels_last, model.small_map_gemm left at auto): timed steps per
    candidate combination and phase shape at start-up, after one warm-up step each; the median counts."""
    calibration_budget: float = 0.1
    """Measured choices: no further round starts once the measurement has spent this fraction of the best
    candidate's predicted seconds for the run, one budget for all the choices measured (each one's warm-up and
    first measured round always run)."""
    choices_cache: str = "auto"
    """Folder of the per-machine cache of measured choices (a second identical run starts without measuring):
    auto = $XDG_CACHE_HOME/dawnbench-recipes/choices (~/.cache/... when unset); none = measure every run."""
    preempt_check_every_steps: int | Literal["auto"] = "auto"
    """How often the ranks agree whether one of them was signalled: a collective (and a host sync) at every this
    many step ends. A signal is acted on up to this many steps late: keep that and a checkpoint's write well
    inside train.preempt_grace_s. auto: from each epoch's first step, as many steps as fit, with the slowest
    rank's newest checkpoint write (a quarter of the grace before one is timed), in half the grace, at the
    slowest rank's seconds per step, each interval at most twice the last (trainer/preemption.py)."""

    def __post_init__(self) -> None:
        require(self.epochs > 0, f"train.epochs: must be > 0, got {self.epochs}")
        require(self.eval_every_epochs > 0, f"train.eval_every_epochs: must be > 0, got {self.eval_every_epochs}")
        require(self.max_steps_per_epoch >= 0 and self.checkpoint_every_epochs >= 0 and self.keep_checkpoints > 0
                and self.checkpoint_every_steps >= 0,
                "train.max_steps_per_epoch, train.checkpoint_every_epochs and train.checkpoint_every_steps must be "
                ">= 0, train.keep_checkpoints > 0")
        require(self.max_skipped_steps > 0, f"train.max_skipped_steps: must be > 0, got {self.max_skipped_steps}")
        require(self.calibration_rounds >= 1, f"train.calibration_rounds: must be >= 1, got {self.calibration_rounds}")
        require(self.calibration_budget > 0, f"train.calibration_budget: must be > 0, got {self.calibration_budget}")
        require(self.preempt_grace_s > 0, f"train.preempt_grace_s: must be > 0, got {self.preempt_grace_s}")
        require(self.preempt_check_every_steps == "auto" or self.preempt_check_every_steps > 0,
                f"train.preempt_check_every_steps: must be auto or > 0, got {self.preempt_check_every_steps}")

    def should_resume(self) -> bool:
        """Whether this start resumes: asked for, or (auto) a torchrun restart or a requeued Slurm job."""
        if self.resume == "auto":
            return any(int(os.environ.get(name, "0") or 0) > 0
                       for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        return bool(self.resume)


class RunConfig(Protocol):
    """The sections of a root config the Trainer reads (a recipe's `Config`, or `LoopConfig`)."""

    train: TrainConfig
    schedule: ScheduleConfig
    log: LogConfig


@dataclass
class LoopConfig:
    """A root config of only the sections the Trainer reads: for a Trainer built without a recipe (tests,
    benchmarks, the GPU check)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Epochs, precision, checkpoints."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning rate, momentum and phases."""
    log: LogConfig = field(default_factory=LogConfig)
    """Outputs."""


@dataclass
class Components:
    """The runtime objects a Trainer drives, built from the other sections (`trainer.run` builds them)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    comm: Communicator
    metrics: MetricsLogger = field(default_factory=lambda: MetricsLogger([]))
    """Rank 0's writers; the null logger writes nothing."""
    guard: ReplicaGuard | None = None
    """The replica-consistency check (dist.check_every_steps); None = never."""

