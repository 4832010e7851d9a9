"""Cost model and planner: step time, time to target and cost of each gradient exchange on a cluster.

Given a model (its gradient buckets), the compute time per image at each phase's image size, a cluster
(nodes, GPUs per node, intra- and inter-node links, $ per node-hour) and a recipe config (phases, epochs,
batch, comm), it predicts the step time of dense, dense fp16, topk and hitopk exchanges, then the time to
target and the cost, and recommends an exchange and a density.

The model (every formula is a function below, tested in tests/test_plan.py):
- each collective is alpha-beta: `rounds * alpha + bytes over the busiest link / bandwidth` (ring
  allreduce 2(p-1) rounds and 2(p-1)/p of the buffer; reduce-scatter and allgather half of that);
- an exchange is, per gradient bucket, the chain of collectives of trainer/comm (dense: one allreduce,
  flat ring on the emulated cluster, hierarchical on a GPU cluster; topk: selection + allgather of k
  (value, index) pairs among all ranks; hitopk: intra-node reduce-scatter, selection on the 1/L shard,
  allgather among the N nodes' ranks of one local rank - the L groups share the node's NIC - and the
  intra-node allgather);
- a step is forward, then backward releasing the buckets at measured fractions of its duration; bucket
  chains run one after another from the moment their bucket is ready; the step ends when backward and
  the last chain are done (`overlap_step_s`).

Calibration (`--calibration`, written by scripts/bench/scaling.py as root): on the emulated cluster the
links are fitted to the raw collectives measured there; there is no GPU, so the exchange's own work
(gathering buckets, casts, selection, intra-node copies) shares the CPU cores with the compute, and the
calibration is the CPU seconds per step each exchange took there (see EmulatedCluster). Every measured
step (model x layout x rate x exchange) is then predicted from those, the measured compute-only forward
and backward times and the model's buckets, and printed next to the measurement. No constant is fitted to
the step times. From the calibration the GPU plan takes the TCP efficiency of the shaped links (payload
bandwidth / rate) and, for a model it has measured, when backward releases each bucket.

Paper setting: 16 nodes x 8 V100, 25 Gbit/s between nodes, configs/resnet50_dawnbench.yaml, with the
published times as cited constants and the V100's compute time per image as a stated assumption.

    python -m scripts.plan [--config configs/resnet50_dawnbench.yaml] [section.key=value ...]
        [--nodes 16 --gpus-per-node 8 --inter-gbit 25 --intra-gbyte 100 --price 24.48]
        [--calibration runs/scaling/calibration.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from trainer.comm.cost import (DENSE, Choice, Layout, Link, Network, Selection, allgather_s, describe, fit_affine,
                               hierarchical_allreduce_s, overlap_step_s, reduce_scatter_s, ring_allreduce_s,
                               with_inter_rate)

# ---------------------------------------------------------------- published figures and stated assumptions

PUBLISHED_S = {
    "Shi et al., MLSys 2021 (arXiv 2010.10458): 128 V100, 25 Gbit/s": 2 * 60 + 31,
    "Alibaba, DAWNBench ImageNet entry it beat": 2 * 60 + 38,
}
"""Published ResNet-50 time to 93% top-5 on ImageNet (DAWNBench training time), seconds."""

V100_IMAGES_PER_S_224 = 1200.0
"""Assumption, cited: ResNet-50 v1.5 training throughput of one V100 16 GB, mixed precision, 224 px, batch
256 — NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance: NVIDIA DGX-1 16GB (8x V100 16GB)", 1 GPU: 1200 img/s (8 GPUs: 8322 img/s). Other image
sizes are scaled by pixel count (FLOPs of a convolutional network grow with the pixels)."""

V100_HBM_BYTES_PER_S = 900e9
"""Assumption, cited: V100 SXM2 HBM2 bandwidth, 900 GB/s (NVIDIA Tesla V100 datasheet)."""

SELECTION_PASSES = 4
"""Assumption: GPU MSTopK reads its input about 4 times (statistics, counts, band, gather: kernels/mstopk_triton.py);
memory-bound, so selection time = passes x bytes / HBM bandwidth + SELECTION_LAUNCH_S."""

SELECTION_LAUNCH_S = 200e-6
"""Assumption: kernel launches and host synchronisation of one GPU selection (~20 launches of ~10 us)."""

NVLINK_BYTES_PER_S = 100e9
"""Assumption: ring bandwidth between the 8 V100s of a node over NVLink, 100 GB/s per GPU (a third of the
300 GB/s aggregate NVLink bandwidth the V100 datasheet states; a ring uses one link pair per direction)."""

INTRA_ALPHA_S = 10e-6
"""Assumption: latency of one NVLink ring step (NCCL, same node)."""

INTER_ALPHA_S = 50e-6
"""Assumption: latency of one inter-node ring step over TCP on a cloud VPC (NCCL sockets)."""

TCP_EFFICIENCY_DEFAULT = 0.95
"""Payload fraction of a link's rate TCP achieves (1448 of 1500-byte frames, ACKs); replaced by the value
measured on the emulated cluster when a calibration file is given."""

P3_16XLARGE_USD_PER_HOUR = 24.48
"""Assumption, cited: AWS EC2 on-demand price of p3.16xlarge (8 V100, 25 Gbit/s), us-east-1."""

IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_VAL_IMAGES = 50_000
BACKWARD_SHARE = 2.0 / 3.0
"""Assumption: backward is 2/3 of a training step's compute (twice the forward's FLOPs)."""

EXCHANGES = ("dense", "dense fp16", "topk", "hitopk")
DENSITIES = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05)


class PlanError(ValueError):
    """A mistake in the planner's input: the message names the option or file and the fix."""


