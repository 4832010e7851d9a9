"""Greedy and beam-search decoding of a sequence-to-sequence model, and sacreBLEU over a whole split, across
ranks.

Hypotheses are detokenized with sentencepiece and scored by sacrebleu against the raw reference lines, so
the BLEU is the standard, comparable one. Beam search follows fairseq's SequenceGenerator: batched over
sentences and beams, a finished hypothesis scored by its log-probability divided by length^len_penalty
(fairseq's --lenpen), a sentence done when it has `beam` finished hypotheses; with beam 1 it is greedy search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

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
    limit = decode_limits(model, src, max_len_a, max_len_b)
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


def decode_limits(model: Seq2Seq, src: torch.Tensor, max_len_a: float, max_len_b: int) -> torch.Tensor:
    """Per sentence, the most tokens (EOS included) the decoder may produce: max_len_a x |src| + max_len_b."""
    src_len = (src != PAD).sum(1)
    return (max_len_a * src_len.float() + max_len_b).long().clamp(max=model.max_positions - 1)


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, beam: int = 4, len_penalty: float = 1.0,
                max_len_a: float = 1.2, max_len_b: int = 10) -> list[list[int]]:
    """Beam search: per sentence, the ids (without EOS) of the best finished hypothesis.

    Each step scores `beam` live hypotheses per sentence, keeps the 2 x beam best extensions, finishes those
    among the first `beam` that end in EOS (score / length^len_penalty, length counting EOS) and continues
    with the best `beam` that do not. At the length limit (`greedy_decode`'s) the best `beam` extensions are
    finished as they are. A sentence leaves the batch once it has `beam` finished hypotheses.
    """
    if beam < 1:
        raise ValueError(f"beam size must be >= 1, got {beam}")
    n, k = src.shape[0], beam
    limit = decode_limits(model, src, max_len_a, max_len_b)
    memory = model.encode(src).repeat_interleave(k, dim=0)  # row s * k + j: sentence s, beam j
    src_pad = (src == PAD).repeat_interleave(k, dim=0)
    ys = torch.full((n * k, 1), BOS, dtype=torch.long, device=src.device)
    scores = torch.full((n, k), -torch.inf, device=src.device)
    scores[:, 0] = 0.0  # at the first step all beams are the same empty prefix: extend only one
    alive = torch.arange(n, device=src.device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(n)]
    for step in range(int(limit.max())):
        lprobs = torch.log_softmax(model.decode(ys, memory, src_pad)[:, -1].float(), dim=-1)
        vocab = lprobs.shape[1]
        cand = (scores.reshape(-1, 1) + lprobs).view(len(alive), k * vocab)
        top, flat = cand.topk(min(2 * k, k * vocab), dim=1)  # (alive, 2k), best first
        origin, token = flat // vocab, flat % vocab
        rank = torch.arange(top.shape[1], device=src.device).expand_as(top)
        at_limit = (step + 1 >= limit[alive])[:, None]
        ends = ((token == EOS) | at_limit) & (rank < k) & (top > -torch.inf)
        for row, col in torch.nonzero(ends).tolist():
            s, prev = int(alive[row]), row * k + int(origin[row, col])
            ids = ys[prev, 1:].tolist() + ([] if int(token[row, col]) == EOS else [int(token[row, col])])
            finished[s].append((float(top[row, col]) / (step + 1) ** len_penalty, ids))
        # the best k extensions that do not end the sentence continue (at most k of the 2k end in EOS)
        order = torch.where(token == EOS, rank + top.shape[1], rank).argsort(dim=1)[:, :k]
        top, origin, token = top.gather(1, order), origin.gather(1, order), token.gather(1, order)
        done = torch.tensor([len(finished[int(s)]) >= k for s in alive.tolist()], device=src.device)
        done |= at_limit[:, 0]
        keep = ~done
        rows = (torch.arange(len(alive), device=src.device)[:, None] * k + origin)[keep].flatten()
        alive, scores = alive[keep], top[keep]
        if not len(alive):
            break
        ys = torch.cat([ys[rows], token[keep].reshape(-1, 1)], dim=1)
        memory, src_pad = memory[rows], src_pad[rows]
    return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacreBLEU (13a tokenization, standard settings) of detokenized hypotheses against one reference each."""
    import sacrebleu
    if len(hypotheses) != len(references):
        raise ValueError(f"corpus_bleu: {len(hypotheses)} hypotheses but {len(references)} references")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


@dataclass(frozen=True)
class Search:
    """How sentences are decoded: beam size (1 = greedy search), length penalty, output length limit."""

    beam: int = 1
    len_penalty: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam size must be >= 1, got {self.beam}")

    def decode(self, model: Seq2Seq, src: torch.Tensor) -> list[list[int]]:
        if self.beam == 1:
            return greedy_decode(model, src, self.max_len_a, self.max_len_b)
        return beam_search(model, src, self.beam, self.len_penalty, self.max_len_a, self.max_len_b)


def translate_split(model: Seq2Seq, data: TranslationData, split: Any, topo: Topology, max_tokens: int,
                    limit: int = 0, search: Search = Search()) -> tuple[list[str], list[int]]:
    """This rank's share of `split` decoded: (detokenized hypotheses, their pair positions)."""
    was_training = model.training
    model.eval()
    hyps: list[str] = []
    positions: list[int] = []
    try:
        for batch in eval_batches(split.src_lens, max_tokens, topo.rank, topo.world_size, limit):
            ids = search.decode(model, collate_src(split, batch).to(topo.device))
            hyps += [data.decode(x) for x in ids]
            positions += [int(p) for p in batch]
    finally:
        model.train(was_training)
    return hyps, positions


@torch.no_grad()
def translate_lines(model: Seq2Seq, data: TranslationData, lines: list[str], max_tokens: int,
                    search: Search = Search(), device: torch.device | str = "cpu") -> tuple[list[str], int]:
    """Raw source sentences to detokenized translations, in order; (translations, how many sources were
    cut to the model's longest input). An empty line gives an empty translation."""
    keep = model.max_positions - 1  # the source's EOS takes one position
    ids = [data.sp.encode(line.strip()) for line in lines]
    cut = sum(len(x) > keep for x in ids)
    ids = [torch.tensor(x[:keep] + [EOS]) for x in ids]
    nonempty = np.flatnonzero([len(x) > 1 for x in ids])
    out = [""] * len(lines)
    model.eval()
    lens = np.array([len(ids[i]) - 1 for i in nonempty], dtype=np.int64)
    for batch in eval_batches(lens, max_tokens, 0, 1):
        src = pad_sequence([ids[nonempty[b]] for b in batch], batch_first=True, padding_value=PAD).to(device)
        for b, hyp in zip(batch, search.decode(model, src)):
            out[nonempty[b]] = data.decode(hyp)
    return out, cut


def evaluate_bleu(model: Seq2Seq, data: TranslationData, split: Any, topo: Topology, max_tokens: int,
                  limit: int = 0, search: Search = Search()) -> tuple[float, list[str]]:
    """Collective: every rank decodes its share; rank 0 scores the whole split; (BLEU on every rank,
    hypotheses in split order on rank 0, [] elsewhere)."""
    hyps, positions = translate_split(model, data, split, topo, max_tokens, limit, search)
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
