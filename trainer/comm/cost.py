"""The one cost model of a gradient exchange: each bucket's exchange as the collectives it issues plus its
local work, and the time of a step in which those exchanges overlap backward.

`describe(n, choice, layout)` is what trainer/comm does for one bucket of n fp32 gradients (the kinds, `Choice`
and `KINDS`, are trainer/comm/plan.py's, re-exported here):
- dense: one allreduce of the bucket over all ranks (fp32, or fp16/bf16 on the wire);
- topk: every rank selects k = ceil(density n) of its residual-corrected bucket, allgathers (value, index)
  pairs with every rank and scatter-adds them;
- hitopk: intra-node reduce-scatter, selection on this rank's 1/L shard, allgather of the pairs among the
  N nodes' ranks of this local rank (the L local ranks share the node's link), intra-node allgather;
- powersgd: an allreduce of the tensors it leaves uncompressed, then per round one allreduce of the low-rank
  factors of all the bucket's compressed matrices (P: rows x r each, then Q: cols x r each), and the
  matrix products and orthogonalisations around them (`Exchange.flops`, timed at `Network.seconds_per_flop`).
  Its bytes depend on the bucket's tensor shapes, which the caller passes (`matrices`; `shapes` per bucket to
  `candidates`, `predict` and `choose`): `auto` considers it where `comm.auto_kinds` lists it, the planner,
  which knows only bucket sizes, does not.
The communicators count their bytes from this description (`sent_bytes`), the `auto` communicator times
it with the links it measured, and the planner (`trainer/comm/planner.py`) times it with a cluster's links.

Collective times are alpha-beta (`trainer/comm/links.py`, re-exported here): ring steps x latency + the bytes
through the busiest link / its bandwidth; `build_network` fits a network's links to probe measurements.
A step is its compute plus the exposed exchange (`exposed_s`): bucket chains run one after another, each
from the moment backward has produced its bucket, and the optimizer waits for the last one. `choose` finds
the plan (one of `candidates` per bucket) with the least predicted exposed time (`predict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from trainer.comm.links import (Link, Selection, allgather_s, fit_affine, fit_collective, fit_link,  # noqa: F401
                                fit_selection, hierarchical_allreduce_s, reduce_scatter_s, ring_allreduce_s,
                                rounds_of, volume_of)
from trainer.comm.plan import AUTO_KINDS, CODES, DENSE, KINDS, Choice, plan_summary  # noqa: F401

if TYPE_CHECKING:
    from trainer.dist import Topology


@dataclass(frozen=True)
class Layout:
    """Ranks as the exchange sees them: `nodes` nodes of `per_node` ranks."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def group_size(self, group: str) -> int:
        return {"world": self.world, "intra": self.per_node, "inter": self.nodes}[group]


@dataclass(frozen=True)
class Collective:
    op: str
    """allreduce, reduce_scatter or allgather."""
    nbytes: float
    """allreduce and reduce-scatter: the whole buffer; allgather: one rank's payload."""
    group: str
    """world, intra (this rank's node) or inter (this local rank's peers on the other nodes)."""
    wire_bytes: int = 4
    """Bytes per element on the wire (2: a 16-bit dense allreduce)."""


@dataclass(frozen=True)
class Exchange:
    """One bucket's exchange: its collectives in order, and the elements its local work touches."""

    collectives: tuple[Collective, ...]
    select_elements: int = 0
    """Elements MSTopK selects from (with the residual add, pack, clear and scatter-add around it)."""
    k: int = 0
    """Pairs this rank sends (sparse)."""
    cast_elements: int = 0
    """Elements cast to and from a 16-bit wire dtype."""
    flops: float = 0.0
    """Floating-point operations of local compute besides selection (powersgd's products and
    orthogonalisations), timed at `Network.seconds_per_flop`."""


def k_of(size: int, density: float) -> int:
    """How many (value, index) pairs a shard of `size` elements sends at `density`."""
    return min(size, max(1, math.ceil(density * size)))


