"""PowerSGD (Vogels et al., NeurIPS 2019): each gradient matrix M of a bucket is sent as the rank-r factors of
one power iteration, with error feedback and a warm-started Q - the kind powersgd of the plan executor
(`PowerSGDExecution`, run by trainer/comm/execute.py) and the fixed communicator of `comm.kind: powersgd`.

Per bucket, as `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook` does for a DDP bucket: the residual is
added to the bucket (`PlanExecutor.accumulate`); every parameter with at least two dimensions is viewed as a
matrix (its first dimension by the rest) and compressed when its factors are under half its elements
(`MIN_COMPRESSION_RATE`); the other tensors (biases, norms' scales, small matrices) go in one dense allreduce.
For the compressed ones: P = M Q, allreduce P, orthogonalise P, Q = M^T P, allreduce Q, average,
M_hat = P Q^T. What this rank's input was less the averaged result is its new residual
(`PlanExecutor.keep_residual`), and Q is kept for the next step (warm start) or drawn afresh from a seeded
sequence that every rank draws alike.

Why not torch's hook itself: it takes a DDP `GradBucket` and a torch process group and chains its collectives as
futures; these buckets are flat buffers exchanged on the executor's thread over `trainer.dist.Group`, which also
runs on Horovod. `tests/test_comm_powersgd.py` checks this code against the hook on the same gradients.
docs/communicators.md describes the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from trainer.comm.base import Bucket
from trainer.comm.config import CommConfig
from trainer.comm.cost import describe, exchange_bytes
from trainer.comm.execute import PlanExecutor
from trainer.comm.plan import DENSE, Choice
from trainer.config import ConfigError
from trainer.dist import Topology

MIN_COMPRESSION_RATE = 2
"""A matrix is compressed only when its elements exceed its factors' (rows + cols) x r by this factor (the
hook's default `min_compression_rate`): otherwise the factors would save little and it goes dense."""

SEED = 0
"""The seed of the sequence that seeds each random Q (the hook's default `random_seed`)."""

EPSILON = 1e-8
"""Added to each column's norm in Gram-Schmidt: a matrix whose gradient is all zero (an unused parameter) would
otherwise divide by zero and make every rank's step NaN."""


@dataclass(frozen=True)
class Matrix:
    """One compressed tensor of a bucket: `rows` x `cols` elements from `offset`, approximated at `rank`."""

    offset: int
    rows: int
    cols: int
    rank: int


@dataclass(frozen=True)
class BucketView:
    """How PowerSGD sees a bucket: its compressed matrices and the (offset, elements) spans sent dense."""

    matrices: tuple[Matrix, ...]
    dense: tuple[tuple[int, int], ...]

    @property
    def shapes(self) -> tuple[tuple[int, int, int], ...]:
        """(rows, cols, rank) per matrix, as `cost.describe` takes them."""
        return tuple((m.rows, m.cols, m.rank) for m in self.matrices)

    @property
    def sent_elements(self) -> int:
        """Elements one rank sends: the dense spans and both factors of every matrix."""
        return sum(n for _, n in self.dense) + sum((m.rows + m.cols) * m.rank for m in self.matrices)


