"""The emulated cluster the planner is checked against: scripts/bench/scaling.py's measurements (its
calibration file) and the planner's prediction of every step it measured.

A calibration holds, per layout and rate, the collectives measured alone (`primitives`, named by the link
they probe: `cost.PROBES`, [elements, wall s, CPU s] at two sizes), the exchanges' local pieces, and per model
its buckets, when backward releases them and each exchange's measured step (named by trainer/comm/plan.py's
`KINDS`, plus "compute only" and "auto"). `EmulatedCluster` fits the links to the collectives as the auto communicator fits
its probes (`cost.build_network`) and predicts a step; `compare_with_measurements` sets each prediction
beside its measurement.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trainer.comm.cost import PROBES, Layout, Network, Selection, build_network, describe, exposed_s, fit_affine
from trainer.comm.plan import KINDS, Choice, fixed_plan
from trainer.comm.planner import TCP_EFFICIENCY_DEFAULT, ModelSpec, PlanError

WIRE_BYTES = {"world16": 2}
"""Bytes per element of a probe's collective (4, fp32, unless named here)."""

RENAMED = {"dense fp16": "dense16", "allreduce": "world", "allreduce_fp16": "world16", "allgather": "world_gather",
           "allgather_inter": "inter", "allgather_intra": "intra_gather", "reduce_scatter_intra": "intra_scatter"}
"""Names in calibrations written before the bench used the cost model's names -> the cost model's names."""


def fit_cpu(points: Sequence[Sequence[float]]) -> Selection:
    """CPU seconds per call of a measured piece, affine in its size (elements)."""
    if len(points) < 2 or len(points[0]) < 3:
        raise PlanError("calibration: each piece needs [elements, wall s, CPU s] at two sizes at least "
                        "(a calibration from an older scaling.py? rerun it)")
    return Selection(*fit_affine([(p[0], max(p[2], 0.0)) for p in points]))


@dataclass
class EmulatedCluster:
    """One layout and rate of the emulated cluster, as measured by scripts/bench/scaling.py.

    There is no GPU here: the exchange's own work (gathering and averaging buckets, casts, selection, the
    intra-node copies through loopback, gloo's sums) runs on the same cores as the compute. A step is the
    compute plus the larger of
    - the CPU bound: that work. R ranks share C cores with whatever else runs there; under processor
      sharing, work that runs alongside the compute delays it by R/C times its CPU seconds (the extra
      threads also take cores from other tenants, so the machine's load cancels out);
    - the exposed chains (`cost.exposed_s`) over the shaped links, their CPU pieces at the compute's own
      wall-per-CPU-second of that run (rho, the machine's load as the ranks saw it), the write-back after
      the last one.
    Links are fitted to the collectives' wall times (`cost.build_network`), compute comes from the
    compute-only steps, CPU costs from the pieces (scaling.py's measure_primitives and
    measure_sparse_on_gradients), scaled to the exchange's CPU seconds per step when that measurement is given.
    """

    nodes: int
    ranks_per_node: int
    cores: int
    network: Network
    """The fitted links under the cost model's names (ring algorithms, as gloo runs them)."""
    cpu: dict[str, Selection]
    """CPU seconds of each measured piece (`.seconds(elements)`)."""

    @classmethod
    def from_run(cls, run: dict, cores: int) -> "EmulatedCluster":
        """The cluster of one measured run (layout and rate) of a calibration."""
        layout, prim = Layout(int(run["nodes"]), int(run["ranks_per_node"])), run["primitives"]
        probes = {name: [(WIRE_BYTES.get(name, 4) * p[0], p[1]) for p in prim[name]] for name in PROBES if name in prim}
        return cls(layout.nodes, layout.per_node, cores, build_network(layout, probes),
                   {name: fit_cpu(points) for name, points in prim.items()})

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def bucket(self, n: int, choice: Choice, sparse_cpu: tuple[float, float] | None = None
               ) -> tuple[float, float, float]:
        """(network seconds, CPU seconds on the exchange's chain, CPU seconds in all) of one bucket.

        sparse_cpu: the sparse local work measured on the model's own gradients (whole bucket, 1/L shard);
        otherwise the fit on heavy-tailed random values."""
        per, cpu = self.ranks_per_node, self.cpu
        local = cpu["dense_local"].seconds(n)  # gather into the bucket, average, write back (the training thread)
        desc = describe(n, choice, self.network.layout)
        # the shaped links carry the collectives over all ranks and between nodes; intra-node ones are CPU work
        net = sum(self.network.collective_s(c) for c in desc.collectives if c.group != "intra")
        if choice.kind == "dense16":  # the casts on the training thread, the fp16 sums in gloo's threads
            return net, 0.0, local + cpu["fp16_cast"].seconds(n) + cpu["world16"].seconds(n)
        if choice.kind == "dense":
            return net, 0.0, local + cpu["world"].seconds(n)
        if desc.select_elements == n:  # every rank its own node: topk, or hitopk on 1-rank nodes
            chain_cpu = sparse_cpu[0] if sparse_cpu else cpu["sparse_local"].seconds(n)
            return net, chain_cpu, local + chain_cpu + cpu["world_gather"].seconds(2 * desc.k)
        shard = math.ceil(n / per)
        chain_cpu = (cpu["intra_scatter"].seconds(shard * per) + cpu["intra_gather"].seconds(shard)
                     + (sparse_cpu[1] if sparse_cpu else cpu["sparse_local"].seconds(shard)))
        return net, chain_cpu, local + chain_cpu + cpu["inter"].seconds(2 * desc.k)

    def step_s(self, compute: dict, model: ModelSpec, plan: Sequence[Choice],
               sparse_cpu: Sequence[tuple[float, float]] | None = None, exchange_cpu_s: float | None = None) -> float:
        """A step of `plan` (a choice per bucket), given the compute-only cell of the same run (wall and CPU s).

        exchange_cpu_s: the exchange's CPU seconds per step and rank as measured in the emulated steps (the
        calibration); the pieces then only say how it splits between buckets and chains. Without it, the
        pieces' own CPU costs are used (measured alone, they miss the cache and memory contention with the
        compute, and gloo's polling while a peer is descheduled)."""
        rho = (compute["fwd_s"] + compute["bwd_s"]) / max(compute["fwd_cpu_s"] + compute["bwd_cpu_s"], 1e-9)
        sharing = max(1.0, self.world / self.cores)
        costs = [self.bucket(n, c, sparse_cpu[i] if sparse_cpu else None)
                 for i, (n, c) in enumerate(zip(model.buckets, plan))]
        total = sum(t for _, _, t in costs)
        scale = exchange_cpu_s / total if exchange_cpu_s is not None and total > 0 else 1.0
        chains = [net + rho * chain_cpu * scale for net, chain_cpu, _ in costs]
        chains[-1] += rho * self.cpu["dense_local"].seconds(model.buckets[-1])  # the write-back after the last chain
        return compute["fwd_s"] + compute["bwd_s"] + exposed_s(model.ready_before_end(compute["bwd_s"]), chains,
                                                                 sharing * total * scale)