def describe(n: int, choice: Choice, layout: Layout, matrices: Sequence[tuple[int, int, int]] | None = None
             ) -> Exchange:
    """The collectives and local work of one bucket of n fp32 gradients exchanged as `choice`; powersgd needs
    the (rows, cols, rank) of the bucket's compressed matrices (`matrices`), its other elements go dense."""
    if layout.world == 1:
        return Exchange(())
    if choice.kind == "powersgd":
        if matrices is None:
            raise ValueError("describe: a powersgd exchange depends on the bucket's tensor shapes; pass its matrices")
        dense = n - sum(rows * cols for rows, cols, _ in matrices)
        factors = (Collective("allreduce", 4 * sum(rows * r for rows, _, r in matrices), "world"),
                   Collective("allreduce", 4 * sum(cols * r for _, cols, r in matrices), "world")) if matrices else ()
        # P = M Q, Q = M^T P, M_hat = P Q^T (2 rows cols r each); Gram-Schmidt of P and of the warm-started Q
        flops = sum(6 * rows * cols * r + 2 * (rows + cols) * r * r for rows, cols, r in matrices)
        return Exchange(((Collective("allreduce", 4 * dense, "world"),) if dense else ()) + factors, flops=flops)
    if choice.kind == "dense":
        return Exchange((Collective("allreduce", 4 * n, "world"),))
    if choice.kind == "dense16":
        return Exchange((Collective("allreduce", 2 * n, "world", 2),), cast_elements=n)
    if choice.kind == "topk" or layout.per_node == 1:  # hitopk on 1-rank nodes is topk
        k = k_of(n, choice.density)
        return Exchange((Collective("allgather", 8 * k, "world"),), select_elements=n, k=k)
    per = layout.per_node
    shard = math.ceil(n / per)
    if layout.nodes == 1:  # one node: no slow link, nothing selected
        return Exchange((Collective("reduce_scatter", 4 * shard * per, "intra"),
                         Collective("allgather", 4 * shard, "intra")))
    k = k_of(shard, choice.density)
    return Exchange((Collective("reduce_scatter", 4 * shard * per, "intra"),
                     Collective("allgather", 8 * k, "inter"),
                     Collective("allgather", 4 * shard, "intra")), select_elements=shard, k=k)


def describe_local(n: int, state_elements: int, layout: Layout, wire_bytes: int = 4, k: int = 0) -> Exchange:
    """One synchronisation of `comm.kind: local` (every H steps, nothing in between): the allreduce of the n
    pseudo-gradient elements on the wire (2 bytes: bf16), or with k > 0 the allgather of each rank's k (value,
    index) pairs selected from them; then the fp32 allreduce of the `state_elements` averaged with them
    (BatchNorm statistics, the optimizer's per-element state)."""
    if layout.world == 1:
        return Exchange(())
    state = (Collective("allreduce", 4 * state_elements, "world"),) if state_elements else ()  # none: not run
    if k:
        return Exchange((Collective("allgather", 8 * k, "world"),) + state, select_elements=n, k=k)
    return Exchange((Collective("allreduce", wire_bytes * n, "world", wire_bytes),) + state,
                    cast_elements=n if wire_bytes == 2 else 0)


def sent_bytes(c: Collective, layout: Layout) -> tuple[float, float]:
    """Bytes one rank sends in collective `c` (ring algorithms): all links, and its share of the node-crossing
    hops (a ring over all ranks, node-major, crosses nodes on N of its W hops: the average over ranks)."""
    p = layout.group_size(c.group)
    if p <= 1:
        return 0.0, 0.0
    if c.op == "allreduce":
        sent = 2 * (p - 1) / p * c.nbytes
    elif c.op == "reduce_scatter":
        sent = (p - 1) / p * c.nbytes
    else:
        sent = (p - 1) * c.nbytes
    if c.group == "intra":
        return sent, 0.0
    if c.group == "inter":
        return sent, sent
    # a node-major ring over all ranks (allreduce or allgather): N of its W hops cross nodes
    return sent, (sent * layout.nodes / layout.world if layout.nodes > 1 else 0.0)


# ---------------------------------------------------------------- timing


