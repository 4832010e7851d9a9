"""Planner: step time, time to target and cost of a recipe's gradient exchanges on a GPU cluster.

Each bucket's exchange is `trainer/comm/cost.py`'s list of collectives and local work, timed with alpha-beta
links; a step is its compute plus the exposed exchange (`cost.predict`); `comm.kind: auto`'s per-bucket choice
is `cost.choose` over `cost.candidates`, as on the live cluster. This module adds what a plan needs around it:
a GPU cluster (`gpu_network`: nodes, GPUs per node, links), the model's buckets (`model_spec`, packed as
trainer/comm packs them) and when backward releases them, the compute time per step, the recipe's phases
(`phases_from_config`) and the time to its last epoch with evaluation and its cost (`predict_run`).
`replan` re-plans a `comm.kind: auto` run's own calibration at other bandwidths and cluster sizes; the
emulated cluster the planner is checked against is `trainer/comm/emulated.py`.

Published times are cited constants; a V100's compute and a node's links are stated assumptions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from trainer.comm.cost import (Collective, Layout, Link, Network, Selection, candidates, choose, describe_local,
                               k_of, predict, with_inter_rate)
from trainer.comm.plan import DENSE, Choice, fixed_plan

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

DENSITIES = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05)
"""Sparse densities planned besides the recipe's own comm.densities."""


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


def model_spec(name: str, parameters: Sequence[Any], bucket_mb: float, calibration: dict | None = None) -> ModelSpec:
    """The model's buckets as trainer/comm packs them; ready fractions measured on the emulated cluster when
    the calibration measured a model of this name with these very buckets, else by parameter count."""
    from trainer.comm.base import make_buckets

    buckets = [b.numel for b in make_buckets(list(parameters), bucket_mb)]
    for run in (calibration or {}).get("runs", []):
        m = run.get("models", {}).get(name)
        if m and list(m["buckets"]) == buckets:
            return ModelSpec(name, buckets, list(m["bucket_ready"]))
    return ModelSpec(name, buckets)


def step_seconds(forward_s: float, backward_s: float, model: ModelSpec, plan: Sequence[Choice], net: Network) -> float:
    """One training step on a GPU cluster: the compute, then the exchange `cost.predict` says is exposed (no
    exchange work competes with the GPU's compute)."""
    if net.layout.world == 1:
        return forward_s + backward_s
    exposed, _ = predict(model.buckets, model.ready_before_end(backward_s), plan, net, False)
    return forward_s + backward_s + exposed


@dataclass(frozen=True)
class Strategy:
    """What a run's `comm` section would do: one choice for every bucket (`plan.fixed_plan`), or auto's
    per-bucket choice (`choice` None)."""

    choice: Choice | None
    dense_below: int = 16384
    densities: tuple[float, ...] = ()
    """auto: the densities it may pick (already bounded by the recipe's min_density)."""
    local_steps: int = 0
    """local (`choice` None): H, the steps between synchronisations; 0 = not local."""
    state_per_param: int = 1
    """local: optimizer state elements averaged per parameter at a synchronisation (SGD/LARS 1, Adam 2)."""
    wire_bytes: int = 4
    """local: bytes per pseudo-gradient element on the wire (2: bf16)."""
    local_density: float = 1.0
    """local: the fraction of the pseudo-gradient sent as top-k pairs (1: all of it, allreduced)."""
    local_overlap: bool = False
    """local: the synchronisation runs behind the next round's steps, without the state (comm.local_overlap)."""

    @property
    def label(self) -> str:
        if self.choice is not None:
            return self.choice.label
        if not self.local_steps:
            return "auto"
        return (f"local H={self.local_steps}" + (f" top-k {self.local_density:g}" if self.local_density < 1 else "")
                + (" overlapped" if self.local_overlap else ""))

    def step_s(self, forward_s: float, backward_s: float, model: ModelSpec, net: Network) -> tuple[float, list[Choice]]:
        """One step's seconds and each bucket's choice (local: none; its synchronisation is spread over the H steps
        of a round, less what the next round's compute hides when overlapped, plus every step's 1-element allreduce
        of the non-finite flag; the rounds an epoch's end cuts short, and its waiting synchronisation, are not
        counted: at most one more synchronisation per epoch)."""
        if self.local_steps:
            k = k_of(model.params, self.local_density) if self.local_density < 1 else 0
            state = 0 if self.local_overlap else self.state_per_param * model.params
            sync = net.chain_s(describe_local(model.params, state, net.layout, self.wire_bytes, k))
            hidden = self.local_steps * (forward_s + backward_s) if self.local_overlap else 0.0
            flag = net.collective_s(Collective("allreduce", 4, "world"))
            return forward_s + backward_s + flag + max(0.0, sync - hidden) / self.local_steps, []
        plan = self.plan(model, backward_s, net)
        return step_seconds(forward_s, backward_s, model, plan, net), plan

    def plan(self, model: ModelSpec, backward_s: float, net: Network) -> list[Choice]:
        """Each bucket's choice when backward takes `backward_s`."""
        if self.choice is not None:
            return list(fixed_plan(self.choice.kind, model.buckets, self.choice.density, self.dense_below))

        def options(i: int) -> list[Choice]:
            return candidates(model.buckets[i], net.layout, self.densities, 0.0, self.dense_below)

        plan, _ = choose(model.buckets, model.ready_before_end(backward_s), net, options, False)
        return plan

    def is_configured(self, comm: Any) -> bool:
        """Whether this is what the `comm` section itself asks for."""
        if comm.kind == "local" or self.local_steps:
            return comm.kind == "local" and self.local_steps == comm.local_steps
        if comm.kind == "auto" or self.choice is None:
            return comm.kind == "auto" and self.choice is None
        return self.choice.kind == comm.kind and (self.choice.kind == "dense" or self.choice.density == comm.density)


