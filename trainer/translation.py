"""Translation as a `Task` (trainer/task.py): label-smoothed cross entropy on token-based batches of a prepared
parallel corpus (data.translation), validation BLEU and loss, held-out test BLEU, and the `train` keys the
Transformer recipe adds (BLEU target, gradient clipping, decoding lengths).

The model is any sequence-to-sequence network with the `trainer.decoding.Seq2Seq` interface (the recipe's
is recipes/transformer_model.py); decoding and sacreBLEU live in trainer/decoding.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data.translation import PAD, TranslationBatch, TranslationData, collate, eval_batches
from trainer.choices import Probe
from trainer.config import require
from trainer.decoding import Search, Seq2Seq, evaluate_bleu
from trainer.dist import Topology, all_reduce_sum
from trainer.schedules import Phase
from trainer.task import Task
from trainer.train_config import TrainConfig


def translation_loss(model: nn.Module, batch: TranslationBatch, label_smoothing: float) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross entropy, mean over this rank's target tokens; (loss, target tokens)."""
    logits = model(batch.src, batch.tgt_in)
    n = batch.num_tokens
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss / max(1, n), n


@dataclass
class TranslationTrainConfig(TrainConfig):
    target_bleu: float = 0.0
    """Time-to-target: validation sacreBLEU (0-100) that stops the clock; 0 = none."""
    clip_norm: float = 0.0
    """Clip the global L2 norm of the averaged gradients to this before each update; 0 = off."""
    decode_max_len_a: float = 1.2
    """Greedy decoding stops at decode_max_len_a x source length + decode_max_len_b tokens (fairseq's
    --max-len-a/b) if no end-of-sentence came before."""
    decode_max_len_b: int = 10
    """See decode_max_len_a."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.target_bleu <= 100, f"train.target_bleu: sacreBLEU in [0, 100], got {self.target_bleu}")
        require(self.clip_norm >= 0, f"train.clip_norm: must be >= 0, got {self.clip_norm}")
        require(self.decode_max_len_a >= 0 and self.decode_max_len_b > 0,
                "train.decode_max_len_a must be >= 0 and train.decode_max_len_b > 0")


class TranslationTask(Task):
    """A sequence-to-sequence model on a prepared parallel corpus: token-based batches, label-smoothed loss,
    BLEU on the validation split (the target) and on the held-out test split (before and after training)."""

    unit = "tokens"

    def __init__(self, model: Seq2Seq, data: TranslationData, topo: Topology, train: TranslationTrainConfig,
                 label_smoothing: float) -> None:
        self.model, self.data, self.topo, self.cfg = model, data, topo, train
        self.label_smoothing = label_smoothing
        self.targets = {"bleu": train.target_bleu}

    def steps_per_epoch(self, phase: Phase) -> int:
        return self.data.steps_per_epoch()

    def train_batches(self, phase: Phase, epoch: int, start_step: int = 0) -> Iterator[TranslationBatch]:
        for batch in self.data.train_batches(epoch, start_step):
            yield batch.to(self.topo.device)

    def loss(self, batch: TranslationBatch) -> tuple[torch.Tensor, int]:
        return translation_loss(self.model, batch, self.label_smoothing)

    def probes(self, phases: list[tuple[Phase, int, int]]) -> list[Probe]:
        """The first batch of epoch 0 (batches hold a fixed number of tokens; the order is a pure function of
        seed and epoch, so reading it changes nothing), standing for every training step of the run; the BLEU
        evaluations (greedy decoding) are not measured."""
        batch = next(iter(self.train_batches(phases[0][0], 0)), None)
        if batch is None:
            return []
        shapes = "x".join(str(n) for n in batch.src.shape) + "->" + "x".join(str(n) for n in batch.tgt_in.shape)
        return [Probe(batch, sum(n for _, n, _ in phases), f"train {shapes} tokens")]

    def bleu(self, split: Any, limit: int = 0) -> float:
        """Collective: sacreBLEU of greedy translations of `split` (the first `limit` pairs; 0 = all)."""
        search = Search(max_len_a=self.cfg.decode_max_len_a, max_len_b=self.cfg.decode_max_len_b)
        return evaluate_bleu(self.model, self.data, split, self.topo, self.data.cfg.max_tokens, limit, search)[0]

    @torch.no_grad()
    def evaluate(self, phase: Phase) -> dict[str, float]:
        """Validation BLEU (greedy) and per-token loss (teacher-forced, no smoothing), across ranks."""
        limit = self.data.cfg.eval_max_sentences
        self.model.eval()
        nll = count = 0.0
        split = self.data.valid
        longest = np.maximum(split.src_lens, split.tgt_lens)
        for positions in eval_batches(longest, self.data.cfg.max_tokens, self.topo.rank,
                                      self.topo.world_size, limit):
            batch = collate(split, positions).to(self.topo.device)
            loss, n = translation_loss(self.model, batch, 0.0)
            nll, count = nll + float(loss) * n, count + n
        nll, count = all_reduce_sum([nll, count], self.topo)
        return {"eval/bleu": self.bleu(split, limit), "eval/loss": nll / max(1.0, count),
                "eval/sentences": float(min(len(split), limit) if limit else len(split))}

    def test(self) -> dict[str, float]:
        """Collective: sacreBLEU of the whole test split; {} when the corpus has none."""
        return {} if self.data.test is None else {"bleu": self.bleu(self.data.test)}

    def target_reached(self, record: dict[str, float]) -> bool:
        return bool(self.cfg.target_bleu) and record["eval/bleu"] >= self.cfg.target_bleu

    def describe(self, phase: Phase) -> str:
        return (f"<= {self.data.cfg.max_tokens} tokens/rank/batch, {self.data.train_size} training pairs "
                f"({self.data.skipped_long + self.data.skipped_prepare} skipped), BPE vocabulary "
                f"{self.data.vocab_size}")

    def report(self, summary: dict[str, Any]) -> list[str]:
        lines = [] if summary["final_bleu"] is None else [f"validation BLEU {summary['final_bleu']:.1f}"]
        if summary.get("test_bleu") is not None:
            before = summary["test_bleu_untrained"]
            before = "n/a (resumed)" if before is None else f"{before:.1f}"
            lines.append(f"held-out test BLEU (sacreBLEU, greedy): untrained {before} -> trained "
                         f"{summary['test_bleu']:.1f}")
        return lines

    def stats(self) -> dict[str, float]:
        return self.data.stats()