def matrix_shape(p: nn.Parameter) -> tuple[int, int] | None:
    """(rows, cols) of a tensor of two or more dimensions seen as a matrix (its first dimension by the rest)."""
    return (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 and p.numel() else None


def max_rank(rows: int, cols: int) -> int:
    """The largest rank at which a rows x cols matrix is compressed (0: none)."""
    return (rows * cols - 1) // (MIN_COMPRESSION_RATE * (rows + cols))


def bucket_view(params: list[nn.Parameter], rank: int) -> BucketView:
    """The matrices and dense spans of a bucket of `params` (in bucket order) at rank `rank`: a tensor of two
    or more dimensions is compressed when worth it at that rank (`max_rank`). The matrices are grouped by shape,
    in the order each shape first appears: the hook's order, which its factors and random draws follow."""
    matrices: dict[tuple[int, int], list[Matrix]] = {}
    dense: list[tuple[int, int]] = []
    offset = 0
    for p in params:
        shape = matrix_shape(p)
        if shape is not None and rank <= max_rank(*shape):
            matrices.setdefault(shape, []).append(Matrix(offset, *shape, rank))
        elif dense and dense[-1][0] + dense[-1][1] == offset:  # adjacent dense tensors: one span
            dense[-1] = (dense[-1][0], dense[-1][1] + p.numel())
        else:
            dense.append((offset, p.numel()))
        offset += p.numel()
    return BucketView(tuple(m for group in matrices.values() for m in group), tuple(dense))


def orthogonalise(m: torch.Tensor) -> torch.Tensor:
    """The columns of `m` (rows x r) made orthonormal, in place: Gram-Schmidt for r <= 2 (with `EPSILON`),
    QR otherwise (as the hook does; QR's columns may differ in sign, which P Q^T does not see)."""
    r = m.shape[1]
    if r > 2:
        m.copy_(torch.linalg.qr(m).Q)
        return m
    for i in range(r):
        col = m[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + EPSILON
        if i + 1 < r:
            rest = m[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return m


def factor_work(flat: torch.Tensor, view: BucketView) -> Callable[[], None]:
    """One step's local work on a bucket's matrices without its collectives (P = M Q, orthogonalise P,
    Q = M^T P, M_hat = P Q^T, orthogonalise the next Q), reading `flat` and writing scratch tensors: what `auto`
    times to price powersgd."""
    mats = [flat[m.offset:m.offset + m.rows * m.cols].float().view(m.rows, m.cols) for m in view.matrices]
    generator = torch.Generator().manual_seed(SEED)
    qs = [torch.randn(m.cols, m.rank, generator=generator).to(flat.device) for m in view.matrices]
    ps = [flat.new_empty(m.rows, m.rank, dtype=torch.float32) for m in view.matrices]
    outs = [torch.empty_like(mat) for mat in mats]

    def run() -> None:
        for mat, p, q, out in zip(mats, ps, qs, outs):
            torch.matmul(mat, q, out=p)
            orthogonalise(p)
            torch.matmul(mat.t(), p, out=q)
            torch.matmul(p, q.t(), out=out)
            orthogonalise(q)
    return run


class PowerSGDExecution:
    """powersgd: the exchange of the module docstring. It holds PowerSGD's own state, per bucket index: Q (the
    average of the last step's, with warm start), and how many random Qs were drawn (without warm start every
    step draws one per bucket); `rollback` restores both as they were before the step."""

    def __init__(self, rank: int, warm_start: bool) -> None:
        self.rank, self.warm_start = rank, warm_start
        self.views: dict[int, BucketView] = {}
        self.q: dict[int, torch.Tensor] = {}
        """Bucket index -> its matrices' Q factors, concatenated (cols x rank each)."""
        self.draws = 0
        """Random Qs drawn so far (the seed sequence's position: every rank draws in the same bucket order)."""
        self._rng = np.random.RandomState(SEED)
        self._before: tuple[dict[int, torch.Tensor], int] | None = None

    def view(self, bucket: Bucket) -> BucketView:
        if bucket.index not in self.views:
            self.views[bucket.index] = bucket_view(bucket.params, self.rank)
        return self.views[bucket.index]

    def begin_step(self) -> None:
        self._before = (dict(self.q), self.draws)  # the tensors are replaced, never written in place

    def rollback(self) -> None:
        if self._before is not None:
            q, draws = self._before
            self.q = dict(q)
            self._seek(draws)

    def _seek(self, draws: int) -> None:
        """Put the seed sequence at position `draws`."""
        self._rng, self.draws = np.random.RandomState(SEED), 0
        for _ in range(draws):
            self._next_seed()

    def _next_seed(self) -> int:
        self.draws += 1
        return int(self._rng.randint(1_000_000_000))

    def _start_q(self, index: int, view: BucketView, device: torch.device) -> torch.Tensor:
        """This step's Q of bucket `index`: the last one orthogonalised (warm start), else a new random one,
        drawn on the CPU from the next seed (the same numbers on every rank and device)."""
        if self.warm_start and index in self.q:
            q = self.q[index].clone()
            for part in self._parts(q, view, "cols"):
                orthogonalise(part)
            return q
        generator = torch.Generator().manual_seed(self._next_seed())
        q = torch.empty(sum(m.cols * m.rank for m in view.matrices), device=device)
        for part in self._parts(q, view, "cols"):
            part.copy_(torch.randn(part.shape, generator=generator))
            orthogonalise(part)
        return q

    @staticmethod
    def _parts(flat: torch.Tensor, view: BucketView, side: str) -> list[torch.Tensor]:
        """The per-matrix (rows or cols) x rank factors, as views of their concatenation `flat`."""
        out, at = [], 0
        for m in view.matrices:
            n = m.rows if side == "rows" else m.cols
            out.append(flat[at:at + n * m.rank].view(n, m.rank))
            at += n * m.rank
        return out

    def exchange(self, ex: PlanExecutor, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        # `exact` is not needed: a folded residual is part of the input, and what P Q^T misses of it stays in
        # the new residual
        view, flat, world = self.view(bucket), bucket.buffer, ex.topo.world
        what = f"gradient bucket {bucket.index} ({bucket.numel} elements)"
        sent, inter = exchange_bytes(describe(bucket.numel, choice, ex.net_layout, view.shapes), ex.net_layout)
        ex.count(sent=sent, inter_node=inter, sent_elements=view.sent_elements, selected_from=bucket.numel)
        acc, residual = ex.accumulate(bucket.index, flat)
        if view.dense:
            dense = torch.cat([acc[o:o + n] for o, n in view.dense])
            world.all_reduce_(dense, f"allreduce of the uncompressed tensors of {what}")
            dense.div_(ex.topo.world_size)
            at = 0
            for o, n in view.dense:
                flat[o:o + n].copy_(dense[at:at + n])
                at += n
        if view.matrices:
            mats = [acc[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols) for m in view.matrices]
            q = self._start_q(bucket.index, view, acc.device)
            qs = self._parts(q, view, "cols")
            p = acc.new_empty(sum(m.rows * m.rank for m in view.matrices))
            ps = self._parts(p, view, "rows")
            for mat, p_, q_ in zip(mats, ps, qs):
                torch.matmul(mat, q_, out=p_)
            world.all_reduce_(p, f"allreduce of the P factors of {what}")
            for mat, p_, q_ in zip(mats, ps, qs):
                orthogonalise(p_)
                torch.matmul(mat.t(), p_, out=q_)
            world.all_reduce_(q, f"allreduce of the Q factors of {what}")
            q.div_(ex.topo.world_size)
            for m, p_, q_ in zip(view.matrices, ps, qs):
                torch.matmul(p_, q_.t(), out=flat[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols))
            if self.warm_start:
                self.q[bucket.index] = q
        ex.keep_residual(bucket.index, "powersgd", acc.sub_(flat), residual)  # input less what was applied
        return flat

    def state_dict(self) -> dict:
        """Q per bucket index (host copies) and the random draws so far."""
        return {"q": {i: q.to("cpu", copy=True) for i, q in self.q.items()}, "draws": self.draws}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.q = {int(i): q.to(device) for i, q in state.get("q", {}).items()}
        self._seek(int(state.get("draws", 0)))
        self._before = None


class PowerSGDCommunicator(PlanExecutor):
    """`comm.kind: powersgd`: every bucket of at least `comm.dense_below` elements with a matrix worth
    compressing at rank `comm.powersgd_rank` is exchanged as powersgd, the others dense. Its state adds
    PowerSGD's (`powersgd`: Q per bucket, random draws) to the residuals. Its class name is recorded in
    checkpoints (the communicator layout)."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology) -> None:
        self.powersgd = PowerSGDExecution(cfg.powersgd_rank, cfg.powersgd_warm_start)
        super().__init__(cfg, model, topo, "powersgd", {"powersgd": self.powersgd},
                         dense_warmup_steps=cfg.dense_warmup_steps)
        views = [self.powersgd.view(b) for b in self.buckets]
        self.plan = [c if c.kind != "powersgd" or v.matrices else DENSE for c, v in zip(self.plan, views)]
        shapes = [s for b in self.buckets if b.numel >= cfg.dense_below
                  for p in b.params if (s := matrix_shape(p)) is not None]
        best = max(shapes, key=lambda s: max_rank(*s), default=None)
        if not any(c.kind == "powersgd" for c in self.plan) and best is not None and max_rank(*best) >= 1:
            # the rank alone leaves every bucket dense (without matrices, or below dense_below, all dense is
            # what the config asks for, as with top-k)
            self.detach()
            raise ConfigError(f"comm.powersgd_rank: {cfg.powersgd_rank} compresses no tensor of a bucket of at least "
                              f"comm.dense_below={cfg.dense_below} elements ((rows + cols) x rank x "
                              f"{MIN_COMPRESSION_RATE} must stay below rows x cols); at most {max_rank(*best)} "
                              f"compresses the {best[0]} x {best[1]} matrix")

    def begin_step(self) -> None:
        super().begin_step()
        self.powersgd.begin_step()

    def rollback(self) -> None:
        super().rollback()
        self.powersgd.rollback()

    def state_dict(self) -> dict:
        """The executor's (steps, residuals) and `powersgd`: Q per bucket and the random draws so far."""
        return {**super().state_dict(), "powersgd": self.powersgd.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """A state of any communicator on these buckets: a whole-bucket residual (powersgd's, or topk's) is
        this kind's; a missing `powersgd` entry starts Q afresh."""
        super().load_state_dict(state)
        for i, residual in self.residuals.items():
            if residual.numel() == self.buckets[i].numel:
                self._residual_kind[i] = "powersgd"
        self.powersgd.load_state_dict(state.get("powersgd", {}), self.topo.device)
