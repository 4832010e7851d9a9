"""Greedy decoding of a sequence-to-sequence model and sacreBLEU over a whole split, across ranks.

Hypotheses are detokenized with sentencepiece and scored by sacrebleu against the raw reference lines, so
the BLEU is the standard, comparable one.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from data.translation import BOS, EOS, PAD, TranslationData, collate_src, eval_batches
from trainer.dist import Topology, all_reduce_sum


class Seq2Seq(Protocol):
    """What decoding needs of a model: its encoder, its decoder's logits, and the longest sequence it takes."""

    max_positions: int
    training: bool

    def encode(self, src: torch.Tensor) -> torch.Tensor: ...

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


@torch.no_grad()
def greedy_decode(model: Seq2Seq, src: torch.Tensor, max_len_a: float = 1.2,
                  max_len_b: int = 10) -> list[list[int]]:
    """Greedy search: per sentence, ids up to (not including) EOS, at most max_len_a x |src| + max_len_b.

    The decoder re-reads the whole prefix each step (nn.TransformerDecoder keeps no cache): quadratic in
    the output length, which is short here; finished rows leave the batch so they cost nothing more.
    """
    memory = model.encode(src)
    src_pad = src == PAD
    src_len = (~src_pad).sum(1)
    limit = (max_len_a * src_len.float() + max_len_b).long().clamp(max=model.max_positions - 1)
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


def translate_split(model: Seq2Seq, data: TranslationData, split: Any, topo: Topology,
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


def evaluate_bleu(model: Seq2Seq, data: TranslationData, split: Any, topo: Topology, max_tokens: int,
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
