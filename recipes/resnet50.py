"""ResNet-50 on ImageNet-layout data, DAWNBench style (Shi et al., MLSys 2021; docs/architecture.md).

    python -m recipes.resnet50 --config configs/resnet50_dawnbench.yaml [--resume] [section.key=value ...]
    torchrun --nproc_per_node 8 --max-restarts 3 -m recipes.resnet50 --config configs/resnet50_1node.yaml
        (a failed rank restarts the job, which resumes from its newest valid checkpoint: README "Reliability")

The method: torchvision's ResNet-50 with the last BatchNorm of every residual block initialised to zero,
label smoothing, no weight decay on BatchNorm and bias, LARS with warm-up and decay, progressive resizing
through the phase table, gradients averaged by the configured communicator, and the clock stopped when
validation reaches the target accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torchvision
from torch import nn

from data import DataConfig, batch_dtype
from trainer.classification import ClassificationTask, ClassificationTrainConfig, build_classification_data
from trainer.comm import CommConfig
from trainer.config import require
from trainer.dist import DistConfig, Topology
from trainer.metrics import LogConfig
from trainer.optim import OptimConfig, build_optimizer
from trainer.run import run
from trainer.schedules import ScheduleConfig, check_phase_table
from trainer.torchvision_weights import check_init, maybe_init_from_torchvision


@dataclass
class ModelConfig:
    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"] = "resnet50"
    """torchvision ResNet variant."""
    zero_init_residual: bool = True
    """Start every residual block as the identity (last BatchNorm gamma = 0)."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy loss."""
    small_map_gemm: bool | Literal["auto"] = "auto"
    """On the CPU, convolutions with at most 4 output positions (the last stage at 32-64 px) run as one GEMM
    (kernels/small_conv.py): true, false, or auto = measured at start-up against oneDNN's direct
    convolutions (trainer/choices.py); same parameters; no effect on CUDA."""
    max_pool_channels_last: bool = True
    """On the CPU, the stem's max pool takes ATen's channels-last kernel for NCHW activations
    (kernels/max_pool.py): the same outputs and gradients, bit for bit, from a vectorized kernel; false = the
    NCHW kernel. No effect on CUDA or with train.channels_last."""
    init: Literal["random", "torchvision"] = "random"
    """Initial weights: random, or torchvision's pretrained weights for model.arch found on this machine
    (model.init_weights, else torch hub's cache); a classifier of another size stays random."""
    init_weights: str = ""
    """With model.init=torchvision: the weights file (a torchvision state dict); "" = look in torch hub's cache."""

    def __post_init__(self) -> None:
        require(0 <= self.label_smoothing < 1, f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        check_init(self.init, self.arch, self.init_weights)  # a missing file: an error now, before any work


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network and its loss."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset location and input pipeline."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and its hyper-parameters."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning rate, momentum and progressive-resizing phases."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Gradient communicator."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process group and topology."""
    train: ClassificationTrainConfig = field(default_factory=ClassificationTrainConfig)
    """Epochs, targets, precision, checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Outputs: TensorBoard, JSONL, DAWNBench files."""

    def __post_init__(self) -> None:
        check_phase_table(self.schedule.phases, self.train.epochs, "the ResNet-50 recipe")
        batch_dtype(self.data.dtype, self.train.amp, gpu=False)  # float16 batches into an fp32 model: an error now
        require(not (self.comm.kind == "local" and self.train.ema_decay > 0 and self.train.ema_every_steps > 1),
                f"train.ema_every_steps: must be 1 with comm.kind local (the average folds in the synchronised "
                f"weights once per round, whose ends do not fall on every {self.train.ema_every_steps}th step), got "
                f"{self.train.ema_every_steps}")


class GlobalAvgPool(nn.Module):
    """The mean over height and width, shaped as nn.AdaptiveAvgPool2d(1)'s output (N, C, 1, 1). Its backward is
    an expand, deterministic on CUDA, where adaptive_avg_pool2d's backward raises under train.deterministic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3), keepdim=True)


def build_model(cfg: ModelConfig, num_classes: int, verbose: bool = False) -> nn.Module:
    """torchvision's ResNet, residual blocks starting as the identity (model.zero_init_residual), or from
    torchvision's pretrained weights (model.init), its global pool a `GlobalAvgPool` (no parameters: the state
    dict keeps torchvision's keys); the task applies model.small_map_gemm and model.max_pool_channels_last."""
    model = torchvision.models.get_model(cfg.arch, num_classes=num_classes, zero_init_residual=cfg.zero_init_residual)
    model.avgpool = GlobalAvgPool()
    return maybe_init_from_torchvision(model, cfg.init, cfg.arch, cfg.init_weights, verbose)


def build_task(cfg: Config, topo: Topology, data: Any) -> tuple[ClassificationTask, torch.optim.Optimizer]:
    """Parameter groups (trainer/optim.py): no weight decay and no LARS trust ratio on BatchNorm and biases."""
    model = build_model(cfg.model, data.num_classes, verbose=topo.is_main).to(topo.device)
    task = ClassificationTask(model, data, topo, cfg.schedule.phases, cfg.train, cfg.model.label_smoothing,
                              cfg.model.small_map_gemm, cfg.model.max_pool_channels_last)
    return task, build_optimizer(task.model, cfg.optim)


def main(argv: list[str] | None = None) -> dict:
    return run(Config, build_classification_data, build_task, argv, prog="python -m recipes.resnet50")


if __name__ == "__main__":
    main()
