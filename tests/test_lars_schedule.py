"""The flagship's LARS lets its lr schedule act; LARC's trust_clip at lr 25 leaves the lr's size without effect.

A two-layer MLP on scikit-learn's handwritten digits trains for 40 steps (batch 128, one process) under the
optimizer that configs/resnet50_dawnbench.yaml builds, along that config's schedule squeezed into the 40 steps
(warm-up to 25 over the first half, then linear decay to 0.2, cyclic momentum 0.98-0.9). Two runs that differ
only in the lr schedule are compared by how far apart their final weights end, relative to how far they moved.

With the trust range [1e-5, 1] a step's own rate is lr x ratio: another schedule moves the weights elsewhere.
With trust_clip it is lr x min(ratio / lr, 1) = min(ratio, lr), which at lr >> ratio (ratios stay below 0.1
here) is the ratio whatever the lr. The lr then acts only through momentum: the buffer holds ratio / lr x g
and the step multiplies it by the current lr, so the update is u_t = ratio_t x g_t + mu x (lr_t / lr_t-1) x
u_t-1, SGD momentum at the rate `ratio` with momentum mu x lr_t / lr_t-1. Hence the two comparisons below:
scaling the whole schedule (same lr_t / lr_t-1), and warm-up-and-decay against a constant lr without momentum.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from sklearn.datasets import load_digits

from kernels import FusedLARS
from recipes.resnet50 import Config
from trainer.config import load_config
from trainer.optim import build_optimizer, set_lr_momentum
from trainer.schedules import get_lr, get_momentum

FLAGSHIP = "configs/resnet50_dawnbench.yaml"
# The flagship as it was: LARC clip mode, no range, no Nesterov.
TRUST_CLIP = ["optim.trust_clip=true", "optim.min_trust_ratio=0", "optim.max_trust_ratio=null",
              "optim.nesterov=false"]
STEPS, BATCH = 40, 128

Schedule = Callable[[int], tuple[float, float]]  # step -> (lr, momentum)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]  # small models: threads only add overhead


def recipe(cfg: Config, scale: float = 1.0) -> Schedule:
    """The config's lr and momentum schedule over STEPS steps, each at the middle of its span (so no step
    has the warm-up's lr of exactly 0); `scale` multiplies the lr (not the momentum)."""
    peak = cfg.optim.lr

    def at(step: int) -> tuple[float, float]:
        lr = get_lr(cfg.train.epochs * (step + 0.5) / STEPS, cfg.schedule, peak, cfg.train.epochs)
        return scale * lr, get_momentum(lr, peak, cfg.schedule, cfg.optim.momentum)
    return at


def constant(lr: float, momentum: float) -> Schedule:
    return lambda step: (lr, momentum)


def train(cfg: Config, schedule: Schedule, digits: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """Weights at the start and after STEPS steps of FusedLARS built from cfg.optim, along `schedule`.
    The layers have no biases: those would take plain SGD momentum at the raw lr of 25 (lars_exclude)."""
    x, y = digits
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10, bias=False))
    optimizer = build_optimizer(model, cfg.optim)
    assert isinstance(optimizer, FusedLARS)
    batches = torch.Generator().manual_seed(1)  # the same batches in every run
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    for step in range(STEPS):
        index = torch.randint(0, len(x), (BATCH,), generator=batches)
        loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        set_lr_momentum(optimizer, *schedule(step))
        optimizer.step()
    return [start, torch.cat([p.detach().flatten() for p in model.parameters()])]


def apart(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Distance between two runs' final weights, relative to how far run a's weights moved."""
    return ((a[1] - b[1]).norm() / (a[1] - a[0]).norm()).item()


# Pairs of schedules that trust_clip cannot tell apart while lr >> ratio (see the module docstring).
COMPARISONS = {
    "recipe vs recipe x 0.1": lambda cfg: (recipe(cfg), recipe(cfg, 0.1)),
    "warm-up and decay vs constant peak, no momentum": lambda cfg: (
        lambda step: (recipe(cfg)(step)[0], 0.0), constant(cfg.optim.lr, 0.0)),
}


@pytest.mark.parametrize("comparison", COMPARISONS)
def test_trust_range_lets_the_lr_schedule_act(comparison: str, digits) -> None:
    cfg = load_config(Config, FLAGSHIP)
    assert (cfg.optim.trust_clip, cfg.optim.min_trust_ratio, cfg.optim.max_trust_ratio) == (False, 1e-5, 1.0)
    first, second = COMPARISONS[comparison](cfg)
    assert apart(train(cfg, first, digits), train(cfg, second, digits)) > 0.3


@pytest.mark.parametrize("comparison", COMPARISONS)
def test_trust_clip_at_lr_25_leaves_the_lr_without_effect(comparison: str, digits) -> None:
    """The defect of the previous flagship config: the same weights (to float rounding) whatever the lr."""
    cfg = load_config(Config, FLAGSHIP, TRUST_CLIP)
    first, second = COMPARISONS[comparison](cfg)
    assert apart(train(cfg, first, digits), train(cfg, second, digits)) < 1e-3