@dataclass
class Network:
    """The links an exchange runs over, as `collective_s` reads them.

    links: "world" (an allreduce over all ranks; on a GPU cluster, with dense_algorithm hierarchical, the
    intra and inter links instead), "world16" (the same on a 16-bit wire, if it differs), "world_gather"
    (an allgather over all ranks, if it differs from "world"), "intra" and "inter" (each node's link; the L
    local ranks' inter-node allgathers share it)."""

    layout: Layout
    links: dict[str, Link]
    selection: Selection = field(default_factory=lambda: Selection(0.0, 0.0))
    cast_per_element_s: float = 0.0
    dense_algorithm: str = "ring"
    """ring: one flat ring over all ranks (gloo); hierarchical: NCCL's 2-D allreduce."""
    net_scale: float = 1.0
    """Measured / modelled time of the collectives on the live cluster (contention with backward, drift)."""
    seconds_per_flop: float = 0.0
    """Seconds per floating-point operation of an exchange's other local work (`Exchange.flops`: powersgd's
    products), measured on the real matrices; 0 where nothing measured it."""

    def link(self, *names: str) -> Link:
        for name in names:
            if name in self.links:
                return self.links[name]
        raise KeyError(f"no link among {names}; known: {sorted(self.links)}")

    def collective_s(self, c: Collective) -> float:
        lay = self.layout
        p = lay.group_size(c.group)
        if p <= 1:
            return 0.0
        if c.op == "allreduce":
            if self.dense_algorithm == "hierarchical" and "intra" in self.links and "inter" in self.links:
                t = hierarchical_allreduce_s(c.nbytes, lay.nodes, lay.per_node, self.links["intra"],
                                             self.links["inter"])
            else:
                names = ("world16", "world") if c.wire_bytes == 2 else ("world",)
                t = ring_allreduce_s(c.nbytes, p, self.link(*names))
        elif c.group == "intra":  # a layout the links were not measured on: the world link stands in
            t = (reduce_scatter_s if c.op == "reduce_scatter" else allgather_s)(c.nbytes, p, self.link("intra", "world"))
        elif c.group == "inter":
            t = allgather_s(c.nbytes, p, self.link("inter", "world_gather", "world"), sharing=lay.per_node)
        else:
            t = allgather_s(c.nbytes, p, self.link("world_gather", "inter", "world"))
        return t * self.net_scale

    def network_s(self, ex: Exchange) -> float:
        return sum(self.collective_s(c) for c in ex.collectives)

    def local_s(self, ex: Exchange) -> float:
        return (self.selection.seconds(ex.select_elements) + self.cast_per_element_s * ex.cast_elements
                + self.seconds_per_flop * ex.flops)

    def chain_s(self, ex: Exchange) -> float:
        """Seconds of one bucket's chain: its collectives and its local work, one after the other."""
        return self.network_s(ex) + self.local_s(ex)


def exposed_s(ready_before_end: Sequence[float], chain_s: Sequence[float], cpu_s: float = 0.0) -> float:
    """Seconds the optimizer waits after backward: chains start `ready_before_end[b]` seconds before
    backward ends (in launch order, one at a time); `cpu_s` of work competing with backward delays it."""
    end = -math.inf
    for ready, seconds in zip(ready_before_end, chain_s):
        end = max(end, -ready) + seconds
    return max(cpu_s, end, 0.0)


PROBES = ("world", "world16", "world_gather", "inter", "intra_gather", "intra_scatter")
"""The measured collectives a network's links are fitted to, by link: allreduce over all ranks (fp32, 16-bit
wire), allgather over all ranks, allgather among a local rank's peers on the other nodes, and the intra-node
allgather and reduce-scatter (both fit the one "intra" link)."""


