"""Plans: one `Choice` per gradient bucket, from one vocabulary of kinds, and the fixed plans of `comm.kind`.

The kinds' names are those the cost model (`trainer/comm/cost.py`), the logs (`comm/choice/<bucket>`) and the
benches use. `trainer/comm/execute.py` runs a plan; `auto` changes it at run time. docs/communicators.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

KINDS = ("dense", "dense16", "topk", "hitopk", "powersgd")
"""The per-bucket exchanges: dense fp32, dense on a 16-bit wire, flat top-k, hierarchical top-k, PowerSGD's
low-rank factors (trainer/comm/powersgd.py)."""

CODES = {kind: i for i, kind in enumerate(KINDS)}
"""A choice's number in the logged stats (`comm/choice/<bucket>`): 0 dense, 1 dense16, 2 topk, 3 hitopk,
4 powersgd (new kinds go last: checkpoints record residual kinds by these numbers)."""

SPARSE = ("topk", "hitopk")
"""The kinds that send a fraction (`Choice.density`) of a bucket and keep the rest as error feedback."""

COMPRESSED = (*SPARSE, "powersgd")
"""The lossy kinds, each with error feedback: a fixed plan leaves buckets below `comm.dense_below` dense."""

AUTO_KINDS = ("dense", "dense16", *SPARSE)
"""The kinds `comm.kind: auto` chooses among per bucket by default (`comm.auto_kinds`; the cost model predicts
them from a bucket's size alone)."""

AUTO_CHOOSABLE = (*AUTO_KINDS, "powersgd")
"""The kinds `comm.auto_kinds` may list: powersgd too, priced from the (rows, cols, rank) of a bucket's matrices."""


@dataclass(frozen=True)
class Choice:
    """How one bucket is exchanged."""

    kind: str = "dense"
    density: float = 1.0
    """Fraction sent (sparse kinds; 1 for dense)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"exchange {self.kind!r}: valid ones are {', '.join(KINDS)}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")

    @property
    def sparse(self) -> bool:
        return self.kind in SPARSE

    @property
    def label(self) -> str:
        return f"{self.kind} {self.density:g}" if self.sparse else self.kind


DENSE = Choice("dense")

Plan = tuple[Choice, ...]
"""One choice per bucket, in bucket (launch) order."""


def plan_summary(plan: Sequence[Choice]) -> str:
    """`3 x hitopk 0.01, 2 x dense`: how many buckets take each choice."""
    counts: dict[str, int] = {}
    for c in plan:
        counts[c.label] = counts.get(c.label, 0) + 1
    return ", ".join(f"{v} x {k}" for k, v in counts.items())


def fixed_plan(kind: str, sizes: Sequence[int], density: float = 1.0, dense_below: int = 0) -> Plan:
    """The plan of a fixed `kind` for buckets of `sizes` elements: every bucket takes `kind`, except that a
    compressed kind (a sparse one sent at `density`, or powersgd) leaves buckets below `dense_below` elements dense."""
    choice = Choice(kind, density if kind in SPARSE else 1.0)
    return tuple(choice if kind not in COMPRESSED or n >= dense_below else DENSE for n in sizes)