def strategies(comm: Any, densities: Sequence[float], state_per_param: int = 1) -> list[Strategy]:
    """dense, dense16, topk and hitopk at each of `densities` and comm.densities the recipe allows (>=
    comm.min_density), auto (over comm.densities, as in a run), last; and first, when the config asks for
    comm.kind local, local at its comm.local_steps (it changes convergence: the planner offers it only where the
    config declares it, and assumes the recipe's epochs hold)."""
    safe = tuple(sorted(d for d in {*densities, *comm.densities} if d >= comm.min_density))
    if not safe:
        raise PlanError(f"--densities and comm.densities: none is >= the recipe's comm.min_density {comm.min_density:g} (the density "
                        "it declares safe for convergence)")
    out = [Strategy(DENSE, comm.dense_below), Strategy(Choice("dense16"), comm.dense_below)]
    out += [Strategy(Choice(kind, d), comm.dense_below) for kind in ("topk", "hitopk") for d in safe]
    if comm.kind == "local":
        out.insert(0, Strategy(None, comm.dense_below, local_steps=comm.local_steps,
                               state_per_param=0 if comm.local_state == "keep" else state_per_param,
                               wire_bytes=2 if comm.compression == "bf16" else 4, local_density=comm.local_density,
                               local_overlap=comm.local_overlap))
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
        t, plan = strategy.step_s(fwd, bwd, model, net)
        step_s.append(t)
        plans.append(plan)
        steps = ph.epochs * ph.steps_per_epoch
        warm = min(steps, max(0, warmup_steps))
        warmup_steps -= warm
        # the warm-up steps: dense, or local synchronising every step and waiting for it
        warm_s = replace(strategy, local_steps=1, local_overlap=False).step_s(fwd, bwd, model, net)[0] \
            if strategy.local_steps else \
            step_seconds(fwd, bwd, model, [DENSE] * len(model.buckets), net)
        train_s += (steps - warm) * t + warm * warm_s
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


def transformer_compute_s(params: int, tokens: int) -> float:
    """Forward + backward of one Transformer step on one GPU: 6 x parameters x tokens FLOPs at
    TRANSFORMER_UTILIZATION of a V100's tensor throughput (a stated assumption)."""
    return 6 * params * tokens / (V100_TENSOR_FLOPS * TRANSFORMER_UTILIZATION)


def step_plans(strategies_: Sequence[Strategy], model: ModelSpec, compute_s: float, net: Network
               ) -> list[tuple[Strategy, float, list[Choice]]]:
    """(strategy, step seconds, each bucket's choice) of one step of `compute_s` compute under each strategy."""
    fwd, bwd = compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE
    out = []
    for s in strategies_:
        t, plan = s.step_s(fwd, bwd, model, net)
        out.append((s, t, plan))
    return out


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


@dataclass
class Replan:
    """auto's choice for one layout at one inter-node rate (a factor of the measured one)."""

    layout: Layout
    rate_factor: float
    plan: list[Choice]
    exposed_s: float
    dense_exposed_s: float


def replan(cal: dict[str, float], base: Network, sizes: Sequence[int], ready: Sequence[float],
           densities: Sequence[float], layouts: Sequence[Layout], factors: Sequence[float]) -> list[Replan]:
    """What auto would choose, and the exposed exchange it predicts, on each layout at each rate factor, from
    a run's calibration (`base`: its fitted network, `sizes` and `ready`: its buckets and ready times); other
    layouts keep the measured links (the node-crossing ones scaled by the factor, `cost.with_inter_rate`) and
    ready times."""
    out = []
    local = bool(cal["local_competes"])
    for layout in layouts:
        for factor in factors:
            net = with_inter_rate(base, factor, layout)
            options = lambda i, lay=layout: candidates(sizes[i], lay, densities, cal["min_density"],  # noqa: E731
                                                       int(cal["dense_below"]))
            plan, exposed = choose(sizes, ready, net, options, local)
            dense, _ = predict(sizes, ready, [DENSE] * len(sizes), net, local)
            out.append(Replan(layout, factor, plan, exposed, dense))
    return out