def build_network(layout: Layout, probes: dict[str, list[tuple[float, float]]],
                  select_points: Sequence[tuple[float, float]] = (), cast_per_element_s: float = 0.0,
                  seconds_per_flop: float = 0.0) -> Network:
    """The links fitted to probe measurements ({probe: [(bytes, seconds)]}, `PROBES`) and the sparse local
    work fitted to [(elements, seconds)]."""
    w, per, nodes = layout.world, layout.per_node, layout.nodes
    links = {"world": fit_collective(probes["world"], ring_allreduce_s, w)}
    if "world16" in probes:  # a link carries bytes: a 16-bit wire is never faster per byte (its sums may be slower)
        fitted = fit_collective(probes["world16"], ring_allreduce_s, w)
        links["world16"] = Link(max(fitted.alpha_s, links["world"].alpha_s),
                                min(fitted.bytes_per_s, links["world"].bytes_per_s))
    if "world_gather" in probes:
        links["world_gather"] = fit_collective(probes["world_gather"], allgather_s, w)
    if "inter" in probes:  # the node's L local ranks gather at once over its link
        links["inter"] = fit_collective(probes["inter"], lambda b, p, link: allgather_s(b, p, link, sharing=per),
                                        nodes)
    if "intra_gather" in probes:  # one link from both intra-node collectives: bytes scaled by each one's volume
        pts = [(b * volume_of(allgather_s, per), t) for b, t in probes["intra_gather"]]
        pts += [(b * volume_of(reduce_scatter_s, per), t) for b, t in probes.get("intra_scatter", [])]
        links["intra"] = fit_link(pts, rounds_of(allgather_s, per), 1.0)
    return Network(layout, links, fit_selection(select_points), cast_per_element_s,
                   seconds_per_flop=seconds_per_flop)


def exchange_bytes(ex: Exchange, layout: Layout) -> tuple[float, float]:
    """Bytes one rank sends in exchange `ex`: all links, and the inter-node share."""
    sent = inter = 0.0
    for c in ex.collectives:
        s, i = sent_bytes(c, layout)
        sent, inter = sent + s, inter + i
    return sent, inter


def layout_of(topo: Topology) -> Layout:
    """The `Layout` of a `trainer.dist.Topology`."""
    return Layout(int(topo.num_nodes), int(topo.ranks_per_node))


CROSSING = ("world", "world16", "world_gather", "inter")
"""The links whose busiest hop crosses nodes (when there are several): they scale with the network's rate."""


def with_inter_rate(net: Network, factor: float, layout: Layout | None = None) -> Network:
    """`net` with the node-crossing links `factor` times as fast (a faster or slower network), optionally
    on another layout (the same links, other group sizes).

    A link's time per byte is the slower of the wire and the hosts' own work per byte (the "intra" link's:
    copies, sums, the TCP stack), which stream through it together rather than one after the other: a faster
    network is floored at the hosts' rate (a link calibrated faster than the hosts is all host work and does
    not speed up), a slower one treats the calibrated link as all wire, which can only overstate the slowdown
    of a link the hosts limited. Without an "intra" link (one rank per node) there is no floor. A 16-bit wire
    scales like the others: its casts are local work (`cast_per_element_s`), and what its fit adds over fp32's
    per byte moves with the rate (absent at 1 Gbit/s on the emulated cluster, present at 200 Mbit/s)."""
    host = 1.0 / net.links["intra"].bytes_per_s if "intra" in net.links else 0.0

    def scaled(link: Link) -> Link:
        wire = 1.0 / link.bytes_per_s
        return Link(link.alpha_s, 1.0 / max(wire / factor, min(host, wire)))

    links = {name: scaled(link) if name in CROSSING else link for name, link in net.links.items()}
    return Network(layout or net.layout, links, net.selection, net.cast_per_element_s, net.dense_algorithm,
                   net.net_scale, net.seconds_per_flop)


# ---------------------------------------------------------------- choosing

MARGIN = 0.02
"""A bucket leaves dense only for a predicted saving above this fraction of the step's exposed time
(plus a tenth of a millisecond): ties stay dense."""


Shapes = Sequence[tuple[int, int, int]]
"""(rows, cols, rank) of each matrix powersgd compresses in one bucket (`powersgd.BucketView.shapes`)."""


