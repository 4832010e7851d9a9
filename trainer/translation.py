"""Translation: the encoder-decoder Transformer, its loss, greedy decoding, sacreBLEU, and the Task.

The model is torch's own `nn.Transformer` (scaled-dot-product attention inside `nn.MultiheadAttention`)
with one embedding matrix shared by source, target and output projection (fairseq's
--share-all-embeddings; the BPE vocabulary is joint), sinusoidal positions and embeddings scaled by
sqrt(d_model), as in Vaswani et al. 2017. Evaluation decodes greedily, detokenizes with sentencepiece
and scores with sacrebleu against the raw reference lines, so the BLEU is the standard, comparable one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data.translation import (BOS, EOS, PAD, TranslationBatch, TranslationData, collate, collate_src,
                              eval_batches)
from trainer.config import require
from trainer.dist import Topology, all_reduce_sum
from trainer.loop import TrainConfig
from trainer.schedules import Phase

# ---------------------------------------------------------------- model


@dataclass
class TransformerConfig:
    d_model: int = 512
    """Embedding and residual width (base 512, big 1024)."""
    heads: int = 8
    """Attention heads (base 8, big 16)."""
    encoder_layers: int = 6
    """Encoder layers."""
    decoder_layers: int = 6
    """Decoder layers."""
    ffn_dim: int = 2048
    """Feed-forward inner width (base 2048, big 4096)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention weights, feed-forward and residuals (nn.Transformer has one rate)."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy loss."""
    norm_first: bool = False
    """Pre-norm layers (LayerNorm before each sub-layer); false = the paper's post-norm."""
    max_positions: int = 1024
    """Longest sequence the sinusoidal position table covers (BPE tokens + 1)."""

    def __post_init__(self) -> None:
        require(self.d_model > 0 and self.d_model % self.heads == 0,
                f"model.d_model: must be a positive multiple of model.heads ({self.heads}), got {self.d_model}")
        require(self.encoder_layers > 0 and self.decoder_layers > 0 and self.ffn_dim > 0,
                "model.encoder_layers, model.decoder_layers and model.ffn_dim must be > 0")
        require(0 <= self.dropout < 1, f"model.dropout: must be in [0, 1), got {self.dropout}")
        require(0 <= self.label_smoothing < 1, f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """Vaswani et al.'s fixed position encodings: sin on even, cos on odd channels."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer with shared embeddings; `forward(src, tgt_in)` gives logits (B, T, vocab)."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0.0, cfg.d_model ** -0.5)  # fairseq's init for tied output weights
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        layer = dict(d_model=cfg.d_model, nhead=cfg.heads, dim_feedforward=cfg.ffn_dim, dropout=cfg.dropout,
                     batch_first=True, norm_first=cfg.norm_first)
        # Built as nn.Transformer builds them, minus the prototype nested-tensor path (it warns, and would make
        # a sentence's encoding depend on its batch's padding).
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), cfg.encoder_layers,
                                        nn.LayerNorm(cfg.d_model), enable_nested_tensor=False)
        decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), cfg.decoder_layers,
                                        nn.LayerNorm(cfg.d_model))
        self.transformer = nn.Transformer(cfg.d_model, cfg.heads, custom_encoder=encoder, custom_decoder=decoder,
                                          batch_first=True)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds model.max_positions {self.cfg.max_positions}")
        x = self.embed(ids) * math.sqrt(self.cfg.d_model) + self.positions[:ids.shape[1]]
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return self.transformer.encoder(self.embed_tokens(src), src_key_padding_mask=src == PAD)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        length = tgt_in.shape[1]  # boolean like the padding masks (mixed mask types are deprecated in torch)
        causal = torch.ones(length, length, dtype=torch.bool, device=tgt_in.device).triu(1)
        h = self.transformer.decoder(self.embed_tokens(tgt_in), memory, tgt_mask=causal, tgt_is_causal=True,
                                     tgt_key_padding_mask=tgt_in == PAD, memory_key_padding_mask=src_pad)
        return F.linear(h, self.embed.weight)  # output projection tied to the embeddings

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decode(tgt_in, self.encode(src), src == PAD)


def build_transformer(cfg: TransformerConfig, vocab_size: int) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(cfg, vocab_size)


def translation_loss(model: nn.Module, batch: TranslationBatch, label_smoothing: float) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross entropy, mean over this rank's target tokens; (loss, target tokens)."""
    logits = model(batch.src, batch.tgt_in)
    n = batch.num_tokens
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss / max(1, n), n


# ---------------------------------------------------------------- decoding and BLEU


@torch.no_grad()
def greedy_decode(model: Seq2SeqTransformer, src: torch.Tensor, max_len_a: float = 1.2,
                  max_len_b: int = 10) -> list[list[int]]:
    """Greedy search: per sentence, ids up to (not including) EOS, at most max_len_a x |src| + max_len_b.

    The decoder re-reads the whole prefix each step (nn.TransformerDecoder keeps no cache): quadratic in
    the output length, which is short here; finished rows leave the batch so they cost nothing more.
    """
    memory = model.encode(src)
    src_pad = src == PAD
    src_len = (~src_pad).sum(1)
    limit = (max_len_a * src_len.float() + max_len_b).long().clamp(max=model.cfg.max_positions - 1)
    out: list[list[int]] = [[] for _ in range(src.shape[0])]
    alive = torch.arange(src.shape[0], device=src.device)
    ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
    for step in range(int(limit.max())):
        nxt = model.decode(ys, memory, src_pad)[:, -1].argmax(-1)
        ys = torch.cat([ys, nxt[:, None]], dim=1)
        finished = (nxt == EOS) | (step + 1 >= limit[alive])
        if finished.any():
            for row in torch.nonzero(finished).flatten().tolist():
                out[int(alive[row])] = [t for t in ys[row, 1:].tolist() if t != EOS]
            keep = ~finished
            alive, ys, memory, src_pad = alive[keep], ys[keep], memory[keep], src_pad[keep]
            if not len(alive):
                break
    return out


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacreBLEU (13a tokenization, standard settings) of detokenized hypotheses against one reference each."""
    import sacrebleu
    if len(hypotheses) != len(references):
        raise ValueError(f"corpus_bleu: {len(hypotheses)} hypotheses but {len(references)} references")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def translate_split(model: Seq2SeqTransformer, data: TranslationData, split: Any, topo: Topology,
                    max_tokens: int, limit: int = 0, max_len_a: float = 1.2,
                    max_len_b: int = 10) -> tuple[list[str], list[int]]:
    """This rank's share of `split` decoded: (detokenized hypotheses, their pair positions)."""
    was_training = model.training
    model.eval()
    hyps: list[str] = []
    positions: list[int] = []
    try:
        for batch in eval_batches(split.src_lens, max_tokens, topo.rank, topo.world_size, limit):
            ids = greedy_decode(model, collate_src(split, batch).to(topo.device), max_len_a, max_len_b)
            hyps += [data.decode(x) for x in ids]
            positions += [int(p) for p in batch]
    finally:
        model.train(was_training)
    return hyps, positions


def evaluate_bleu(model: Seq2SeqTransformer, data: TranslationData, split: Any, topo: Topology, max_tokens: int,
                  limit: int = 0, max_len_a: float = 1.2, max_len_b: int = 10) -> tuple[float, list[str]]:
    """Collective: every rank decodes its share; rank 0 scores the whole split; (BLEU on every rank,
    hypotheses in split order on rank 0, [] elsewhere)."""
    hyps, positions = translate_split(model, data, split, topo, max_tokens, limit, max_len_a, max_len_b)
    if topo.distributed:
        gathered = topo.world.gather_object((hyps, positions))
        hyps, positions = [], []
        for h, p in gathered or []:
            hyps += h
            positions += p
    bleu = 0.0
    ordered: list[str] = []
    if topo.is_main:
        order = np.argsort(positions, kind="stable")
        ordered = [hyps[i] for i in order]
        bleu = corpus_bleu(ordered, split.references(np.asarray(positions)[order]))
    if topo.distributed:
        bleu = all_reduce_sum([bleu], topo)[0]  # only rank 0 contributes: everyone gets its score
    return bleu, ordered


# ---------------------------------------------------------------- the task


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


class TranslationTask:
    """A Transformer on a prepared parallel corpus: token-based batches, label-smoothed loss, BLEU."""

    unit = "tokens"

    def __init__(self, model: Seq2SeqTransformer, data: TranslationData, topo: Topology,
                 train: TranslationTrainConfig, label_smoothing: float) -> None:
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

    def bleu(self, split: Any, limit: int = 0) -> float:
        """Collective: sacreBLEU of greedy translations of `split` (the first `limit` pairs; 0 = all)."""
        return evaluate_bleu(self.model, self.data, split, self.topo, self.data.cfg.max_tokens, limit,
                             self.cfg.decode_max_len_a, self.cfg.decode_max_len_b)[0]

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

    def target_reached(self, record: dict[str, float]) -> bool:
        return bool(self.cfg.target_bleu) and record["eval/bleu"] >= self.cfg.target_bleu

    def describe(self, phase: Phase) -> str:
        return (f"<= {self.data.cfg.max_tokens} tokens/rank/batch, {self.data.train_size} training pairs "
                f"({self.data.skipped_long + self.data.skipped_prepare} skipped), BPE vocabulary "
                f"{self.data.vocab_size}")

    def stats(self) -> dict[str, float]:
        return self.data.stats()

    def state_dict(self) -> dict[str, Any]:
        return {}  # the batch order is a pure function of (seed, epoch): the trainer's position is enough

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
