"""Alpha-beta links: the time of a ring collective over a link, and the link fitted to measured times.

A `Link` is a latency per ring step and the payload bandwidth of the busiest hop. The collective formulas
(`ring_allreduce_s`, `reduce_scatter_s`, `allgather_s`, `hierarchical_allreduce_s`) take bytes, ranks and a
link; `fit_collective` inverts one of them: the link that makes it fit measured (bytes, seconds) points,
by least squares on the formula's own rounds and volume. `Selection` is the local work of a sparse
exchange, affine in the elements it selects from. `trainer/comm/cost.py` builds its networks from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Link:
    """One kind of link: latency per ring step and payload bandwidth (bytes/s) of its busiest hop."""

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.alpha_s < 0:
            raise ValueError(f"link: bandwidth must be > 0 and latency >= 0, got {self.bytes_per_s} B/s, "
                             f"{self.alpha_s} s")


def ring_allreduce_s(nbytes: float, p: int, link: Link) -> float:
    """Ring allreduce of an nbytes buffer over p ranks: 2(p-1) steps, 2(p-1)/p of the buffer per link."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bytes_per_s


def reduce_scatter_s(nbytes: float, p: int, link: Link) -> float:
    """Ring reduce-scatter of an nbytes buffer (each rank keeps 1/p): p-1 steps, (p-1)/p of the buffer."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.bytes_per_s


def allgather_s(payload_bytes: float, p: int, link: Link, sharing: int = 1) -> float:
    """Ring allgather of one payload per rank over p ranks: p-1 steps, p-1 payloads through each link.

    `sharing` groups run at once over the same link (hitopk: the L local ranks of a node share its NIC)."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + sharing * (p - 1) * payload_bytes / link.bytes_per_s


def hierarchical_allreduce_s(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """NCCL-style 2-D allreduce: intra-node reduce-scatter, per_node parallel inter-node rings on 1/per_node
    shards (sharing the NIC), intra-node allgather."""
    return (reduce_scatter_s(nbytes, per_node, intra) + ring_allreduce_s(nbytes, nodes, inter)
            + allgather_s(nbytes / per_node, per_node, intra))


@dataclass(frozen=True)
class Selection:
    """Local work of a sparse exchange: fixed seconds per call plus seconds per element selected from."""

    fixed_s: float
    per_element_s: float

    def seconds(self, n: float) -> float:
        """Seconds of the work on n elements (none for no elements)."""
        return self.fixed_s + self.per_element_s * n if n else 0.0


def fit_link(points: Sequence[tuple[float, float]], rounds: float, volume: float) -> Link:
    """Least-squares latency and bandwidth from measured (bytes, seconds): t = rounds a + volume bytes / bw.

    volume: bytes through the busiest link per byte of the measured size (the formula's factor)."""
    fixed, per = fit_affine([(volume * x, t) for x, t in points])
    if per <= 0:  # noise hid the growth with size: no latency, the largest size's throughput
        x, t = max(points)
        fixed, per = 0.0, max(t, 1e-9) / max(volume * x, 1.0)
    return Link(fixed / rounds if rounds else 0.0, 1.0 / per)


def fit_affine(xy: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x with a >= 0 (a negative intercept is refitted through the origin)."""
    if not xy:
        raise ValueError("fit_affine: no points")
    xs, ys = [x for x, _ in xy], [y for _, y in xy]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-30), 0.0
    return intercept, slope


def fit_collective(points: Sequence[tuple[float, float]], formula: Callable[[float, int, Link], float], p: int
                   ) -> Link:
    """The link that makes `formula` (a collective: bytes, ranks, link -> seconds) fit the measured
    (bytes, seconds) at p ranks: least squares on the formula's own rounds and volume."""
    return fit_link(points, rounds_of(formula, p), volume_of(formula, p))


def rounds_of(formula: Callable[[float, int, Link], float], p: int) -> float:
    """The latency terms of a collective's formula at p ranks: its time for no bytes at 1 s per step."""
    return formula(0.0, p, Link(1.0, 1.0))


def volume_of(formula: Callable[[float, int, Link], float], p: int) -> float:
    """The bytes through the busiest link per byte of a collective's size: its time at 1 B/s, no latency."""
    return formula(1.0, p, Link(0.0, 1.0))


def fit_selection(points: Sequence[tuple[float, float]]) -> Selection:
    """Local work fitted to measured (elements, seconds): affine, or the average cost per element when noise
    between the sizes hides the growth."""
    if not points:
        return Selection(0.0, 0.0)
    fixed, per_element = fit_affine(points)
    if per_element <= 0:
        fixed, per_element = 0.0, sum(t for _, t in points) / sum(n for n, _ in points)
    return Selection(fixed, per_element)