# ---------------------------------------------------------------- cluster, model, exchange (the collectives of an
# exchange and their alpha-beta times are trainer/comm/cost.py's, shared with the communicators)


@dataclass
class Cluster:
    """Where the training runs, as the cost model sees it."""

    nodes: int
    ranks_per_node: int
    inter: Link
    """Each node's NIC, each direction (payload bandwidth, i.e. after TCP overhead)."""
    intra: Link
    """Between ranks of one node."""
    selection: Selection
    dense_algorithm: str = "hierarchical"
    """hierarchical (NCCL 2-D) or ring (one flat ring over all ranks, as gloo does)."""
    price_per_node_hour: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise PlanError(f"cluster: nodes and GPUs per node must be >= 1, got {self.nodes} x {self.ranks_per_node}")
        if self.dense_algorithm not in ("hierarchical", "ring"):
            raise PlanError(f"cluster: dense_algorithm must be hierarchical or ring, got {self.dense_algorithm!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class ModelSpec:
    """The gradient buckets of a model and when backward produces them."""

    name: str
    buckets: list[int]
    """Elements per bucket, in launch order (last layers first)."""
    ready: list[float] = field(default_factory=list)
    """Fraction of the backward pass at which each bucket is complete; default: by parameter count."""

    def __post_init__(self) -> None:
        if not self.buckets or min(self.buckets) < 1:
            raise PlanError(f"model {self.name}: needs at least one non-empty gradient bucket")
        if not self.ready:
            total, acc = sum(self.buckets), 0
            for n in self.buckets:
                acc += n
                self.ready.append(acc / total)
        if len(self.ready) != len(self.buckets):
            raise PlanError(f"model {self.name}: {len(self.ready)} ready fractions for {len(self.buckets)} buckets")

    @property
    def params(self) -> int:
        return sum(self.buckets)


@dataclass(frozen=True)
class Exchange:
    kind: str
    """dense, dense fp16, topk or hitopk."""
    density: float = 0.01
    dense_below: int = 16384

    def __post_init__(self) -> None:
        if self.kind not in EXCHANGES:
            raise PlanError(f"exchange {self.kind!r}: valid ones are {', '.join(EXCHANGES)}")
        if not 0 < self.density <= 1:
            raise PlanError(f"density must be in (0, 1], got {self.density}")

    @property
    def label(self) -> str:
        return self.kind if self.kind.startswith("dense") else f"{self.kind} d={self.density:g}"


def choice_of(n: int, ex: Exchange) -> Choice:
    """The cost model's choice for a bucket of n elements under `ex` (buckets below dense_below go dense)."""
    if ex.kind == "dense":
        return DENSE
    if ex.kind == "dense fp16":
        return Choice("dense16")
    return Choice(ex.kind, ex.density) if n >= ex.dense_below else DENSE


def cluster_network(c: Cluster) -> Network:
    """The cluster's links as the cost model reads them."""
    return Network(Layout(c.nodes, c.ranks_per_node), {"world": c.inter, "inter": c.inter, "intra": c.intra},
                   c.selection, dense_algorithm=c.dense_algorithm)


def bucket_cost(n: int, ex: Exchange, c: Cluster) -> float:
    """Seconds to exchange one bucket of n fp32 gradients on a GPU cluster: trainer/comm/cost.py's
    description of the exchange (its collectives and selection), timed on the cluster's links."""
    net = cluster_network(c)
    return net.chain_s(describe(n, choice_of(n, ex), net.layout))


def step_seconds(forward_s: float, backward_s: float, model: ModelSpec, ex: Exchange | None, c: Cluster) -> float:
    """One training step on a GPU cluster: no exchange work competes with the GPU's compute."""
    if ex is None or c.world == 1:
        return forward_s + backward_s
    return overlap_step_s(forward_s, backward_s, model.ready, [bucket_cost(n, ex, c) for n in model.buckets])


# ---------------------------------------------------------------- recipe: phases -> time to target and cost


@dataclass
class PhasePlan:
    image_size: int
    val_image_size: int
    epochs: int
    batch_size: int
    steps_per_epoch: int
    compute_s: float
    """Forward + backward of one rank's share of the batch."""


def phases_from_config(cfg: Any, world: int, train_images: int = IMAGENET_TRAIN_IMAGES,
                       compute_s_per_image: dict[int, float] | None = None,
                       images_per_s_224: float = V100_IMAGES_PER_S_224) -> list[PhasePlan]:
    """The recipe's phase table as the planner needs it (drop_last batches, as the loaders do)."""
    phases = cfg.schedule.phases
    if not phases:
        raise PlanError("config: schedule.phases is empty; the planner needs the phase table (image size, batch)")
    out = []
    for i, p in enumerate(phases):
        if p.batch_size % world:
            raise PlanError(f"config: schedule.phases[{i}].batch_size {p.batch_size} is not divisible by the "
                            f"world size {world} (nodes x GPUs per node)")
        steps = train_images // p.batch_size
        if steps < 1:
            raise PlanError(f"config: schedule.phases[{i}].batch_size {p.batch_size} exceeds the {train_images} "
                            "training images")
        per_image = (compute_s_per_image or {}).get(p.image_size)
        if per_image is None:
            per_image = (p.image_size / 224) ** 2 / images_per_s_224
        out.append(PhasePlan(p.image_size, p.val_image_size or p.image_size, p.end_epoch - p.start_epoch,
                             p.batch_size, steps, per_image * p.batch_size / world))
    return out


@dataclass
class Prediction:
    exchange: Exchange
    step_s: list[float]
    """Per phase."""
    train_s: float
    eval_s: float
    cost_usd: float

    @property
    def total_s(self) -> float:
        return self.train_s + self.eval_s


def predict_run(phases: list[PhasePlan], model: ModelSpec, ex: Exchange, c: Cluster, warmup_steps: int = 0,
                eval_every: int = 1, images_per_s_224: float = V100_IMAGES_PER_S_224) -> Prediction:
    """Time to the end of the recipe (its target epoch) and its cost; `warmup_steps` use a dense exchange."""
    dense = Exchange("dense", dense_below=ex.dense_below)
    train_s, eval_s, step_s, epoch = 0.0, 0.0, [], 0
    for ph in phases:
        fwd, bwd = ph.compute_s * (1 - BACKWARD_SHARE), ph.compute_s * BACKWARD_SHARE
        t = step_seconds(fwd, bwd, model, ex, c)
        step_s.append(t)
        steps = ph.epochs * ph.steps_per_epoch
        warm = min(steps, max(0, warmup_steps))
        warmup_steps -= warm
        train_s += (steps - warm) * t + warm * step_seconds(fwd, bwd, model, dense, c)
        for _ in range(ph.epochs):
            epoch += 1
            if epoch % eval_every == 0:  # forward only: a third of a training step's work per image
                per_image = (ph.val_image_size / 224) ** 2 / images_per_s_224 * (1 - BACKWARD_SHARE)
                eval_s += math.ceil(IMAGENET_VAL_IMAGES / c.world) * per_image
    total = train_s + eval_s
    return Prediction(ex, step_s, train_s, eval_s, total / 3600 * c.nodes * c.price_per_node_hour)


def recommend(preds: list[Prediction], slack: float = 0.03) -> Prediction:
    """The fastest exchange; among sparse densities within `slack` of it, the densest (closest to dense SGD,
    the safest for convergence: the planner assumes the recipe's epochs hold at every density)."""
    best = min(preds, key=lambda p: p.total_s)
    close = [p for p in preds if p.total_s <= best.total_s * (1 + slack) and p.exchange.kind == best.exchange.kind]
    return max(close, key=lambda p: p.exchange.density)


# ---------------------------------------------------------------- models


def model_spec(name: str, bucket_mb: float, calibration: dict | None = None) -> ModelSpec:
    """Buckets of `name` (resnet50, transformer) as trainer/comm packs them; ready fractions measured on
    the emulated cluster when the calibration has them, else by parameter count."""
    if calibration:
        for run in calibration.get("runs", []):
            m = run.get("models", {}).get(name)
            if m and calibration.get("bucket_mb") == bucket_mb:
                return ModelSpec(name, list(m["buckets"]), list(m["bucket_ready"]))
    import torch

    from trainer.comm.base import make_buckets

    with torch.device("meta"):  # shapes only, no memory
        if name == "resnet50":
            import torchvision

            module = torchvision.models.resnet50()
        elif name == "transformer":  # Transformer-base: d 512, 6+6 layers, a shared 32k vocabulary
            from recipes.transformer_model import Seq2SeqTransformer, TransformerConfig

            module = Seq2SeqTransformer(TransformerConfig(), 32000)
        else:
            raise PlanError(f"--model {name!r}: valid models are resnet50, transformer")
    return ModelSpec(name, [b.numel for b in make_buckets(list(module.parameters()), bucket_mb)])


# ---------------------------------------------------------------- calibration against the emulated cluster


def fit_link(points: Sequence[Sequence[float]], rounds: float, bytes_per_element: float) -> Link:
    """Least-squares latency and bandwidth from measured (elements, wall seconds, ...): t = rounds a + bytes / bw.

    bytes_per_element: bytes over the busiest link per element of the measured size (the formula's volume)."""
    if len(points) < 2:
        raise PlanError("calibration: a collective needs measurements at two sizes at least")
    fixed, per = _fit_affine([(bytes_per_element * p[0], p[1]) for p in points])
    if per <= 0:
        raise PlanError(f"calibration: measured times do not grow with size ({points}); rerun the benchmark")
    return Link(fixed / rounds if rounds else 0.0, 1.0 / per)


@dataclass(frozen=True)
class Affine:
    """fixed + per_unit x size: CPU seconds of a piece of an exchange as a function of its size."""

    fixed: float
    per_unit: float

    def __call__(self, size: float) -> float:
        return self.fixed + self.per_unit * size


_fit_affine = fit_affine


def fit_cpu(points: Sequence[Sequence[float]]) -> Affine:
    """CPU seconds per call of a measured piece, affine in its size (elements)."""
    if len(points) < 2 or len(points[0]) < 3:
        raise PlanError("calibration: each piece needs [elements, wall s, CPU s] at two sizes at least "
                        "(a calibration from an older scaling.py? rerun it)")
    return Affine(*_fit_affine([(p[0], max(p[2], 0.0)) for p in points]))


@dataclass
class EmulatedCluster:
    """One layout and rate of the emulated cluster, as measured by scripts/bench/scaling.py.

    There is no GPU here: the exchange's own work (gathering and averaging buckets, casts, selection, the
    intra-node copies through loopback, gloo's sums) runs on the same cores as the compute. A step is the
    larger of
    - the CPU bound: compute plus that work. R ranks share C cores with whatever else runs there; under
      processor sharing, work that runs alongside the compute delays it by R/C times its CPU seconds
      (the extra threads also take cores from other tenants, so the machine's load cancels out);
    - the network bound: the bucket chains of overlap_step_s over the shaped links, their CPU pieces at
      the compute's own wall-per-CPU-second of that run (rho, the machine's load as the ranks saw it).
    Links come from the collectives' wall times, compute from the compute-only steps, CPU costs from the
    pieces (scaling.py's measure_primitives and measure_sparse_on_gradients), scaled to the exchange's
    CPU seconds per step when that measurement is given.
    """

    nodes: int
    ranks_per_node: int
    cores: int
    links: dict[str, Link]
    cpu: dict[str, Affine]

    @classmethod
    def from_run(cls, run: dict, cores: int) -> "EmulatedCluster":
        nodes, per = int(run["nodes"]), int(run["ranks_per_node"])
        w, prim = nodes * per, run["primitives"]
        links = {"allreduce": fit_link(prim["allreduce"], 2 * (w - 1), 2 * (w - 1) / w * 4),
                 "allreduce_fp16": fit_link(prim["allreduce_fp16"], 2 * (w - 1), 2 * (w - 1) / w * 2),
                 "allgather": fit_link(prim["allgather"], w - 1, (w - 1) * 4)}
        if per > 1 and nodes > 1:
            links["allgather_inter"] = fit_link(prim["allgather_inter"], nodes - 1, per * (nodes - 1) * 4)
        return cls(nodes, per, cores, links, {name: fit_cpu(points) for name, points in prim.items()})

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def bucket(self, n: int, ex: Exchange, sparse_cpu: tuple[float, float] | None = None
               ) -> tuple[float, float, float]:
        """(network seconds, CPU seconds on the exchange's chain, CPU seconds in all) of one bucket.

        sparse_cpu: the sparse local work measured on the model's own gradients (whole bucket, 1/L shard);
        otherwise the fit on heavy-tailed random values."""
        nodes, per, cpu = self.nodes, self.ranks_per_node, self.cpu
        local = cpu["dense_local"](n)  # gather into the bucket, average, write back (the training thread)
        choice = choice_of(n, ex)
        desc = describe(n, choice, Layout(nodes, per))
        # the shaped links carry the collectives over all ranks and between nodes; intra-node ones are CPU work
        net = sum(self.network.collective_s(c) for c in desc.collectives if c.group != "intra")
        if choice.kind == "dense16":  # the casts on the training thread, the fp16 sums in gloo's threads
            return net, 0.0, local + cpu["fp16_cast"](n) + cpu["allreduce_fp16"](n)
        if choice.kind == "dense":
            return net, 0.0, local + cpu["allreduce"](n)
        if desc.select_elements == n:  # every rank its own node: topk, or hitopk on 1-rank nodes
            chain_cpu = sparse_cpu[0] if sparse_cpu else cpu["sparse_local"](n)
            return net, chain_cpu, local + chain_cpu + cpu["allgather"](2 * desc.k)
        shard = math.ceil(n / per)
        chain_cpu = (cpu["reduce_scatter_intra"](shard * per) + cpu["allgather_intra"](shard)
                     + (sparse_cpu[1] if sparse_cpu else cpu["sparse_local"](shard)))
        return net, chain_cpu, local + chain_cpu + cpu["allgather_inter"](2 * desc.k)

    @property
    def network(self) -> Network:
        """The fitted links under the cost model's names (ring algorithms, as gloo runs them)."""
        names = {"allreduce": "world", "allreduce_fp16": "world16", "allgather": "world_gather",
                 "allgather_inter": "inter"}
        return Network(Layout(self.nodes, self.ranks_per_node),
                       {names[k]: v for k, v in self.links.items() if k in names})

    def step_s(self, compute: dict, model: ModelSpec, ex: Exchange,
               sparse_cpu: Sequence[tuple[float, float]] | None = None, exchange_cpu_s: float | None = None) -> float:
        """A step of `ex`, given the compute-only cell of the same run (wall and CPU seconds).

        exchange_cpu_s: the exchange's CPU seconds per step and rank as measured in the emulated steps (the
        calibration); the pieces then only say how it splits between buckets and chains. Without it, the
        pieces' own CPU costs are used (measured alone, they miss the cache and memory contention with the
        compute, and gloo's polling while a peer is descheduled)."""
        rho = (compute["fwd_s"] + compute["bwd_s"]) / max(compute["fwd_cpu_s"] + compute["bwd_cpu_s"], 1e-9)
        sharing = max(1.0, self.world / self.cores)
        costs = [self.bucket(n, ex, sparse_cpu[i] if sparse_cpu else None) for i, n in enumerate(model.buckets)]
        total = sum(t for _, _, t in costs)
        scale = exchange_cpu_s / total if exchange_cpu_s is not None and total > 0 else 1.0
        chains = [net + rho * chain_cpu * scale for net, chain_cpu, _ in costs]
        tail = rho * self.cpu["dense_local"](model.buckets[-1])
        return overlap_step_s(compute["fwd_s"], compute["bwd_s"], model.ready, chains, cpu_s=sharing * total * scale,
                              tail_s=tail)


def _cells(calibration: dict) -> list[tuple[dict, str, dict, str, dict]]:
    out = []
    for run in calibration["runs"]:
        for name, m in run["models"].items():
            for kind, cell in m["exchanges"].items():
                if kind in EXCHANGES:  # not "compute only", nor auto (a choice per bucket: make_cells in the bench)
                    out.append((run, name, m, kind, cell))
    return out


def load_calibration(path: str | Path) -> dict:
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
    return cal


def compare_with_measurements(calibration: dict) -> list[dict[str, Any]]:
    """Every measured step next to the planner's prediction for it: `predicted_s` calibrated with the
    exchange's measured CPU seconds per step, `pieces_s` from the separately measured pieces alone."""
    rows = []
    cores = int(calibration.get("cores", 2))
    for run, name, m, kind, cell in _cells(calibration):
        try:
            cluster = EmulatedCluster.from_run(run, cores)
        except PlanError as e:  # e.g. an unshaped link whose probes did not grow with size: not predictable
            print(f"planner: {run['nodes']}x{run['ranks_per_node']} @ {run['rate']} not compared: {e}", file=sys.stderr)
            continue
        spec = ModelSpec(name, list(m["buckets"]), list(m["bucket_ready"]))
        ex = Exchange(kind, calibration["density"], calibration["dense_below"])
        compute = m["exchanges"]["compute only"]
        pieces = [(row[2], row[4]) for row in m["sparse_local"]] if "sparse_local" in m else None
        exchange_cpu = max(cell["cpu_s"] - compute["cpu_s"], 0.0)
        pred = cluster.step_s(compute, spec, ex, pieces, exchange_cpu)
        rows.append({"model": name, "nodes": run["nodes"], "ranks_per_node": run["ranks_per_node"],
                     "rate": run["rate"], "exchange": kind, "measured_s": cell["step_s"], "predicted_s": pred,
                     "error": pred / cell["step_s"] - 1, "exchange_cpu_s": exchange_cpu,
                     "pieces_s": cluster.step_s(compute, spec, ex, pieces)})
    return rows


def tcp_efficiency(calibration: dict) -> float:
    """Payload bandwidth of the emulated links' allreduce fit over their nominal rate (median over runs)."""
    return statistics.median(EmulatedCluster.from_run(r, 1).links["allreduce"].bytes_per_s * 8 / rate_bps(r["rate"])
                             for r in calibration["runs"] if r["rate"] != "unlimited")


def rate_bps(rate: str) -> float:
    """A tc rate (1gbit, 200mbit, ...) in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, mult in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * mult
    raise ValueError(f"rate {rate!r}: expected e.g. 1gbit or 200mbit")


# ---------------------------------------------------------------- printing


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from scripts.bench.common import print_table

    print_table(headers, rows)


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(round(seconds % 60)):02d}"


def print_comparison(rows: list[dict[str, Any]], calibration: dict) -> float:
    print(f"Planner vs the emulated cluster (scripts/bench/scaling.py, {calibration.get('measured', '?')}, "
          f"{calibration.get('machine', '?')}). Predicted from: links fitted to the raw collectives, the "
          "compute-only steps, the buckets, and the exchange's CPU seconds per step measured there (calibration: "
          "on GPUs that work runs on the GPU); 'pieces only' uses the pieces' CPU cost measured alone instead:")
    _table(["model", "nodes", "links", "exchange", "measured ms", "exchange CPU ms", "predicted ms", "error",
            "pieces only ms", "error "],
           [[r["model"], f"{r['nodes']}x{r['ranks_per_node']}", r["rate"], r["exchange"], r["measured_s"] * 1e3,
             r["exchange_cpu_s"] * 1e3, r["predicted_s"] * 1e3, f"{r['error'] * 100:+.1f}%", r["pieces_s"] * 1e3,
             f"{(r['pieces_s'] / r['measured_s'] - 1) * 100:+.1f}%"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(f"max |error| {worst * 100:.1f}%; {within} of {len(rows)} measured steps within 15% "
          f"({'OK' if worst <= 0.15 else 'ABOVE TARGET'}); pieces only: max |error| "
          f"{max(abs(r['pieces_s'] / r['measured_s'] - 1) for r in rows) * 100:.1f}%\n")
    return worst


def print_plan(cfg: Any, args: argparse.Namespace, c: Cluster, spec: ModelSpec, phases: list[PhasePlan],
               efficiency: float, efficiency_from: str) -> dict[str, Any]:
    print(f"Plan: {args.config} on {c.nodes} nodes x {c.ranks_per_node} GPUs, {args.inter_gbit:g} Gbit/s between "
          f"nodes (payload {c.inter.bytes_per_s * 8 / 1e9:.2f} Gbit/s at TCP efficiency {efficiency:.3f}, "
          f"{efficiency_from}), {args.intra_gbyte:g} GB/s inside a node, ${c.price_per_node_hour:.2f}/node-hour")
    print(f"model {spec.name}: {spec.params:,} parameters in {len(spec.buckets)} buckets of <= "
          f"{cfg.comm.bucket_mb:g} MB; compute per GPU: {args.images_per_s:g} img/s at 224 px "
          f"(stated assumption, scaled by pixels)")
    _table(["phase", "epochs", "image px", "global batch", "steps/epoch", "compute ms/step"],
           [[i, p.epochs, p.image_size, p.batch_size, p.steps_per_epoch, p.compute_s * 1e3]
            for i, p in enumerate(phases)])
    exchanges = [Exchange("dense", dense_below=cfg.comm.dense_below),
                 Exchange("dense fp16", dense_below=cfg.comm.dense_below)]
    exchanges += [Exchange(k, d, cfg.comm.dense_below) for k in ("topk", "hitopk") for d in args.densities]
    preds = [predict_run(phases, spec, ex, c, cfg.comm.dense_warmup_steps, cfg.train.eval_every_epochs,
                         args.images_per_s) for ex in exchanges]
    print("\nPredicted (training + evaluation; data loading, start-up and checkpoints not modelled):")
    _table(["exchange", *[f"step ms @{p.image_size}" for p in phases], "train s", "eval s", "time", "cost $"],
           [[p.exchange.label, *[s * 1e3 for s in p.step_s], p.train_s, p.eval_s, _mmss(p.total_s), p.cost_usd]
            for p in preds])
    configured = next((p for p in preds if p.exchange.kind == cfg.comm.kind and
                       (p.exchange.kind.startswith("dense") or p.exchange.density == cfg.comm.density)), None)
    best = recommend(preds)
    print(f"\nRecommendation: {best.exchange.label} ({_mmss(best.total_s)}, ${best.cost_usd:.2f}); densest setting "
          "within 3% of the fastest (density changes convergence; the planner assumes the recipe's epochs hold)")
    if configured is not None:
        print(f"The config's own choice, comm.kind={cfg.comm.kind} density={cfg.comm.density:g}: "
              f"{_mmss(configured.total_s)}, ${configured.cost_usd:.2f}")
    print("Published (DAWNBench time to 93% top-5, 128 V100, 25 Gbit/s; end to end, incl. data loading):")
    for who, seconds in PUBLISHED_S.items():
        print(f"  {_mmss(seconds)}  {who}")
    return {"recommended": best.exchange.label, "recommended_s": round(best.total_s, 1),
            "configured_s": round(configured.total_s, 1) if configured else None,
            "dense_s": round(preds[0].total_s, 1), "published_s": PUBLISHED_S}


# ---------------------------------------------------------------- a run's own calibration (comm.kind auto)


def load_run_calibration(run: str | Path) -> dict[str, float]:
    """The `comm/calib/*` values of the last logged step of RUN/metrics.jsonl (a comm.kind auto run)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise PlanError(f"--from-run {run}: no metrics.jsonl there (a run folder is log.dir/<run name>)")
    found: dict[str, float] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        calib = {k[len("comm/calib/"):]: v for k, v in record.items() if k.startswith("comm/calib/")}
        if calib:
            found = calib
    if not found:
        raise PlanError(f"--from-run {run}: its metrics.jsonl has no comm/calib/* values; they are logged by "
                        "comm.kind=auto once its calibration steps are done")
    return found


def calibration_densities(cal: dict[str, float]) -> tuple[float, ...]:
    """The run's `comm.densities` from its calibration (`density/<i>`; empty when it did not log them)."""
    count = sum(1 for key in cal if key.startswith("density/"))
    return tuple(cal[f"density/{i}"] for i in range(count))


def print_from_run(args: argparse.Namespace) -> dict[str, Any]:
    """What auto would choose, and the exposed exchange it predicts, at other bandwidths and cluster sizes,
    from a run's own calibration (links, selection cost, bucket sizes and ready times)."""
    from trainer.comm.auto import candidates, choose, network_from_calibration

    cal = load_run_calibration(args.from_run)
    measured = Layout(int(cal["nodes"]), int(cal["ranks_per_node"]))
    base, sizes, ready = network_from_calibration(cal, measured)
    densities = calibration_densities(cal) or _parse_densities(args.densities)
    factors = _parse_densities(args.rate_factors, "--rate-factors", upper=None)
    layouts = [measured, Layout(measured.nodes * 4, measured.per_node)]
    if (args.nodes, args.gpus_per_node) != (16, 8) or measured.per_node > 1:
        layouts.append(Layout(args.nodes, args.gpus_per_node))
    print(f"From {args.from_run}: measured on {measured.nodes} nodes x {measured.per_node} ranks; "
          f"{len(sizes)} buckets, {sum(sizes):,} gradients; links "
          + ", ".join(f"{k} {v.bytes_per_s * 8 / 1e9:.3g} Gbit/s" for k, v in base.links.items())
          + f"; selection {base.selection.per_element_s * 1e9:.1f} ns/element; min density {cal['min_density']:g}")
    print("Other layouts keep the measured links (the node-crossing ones scaled by the factor) and ready times.")
    rows, out = [], []
    for layout in layouts:
        for factor in factors:
            net = with_inter_rate(base, factor, layout)
            options = lambda n, lay=layout: candidates(n, lay, densities, cal["min_density"],  # noqa: E731
                                                       int(cal["dense_below"]))
            plan, exposed = choose(sizes, ready, net, options, bool(cal["local_competes"]))
            _, dense = choose(sizes, ready, net, lambda n: [DENSE], bool(cal["local_competes"]))
            counts: dict[str, int] = {}
            for c in plan:
                counts[c.label] = counts.get(c.label, 0) + 1
            summary = ", ".join(f"{v} x {k}" for k, v in counts.items())
            rows.append([f"{layout.nodes}x{layout.per_node}", f"x{factor:g}", summary, exposed * 1e3, dense * 1e3])
            out.append({"layout": f"{layout.nodes}x{layout.per_node}", "rate_factor": factor,
                        "plan": [c.label for c in plan], "exposed_ms": round(exposed * 1e3, 2),
                        "dense_exposed_ms": round(dense * 1e3, 2)})
    _table(["nodes", "inter-node rate", "auto's choice (buckets)", "exposed ms", "all dense exposed ms"], rows)
    return {"from_run": str(args.from_run), "plans": out}


# ---------------------------------------------------------------- entry point


def _parse_densities(text: str, option: str = "--densities", upper: float | None = 1.0) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PlanError(f"{option} {text!r}: expected numbers separated by commas, e.g. 0.001,0.01") from None
    if not values or any(not 0 < v or (upper is not None and v > upper) for v in values):
        what = "density" if option == "--densities" else "value"
        raise PlanError(f"{option} {text!r}: each {what} must be in (0, {upper if upper is not None else float('inf'):g}]")
    return values


def _parse_compute(items: Sequence[str]) -> dict[int, float]:
    out = {}
    for item in items:
        size, sep, ms = item.partition("=")
        try:
            out[int(size)] = float(ms) / 1e3
        except ValueError:
            raise PlanError(f"--compute-ms {item!r}: expected IMAGE_PX=MS_PER_IMAGE, e.g. 96=0.16") from None
        if not sep or out[int(size)] <= 0:
            raise PlanError(f"--compute-ms {item!r}: expected IMAGE_PX=MS_PER_IMAGE with MS > 0")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/plan.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/resnet50_dawnbench.yaml", help="recipe YAML (phases, epochs, comm)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for the recipe")
    p.add_argument("--model", default="", help="resnet50 or transformer (default: the config's model.arch)")
    p.add_argument("--nodes", type=int, default=16, help="nodes (default 16)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--inter-gbit", type=float, default=25.0, help="inter-node link, Gbit/s per direction (default 25)")
    p.add_argument("--intra-gbyte", type=float, default=NVLINK_BYTES_PER_S / 1e9,
                   help=f"intra-node ring bandwidth, GB/s (default {NVLINK_BYTES_PER_S / 1e9:g}: NVLink, assumed)")
    p.add_argument("--price", type=float, default=P3_16XLARGE_USD_PER_HOUR,
                   help=f"$ per node-hour (default {P3_16XLARGE_USD_PER_HOUR}: AWS p3.16xlarge on demand)")
    p.add_argument("--images-per-s", type=float, default=V100_IMAGES_PER_S_224,
                   help=f"training images/s of one GPU at 224 px (default {V100_IMAGES_PER_S_224:g}: V100, cited)")
    p.add_argument("--compute-ms", nargs="*", default=[], metavar="PX=MS",
                   help="measured compute (fwd+bwd) ms per image at an image size; replaces the scaled assumption")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)), help="sparse densities to consider")
    p.add_argument("--from-run", default="", metavar="RUN",
                   help="a comm.kind=auto run folder: what auto would choose at other bandwidths and cluster sizes, "
                        "from that run's own calibration")
    p.add_argument("--rate-factors", default="0.1,0.2,0.5,1,2,5,10",
                   help="with --from-run: inter-node bandwidths to plan for, as factors of the measured one")
    p.add_argument("--calibration", default="runs/scaling/calibration.json",
                   help="scripts/bench/scaling.py's measurements (compared when present; '' = none)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except PlanError as e:  # ConfigError is a ValueError too, but has its own prefix
        print(f"plan.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as e:
        print(f"plan.py: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def load_recipe_config(path: str, overrides: Sequence[str]) -> Any:
    from recipes.resnet50 import Config
    from trainer.config import load_config

    return load_config(Config, path, list(overrides))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.from_run:
        return print_from_run(args)
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for name in ("inter_gbit", "intra_gbyte", "images_per_s"):
        if not getattr(args, name) > 0:
            raise PlanError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.price < 0:
        raise PlanError(f"--price: must be >= 0, got {args.price}")
    args.densities = _parse_densities(args.densities)
    compute = _parse_compute(args.compute_ms)
    cfg = load_recipe_config(args.config, args.overrides)

    calibration, worst = None, None
    explicit = args.calibration != build_parser().get_default("calibration")
    if args.calibration and (explicit or Path(args.calibration).is_file()):
        calibration = load_calibration(args.calibration)
        worst = print_comparison(compare_with_measurements(calibration), calibration)
    else:
        print(f"(no calibration{f' at {args.calibration}' if args.calibration else ''}: run scripts/bench/scaling.py "
              "as root to measure the emulated cluster and compare the planner with it)\n")

    efficiency, source = TCP_EFFICIENCY_DEFAULT, "assumed"
    if calibration:
        efficiency, source = tcp_efficiency(calibration), "measured on the emulated cluster"
    spec = model_spec(args.model or ("transformer" if cfg.model.arch == "transformer" else cfg.model.arch),
                      cfg.comm.bucket_mb, calibration)
    sel_bytes = 4 * SELECTION_PASSES / V100_HBM_BYTES_PER_S
    c = Cluster(args.nodes, args.gpus_per_node, inter=Link(INTER_ALPHA_S, args.inter_gbit * 1e9 / 8 * efficiency),
                intra=Link(INTRA_ALPHA_S, args.intra_gbyte * 1e9),
                selection=Selection(SELECTION_LAUNCH_S, sel_bytes), price_per_node_hour=args.price)
    phases = phases_from_config(cfg, c.world, compute_s_per_image=compute, images_per_s_224=args.images_per_s)
    out = print_plan(cfg, args, c, spec, phases, efficiency, source)
    if worst is not None:
        out["calibration_max_error"] = round(worst, 4)
    return out


if __name__ == "__main__":
    main()
