"""Transformer on WMT En-De (Vaswani et al. 2017), with the communicators of Shi et al. (MLSys 2021).

    python -m recipes.transformer --config configs/transformer_quickstart_cpu.yaml [--resume] [section.key=value ...]
    python -m recipes.transformer translate RUN [--beam 4] [--average-last N] [--input FILE|-] [--output FILE]
        (a trained run's model: translate text, or sacreBLEU of beam and greedy search on its test split)
    torchrun --nproc_per_node 8 -m recipes.transformer --config configs/transformer_wmt16_en_de.yaml

The method, as fairseq's WMT'16 recipe (Ott et al. 2018): torch's nn.Transformer with one embedding matrix
shared by source, target and output projection over a joint BPE vocabulary; label-smoothed cross entropy;
token-based batches; fused Adam with betas (0.9, 0.98) on an inverse-square-root schedule after a linear
warm-up; optional gradient clipping; mixed precision on GPUs; gradients averaged by the configured
communicator (the paper's hierarchical top-k on the cluster). The clock stops when greedy sacreBLEU on the
validation split reaches the target; the held-out test split is scored before and after training.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from data.translation import TranslationData, TranslationDataConfig
from recipes.transformer_model import TransformerConfig, build_transformer
from trainer.comm import CommConfig
from trainer.dist import DistConfig, Topology
from trainer.metrics import LogConfig
from trainer.optim import OptimConfig, build_optimizer, maybe_clip_gradients
from trainer.run import run
from trainer.schedules import ScheduleConfig
from trainer.translate import translate_main
from trainer.translation import TranslationTask, TranslationTrainConfig


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


def build_data(cfg: Config, topo: Topology) -> TranslationData:
    """This rank's token batches of the corpus in data.root (as scripts/prepare_wmt.py writes it)."""
    return TranslationData(cfg.data, topo.rank, topo.world_size, cfg.train.seed)


def build_task(cfg: Config, topo: Topology, data: TranslationData) -> tuple[TranslationTask, torch.optim.Optimizer]:
    """Adam over the model's parameter groups; gradients clipped after averaging (train.clip_norm)."""
    model = build_transformer(cfg.model, data.vocab_size).to(topo.device)
    optimizer = build_optimizer(model, cfg.optim)
    maybe_clip_gradients(optimizer, cfg.train.clip_norm)
    return TranslationTask(model, data, topo, cfg.train, cfg.model.label_smoothing), optimizer


def main(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["translate"]:
        return translate_main(Config, build_transformer, args[1:], "python -m recipes.transformer translate",
                              raise_errors=argv is not None)
    return run(Config, build_data, build_task, argv, prog="python -m recipes.transformer")


if __name__ == "__main__":
    main()
