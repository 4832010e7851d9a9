"""Schedules: pure functions of the (fractional) epoch — learning rate, momentum, and the phase table.

The trainer calls them once per iteration with `epoch + step / steps_in_epoch`, so per-epoch rates are
interpolated per iteration even when phases change the number of steps per epoch. `Schedule` binds them to
one run: its phases, its length, and the peak lr and base momentum of the optimizer it drives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from trainer.config import require


@dataclass
class Phase:
    """One stage of progressive resizing: an epoch range with its own image and batch sizes."""

    start_epoch: int = 0
    """First epoch of the phase (inclusive)."""
    end_epoch: int = 1
    """Last epoch of the phase (exclusive); the next phase starts here."""
    image_size: int = 224
    """Training crop size in pixels (square)."""
    batch_size: int = 256
    """Global batch size (all ranks together); must be divisible by the world size."""
    val_image_size: int = 0
    """Validation crop size in pixels; 0 = the training image_size."""
    min_scale: float = 0.0
    """Random-resized-crop lower area bound for this phase; 0 = data.min_scale."""
    lr_scale: float = 1.0
    """Multiplier on the scheduled learning rate during this phase (e.g. 0.5 when the batch halves)."""

    def __post_init__(self) -> None:
        require(0 <= self.start_epoch < self.end_epoch,
                f"schedule.phases: start_epoch {self.start_epoch} must be >= 0 and < end_epoch {self.end_epoch}")
        require(self.image_size > 0 and self.batch_size > 0 and self.val_image_size >= 0,
                "schedule.phases: image_size and batch_size must be > 0, val_image_size >= 0")
        require(0.0 <= self.min_scale <= 1.0, f"schedule.phases: min_scale must be in [0, 1], got {self.min_scale}")
        require(self.lr_scale > 0, f"schedule.phases: lr_scale must be > 0, got {self.lr_scale}")


@dataclass
class ScheduleConfig:
    warmup_epochs: float = 0.0
    """Epochs of linear warm-up from warmup_start_factor x peak lr (optim.lr) to the peak."""
    warmup_start_factor: float = 0.0
    """Learning rate at the first step, as a fraction of the peak."""
    decay: Literal["linear", "cosine", "poly", "step", "constant", "inverse_sqrt"] = "cosine"
    """Shape of the decay from the peak (end of warm-up) to final_lr at the last epoch; inverse_sqrt =
    peak x sqrt(warmup_epochs / epoch) (Vaswani et al., fairseq's inverse_sqrt; ignores final_lr)."""
    final_lr: float = 0.0
    """Learning rate reached at the end of training (absolute, not a fraction)."""
    poly_power: float = 2.0
    """Exponent of the poly decay."""
    step_milestones: list[float] = field(default_factory=list)
    """Epochs at which the step decay multiplies the rate by step_gamma."""
    step_gamma: float = 0.1
    """Factor applied at each step milestone."""
    momentum_min: float = 0.0
    """Cyclic momentum: 0 = constant optim.momentum; otherwise momentum falls from optim.momentum to this
    value as the rate rises to its peak and climbs back as it decays (inverse to the lr)."""
    total_epochs: float = 0.0
    """Length the lr schedule is computed for; 0 = train.epochs (set it to debug a schedule on short runs)."""
    phases: list[Phase] = field(default_factory=list)
    """Progressive-resizing table, contiguous from epoch 0 to train.epochs; empty = one phase from data.*."""

    def __post_init__(self) -> None:
        require(self.warmup_epochs >= 0, f"schedule.warmup_epochs: must be >= 0, got {self.warmup_epochs}")
        require(0 <= self.warmup_start_factor <= 1,
                f"schedule.warmup_start_factor: must be in [0, 1], got {self.warmup_start_factor}")
        require(self.final_lr >= 0, f"schedule.final_lr: must be >= 0, got {self.final_lr}")
        require(0 <= self.momentum_min < 1, f"schedule.momentum_min: must be in [0, 1), got {self.momentum_min}")
        require(self.decay != "inverse_sqrt" or self.warmup_epochs > 0,
                "schedule.decay: inverse_sqrt needs schedule.warmup_epochs > 0 (the decay is sqrt(warmup / epoch))")
        require(list(self.step_milestones) == sorted(self.step_milestones),
                f"schedule.step_milestones: must be increasing, got {self.step_milestones}")


def check_phases(phases: list[Phase], epochs: int) -> None:
    """Phases must tile [0, epochs) without gap or overlap."""
    expected = 0
    for i, p in enumerate(phases):
        require(p.start_epoch == expected,
                f"schedule.phases[{i}].start_epoch: expected {expected} (phases must be contiguous from epoch 0), "
                f"got {p.start_epoch}")
        expected = p.end_epoch
    require(not phases or expected == epochs,
            f"schedule.phases: the last phase ends at epoch {expected} but train.epochs is {epochs}; "
            "make them equal")


def check_phase_table(phases: list[Phase], epochs: int, who: str) -> None:
    """For `who` (a recipe whose image size and batch come from the phase table): at least one phase, and the
    phases tile [0, epochs) (`check_phases`)."""
    require(bool(phases), f"schedule.phases: {who} needs at least one phase (image_size and batch_size per epoch "
                          "range)")
    check_phases(phases, epochs)


def get_phase(phases: list[Phase], epoch: int) -> Phase:
    """The phase that contains `epoch` (phases are contiguous; the last one extends to the end)."""
    for p in phases:
        if p.start_epoch <= epoch < p.end_epoch:
            return p
    return phases[-1]


def get_lr(epoch: float, cfg: ScheduleConfig, peak_lr: float, total_epochs: float) -> float:
    """Learning rate at fractional `epoch`: linear warm-up, then the configured decay to `final_lr`."""
    total = cfg.total_epochs or total_epochs
    if epoch < cfg.warmup_epochs:
        start = cfg.warmup_start_factor * peak_lr
        return start + (peak_lr - start) * epoch / cfg.warmup_epochs
    if cfg.decay == "step":
        return peak_lr * cfg.step_gamma ** sum(epoch >= m for m in cfg.step_milestones)
    if cfg.decay == "inverse_sqrt":  # scale-free: warm-up of N updates = N / steps-per-epoch epochs
        return peak_lr * math.sqrt(cfg.warmup_epochs / epoch)
    if cfg.decay == "constant" or total <= cfg.warmup_epochs:
        return peak_lr
    progress = min(1.0, (epoch - cfg.warmup_epochs) / (total - cfg.warmup_epochs))
    if cfg.decay == "linear":
        remaining = 1.0 - progress
    elif cfg.decay == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # poly
        remaining = (1.0 - progress) ** cfg.poly_power
    return cfg.final_lr + (peak_lr - cfg.final_lr) * remaining


def get_momentum(lr: float, peak_lr: float, cfg: ScheduleConfig, base_momentum: float) -> float:
    """Cyclic momentum, inverse to the lr: base at lr 0, momentum_min at the peak; constant when disabled."""
    if not cfg.momentum_min or peak_lr <= 0:
        return base_momentum
    return base_momentum - (base_momentum - cfg.momentum_min) * min(1.0, lr / peak_lr)


@dataclass
class Schedule:
    """The schedules of one run: the phase table, and lr and momentum at any fractional epoch."""

    cfg: ScheduleConfig
    peak_lr: float
    """The rate warm-up rises to and decay starts from."""
    base_momentum: float | None
    """The upper end of the cyclic momentum; None for an optimizer without momentum (Adam)."""
    total_epochs: float
    """The run's length (train.epochs); schedule.total_epochs, when set, overrides it for the lr."""
    phases: list[Phase]
    """Contiguous from epoch 0 to the end of the run."""

    def phase(self, epoch: int) -> Phase:
        return get_phase(self.phases, epoch)

    def lr(self, epoch: float, phase: Phase) -> float:
        """The rate at fractional `epoch`, scaled by its phase's lr_scale."""
        return get_lr(epoch, self.cfg, self.peak_lr, self.total_epochs) * phase.lr_scale

    def momentum(self, lr: float) -> float | None:
        """The momentum that goes with `lr` (constant unless schedule.momentum_min is set); None without one."""
        return None if self.base_momentum is None else get_momentum(lr, self.peak_lr, self.cfg, self.base_momentum)

    def warmup_steps(self, steps_in_epoch: Callable[[int], int]) -> float:
        """Optimizer steps the warm-up lasts, given the steps of each epoch (phases may differ)."""
        warmup = self.cfg.warmup_epochs
        return sum(min(1.0, warmup - e) * steps_in_epoch(e) for e in range(math.ceil(warmup)))

    def describe(self, steps_in_epoch: Callable[[int], int]) -> str:
        """One line for the run plan: warm-up length in epochs and updates, peak, decay."""
        warmup = (f"warm-up {self.cfg.warmup_epochs:g} epochs = {self.warmup_steps(steps_in_epoch):.0f} updates "
                  f"to " if self.cfg.warmup_epochs else "")
        return f"lr: {warmup}peak {self.peak_lr:g}, then {self.cfg.decay} decay"


def build_schedule(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, epochs: int) -> Schedule:
    """The run's schedule over `epochs`; no phase table means one phase spanning the run (e.g. translation).

    The peak lr and base momentum are the optimizer's own, as `trainer.optim.build_optimizer` set them from
    optim.lr and optim.momentum: the optim section is read in one place.
    """
    return Schedule(cfg, optimizer.defaults["lr"], optimizer.defaults.get("momentum"), float(epochs),
                    cfg.phases or [Phase(start_epoch=0, end_epoch=epochs)])