def candidates(n: int, layout: Layout, densities: Sequence[float], min_density: float, dense_below: int,
               kinds: Sequence[str] = AUTO_KINDS, shapes: Shapes | None = None) -> list[Choice]:
    """The exchanges auto considers for a bucket of n elements (dense first), among `kinds`: powersgd only
    for a bucket with matrices to compress (`shapes` non-empty)."""
    out = [DENSE] + ([Choice("dense16")] if "dense16" in kinds else [])
    if layout.world == 1 or n < dense_below:
        return out
    safe = sorted({d for d in densities if d >= min_density}, reverse=True)
    if "topk" in kinds:
        out += [Choice("topk", d) for d in safe]
    if "hitopk" in kinds and layout.per_node > 1 and layout.nodes > 1:
        out += [Choice("hitopk", d) for d in safe]
    if "powersgd" in kinds and shapes:
        out.append(Choice("powersgd"))
    return out


def shapes_at(shapes: Sequence[Shapes | None] | None, i: int) -> Shapes | None:
    """Bucket i's matrices (empty: none); None without `shapes` (a powersgd choice then cannot be priced)."""
    return (shapes[i] or ()) if shapes is not None else None


def predict(sizes: Sequence[int], ready_before_end: Sequence[float], plan: Sequence[Choice], net: Network,
            local_competes: bool, shapes: Sequence[Shapes | None] | None = None) -> tuple[float, list[float]]:
    """(predicted exposed seconds, each bucket's chain seconds) of `plan`; `shapes`: each bucket's matrices
    (needed by a powersgd choice)."""
    chains, local = [], 0.0
    for i, (n, choice) in enumerate(zip(sizes, plan)):
        ex = describe(n, choice, net.layout, shapes_at(shapes, i))
        chains.append(net.chain_s(ex))
        local += net.local_s(ex)
    return exposed_s(ready_before_end, chains, local if local_competes else 0.0), chains


def uniform_plans(count: int, options: Callable[[int], list[Choice]]) -> list[list[Choice]]:
    """Each candidate on every bucket that has it, dense on the others: one plan per candidate, in order."""
    every = {c: None for i in range(count) for c in options(i)}  # ordered, no duplicates
    return [[c if c in options(i) else DENSE for i in range(count)] for c in every]


def choose(sizes: Sequence[int], ready_before_end: Sequence[float], net: Network,
           options: Callable[[int], list[Choice]], local_competes: bool,
           start: Sequence[Choice] | None = None, shapes: Sequence[Shapes | None] | None = None
           ) -> tuple[list[Choice], float]:
    """The plan with the least predicted exposed time, and that time.

    Coordinate descent (largest buckets first) from `start` (default all dense) and from every uniform plan
    (each candidate on every bucket that has it): with many small buckets no single bucket's move may clear
    the margin while moving them all does. Another start's plan replaces the first one's only if it is
    predicted faster by the margin, so ties stay with `start`. `options(i)`: bucket i's candidates (`candidates`
    with its size and matrices); `shapes`: each bucket's powersgd matrices, to price a powersgd choice."""
    first = list(start) if start is not None else [DENSE] * len(sizes)
    plan, best = _descend(sizes, ready_before_end, net, options, local_competes, first, shapes)
    for trial in uniform_plans(len(sizes), options):
        if trial == first:
            continue
        other, t = _descend(sizes, ready_before_end, net, options, local_competes, trial, shapes)
        if t < best - MARGIN * best - 1e-4:
            plan, best = other, t
    return plan, best


def _descend(sizes: Sequence[int], ready_before_end: Sequence[float], net: Network,
             options: Callable[[int], list[Choice]], local_competes: bool, plan: list[Choice],
             shapes: Sequence[Shapes | None] | None = None) -> tuple[list[Choice], float]:
    """Coordinate descent from `plan`: a bucket changes only for a predicted saving above the margin."""
    best, _ = predict(sizes, ready_before_end, plan, net, local_competes, shapes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    for _ in range(3):
        changed = False
        for i in order:
            for choice in options(i):
                if choice == plan[i]:
                    continue
                trial = plan[:i] + [choice] + plan[i + 1:]
                t, _ = predict(sizes, ready_before_end, trial, net, local_competes, shapes)
                if t < best - MARGIN * best - 1e-4:
                    plan, best, changed = trial, t, True
        if not changed:
            break
    return plan, best
