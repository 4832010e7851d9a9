"""Transformer on WMT En-De (Vaswani et al. 2017), with the communicators of Shi et al. (MLSys 2021).

    python -m recipes.transformer --config configs/transformer_quickstart_cpu.yaml [--resume] [section.key=value ...]
    torchrun --nproc_per_node 8 -m recipes.transformer --config configs/transformer_wmt16_en_de.yaml

The method, as fairseq's WMT'16 recipe (Ott et al. 2018): torch's nn.Transformer with one embedding matrix
shared by source, target and output projection over a joint BPE vocabulary; label-smoothed cross entropy;
token-based batches; fused Adam with betas (0.9, 0.98) on an inverse-square-root schedule after a linear
warm-up; optional gradient clipping; mixed precision on GPUs; gradients averaged by the configured
communicator (the paper's hierarchical top-k on the cluster). The clock stops when greedy sacreBLEU on the
validation split reaches the target; the held-out test split is scored before and after training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.translation import TranslationData, TranslationDataConfig, TranslationDataError
from trainer.cli import parse_config
from trainer.comm import CommConfig, build_communicator
from trainer.config import ConfigError, save_config, to_dict
from trainer.devices import gpu_requests, require_cuda_for
from trainer.dist import DistConfig, ReplicaGuard, setup_distributed, teardown_distributed
from trainer.loop import Trainer, seed_everything
from trainer.metrics import LogConfig, MetricsLogger, build_metrics
from trainer.optim import OptimConfig, build_optimizer, maybe_clip_gradients
from trainer.schedules import ScheduleConfig
from trainer.translation import TransformerConfig, TranslationTask, TranslationTrainConfig, build_transformer


@dataclass
class Config:
    model: TransformerConfig = field(default_factory=TransformerConfig)
    """The network and its loss."""
    data: TranslationDataConfig = field(default_factory=TranslationDataConfig)
    """Prepared parallel corpus and token batching."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="adam", lr=1.0e-3, betas=(0.9, 0.98),
                                                                   weight_decay=0.0))
    """Optimizer and its hyper-parameters."""
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(decay="inverse_sqrt", warmup_epochs=1.0,
                                                                            warmup_start_factor=1.0e-4))
    """Learning rate: warm-up, then inverse square root."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Gradient communicator."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process group and topology."""
    train: TranslationTrainConfig = field(default_factory=TranslationTrainConfig)
    """Epochs, BLEU target, clipping, decoding, precision, checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Outputs: TensorBoard, JSONL, checkpoints."""


def held_out_bleu(task: TranslationTask, trainer: Trainer, metrics: MetricsLogger, name: str) -> float | None:
    """Collective: sacreBLEU of the whole test split, logged as eval/test_bleu_<name>; None without a test split."""
    if task.data.test is None:
        return None
    with torch.no_grad(), trainer.autocast():
        bleu = task.bleu(task.data.test)
    metrics.log("test", trainer.step, {f"eval/test_bleu_{name}": bleu})
    return bleu


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(Config, argv, prog="python -m recipes.transformer")
    require_cuda_for(gpu_requests(cfg.dist.backend, cfg.train.amp))  # before any process group or data
    topo = setup_distributed(cfg.dist)
    metrics = None
    try:
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        data = TranslationData(cfg.data, topo.rank, topo.world_size, cfg.train.seed)
        model = build_transformer(cfg.model, data.vocab_size).to(topo.device)
        optimizer = build_optimizer(model, cfg.optim)
        maybe_clip_gradients(optimizer, cfg.train.clip_norm)
        comm = build_communicator(cfg.comm, model, topo)
        resuming = cfg.train.should_resume()
        metrics = build_metrics(cfg.log, topo.is_main, fresh=not resuming)
        if topo.is_main:
            save_config(cfg, Path(cfg.log.dir) / "config.yaml")
        task = TranslationTask(model, data, topo, cfg.train, cfg.model.label_smoothing)
        trainer = Trainer(cfg.train, cfg.schedule, cfg.optim, cfg.log, topo, model, task, optimizer, comm, metrics,
                          to_dict(cfg), ReplicaGuard(cfg.dist.check_every_steps, topo))
        if topo.is_main:
            steps = data.steps_per_epoch()
            print(f"warm-up: {cfg.schedule.warmup_epochs} epochs x {steps} steps = "
                  f"{cfg.schedule.warmup_epochs * steps:.0f} updates")
        untrained = None if resuming else held_out_bleu(task, trainer, metrics, "untrained")
        summary = trainer.fit()
        trained = held_out_bleu(task, trainer, metrics, "trained")
        summary.update(test_bleu_untrained=untrained, test_bleu=trained)
        metrics.summary(summary)
        if topo.is_main:
            print_result(summary, cfg)
        return summary
    finally:
        if metrics is not None:
            metrics.close()
        teardown_distributed()


def print_result(summary: dict, cfg: Config) -> None:
    tta = summary["time_to_target_s"]
    reached = f"target {cfg.train.target_bleu:g} reached in {tta:.1f} s" if tta is not None else "target NOT reached"
    if summary["final_bleu"] is not None:
        print(f"validation BLEU {summary['final_bleu']:.1f} after {summary['epochs_run']} epochs, "
              f"{summary['elapsed_s']:.1f} s; {reached}")
    if summary["test_bleu"] is not None:
        before = summary["test_bleu_untrained"]
        before = "n/a (resumed)" if before is None else f"{before:.1f}"
        print(f"held-out test BLEU (sacreBLEU, greedy): untrained {before} -> trained {summary['test_bleu']:.1f}")
    print(f"outputs in {cfg.log.dir}: metrics.jsonl, summary.json, tensorboard/, checkpoints/")


if __name__ == "__main__":
    try:
        main()
    except TranslationDataError as e:  # a user mistake: one line, not a traceback from every rank
        raise SystemExit(f"dataset error: {e}") from None
    except ConfigError as e:  # e.g. a GPU setting on a machine without a usable GPU
        raise SystemExit(f"config error: {e}") from None
