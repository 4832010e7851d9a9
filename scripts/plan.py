"""Planner: step time, time to target and cost of a recipe's gradient exchanges on a GPU cluster.

A command line over the package's cost model: each bucket's exchange is `trainer/comm/cost.py`'s list of
collectives and local work, timed with alpha-beta links; a step is its compute plus the exposed exchange
(`cost.exposed_s`, through `cost.predict`); `comm.kind: auto`'s per-bucket choice is `cost.choose` over
`cost.candidates`, as on the live cluster. This module adds what a plan needs
around it: a cluster (nodes, GPUs per node, links, $ per node-hour), the model's buckets (the real model
of the config, built on the meta device and packed as trainer/comm packs it), the compute time per step
and the recipe's phases.

- ResNet recipe configs (`schedule.phases`): per phase and exchange the step time, then time to the
  recipe's last epoch with evaluation, and the cost; it recommends a fixed exchange and density (the
  densest within 3% of the fastest) and shows what auto would choose.
- Transformer recipe configs: step time per exchange and auto's choice (the epochs to the BLEU target are
  not known in advance, so there is no time to target).
- `--from-run RUN`: a `comm.kind: auto` run's own calibration (links, selection cost, buckets, ready
  times), re-planned at other inter-node bandwidths and cluster sizes.
- `--calibration` (written by scripts/bench/scaling.py as root): every step measured on the emulated
  cluster next to its prediction (`EmulatedCluster`); the GPU plan takes the TCP efficiency of the shaped
  links from it and, for a model it measured, when backward releases each bucket.

Paper setting by default: 16 nodes x 8 V100, 25 Gbit/s between nodes, configs/resnet50_dawnbench.yaml, with
the published times as cited constants and the V100's compute as a stated assumption.

    python -m scripts.plan [--config configs/resnet50_dawnbench.yaml | --model transformer] [section.key=value ...]
        [--nodes 16 --gpus-per-node 8 --inter-gbit 25 --intra-gbyte 100 --price 24.48]
        [--calibration runs/scaling/calibration.json] [--from-run runs/<name> --rate-factors 0.1,1,10]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from trainer.comm.auto import build_network, network_from_calibration
from trainer.comm.cost import DENSE, Choice, plan_summary, Layout, Link, Network, Selection, candidates, choose, \
    describe, exposed_s, fit_affine, predict, with_inter_rate

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

V100_TENSOR_FLOPS = 125e12
"""Cited: V100 SXM2 peak mixed-precision tensor throughput, 125 TFLOPS (NVIDIA Tesla V100 datasheet)."""

TRANSFORMER_UTILIZATION = 0.3
"""Assumption: fraction of that peak a Transformer training step sustains; its compute per step is then
6 x parameters x tokens FLOPs (forward 2, backward 4) at this rate. `--step-ms` replaces it."""

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

WMT_VOCAB = 32000
"""The shared BPE vocabulary when the config's corpus is not prepared here (scripts/prepare_wmt.py's default)."""

DENSITIES = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05)

BENCH_KINDS = {"dense": "dense", "dense fp16": "dense16", "topk": "topk", "hitopk": "hitopk"}
"""scripts/bench/scaling.py's names of the fixed exchanges -> the cost model's kinds (`cost.KINDS`)."""


class PlanError(ValueError):
    """A mistake in the planner's input: the message names the option or file and the fix."""


# ---------------------------------------------------------------- cluster and model


def gpu_network(nodes: int, per_node: int, inter_gbit: float, intra_gbyte: float, efficiency: float) -> Network:
    """A GPU cluster's links as the cost model reads them: NCCL's hierarchical allreduce over NVLink inside a
    node and TCP between nodes (payload bandwidth: the rate at `efficiency`), selection memory-bound on HBM."""
    inter = Link(INTER_ALPHA_S, inter_gbit * 1e9 / 8 * efficiency)
    return Network(Layout(nodes, per_node), {"world": inter, "inter": inter,
                                             "intra": Link(INTRA_ALPHA_S, intra_gbyte * 1e9)},
                   Selection(SELECTION_LAUNCH_S, 4 * SELECTION_PASSES / V100_HBM_BYTES_PER_S),
                   dense_algorithm="hierarchical")


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

    def ready_before_end(self, backward_s: float) -> list[float]:
        """Seconds before the end of a `backward_s` backward at which each bucket is ready."""
        return [backward_s * (1 - r) for r in self.ready]


