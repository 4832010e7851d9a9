"""ResNet-50 on ImageNet-layout data, DAWNBench style (Shi et al., MLSys 2021; DESIGN.md).

    python -m recipes.resnet50 --config configs/resnet50_dawnbench.yaml [--resume] [section.key=value ...]
    torchrun --nproc_per_node 8 -m recipes.resnet50 --config configs/resnet50_1node.yaml
    torchrun --nproc_per_node 8 --max-restarts 3 -m recipes.resnet50 ... train.checkpoint_every_steps=200
        (a failed rank restarts the job, which resumes from the newest valid checkpoint: README "Reliability")

The method: torchvision's ResNet-50 with the last BatchNorm of every residual block initialised to zero,
label smoothing, no weight decay on BatchNorm and bias, LARS with warm-up and decay, progressive resizing
through the phase table, gradients averaged by the configured communicator, and the clock stopped when
validation reaches the target accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torchvision
from torch import nn

from data import DataConfig, DataConfigError, DatasetNotFoundError, build_image_data
from kernels import use_gemm_for_small_maps
from trainer.classification import ClassificationTask, ClassificationTrainConfig
from trainer.cli import parse_config
from trainer.comm import CommConfig, build_communicator
from trainer.config import ConfigError, require, save_config, to_dict
from trainer.devices import gpu_requests, require_cuda_for
from trainer.dist import DistConfig, ReplicaGuard, setup_distributed, teardown_distributed
from trainer.loop import Trainer, seed_everything
from trainer.metrics import LogConfig, build_metrics
from trainer.optim import OptimConfig, build_optimizer
from trainer.schedules import ScheduleConfig, check_phases


@dataclass
class ModelConfig:
    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"] = "resnet50"
    """torchvision ResNet variant."""
    zero_init_residual: bool = True
    """Start every residual block as the identity (last BatchNorm gamma = 0)."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy loss."""
    small_map_gemm: bool = True
    """On the CPU, convolutions with at most 4 output positions (the last stage at 32-64 px) run as one GEMM
    (kernels/small_conv.py: 1.0-5.9x faster than oneDNN per layer, a ResNet-18 step at 32 px 1.65x); same
    parameters; no effect on CUDA."""

    def __post_init__(self) -> None:
        require(0 <= self.label_smoothing < 1, f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


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
        require(bool(self.schedule.phases), "schedule.phases: the ResNet-50 recipe needs at least one phase "
                                            "(image_size and batch_size per epoch range)")
        check_phases(self.schedule.phases, self.train.epochs)


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    model = getattr(torchvision.models, cfg.arch)(num_classes=num_classes, zero_init_residual=cfg.zero_init_residual)
    if cfg.small_map_gemm:
        use_gemm_for_small_maps(model)
    return model


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(Config, argv, prog="python -m recipes.resnet50")
    require_cuda_for(gpu_requests(cfg.dist.backend, cfg.train.amp))  # before any process group or data
    topo = setup_distributed(cfg.dist)
    metrics = data = None
    try:
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        data = build_image_data(cfg.data, topo.rank, topo.world_size, cfg.train.seed, topo.device)
        model = build_model(cfg.model, data.num_classes).to(topo.device)
        if cfg.train.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = build_optimizer(model, cfg.optim)
        comm = build_communicator(cfg.comm, model, topo)
        metrics = build_metrics(cfg.log, topo.is_main, fresh=not cfg.train.should_resume())
        if topo.is_main:
            save_config(cfg, Path(cfg.log.dir) / "config.yaml")
        task = ClassificationTask(model, data, topo, cfg.schedule.phases, cfg.model.label_smoothing,
                                  cfg.train.channels_last, cfg.train.target_top1, cfg.train.target_top5)
        trainer = Trainer(cfg.train, cfg.schedule, cfg.optim, cfg.log, topo, model, task, optimizer, comm, metrics,
                          to_dict(cfg), ReplicaGuard(cfg.dist.check_every_steps, topo))
        summary = trainer.fit()
        if topo.is_main:
            print_result(summary, cfg)
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        if data is not None:
            data.close()
        teardown_distributed()


def print_result(summary: dict, cfg: Config) -> None:
    tta = summary["time_to_target_s"]
    reached = f"target reached in {tta:.1f} s" if tta is not None else "target NOT reached"
    if summary["final_top1"] is not None:
        print(f"final top-1 {summary['final_top1']:.4f}  top-5 {summary['final_top5']:.4f}  after "
              f"{summary['epochs_run']} epochs, {summary['elapsed_s']:.1f} s; {reached}")
    print(f"outputs in {cfg.log.dir}: metrics.jsonl, dawnbench.tsv, summary.json, tensorboard/, checkpoints/")


if __name__ == "__main__":
    try:
        main()
    except (DatasetNotFoundError, DataConfigError) as e:  # a user mistake: one line, not a traceback from every rank
        raise SystemExit(f"dataset error: {e}") from None
    except ConfigError as e:  # e.g. a GPU setting on a machine without a usable GPU
        raise SystemExit(f"config error: {e}") from None
