"""The contract between the train loop and a model + data pair (image classification, translation, ...).

`Trainer` (trainer/loop.py) owns everything every recipe shares: the schedule, the communicator, the
optimizer step with loss scaling, checkpoints and resume, time-to-target, metrics and the progress bar.
A `Task` owns what differs: how a batch becomes a loss, how many steps an epoch has, how the model is
evaluated, when the target is reached and how the result reads. Tasks live in trainer/
(`trainer/classification.py`, `trainer/translation.py`); a recipe builds one and `trainer.run` hands it
to the Trainer. A task that subclasses `Task` inherits the optional parts (no test split, no writers of
its own, no counters, no state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from trainer.choices import Probe
from trainer.metrics import Writer
from trainer.schedules import Phase


class Task(Protocol):
    unit: str
    """What one training item is, for throughput metrics: "images" or "tokens" (`time/{unit}_per_s`)."""
    targets: dict[str, float]
    """The configured targets by eval metric name, e.g. {"top1": 0.97, "top5": 0.0} or {"bleu": 25.0} (0 = not
    set); the run summary reports each as `target_<name>` and the last evaluation's value as `final_<name>`."""
    model: nn.Module
    """The network the task trains (the Trainer's model)."""

    def steps_per_epoch(self, phase: Phase) -> int:
        """Optimizer steps in one epoch of `phase` on every rank (equal on all ranks)."""
        ...

    def train_batches(self, phase: Phase, epoch: int, start_step: int = 0) -> Iterator[Any]:
        """This rank's batches of `epoch`, already on the device, from step `start_step` on (a mid-epoch
        resume skips the batches already trained on; the order is a pure function of seed and epoch)."""
        ...

    def loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Forward pass (the Trainer sets train mode and wraps it in autocast): the loss to backpropagate and
        the number of `unit`s in this rank's batch."""
        ...

    def after_step(self, step: int) -> None:
        """After an optimizer step that changed the weights (not one the loss scaler skipped); `step` is the
        global step it completed (e.g. a moving average of the weights folds them in)."""

    def evaluate(self, phase: Phase) -> dict[str, float]:
        """Collective over all ranks: `eval/*` metrics over the whole validation split (the Trainer wraps it
        in no_grad and autocast; the task sets the model's eval mode)."""
        ...

    def target_reached(self, record: dict[str, float]) -> bool:
        """Whether an evaluation record meets the configured target (False when none is set)."""
        ...

    def describe(self, phase: Phase) -> str:
        """One line for the run plan printed at start, e.g. "24 px  global batch 64 (32/rank)"."""
        ...

    def report(self, summary: dict[str, Any]) -> list[str]:
        """Lines for the printed result: the final evaluation (and test scores) in the task's own terms."""
        return []

    def test(self) -> dict[str, float]:
        """Collective: scores on the held-out test split by name, e.g. {"bleu": 27.1}; {} without one. The
        Trainer scores a fresh run before training and every run after it, outside the clock."""
        return {}

    def writers(self, run_dir: Path) -> list[Writer]:
        """Metric writers of this task's own (e.g. the DAWNBench TSV) in `run_dir`, on rank 0; [] when none."""
        return []

    def stats(self) -> dict[str, float]:
        """Data-side counters for the epoch record (cache hits, skipped items); {} when none."""
        return {}

    def choice_space(self) -> dict[str, list[Any]]:
        """The task's own machine-dependent choices and their candidates (trainer/choices.py), e.g.
        {"channels_last": [False, True]} when left at auto; a pinned choice has one; {} when none."""
        return {}

    def apply_choices(self, choice: dict[str, Any]) -> None:
        """Switch to `choice`: a value for every name of `choice_space`."""

    def probes(self, phases: list[tuple[Phase, int, int]]) -> list[Probe]:
        """A batch per distinct shape the run trains or evaluates at, for measured choices, from (phase,
        training steps, evaluations) per phase; [] = nothing to measure with (choices left at auto keep their
        first candidate)."""
        return []

    def prepare_probe(self, batch: Any) -> Any:
        """A probe's batch as `loss` takes it under the applied choices (e.g. moved into the model's memory
        layout, as every training batch is)."""
        return batch

    def input_candidates(self, cores: int) -> list[int]:
        """data.workers' candidates for a rank with `cores` cores when left at auto (trainer/run_choices.py); one
        value when pinned; [] when the task's input has no such setting."""
        return []

    def input_batches(self, phase: Phase, workers: int) -> Iterator[Any]:
        """Endless training batches of `phase` from a loader of its own with `workers`, as the loader delivers
        them (for measuring `input_candidates`; closing the iterator stops the loader)."""
        raise NotImplementedError

    def use_workers(self, workers: int) -> None:
        """Build the loaders from now on with `workers`."""

    def state_dict(self) -> dict[str, Any]:
        """Task state to checkpoint beyond the model (e.g. a data sampler's position); {} when none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
