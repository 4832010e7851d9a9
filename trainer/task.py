"""The contract between the train loop and a model + data pair (image classification, translation, ...).

`Trainer` (trainer/loop.py) owns everything every recipe shares: the schedule, the communicator, the
optimizer step with loss scaling, checkpoints and resume, time-to-target, metrics and the progress bar.
A `Task` owns what differs: how a batch becomes a loss, how many steps an epoch has, how the model is
evaluated and when the target is reached. Tasks live beside their recipe's components in trainer/
(`trainer/classification.py`, `trainer/translation.py`); recipes build one and hand it to the Trainer.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch

from trainer.schedules import Phase


class Task(Protocol):
    unit: str
    """What one training item is, for throughput metrics: "images" or "tokens" (`time/{unit}_per_s`)."""
    targets: dict[str, float]
    """The configured targets by eval metric name, e.g. {"top1": 0.97, "top5": 0.0} or {"bleu": 25.0} (0 = not
    set); the run summary reports each as `target_<name>` and the last evaluation's value as `final_<name>`."""

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

    def stats(self) -> dict[str, float]:
        """Data-side counters for the epoch record (cache hits, skipped items); {} when none."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Task state to checkpoint beyond the model (e.g. a data sampler's position); {} when none."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...