def fixed_plan(choice: Choice, sizes: Sequence[int], dense_below: int) -> list[Choice]:
    """A pinned `comm.kind` bucket by bucket: `choice` for every bucket, buckets under dense_below dense."""
    return [choice if not choice.sparse or n >= dense_below else DENSE for n in sizes]


def step_seconds(forward_s: float, backward_s: float, model: ModelSpec, plan: Sequence[Choice], net: Network) -> float:
    """One training step on a GPU cluster: the compute, then the exchange `auto.predict` says is exposed (no
    exchange work competes with the GPU's compute)."""
    if net.layout.world == 1:
        return forward_s + backward_s
    exposed, _ = predict(model.buckets, model.ready_before_end(backward_s), plan, net, False)
    return forward_s + backward_s + exposed


@dataclass(frozen=True)
class Strategy:
    """What a run's `comm` section would do: one choice for every bucket (`fixed_plan`), or auto's per-bucket
    choice (`choice` None)."""

    choice: Choice | None
    dense_below: int = 16384
    densities: tuple[float, ...] = ()
    """auto: the densities it may pick (already bounded by the recipe's min_density)."""

    @property
    def label(self) -> str:
        return self.choice.label if self.choice is not None else "auto"

    def plan(self, model: ModelSpec, backward_s: float, net: Network) -> list[Choice]:
        if self.choice is not None:
            return fixed_plan(self.choice, model.buckets, self.dense_below)
        options = lambda n: candidates(n, net.layout, self.densities, 0.0, self.dense_below)  # noqa: E731
        plan, _ = choose(model.buckets, model.ready_before_end(backward_s), net, options, False)
        return plan


def strategies(comm: Any, densities: Sequence[float]) -> list[Strategy]:
    """dense, dense16, topk and hitopk at each of `densities` and comm.densities the recipe allows (>=
    comm.min_density), and auto (over comm.densities, as in a run)."""
    safe = tuple(sorted(d for d in {*densities, *comm.densities} if d >= comm.min_density))
    if not safe:
        raise PlanError(f"--densities and comm.densities: none is >= the recipe's comm.min_density {comm.min_density:g} (the density "
                        "it declares safe for convergence)")
    out = [Strategy(DENSE, comm.dense_below), Strategy(Choice("dense16"), comm.dense_below)]
    out += [Strategy(Choice(kind, d), comm.dense_below) for kind in ("topk", "hitopk") for d in safe]
    return out + [Strategy(None, comm.dense_below, tuple(d for d in comm.densities if d >= comm.min_density))]


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
    strategy: Strategy
    step_s: list[float]
    """Per phase."""
    train_s: float
    eval_s: float
    cost_usd: float
    plans: list[list[Choice]] = field(default_factory=list)
    """Per phase, each bucket's choice."""

    @property
    def total_s(self) -> float:
        return self.train_s + self.eval_s


def predict_run(phases: list[PhasePlan], model: ModelSpec, strategy: Strategy, net: Network, price: float = 0.0,
                warmup_steps: int = 0, eval_every: int = 1, images_per_s_224: float = V100_IMAGES_PER_S_224
                ) -> Prediction:
    """Time to the end of the recipe (its target epoch) and its cost at `price` $ per node-hour;
    `warmup_steps` use a dense exchange."""
    train_s, eval_s, step_s, plans, epoch = 0.0, 0.0, [], [], 0
    for ph in phases:
        fwd, bwd = ph.compute_s * (1 - BACKWARD_SHARE), ph.compute_s * BACKWARD_SHARE
        plan = strategy.plan(model, bwd, net)
        t = step_seconds(fwd, bwd, model, plan, net)
        step_s.append(t)
        plans.append(plan)
        steps = ph.epochs * ph.steps_per_epoch
        warm = min(steps, max(0, warmup_steps))
        warmup_steps -= warm
        train_s += (steps - warm) * t + warm * step_seconds(fwd, bwd, model, [DENSE] * len(model.buckets), net)
        for _ in range(ph.epochs):
            epoch += 1
            if epoch % eval_every == 0:  # forward only: a third of a training step's work per image
                per_image = (ph.val_image_size / 224) ** 2 / images_per_s_224 * (1 - BACKWARD_SHARE)
                eval_s += math.ceil(IMAGENET_VAL_IMAGES / net.layout.world) * per_image
    total = train_s + eval_s
    return Prediction(strategy, step_s, train_s, eval_s, total / 3600 * net.layout.nodes * price, plans)


