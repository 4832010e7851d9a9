"""The weights evaluation takes: the trained ones, or their exponential moving average (train.ema_decay).

The average is torch's own `torch.optim.swa_utils.AveragedModel` with `get_ema_multi_avg_fn`, over parameters
and buffers (BatchNorm statistics included), as torchvision's reference recipe's `--model-ema` and timm's
`ModelEmaV2`: after every `every`-th applied optimizer step, ema = decay * ema + (1 - decay) * weights; the
first update copies the weights. Its state travels in the task's checkpointed state; export reads it from
there (`averaged_weights`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

PREFIX = "module."
"""Where AveragedModel's state dict keeps the averaged copy's entries."""


class RawWeights:
    """train.ema_decay 0 (the null object): evaluation takes the trained model itself; nothing to update or save."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model
        """The module evaluation runs: the trained model."""

    def maybe_update(self, step: int) -> None:
        """Nothing to average."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (a checkpoint's average, if any, is left unused)."""


class WeightEma(RawWeights):
    """An exponential moving average of `model`'s parameters and buffers, updated by `maybe_update` at every
    `every`-th global step; evaluation runs its copy (`module`)."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1) -> None:
        self.source, self.every = model, every
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.averaged.requires_grad_(False)
        self.module = self.averaged.module

    def maybe_update(self, step: int) -> None:
        """Fold the model's current weights into the average when `step` (the global step just applied) is
        due."""
        if step % self.every == 0:
            self.averaged.update_parameters(self.source)

    def metrics(self) -> dict[str, float]:
        return {"eval/ema": 1.0}

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:  # empty: a checkpoint of a run without the average, which starts at the next update
            self.averaged.load_state_dict(state)


def build_eval_weights(model: nn.Module, decay: float, every: int = 1) -> RawWeights:
    """The weights evaluation takes: `model`'s moving average with `decay` per update, every `every` steps
    (`WeightEma`), or with `decay` 0 the model itself (`RawWeights`)."""
    return WeightEma(model, decay, every) if decay > 0 else RawWeights(model)


def averaged_weights(state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The averaged model's own state dict (the trained model's keys) from a `WeightEma.state_dict`; None when
    `state` holds no average."""
    if not state:
        return None
    return {key[len(PREFIX):]: value for key, value in state.items() if key.startswith(PREFIX)}