def renamed(run: dict[str, Any]) -> dict[str, Any]:
    """A measured run (or one cell of it) with its collectives and exchanges under the cost model's names."""
    if "primitives" in run:
        run["primitives"] = {RENAMED.get(k, k): v for k, v in run["primitives"].items()}
    for m in run.get("models", {}).values():
        m["exchanges"] = {RENAMED.get(k, k): v for k, v in m["exchanges"].items()}
    return run


def load_calibration(path: str | Path) -> dict:
    """scripts/bench/scaling.py's calibration file, its names those of the cost model."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"--calibration {path}: file not found; it is written by scripts/bench/scaling.py "
                        "(as root: sudo .venv/bin/python -m scripts.bench.scaling --quick)")
    try:
        cal = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"--calibration {path}: not valid JSON ({e}); rerun scripts/bench/scaling.py") from None
    missing = [k for k in ("version", "density", "dense_below", "runs") if k not in cal]
    if missing or not cal.get("runs"):
        raise PlanError(f"--calibration {path}: not a scaling.py calibration (missing {missing or ['runs']})")
    for run in cal["runs"]:
        renamed(run)
    return cal


def compare_with_measurements(calibration: dict) -> list[dict[str, Any]]:
    """Every measured step of a fixed exchange (`exchange`: one of `plan.KINDS`) next to the planner's
    prediction for it: `predicted_s` calibrated with the exchange's measured CPU seconds per step, `pieces_s`
    from the separately measured pieces alone."""
    rows = []
    cores = int(calibration.get("cores", 2))
    for run in calibration["runs"]:
        cluster = EmulatedCluster.from_run(run, cores)
        for name, m in run["models"].items():
            spec = ModelSpec(name, list(m["buckets"]), list(m["bucket_ready"]))
            compute = m["exchanges"]["compute only"]
            pieces = [(row[2], row[4]) for row in m["sparse_local"]] if "sparse_local" in m else None
            for kind, cell in m["exchanges"].items():
                if kind not in KINDS:  # "compute only", and auto (a choice per bucket: make_cells in the bench)
                    continue
                plan = fixed_plan(kind, spec.buckets, calibration["density"], calibration["dense_below"])
                exchange_cpu = max(cell["cpu_s"] - compute["cpu_s"], 0.0)
                pred = cluster.step_s(compute, spec, plan, pieces, exchange_cpu)
                rows.append({"model": name, "nodes": run["nodes"], "ranks_per_node": run["ranks_per_node"],
                             "rate": run["rate"], "exchange": kind, "measured_s": cell["step_s"],
                             "predicted_s": pred, "error": pred / cell["step_s"] - 1, "exchange_cpu_s": exchange_cpu,
                             "pieces_s": cluster.step_s(compute, spec, plan, pieces)})
    return rows


def tcp_efficiency(calibration: dict) -> float:
    """Payload bandwidth of the emulated links' allreduce fit over their nominal rate (median over runs)."""
    shaped = [r for r in calibration["runs"] if r["rate"] != "unlimited"]
    if not shaped:
        return TCP_EFFICIENCY_DEFAULT
    return statistics.median(EmulatedCluster.from_run(r, 1).network.links["world"].bytes_per_s * 8 / rate_bps(r["rate"])
                             for r in shaped)


def rate_bps(rate: str) -> float:
    """A tc rate (1gbit, 200mbit, ...) in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, mult in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * mult
    raise ValueError(f"rate {rate!r}: expected e.g. 1gbit or 200mbit")
