"""Optimizers by name (`optim.name`), and parameter groups by module type and tensor rank.

Normalization weights and every 1-D tensor (biases) get no weight decay and, for LARS, no trust ratio
(`lars_exclude`) — chosen by module type and rank, never by parameter name, so torchvision's
`downsample.1` BatchNorms are excluded like the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn

from kernels import FusedLARS, build_adam
from trainer.config import require

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass
class OptimConfig:
    name: Literal["sgd", "lars", "adam", "adamw"] = "sgd"
    """Optimizer: SGD momentum, fused multi-tensor LARS, or (fused) Adam / AdamW."""
    lr: float = 0.1
    """Peak learning rate for the global batch (the schedule warms up to it and decays from it)."""
    momentum: float = 0.9
    """SGD/LARS momentum; with schedule.momentum_min set, the upper end of the cyclic momentum."""
    nesterov: bool = False
    """Nesterov momentum (SGD and LARS)."""
    weight_decay: float = 5.0e-5
    """L2 weight decay (coupled, added to the gradient) for SGD/LARS/Adam; decoupled for AdamW."""
    no_decay_norm_and_bias: bool = True
    """Exclude normalization weights and 1-D tensors from weight decay (and from LARS trust ratios)."""
    trust_coefficient: float = 0.001
    """LARS trust coefficient (eta) in eta * ||w|| / (||g|| + wd * ||w|| + eps)."""
    trust_clip: bool = False
    """LARS: clip the local rate so that trust_ratio * lr never exceeds lr (LARC 'clip' mode)."""
    min_trust_ratio: float = 0.0
    """LARS: lower bound of the trust ratio, so the local rate is lr x clip(ratio, min, max); 0 = none."""
    max_trust_ratio: float | None = None
    """LARS: upper bound of the trust ratio (see min_trust_ratio); null = none."""
    eps: float = 1.0e-8
    """Denominator epsilon (LARS trust ratio, Adam)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam / AdamW moment decay rates."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        require(0 <= self.momentum < 1, f"optim.momentum: must be in [0, 1), got {self.momentum}")
        require(self.weight_decay >= 0, f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        require(all(0 <= b < 1 for b in self.betas), f"optim.betas: each must be in [0, 1), got {self.betas}")
        require(not (self.nesterov and self.momentum == 0), "optim.nesterov: needs optim.momentum > 0")
        require(self.min_trust_ratio >= 0, f"optim.min_trust_ratio: must be >= 0, got {self.min_trust_ratio}")
        require(self.max_trust_ratio is None or self.max_trust_ratio > 0,
                f"optim.max_trust_ratio: must be > 0 (or null for no bound), got {self.max_trust_ratio}")
        require(self.max_trust_ratio is None or self.min_trust_ratio <= self.max_trust_ratio,
                f"optim.min_trust_ratio: {self.min_trust_ratio} is above optim.max_trust_ratio "
                f"{self.max_trust_ratio}; the range must be min <= max")
        require(not (self.trust_clip and (self.min_trust_ratio > 0 or self.max_trust_ratio is not None)),
                "optim.trust_clip: cannot be combined with optim.min_trust_ratio / optim.max_trust_ratio "
                "(two different clips of the trust ratio); set optim.trust_clip=false to use the range, "
                "or leave the range unset")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two groups: decayed weights, and norm/bias tensors with no decay and `lars_exclude: True`."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            excluded = cfg.no_decay_norm_and_bias and (isinstance(module, _NORM_TYPES) or p.ndim <= 1)
            (no_decay if excluded else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "lars_exclude": False}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lars_exclude": True})
    return groups


def _sgd(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    for g in groups:  # plain SGD does not know the LARS flag
        g.pop("lars_exclude", None)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=True)


def _lars(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    return FusedLARS(groups, lr=cfg.lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient,
                     eps=cfg.eps, nesterov=cfg.nesterov, trust_clip=cfg.trust_clip,
                     min_trust_ratio=cfg.min_trust_ratio, max_trust_ratio=cfg.max_trust_ratio)


def _adam(name: str) -> Callable[[list[dict], OptimConfig], torch.optim.Optimizer]:
    def build(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
        for g in groups:
            g.pop("lars_exclude", None)
        return build_adam(groups, name=name, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return build


OPTIMIZERS: dict[str, Callable[[list[dict], OptimConfig], torch.optim.Optimizer]] = {
    "sgd": _sgd, "lars": _lars, "adam": _adam("adam"), "adamw": _adam("adamw"),
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.name` over `model`'s parameter groups."""
    return OPTIMIZERS[cfg.name](param_groups(model, cfg), cfg)


def set_lr_momentum(optimizer: torch.optim.Optimizer, lr: float, momentum: float | None) -> None:
    """Apply the scheduled rate, and momentum to the groups that have one (None leaves momentum alone)."""
    for g in optimizer.param_groups:
        g["lr"] = lr
        if momentum is not None and "momentum" in g:
            g["momentum"] = momentum


def optimizer_metrics(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The optimizer's own per-step scalars (e.g. FusedLARS's clipped trust ratios; none for torch's own)."""
    read = getattr(optimizer, "step_metrics", None)
    return {name: float(value) for name, value in read().items()} if read is not None else {}


def maybe_clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clip before every update, as a step pre-hook: it runs after the communicator averaged the gradients
    and after the GradScaler unscaled them, and not at all on a step the scaler skips (inf/NaN)."""
    if max_norm <= 0:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def clip(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(clip)