def recommend(preds: list[Prediction], slack: float = 0.03) -> Prediction:
    """The fastest fixed exchange; among its densities within `slack` of it, the densest (closest to dense
    SGD, the safest for convergence: the planner assumes the recipe's epochs hold at every density)."""
    fixed = [p for p in preds if p.strategy.choice is not None]
    best = min(fixed, key=lambda p: p.total_s)
    close = [p for p in fixed if p.total_s <= best.total_s * (1 + slack)
             and p.strategy.choice.kind == best.strategy.choice.kind]
    return max(close, key=lambda p: p.strategy.choice.density)


# ---------------------------------------------------------------- recipes and models


def is_transformer_config(path: str, overrides: Sequence[str]) -> bool:
    """Whether the YAML (with its overrides) sets a Transformer recipe's model keys (d_model, heads, ...)."""
    from recipes.transformer_model import TransformerConfig
    from trainer.config import load_yaml_chain, parse_overrides

    if not Path(path).is_file():
        return False  # load_config reports it
    data, _ = load_yaml_chain(path)
    keys = set((data.get("model") or {})) | set(parse_overrides(list(overrides)).get("model", {}))
    return bool(keys & ({f.name for f in fields(TransformerConfig)} - {"dropout", "label_smoothing"}))


def load_recipe_config(path: str, overrides: Sequence[str], transformer: bool | None = None) -> Any:
    """The config as its recipe loads it (recipes/transformer.py's schema for a Transformer config, else
    recipes/resnet50.py's)."""
    from trainer.config import load_config

    if transformer is None:
        transformer = is_transformer_config(path, overrides)
    if transformer:
        from recipes.transformer import Config
    else:
        from recipes.resnet50 import Config  # type: ignore[assignment]
    return load_config(Config, path, list(overrides))


def transformer_vocab(cfg: Any) -> tuple[int, str]:
    """The shared vocabulary size: the prepared corpus's, else scripts/prepare_wmt.py's default."""
    from data.translation import MANIFEST, PREPARED

    manifest = Path(cfg.data.root) / PREPARED / MANIFEST
    if manifest.is_file():
        return int(json.loads(manifest.read_text())["vocab_size"]), f"from {manifest}"
    return WMT_VOCAB, f"{cfg.data.root} not prepared here: scripts/prepare_wmt.py's default"


def build_model(cfg: Any, transformer: bool) -> Any:
    """The recipe's model on the meta device (shapes only, no memory)."""
    import torch

    with torch.device("meta"):
        if transformer:
            from recipes.transformer_model import build_transformer

            return build_transformer(cfg.model, transformer_vocab(cfg)[0])
        import torchvision

        return getattr(torchvision.models, cfg.model.arch)()


def model_spec(cfg: Any, transformer: bool, calibration: dict | None = None) -> ModelSpec:
    """The model's buckets as trainer/comm packs them; ready fractions measured on the emulated cluster when
    the calibration measured a model with these very buckets, else by parameter count."""
    from trainer.comm.base import make_buckets

    name = "transformer" if transformer else cfg.model.arch
    buckets = [b.numel for b in make_buckets(list(build_model(cfg, transformer).parameters()), cfg.comm.bucket_mb)]
    for run in (calibration or {}).get("runs", []):
        m = run.get("models", {}).get(name)
        if m and list(m["buckets"]) == buckets:
            return ModelSpec(name, buckets, list(m["bucket_ready"]))
    return ModelSpec(name, buckets)


# ---------------------------------------------------------------- calibration against the emulated cluster


def fit_cpu(points: Sequence[Sequence[float]]) -> Selection:
    """CPU seconds per call of a measured piece, affine in its size (elements)."""
    if len(points) < 2 or len(points[0]) < 3:
        raise PlanError("calibration: each piece needs [elements, wall s, CPU s] at two sizes at least "
                        "(a calibration from an older scaling.py? rerun it)")
    return Selection(*fit_affine([(p[0], max(p[2], 0.0)) for p in points]))


PROBES = {"allreduce": ("world", 4), "allreduce_fp16": ("world16", 2), "allgather": ("world_gather", 4),
          "allgather_inter": ("inter", 4), "allgather_intra": ("intra_gather", 4),
          "reduce_scatter_intra": ("intra_scatter", 4)}
"""scaling.py's collectives ([elements, wall s, CPU s]) -> the auto communicator's probes ((bytes, s)) and
bytes per element."""


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
    Links are fitted to the collectives' wall times as the auto communicator fits its probes
    (`auto.build_network`), compute comes from the compute-only steps, CPU costs from the pieces
    (scaling.py's measure_primitives and measure_sparse_on_gradients), scaled to the exchange's CPU seconds
    per step when that measurement is given.
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
        layout, prim = Layout(int(run["nodes"]), int(run["ranks_per_node"])), run["primitives"]
        probes = {PROBES[name][0]: [(PROBES[name][1] * p[0], p[1]) for p in points]
                  for name, points in prim.items() if name in PROBES}
        return cls(layout.nodes, layout.per_node, cores, build_network(layout, probes, [], 0.0),
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
            return net, 0.0, local + cpu["fp16_cast"].seconds(n) + cpu["allreduce_fp16"].seconds(n)
        if choice.kind == "dense":
            return net, 0.0, local + cpu["allreduce"].seconds(n)
        if desc.select_elements == n:  # every rank its own node: topk, or hitopk on 1-rank nodes
            chain_cpu = sparse_cpu[0] if sparse_cpu else cpu["sparse_local"].seconds(n)
            return net, chain_cpu, local + chain_cpu + cpu["allgather"].seconds(2 * desc.k)
        shard = math.ceil(n / per)
        chain_cpu = (cpu["reduce_scatter_intra"].seconds(shard * per) + cpu["allgather_intra"].seconds(shard)
                     + (sparse_cpu[1] if sparse_cpu else cpu["sparse_local"].seconds(shard)))
        return net, chain_cpu, local + chain_cpu + cpu["allgather_inter"].seconds(2 * desc.k)

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


def _cells(calibration: dict) -> list[tuple[dict, str, dict, str, dict]]:
    out = []
    for run in calibration["runs"]:
        for name, m in run["models"].items():
            for kind, cell in m["exchanges"].items():
                if kind in BENCH_KINDS:  # not "compute only", nor auto (a choice per bucket: make_cells in the bench)
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
    exchange's measured CPU seconds per step, `pieces_s` from the separately measured pieces alone.
    `exchange` is the bench's name of the exchange (dense, dense fp16, topk, hitopk)."""
    rows = []
    cores = int(calibration.get("cores", 2))
    for run, name, m, kind, cell in _cells(calibration):
        cluster = EmulatedCluster.from_run(run, cores)
        spec = ModelSpec(name, list(m["buckets"]), list(m["bucket_ready"]))
        choice = Choice(BENCH_KINDS[kind], calibration["density"] if BENCH_KINDS[kind] in ("topk", "hitopk") else 1.0)
        plan = fixed_plan(choice, spec.buckets, calibration["dense_below"])
        compute = m["exchanges"]["compute only"]
        pieces = [(row[2], row[4]) for row in m["sparse_local"]] if "sparse_local" in m else None
        exchange_cpu = max(cell["cpu_s"] - compute["cpu_s"], 0.0)
        pred = cluster.step_s(compute, spec, plan, pieces, exchange_cpu)
        rows.append({"model": name, "nodes": run["nodes"], "ranks_per_node": run["ranks_per_node"],
                     "rate": run["rate"], "exchange": kind, "measured_s": cell["step_s"], "predicted_s": pred,
                     "error": pred / cell["step_s"] - 1, "exchange_cpu_s": exchange_cpu,
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


# ---------------------------------------------------------------- printing


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Rows under headers in aligned columns (floats: 3 significant digits, no exponent)."""
    cells = [[str(v) if not isinstance(v, float) else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" for v in row]
             for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(round(seconds % 60)):02d}"


def print_comparison(rows: list[dict[str, Any]], calibration: dict) -> float:
    print(f"Planner vs the emulated cluster (scripts/bench/scaling.py, {calibration.get('measured', '?')}, "
          f"{calibration.get('machine', '?')}). In sample: predicted from links fitted to the raw collectives, the "
          "compute-only steps, the buckets, and the exchange's CPU seconds per step measured in that very cell "
          "(on GPUs that work runs on the GPU); 'pieces only' uses the pieces' CPU cost measured alone instead:")
    print_table(["model", "nodes", "links", "exchange", "measured ms", "exchange CPU ms", "predicted ms", "error",
                 "pieces only ms", "error "],
                [[r["model"], f"{r['nodes']}x{r['ranks_per_node']}", r["rate"], r["exchange"], r["measured_s"] * 1e3,
                  r["exchange_cpu_s"] * 1e3, r["predicted_s"] * 1e3, f"{r['error'] * 100:+.1f}%", r["pieces_s"] * 1e3,
                  f"{(r['pieces_s'] / r['measured_s'] - 1) * 100:+.1f}%"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)
    print(f"max |error| {worst * 100:.1f}% over {len(rows)} measured steps; pieces only: max |error| "
          f"{max(abs(r['pieces_s'] / r['measured_s'] - 1) for r in rows) * 100:.1f}%\n")
    return worst


def print_cluster(args: argparse.Namespace, net: Network, spec: ModelSpec, cfg: Any, efficiency: float,
                  efficiency_from: str) -> None:
    print(f"Plan: {args.config} on {args.nodes} nodes x {args.gpus_per_node} GPUs, {args.inter_gbit:g} Gbit/s "
          f"between nodes (payload {net.links['inter'].bytes_per_s * 8 / 1e9:.2f} Gbit/s at TCP efficiency "
          f"{efficiency:.3f}, {efficiency_from}), {args.intra_gbyte:g} GB/s inside a node, ${args.price:.2f}/node-hour")
    print(f"model {spec.name}: {spec.params:,} parameters in {len(spec.buckets)} buckets of <= "
          f"{cfg.comm.bucket_mb:g} MB; densities >= comm.min_density {cfg.comm.min_density:g} (the recipe's safe "
          "bound)")


def print_resnet_plan(cfg: Any, args: argparse.Namespace, net: Network, spec: ModelSpec, phases: list[PhasePlan]
                      ) -> dict[str, Any]:
    print(f"compute per GPU: {args.images_per_s:g} img/s at 224 px (stated assumption, scaled by pixels)")
    print_table(["phase", "epochs", "image px", "global batch", "steps/epoch", "compute ms/step"],
                [[i, p.epochs, p.image_size, p.batch_size, p.steps_per_epoch, p.compute_s * 1e3]
                 for i, p in enumerate(phases)])
    preds = [predict_run(phases, spec, s, net, args.price, cfg.comm.dense_warmup_steps, cfg.train.eval_every_epochs,
                         args.images_per_s) for s in strategies(cfg.comm, args.densities)]
    print("\nPredicted (training + evaluation; data loading, start-up and checkpoints not modelled):")
    print_table(["exchange", *[f"step ms @{p.image_size}" for p in phases], "train s", "eval s", "time", "cost $"],
                [[p.strategy.label, *[s * 1e3 for s in p.step_s], p.train_s, p.eval_s, _mmss(p.total_s), p.cost_usd]
                 for p in preds])
    auto = preds[-1]
    best = recommend(preds)
    print(f"\nRecommendation: {best.strategy.label} ({_mmss(best.total_s)}, ${best.cost_usd:.2f}); the densest "
          "setting within 3% of the fastest fixed one (density changes convergence; the planner assumes the "
          "recipe's epochs hold)")
    print("comm.kind auto would choose, per phase: "
          + "; ".join(f"@{p.image_size} px {plan_summary(plan)}" for p, plan in zip(phases, auto.plans))
          + f" ({_mmss(auto.total_s)}, ${auto.cost_usd:.2f})")
    configured = next((p for p in preds if (p.strategy.label == "auto" if cfg.comm.kind == "auto" else
                       p.strategy.choice is not None and p.strategy.choice.kind == cfg.comm.kind
                       and (p.strategy.choice.kind == "dense" or p.strategy.choice.density == cfg.comm.density))),
                      None)
    if configured is not None:
        print(f"The config's own choice, comm.kind={cfg.comm.kind}: {_mmss(configured.total_s)}, "
              f"${configured.cost_usd:.2f}")
    print("Published (DAWNBench time to 93% top-5, 128 V100, 25 Gbit/s; end to end, incl. data loading):")
    for who, seconds in PUBLISHED_S.items():
        print(f"  {_mmss(seconds)}  {who}")
    return {"recommended": best.strategy.label, "recommended_s": round(best.total_s, 1),
            "configured_s": round(configured.total_s, 1) if configured else None,
            "dense_s": round(preds[0].total_s, 1), "auto_s": round(auto.total_s, 1),
            "auto_plan": [[c.label for c in plan] for plan in auto.plans], "published_s": PUBLISHED_S}


def print_transformer_plan(cfg: Any, args: argparse.Namespace, net: Network, spec: ModelSpec) -> dict[str, Any]:
    tokens = cfg.data.max_tokens
    if args.step_ms:
        compute_s, source = args.step_ms / 1e3, "--step-ms"
    else:
        compute_s = 6 * spec.params * tokens / (V100_TENSOR_FLOPS * TRANSFORMER_UTILIZATION)
        source = (f"6 x parameters x tokens at {TRANSFORMER_UTILIZATION:g} of a V100's {V100_TENSOR_FLOPS / 1e12:g} "
                  "TFLOPS (stated assumption; --step-ms replaces it)")
    print(f"vocabulary {transformer_vocab(cfg)[0]:,} ({transformer_vocab(cfg)[1]}); compute per step: "
          f"{tokens:,} tokens per GPU, {compute_s * 1e3:.1f} ms ({source})")
    fwd, bwd = compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE
    rows, out = [], []
    for s in strategies(cfg.comm, args.densities):
        plan = s.plan(spec, bwd, net)
        t = step_seconds(fwd, bwd, spec, plan, net)
        rows.append([s.label, t * 1e3, (t - compute_s) * 1e3, plan_summary(plan)])
        out.append({"exchange": s.label, "step_ms": round(t * 1e3, 2), "plan": [ch.label for ch in plan]})
    print("\nPredicted step (the epochs to the BLEU target are not known in advance: no time to target):")
    print_table(["exchange", "step ms", "exposed exchange ms", "buckets"], rows)
    best = min(out[:-1], key=lambda r: r["step_ms"])
    print(f"\nFastest fixed exchange: {best['exchange']} ({best['step_ms']:.1f} ms); auto: {out[-1]['step_ms']:.1f} ms")
    return {"steps": out, "recommended": best["exchange"], "compute_ms": round(compute_s * 1e3, 2)}


# ---------------------------------------------------------------- a run's own calibration (comm.kind auto)


def load_run_calibration(run: str | Path) -> dict[str, float]:
    """The `comm/calib/*` values of the last record of RUN/metrics.jsonl that has them (a comm.kind auto run
    logs its calibration once it is measured)."""
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
    if int(found.get("nodes", 1)) < 2:
        raise PlanError(f"--from-run {run}: it ran on 1 node, so no inter-node link was measured; calibrate on "
                        ">= 2 nodes to plan other bandwidths and cluster sizes")
    return found


def calibration_densities(cal: dict[str, float]) -> tuple[float, ...]:
    """The run's `comm.densities` from its calibration (`density/<i>`; empty when it did not log them)."""
    count = sum(1 for key in cal if key.startswith("density/"))
    return tuple(cal[f"density/{i}"] for i in range(count))


def print_from_run(args: argparse.Namespace) -> dict[str, Any]:
    """What auto would choose, and the exposed exchange it predicts, at other bandwidths and cluster sizes,
    from a run's own calibration (links, selection cost, bucket sizes and ready times)."""
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
    local = bool(cal["local_competes"])
    for layout in layouts:
        for factor in factors:
            net = with_inter_rate(base, factor, layout)
            options = lambda n, lay=layout: candidates(n, lay, densities, cal["min_density"],  # noqa: E731
                                                       int(cal["dense_below"]))
            plan, exposed = choose(sizes, ready, net, options, local)
            dense, _ = predict(sizes, ready, [DENSE] * len(sizes), net, local)
            rows.append([f"{layout.nodes}x{layout.per_node}", f"x{factor:g}", plan_summary(plan), exposed * 1e3,
                         dense * 1e3])
            out.append({"layout": f"{layout.nodes}x{layout.per_node}", "rate_factor": factor,
                        "plan": [c.label for c in plan], "exposed_ms": round(exposed * 1e3, 2),
                        "dense_exposed_ms": round(dense * 1e3, 2)})
    print_table(["nodes", "inter-node rate", "auto's choice (buckets)", "exposed ms", "all dense exposed ms"], rows)
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


CONFIGS = {"resnet": "configs/resnet50_dawnbench.yaml", "transformer": "configs/transformer_wmt16_en_de.yaml"}
"""The config planned when --config is not given (by --model's recipe)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/plan.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="", help=f"recipe YAML (default {CONFIGS['resnet']}; with --model "
                                                f"transformer {CONFIGS['transformer']})")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for the recipe")
    p.add_argument("--model", default="", help="transformer, or a ResNet arch (resnet50, ...) replacing model.arch "
                                               "(default: the config's model)")
    p.add_argument("--nodes", type=int, default=16, help="nodes (default 16)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--inter-gbit", type=float, default=25.0, help="inter-node link, Gbit/s per direction (default 25)")
    p.add_argument("--intra-gbyte", type=float, default=NVLINK_BYTES_PER_S / 1e9,
                   help=f"intra-node ring bandwidth, GB/s (default {NVLINK_BYTES_PER_S / 1e9:g}: NVLink, assumed)")
    p.add_argument("--price", type=float, default=P3_16XLARGE_USD_PER_HOUR,
                   help=f"$ per node-hour (default {P3_16XLARGE_USD_PER_HOUR}: AWS p3.16xlarge on demand)")
    p.add_argument("--images-per-s", type=float, default=V100_IMAGES_PER_S_224,
                   help=f"ResNet: training images/s of one GPU at 224 px (default {V100_IMAGES_PER_S_224:g}: V100, cited)")
    p.add_argument("--compute-ms", nargs="*", default=[], metavar="PX=MS",
                   help="ResNet: measured compute (fwd+bwd) ms per image at an image size; replaces the scaled assumption")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="Transformer: measured compute (fwd+bwd) ms of one step on one GPU; replaces the FLOPs estimate")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                   help="sparse densities to consider besides the config's comm.densities (those below its "
                        "comm.min_density are left out)")
    p.add_argument("--from-run", default="", metavar="RUN",
                   help="a comm.kind=auto run folder (>= 2 nodes): what auto would choose at other bandwidths and "
                        "cluster sizes, from that run's own calibration")
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


def check_args(args: argparse.Namespace) -> None:
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for name in ("inter_gbit", "intra_gbyte", "images_per_s"):
        if not getattr(args, name) > 0:
            raise PlanError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.price < 0 or args.step_ms < 0:
        raise PlanError(f"--price and --step-ms: must be >= 0, got {args.price} and {args.step_ms}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.from_run:
        return print_from_run(args)
    check_args(args)
    args.densities = _parse_densities(args.densities)
    compute = _parse_compute(args.compute_ms)
    wants_transformer = args.model == "transformer"
    args.config = args.config or CONFIGS["transformer" if wants_transformer else "resnet"]
    transformer = is_transformer_config(args.config, args.overrides)
    if args.model and wants_transformer != transformer:
        raise PlanError(f"--model {args.model}: {args.config} is a {'Transformer' if transformer else 'ResNet'} "
                        "recipe config; pass a config of that recipe with --config, or leave --model out")
    overrides = list(args.overrides) + ([f"model.arch={args.model}"] if args.model and not transformer else [])
    cfg = load_recipe_config(args.config, overrides, transformer)

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
    spec = model_spec(cfg, transformer, calibration)
    net = gpu_network(args.nodes, args.gpus_per_node, args.inter_gbit, args.intra_gbyte, efficiency)
    print_cluster(args, net, spec, cfg, efficiency, source)
    if transformer:
        out = print_transformer_plan(cfg, args, net, spec)
    else:
        phases = phases_from_config(cfg, net.layout.world, compute_s_per_image=compute, images_per_s_224=args.images_per_s)
        out = print_resnet_plan(cfg, args, net, spec, phases)
    if worst is not None:
        out["calibration_max_error"] = round(worst, 4)
    return out


if __name__ == "__main__":
    main()
