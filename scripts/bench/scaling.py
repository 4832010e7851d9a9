"""Scaling on an emulated cluster: step time of dense, fp16 dense, top-k, hierarchical top-k and auto over slow
links.

The paper's claim is about nodes joined by a slow network. `scripts/netem/cluster.sh` turns this machine
into N network namespaces ("nodes") whose links are shaped to a rate with tc; `scripts/netem/run.sh`
starts one torchrun per node (static rendezvous on node 0, gloo bound to the node's shaped interface).
Ranks of one node talk over that node's loopback (fast), ranks of different nodes over the shaped links.

For 2 nodes x 2 ranks and 4 nodes x 1 rank, over unshaped loopback, 1 Gbit/s and 200 Mbit/s, every rank runs real forward and
backward passes (ResNet-50: torchvision's, 25.6 M parameters in 161 tensors, 4 images of 64 px per rank;
Transformer-base: 6+6 layers, d 512, 32k shared vocabulary, 60.5 M parameters in 185 tensors, 4 x 32
tokens per rank) and the communicator of `comm.kind` exchanges the gradients, launched per 25 MB bucket
from the backward hooks. "compute only" is the same step without exchange; comm ms = step - compute.
A step is as slow as its slowest rank: the median over steps of the per-step maximum over ranks.

All ranks share this machine's cores, 1 thread each: compute times are those of a 4-way shared CPU,
and intra-node exchanges are memory copies competing with them. What transfers to a real cluster is the
shape of the trade-off (bytes over the slow links, how much of it backward hides), not absolute times.

Besides the steps (wall and CPU seconds), each layout and rate measures the collectives alone at two
sizes (the alpha-beta links of `trainer/comm/cost.py`) and the exchanges' local pieces (bucket gathering, casts,
selection on the model's own gradients); everything goes to `--out`/calibration.json, which the planner
reads to predict every measured step (the comparison is a column of the table). The PNG is the paper's
breakdown figure: compute and communication per exchange. ratio (JSON) = dense step / hitopk step for
ResNet-50 on 2 nodes x 2 ranks at 1 Gbit/s.

Needs root (network namespaces); prints why and a JSON line with "skipped" otherwise.

    sudo .venv/bin/python -m scripts.bench.scaling [--quick] [--density 0.01] [--out runs/scaling]

--quick: ResNet-50 only, 4 measured steps per cell (a smoke run); full: both models, 8 steps (`--steps` sets it).
Each model runs in its own processes; every (layout, rate, model) is saved to OUT/cells/ when it is done,
and `--resume` reuses the saved cells of the same steps and density (their commit is printed and kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from scripts.bench import common
from scripts.bench.common import bench_parser, emit_result, print_table, record_run
from trainer.comm.plan import AUTO_KINDS as FIXED
from trainer.comm.emulated import renamed

EXCHANGES: dict[str, dict[str, Any] | None] = {
    "compute only": None,
    **{kind: {"kind": "dense", "compression": "fp16"} if kind == "dense16" else {"kind": kind} for kind in FIXED},
    "auto": {"kind": "auto", "compression": "fp16"}}
"""What each cell measures -> its comm config overrides: the step without exchange (compute only), the fixed
exchanges auto chooses among (trainer/comm/plan.py's `AUTO_KINDS`; dense16 is dense on an fp16 wire),
and `comm.kind: auto` with its default calibration and trials, choosing among the same four (its 16-bit wire:
fp16)."""

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.comm.base import Bucket
    from trainer.dist import Topology

ROOT = Path(__file__).resolve().parents[2]

LAYOUTS = ((2, 2), (4, 1))  # (nodes, ranks per node)
RATES = ("unlimited", "1gbit", "200mbit")
BUCKET_MB = 25.0
DENSE_BELOW = 16384
NETEM_ENV = {"NETEM_PREFIX": "dawnb", "NETEM_SUBNET": "10.213.1"}  # not the default cluster: ours to tear down
PORT = 29517


# ---------------------------------------------------------------- models (worker side)


def build_model(name: str) -> nn.Module:
    """The model and a function returning its loss on a fixed synthetic batch for this rank."""
    import torch
    import torchvision
    from torch import nn

    if name == "resnet50":
        model = torchvision.models.resnet50()
        x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))
        return model, lambda: nn.functional.cross_entropy(model(x), y)
    if name == "transformer":
        model = TransformerBase()
        src, tgt = torch.randint(0, 32000, (4, 32)), torch.randint(0, 32000, (4, 32))
        return model, lambda: nn.functional.cross_entropy(model(src, tgt).flatten(0, 1), tgt.flatten())
    raise ValueError(f"unknown model {name!r} (resnet50, transformer)")


def _transformer_base() -> type:
    import torch
    from torch import nn

    class Base(nn.Module):
        """Transformer-base (Vaswani et al. 2017): d 512, 8 heads, 6+6 layers, FFN 2048, shared 32k embedding."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32000, 512)
            self.body = nn.Transformer(512, 8, 6, 6, 2048, dropout=0.0, batch_first=True)

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            scale = 512 ** 0.5
            h = self.body(self.embed(src) * scale, self.embed(tgt) * scale)
            return h @ self.embed.weight.t()  # output projection tied to the embedding

    return Base


def TransformerBase() -> nn.Module:  # noqa: N802 - a class built lazily so that the parent process never imports torch
    return _transformer_base()()


# ---------------------------------------------------------------- measurements (worker side)


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def cpu_seconds() -> float:
    """CPU time of this process, all threads (gloo's and the exchange thread's included), user + system."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of fn: medians over reps after one warm-up, the slowest rank's per repeat.

    Wall time depends on everything else running on the machine; CPU seconds mostly do not, which is
    why the planner takes both (see trainer/comm/emulated.py: EmulatedCluster)."""
    import torch.distributed as dist

    fn()
    rows = []
    for _ in range(reps):
        dist.barrier()
        start, cpu = time.perf_counter(), cpu_seconds()
        fn()
        rows.append(_max_over_ranks([time.perf_counter() - start, cpu_seconds() - cpu]))
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def measure_primitives(topo: Topology, density: float, reps: int) -> dict[str, list[list[float]]]:
    """Each piece of an exchange, alone, at two sizes: {name: [[elements, wall s, CPU s], ...]}.

    Collectives are named by the link they probe (`cost.PROBES`: world, world16, world_gather, inter,
    intra_scatter, intra_gather) and take the size their formula in trainer/comm/cost.py takes (the full buffer
    for allreduce and reduce-scatter, one rank's payload for allgather). The local pieces are what trainer/comm
    does around the collectives of one bucket: dense_local (gather the gradients into the bucket, average, write
    back), fp16_cast (to and from the wire dtype), sparse_local (add the residual, MSTopK, pack, clear
    the sent elements, scatter-add the gathered payloads, average).
    """
    import torch

    out: dict[str, list[list[float]]] = {}
    gen = torch.Generator().manual_seed(topo.rank)

    def add(name: str, sizes: Sequence[int], make: Callable[[int], Callable[[], object]]) -> None:
        out[name] = [[float(n), *_timed(make(n), reps)] for n in sizes]

    world, intra, inter = topo.world, topo.intra_node, topo.inter_node
    add("world", (2**18, 2**21), lambda n: (lambda t=torch.ones(n): world.all_reduce_(t, "allreduce")))
    add("world16", (2**18, 2**21),
        lambda n: (lambda t=torch.ones(n, dtype=torch.float16): world.all_reduce_(t, "allreduce")))
    add("world_gather", (2**15, 2**18), lambda n: (lambda t=torch.ones(n): world.all_gather(t, "allgather")))
    if topo.ranks_per_node > 1:
        if topo.num_nodes > 1:
            add("inter", (2**15, 2**18),
                lambda n: (lambda t=torch.ones(n): inter.all_gather(t, "allgather")))
        add("intra_scatter", (2**20, 2**23),
            lambda n: (lambda t=torch.ones(n): intra.reduce_scatter(t, "reduce-scatter")))
        add("intra_gather", (2**19, 2**22),
            lambda n: (lambda t=torch.ones(n): intra.all_gather(t, "allgather")))

    def dense_local(n: int) -> Callable[[], None]:
        grads = list(torch.randn(n, generator=gen).chunk(16))

        def run() -> None:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(topo.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()])
                offset += g.numel()
        return run

    def fp16_cast(n: int) -> Callable[[], torch.Tensor]:
        x = torch.randn(n, generator=gen)
        return lambda: x.to(torch.float16).to(torch.float32)

    peers = inter.size if inter is not None else 1

    def sparse_local(n: int) -> Callable[[], None]:
        g = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp()
        return sparse_piece(g, density, peers, topo.world_size)

    add("dense_local", (2**21, 2**23), dense_local)
    add("fp16_cast", (2**21, 2**23), fp16_cast)
    add("sparse_local", (2**21, 2**23), sparse_local)
    return out


def sparse_piece(g: torch.Tensor, density: float, peers: int, world: int) -> Callable[[], None]:
    """trainer/comm/sparse.py's own local work around the collectives of one bucket (or shard) `g`, at the
    communicator's default `selection_iters`."""
    from trainer.comm.config import CommConfig
    from trainer.comm.sparse import sparse_local_work

    return sparse_local_work(g.float(), density, peers, CommConfig().selection_iters, world)


def measure_sparse_on_gradients(buckets: Sequence[Bucket], topo: Topology, density: float, reps: int) -> list[list[float]]:
    """The sparse local work on this model's real gradients, per bucket: [elements, wall s, CPU s] for the
    whole bucket (topk) and for this rank's 1/L shard (hitopk). Selection cost depends on the values: a
    row-sparse embedding gradient, mostly zeros, makes MSTopK fall back to an exact top-k."""
    import math

    import torch

    per = topo.ranks_per_node
    out = []
    for b in buckets:
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in b.params])
        shard = math.ceil(flat.numel() / per)
        mine = flat[topo.local_rank * shard:(topo.local_rank + 1) * shard].contiguous()
        full = _timed(sparse_piece(flat, density, topo.world_size, topo.world_size), reps)
        part = _timed(sparse_piece(mine, density, topo.num_nodes, topo.world_size), reps) if per > 1 else full
        out.append([float(flat.numel()), *full, *part])
    return out


def measure_model(name: str, topo: Topology, density: float, steps: int) -> dict[str, Any]:
    """Step times, CPU seconds and communicator stats of every exchange for one model; the buckets and
    when backward makes each ready (fraction of the backward pass, from the compute-only steps).

    The exchanges alternate step by step (compute only, dense, ..., hitopk, compute only, ...), so that
    load from other processes on this shared machine falls on every exchange alike."""
    import torch
    import torch.distributed as dist

    from trainer.comm import CommConfig, build_communicator
    from trainer.comm.cost import plan_summary
    from trainer.comm.base import make_buckets

    torch.manual_seed(topo.rank)
    model, loss_fn = build_model(name)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = make_buckets(params, BUCKET_MB)
    owner = {id(p): b.index for b in buckets for p in b.params}
    left: dict[int, int] = {}
    marks: dict[int, float] = {}

    def probe(p: nn.Parameter) -> None:  # compute only: when each bucket's last gradient arrives
        left[owner[id(p)]] -= 1
        if left[owner[id(p)]] == 0:
            marks[owner[id(p)]] = time.perf_counter()

    # One model and one set of gradients serve every exchange (Transformer-base x 5 exchanges x 4 ranks would
    # not fit in memory otherwise): each communicator is detached after building and attached for its steps.
    comms = {}
    for kind, overrides in EXCHANGES.items():
        if overrides is not None:  # auto may choose the fixed kinds' density only: the same convergence bound
            extra = {"densities": [density], "min_density": density} if kind == "auto" else {}
            comms[kind] = build_communicator(CommConfig(**overrides, **extra, density=density, bucket_mb=BUCKET_MB,
                                                        dense_below=DENSE_BELOW), model, topo)
            comms[kind].detach()
    # ... and one gathering buffer per bucket: a scratch each step refills, and only one communicator steps at a time
    for c in comms.values():
        for b, mine in zip(buckets, c.buckets, strict=True):
            assert b.numel == mine.numel, "every communicator buckets the model alike"
            b.buffer = b.buffer if b.buffer is not None else torch.empty(b.numel, dtype=b.params[0].dtype)
            mine.buffer = b.buffer
    probes: list = []

    def use(kind: str) -> None:
        """Only `kind`'s hooks on the parameters (compute only: the probes that time bucket readiness)."""
        for c in comms.values():
            c.detach()
        for handle in probes:
            handle.remove()
        probes.clear()
        if kind in comms:
            comms[kind].attach()
        else:
            probes.extend(p.register_post_accumulate_grad_hook(probe) for p in params)
    rows: dict[str, list] = {kind: [] for kind in EXCHANGES}
    stats: dict[str, list] = {kind: [] for kind in EXCHANGES}
    ready_at = []
    try:
        use("auto")  # auto's calibration: its dense warm-up steps and probes, before the measured rounds
        while not comms["auto"].calibrated:
            dist.barrier()
            model.zero_grad(set_to_none=True)
            loss_fn().backward()
            comms["auto"].finish()
        names = list(EXCHANGES)
        for rnd in range(steps + 1):  # round 0 is warm-up (allocations, first-touch, connections)
            # the order rotates every round, so no exchange always follows the same one
            for kind in names[rnd % len(names):] + names[:rnd % len(names)]:
                use(kind)
                comm = comms.get(kind)
                dist.barrier()
                model.zero_grad(set_to_none=True)
                left.update({b.index: len(b.params) for b in buckets})
                start, cpu0 = time.perf_counter(), cpu_seconds()
                loss = loss_fn()
                fwd_end, cpu1 = time.perf_counter(), cpu_seconds()
                loss.backward()
                bwd_end, cpu2 = time.perf_counter(), cpu_seconds()
                step_stats = comm.finish() if comm is not None else {}
                end, cpu3 = time.perf_counter(), cpu_seconds()
                if rnd:
                    rows[kind].append(_max_over_ranks([end - start, fwd_end - start, bwd_end - fwd_end,
                                                       cpu3 - cpu0, cpu1 - cpu0, cpu2 - cpu1]))
                    stats[kind].append(step_stats)
                    if comm is None:
                        ready_at.append([(marks[i] - fwd_end) / (bwd_end - fwd_end) for i in sorted(marks)])
        use("compute only")  # real gradients for the sparse pieces
        model.zero_grad(set_to_none=True)
        left.update({b.index: len(b.params) for b in buckets})
        loss_fn().backward()
        sparse_pieces = measure_sparse_on_gradients(buckets, topo, density, reps=max(2, steps))
    finally:
        use("compute only")  # drops every communicator's hooks, which would otherwise keep it alive
        for handle in probes:
            handle.remove()
    result: dict[str, Any] = {"buckets": [b.numel for b in buckets], "params": sum(p.numel() for p in params),
                              "tensors": len(params), "exchanges": {},
                              "bucket_ready": [statistics.median(col) for col in zip(*ready_at)],
                              "sparse_local": sparse_pieces,
                              "auto": {"plan": [c.label for c in comms["auto"].plan],
                                       "plan_summary": plan_summary(comms["auto"].plan),
                                       "predicted_exposed_s": comms["auto"].predicted_exposed_s,
                                       "trials": [[plan, round(cost * 1e3, 1)]
                                                  for plan, cost in comms["auto"].trial_results()],
                                       "calibration": comms["auto"].calibration}}
    for kind in EXCHANGES:
        cell = {key: statistics.median(r[i] for r in rows[kind])
                for i, key in enumerate(("step_s", "fwd_s", "bwd_s", "cpu_s", "fwd_cpu_s", "bwd_cpu_s"))}
        cell["steps_s"] = [r[0] for r in rows[kind]]
        if stats[kind] and stats[kind][0]:
            cell.update({k: statistics.mean(s[k] for s in stats[kind]) for k in stats[kind][0]})
        result["exchanges"][kind] = cell
    return result


def peak_rss_mb() -> float:
    """The largest resident set this process has had, in MB (Linux reports ru_maxrss in KB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(args: argparse.Namespace) -> None:
    """One rank of the emulated cluster (started by scripts/netem/run.sh under torchrun): one model, and the
    collectives alone when --primitives is given."""
    import torch

    from trainer.dist import DistConfig, setup_distributed, teardown_distributed

    torch.set_num_threads(1)  # all ranks of all nodes share the machine's 2 cores
    topo = setup_distributed(DistConfig(timeout_s=900))
    try:
        out = {"nodes": topo.num_nodes, "ranks_per_node": topo.ranks_per_node, "rate": args.rate, "models": {}}
        if args.primitives:
            out["primitives"] = measure_primitives(topo, args.density, reps=args.steps)
        for name in args.models.split(","):
            m = out["models"][name] = measure_model(name, topo, args.density, args.steps)
            m["peak_rss_mb"] = round(_max_over_ranks([peak_rss_mb()])[0])
            if topo.is_main:
                print(f"  {name}: " + ", ".join(f"{k} {v['step_s'] * 1e3:.0f} ms" for k, v in m["exchanges"].items())
                      + f"; peak RSS {m['peak_rss_mb']} MB per rank", flush=True)
        if topo.is_main:
            Path(args.worker_out).write_text(json.dumps(out))
        torch.distributed.barrier()
    finally:
        teardown_distributed()


# ---------------------------------------------------------------- the emulated cluster (parent side)


def _netem(script: str, *args: str, quiet: bool = False) -> None:
    """Run scripts/netem/SCRIPT with our cluster's prefix (`common.netem`)."""
    common.netem(script, *args, env=NETEM_ENV, bench="scaling", quiet=quiet)


skip_reason = common.netem_skip_reason
"""Why this machine cannot run the emulation (None when it can)."""


def measure_all(args: argparse.Namespace, models: list[str], steps: int) -> list[dict[str, Any]]:
    """Bring the cluster up for each layout and rate and run one worker per model on it (fresh processes: one
    model's heap does not crowd the next); the cluster is always torn down.

    Each (layout, rate, model) is written to OUT/cells/ as soon as it is measured; --resume reuses those
    files (same steps and density) instead of measuring them again, so a run that dies loses one cell."""
    runs = []
    combos = [(layout, rate) for layout in (LAYOUTS[:1] if args.quick else LAYOUTS) for rate in RATES]
    cells_dir = Path(args.out) / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    up = None
    try:
        for i, ((nodes, per_node), rate) in enumerate(combos, 1):
            print(f"[{i}/{len(combos)}] {nodes} nodes x {per_node} ranks, links {rate}", flush=True)
            run: dict[str, Any] = {"nodes": nodes, "ranks_per_node": per_node, "rate": rate, "models": {},
                                   "wall_s": 0.0, "commits": {}}
            for j, model in enumerate(models):
                path = cells_dir / f"{nodes}x{per_node}_{rate}_{model}_steps{steps}_density{args.density}.json"
                part = json.loads(path.read_text()) if args.resume and path.exists() else None
                if part is not None and (j > 0 or "primitives" in part):
                    renamed(part)
                    print(f"  {model}: reused {path} (measured {part['measured']} at {part['commit']})", flush=True)
                else:
                    if up != (nodes, rate):
                        _netem("cluster.sh", "up", str(nodes), rate, quiet=True)
                        up = (nodes, rate)
                    start = time.perf_counter()
                    _netem("run.sh", "--nproc-per-node", str(per_node), "--port", str(PORT + i), "--threads", "1",
                           "-m", "scripts.bench.scaling", "--worker", str(path), "--rate", rate, "--models", model,
                           "--steps", str(steps), "--density", str(args.density), *(["--primitives"] if j == 0 else []))
                    part = json.loads(path.read_text())
                    part.update(wall_s=time.perf_counter() - start, measured=time.strftime("%Y-%m-%d %H:%M"),
                                commit=common.commit())
                    path.write_text(json.dumps(part))
                run["models"].update(part["models"])
                run["wall_s"] += part["wall_s"]
                run["commits"][model] = part["commit"]
                if "primitives" in part:
                    run["primitives"] = part["primitives"]
            runs.append(run)
    finally:
        if up is not None:
            _netem("cluster.sh", "down", quiet=True)
    return runs


# ---------------------------------------------------------------- report (parent side)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """The breakdown figure: per model, layout and rate, a bar per exchange split into compute and comm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(runs[0]["models"])
    fig, axes = plt.subplots(len(models), len(runs), figsize=(3.2 * len(runs), 3.2 * len(models)),
                             squeeze=False, sharey="row")
    for row, model in enumerate(models):
        for col, run in enumerate(runs):
            ax = axes[row][col]
            ex = run["models"][model]["exchanges"]
            compute = ex["compute only"]["step_s"]
            names = list(ex)
            comm = [max(0.0, ex[k]["step_s"] - compute) for k in names]
            ax.bar(names, [compute] * len(names), color="#4c72b0", label="compute (fwd+bwd)")
            ax.bar(names, comm, bottom=[compute] * len(names), color="#dd8452", label="communication not hidden")
            ax.set_title(f"{model}: {run['nodes']}x{run['ranks_per_node']} @ {run['rate']}", fontsize=9)
            ax.tick_params(axis="x", rotation=60, labelsize=8)
            if col == 0:
                ax.set_ylabel("step time (s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Emulated cluster (tc-shaped links, 1 CPU thread per rank): step time breakdown", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: list[dict[str, Any]], args: argparse.Namespace, steps: int) -> dict[str, Any]:
    from trainer.comm.emulated import compare_with_measurements

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    calibration = {"version": 1, "cores": os.cpu_count(), "density": args.density, "bucket_mb": BUCKET_MB,
                   "dense_below": DENSE_BELOW, "steps": steps, "measured": time.strftime("%Y-%m-%d %H:%M"),
                   "machine": _machine(), "runs": runs}
    cal_path = out_dir / "calibration.json"
    cal_path.write_text(json.dumps(calibration, indent=1))
    comparison = {(c["model"], c["nodes"], c["ranks_per_node"], c["rate"], c["exchange"]): c
                  for c in compare_with_measurements(calibration)}

    rows = []
    for run in runs:
        for model, m in run["models"].items():
            base = m["exchanges"]["compute only"]
            dense = m["exchanges"]["dense"]["step_s"]
            for kind, cell in m["exchanges"].items():
                pred = comparison.get((model, run["nodes"], run["ranks_per_node"], run["rate"], kind), {})
                rows.append([model, f"{run['nodes']}x{run['ranks_per_node']}", run["rate"], kind,
                             cell["step_s"] * 1e3, max(0.0, cell["step_s"] - base["step_s"]) * 1e3,
                             cell.get("wait_s", 0.0) * 1e3, cell["cpu_s"] * 1e3,
                             cell.get("bytes_inter_node", 0.0) / 2**20, dense / cell["step_s"],
                             pred["predicted_s"] * 1e3 if pred else "-",
                             f"{pred['error'] * 100:+.1f}%" if pred else "-"])
    print(f"\nStep times on the emulated cluster: median of {steps} steps (slowest rank), exchanges alternating "
          f"step by step; density {args.density}, 25 MB buckets, 1 CPU thread per rank on {_machine()}")
    print("comm ms = step - compute only; not hidden = the wait after backward; CPU = CPU seconds of a rank's step")
    print_table(["model", "nodes", "links", "exchange", "step ms", "comm ms", "not hidden ms", "CPU ms",
                 "inter-node MB/rank", "vs dense", "planner ms", "planner err"], rows)
    plot(runs, out_dir / "scaling.png")
    errors = [abs(c["error"]) for c in comparison.values()]
    print(f"\nbreakdown figure: {out_dir / 'scaling.png'}; calibration for scripts/plan.py: {cal_path}")
    print(f"planner vs emulation, in sample (each cell fed its own measured pieces and CPU time, not a "
          f"prediction): max |error| {max(errors) * 100:.1f}% over {len(errors)} steps; "
          f"details: python -m scripts.plan --calibration {cal_path}")

    targets = {}
    for run in runs:  # hitopk against dense, ResNet-50
        if "resnet50" not in run["models"]:
            continue
        ex = run["models"]["resnet50"]["exchanges"]
        compute = ex["compute only"]["step_s"]
        comm = {k: max(ex[k]["step_s"] - compute, 0.01) for k in ("dense", "hitopk")}  # 10 ms floor: noise
        key = f"{run['nodes']}x{run['ranks_per_node']}@{run['rate']}"
        targets[key] = {"exchange_ratio": round(comm["dense"] / comm["hitopk"], 2),
                        "step_ratio": round(ex["dense"]["step_s"] / ex["hitopk"]["step_s"], 2),
                        "inter_node_bytes_ratio": round(ex["dense"]["bytes_inter_node"]
                                                        / max(ex["hitopk"]["bytes_inter_node"], 1.0), 1)}
        local_s = hitopk_local_floor_s(run, "resnet50")
        targets[key]["sparse_local_ms"] = round(local_s * 1e3, 1)
        targets[key]["dense_exchange_ms"] = round(comm["dense"] * 1e3, 1)
        t = targets[key]
        print(f"ResNet-50 {key}: hitopk vs dense: exchange (step - compute) {t['exchange_ratio']}x faster, step "
              f"{t['step_ratio']}x, inter-node bytes {t['inter_node_bytes_ratio']}x fewer"
              + f"; its sparse local work alone (no network) takes {t['sparse_local_ms']:.0f} ms, so on this CPU "
              f"its exchange is at most {comm['dense'] / local_s:.1f}x faster than dense's "
              f"({t['dense_exchange_ms']:.0f} ms) at any link speed")
    summary = {name: {f"{r['nodes']}x{r['ranks_per_node']}@{r['rate']}":
                      {k: round(v["step_s"] * 1e3, 1) for k, v in r["models"][name]["exchanges"].items()}
                      for r in runs} for name in runs[0]["models"]}
    cells = make_cells(runs, args.density)
    print("\nauto against the fixed exchanges (criteria, on the ratio of medians: within 5% of the best fixed one, "
          "never > 5% slower than dense; the best fixed one is the least of four noisy medians, which favours it); "
          "auto's calibration and trials run before the measured rounds and are not in them (`trials` in the "
          "JSON: each tried plan's step ms, all dense's from the calibration where its trial was skipped); "
          "planner = out-of-sample prediction from auto's calibration at the other shaped rate:")
    print_table(["model", "nodes", "links", "best fixed", "best ms", "auto ms", "auto/best", "per round: median (IQR)",
                 "auto/dense", "auto plan", "planner max |err|"],
                [[c["model"], c["layout"], c["rate"], c["best_fixed"], c["step_ms"][c["best_fixed"]], c["step_ms"]["auto"],
                  c["auto_vs_best"], "{1:.3f} ({0:.3f}-{2:.3f})".format(*c["auto_vs_best_rounds"]),
                  c["auto_vs_dense"], c["auto_plan_summary"],
                  f"{c['planner']['max_abs_error'] * 100:.1f}% (from {c['planner']['calibrated_on']})"
                  if "planner" in c else "-"] for c in cells])
    out_of_sample = [c["planner"]["max_abs_error"] for c in cells if "planner" in c]
    if out_of_sample:
        print(f"planner out of sample (calibrated at the layout's other shaped rate): max |error| "
              f"{max(out_of_sample) * 100:.1f}% over {len(out_of_sample)} cells")
    key = next(r for r in runs if (r["nodes"], r["ranks_per_node"], r["rate"]) == (2, 2, "1gbit"))
    rn = key["models"]["resnet50"]["exchanges"]
    return emit_result("scaling", "dense", rn["dense"]["step_s"] / rn["hitopk"]["step_s"],
                       setting="resnet50 2x2 @1gbit", density=args.density, threads_per_rank=1, targets=targets,
                       planner_in_sample_max_error=round(max(errors), 4),
                       planner_out_of_sample_max_error=round(max(out_of_sample), 4) if out_of_sample else None,
                       png=str(out_dir / "scaling.png"),
                       calibration=str(cal_path), step_ms=summary, steps=steps,
                       auto_within_5pct_of_best=all(c["auto_vs_best"] <= 1.05 for c in cells),
                       auto_never_5pct_slower_than_dense=all(c["auto_vs_dense"] <= 1.05 for c in cells),
                       cells=cells)


def predict_cell(source: dict[str, Any], model: str, target: dict[str, Any], density: float) -> dict[str, float]:
    """Step seconds of every exchange in the `target` run, predicted out of sample from the `source` run of the
    same layout: its auto calibration (links, contention, selection cost, ready times) and compute-only step,
    with the node-crossing links scaled by the ratio of the two nominal rates (`cost.with_inter_rate`). Nothing
    measured in the target run is used. "auto" is the model's plan there: which plan auto's trials keep is measured, not
    predicted."""
    from trainer.comm.auto import network_from_calibration
    from trainer.comm.cost import Layout, candidates, choose, predict, with_inter_rate
    from trainer.comm.emulated import rate_bps
    from trainer.comm.plan import fixed_plan

    m = source["models"][model]
    layout = Layout(source["nodes"], source["ranks_per_node"])
    net, sizes, ready = network_from_calibration(m["auto"]["calibration"], layout)
    net = with_inter_rate(net, rate_bps(target["rate"]) / rate_bps(source["rate"]))
    compute = m["exchanges"]["compute only"]["step_s"]
    out = {}
    for kind in FIXED:
        out[kind] = compute + predict(sizes, ready, fixed_plan(kind, sizes, density, DENSE_BELOW), net, True)[0]
    plan, exposed = choose(sizes, ready, net, lambda i: candidates(sizes[i], layout, [density], density, DENSE_BELOW),
                           True)
    out["auto"] = compute + exposed
    return out


def make_cells(runs: list[dict[str, Any]], density: float) -> list[dict[str, Any]]:
    """One object per (model, layout, rate): each exchange's step ms, auto against the best fixed exchange and
    against dense, auto's plan, and the planner's out-of-sample prediction (calibrated on the other shaped
    rate of the same layout; the unshaped cell has no nominal rate to scale by, so it is not predicted)."""
    cells = []
    for run in runs:
        for model, m in run["models"].items():
            ex = m["exchanges"]
            steps = {k: ex[k]["step_s"] for k in (*FIXED, "auto")}
            best = min(FIXED, key=lambda k: steps[k])
            cell: dict[str, Any] = {
                "model": model, "layout": f"{run['nodes']}x{run['ranks_per_node']}", "rate": run["rate"],
                "step_ms": {k: round(v * 1e3, 1) for k, v in steps.items()},
                "compute_ms": round(ex["compute only"]["step_s"] * 1e3, 1),
                "best_fixed": best, "auto_vs_best": round(steps["auto"] / steps[best], 3),
                "auto_vs_dense": round(steps["auto"] / steps["dense"], 3), "auto_plan": m["auto"]["plan"],
                "auto_plan_summary": m["auto"]["plan_summary"],
                "auto_predicted_exposed_ms": round(m["auto"]["predicted_exposed_s"] * 1e3, 1),
                "auto_trials_ms": m["auto"].get("trials", []), "commit": run.get("commits", {}).get(model, ""),
                # the spread: auto's step over the best fixed one's in the same round (interleaved), per round
                "auto_vs_best_rounds": quartiles([a / b for a, b in zip(ex["auto"]["steps_s"], ex[best]["steps_s"])])}
            sources = [r for r in runs if (r["nodes"], r["ranks_per_node"]) == (run["nodes"], run["ranks_per_node"])
                       and r is not run and r["rate"] != "unlimited" and model in r["models"]]
            if run["rate"] != "unlimited" and sources:
                pred = predict_cell(sources[0], model, run, density)
                errors = {k: round(pred[k] / steps[k] - 1, 3) for k in pred}
                cell["planner"] = {"calibrated_on": sources[0]["rate"],
                                   "predicted_ms": {k: round(v * 1e3, 1) for k, v in pred.items()},
                                   "error": errors, "max_abs_error": max(abs(e) for e in errors.values())}
            cells.append(cell)
    return cells


def quartiles(values: Sequence[float]) -> list[float]:
    """[25th, 50th, 75th] percentile of values, rounded to 3 digits."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return [round(v, 3) for v in q]


def hitopk_local_floor_s(run: dict[str, Any], model: str) -> float:
    """A part of hitopk's exchange that no link speed removes: this rank's sparse local work on the model's
    own gradients (residual add, MSTopK, pack, clear, scatter-add, average), measured with every rank doing
    it at once. With several ranks per node the intra-node reduce-scatter and allgather come on top."""
    return sum(b[3] for b in run["models"][model]["sparse_local"])


def _machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores"


# ---------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("scaling", __doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01, help="topk/hitopk density (default 0.01)")
    parser.add_argument("--out", default="runs/scaling", help="directory for calibration.json and scaling.png")
    parser.add_argument("--models", default="", help="comma-separated subset of resnet50,transformer "
                                                     "(default: both; --quick: resnet50)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps per cell (default 8; --quick 4)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the cells already measured in OUT/cells (same steps and density)")
    parser.add_argument("--worker", metavar="OUT_JSON", help=argparse.SUPPRESS)  # one rank, under run.sh
    parser.add_argument("--primitives", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    record_run(args)
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    steps = args.steps or (4 if args.quick else 8)
    if args.worker:
        args.worker_out, args.steps = args.worker, steps
        run_worker(args)
        return {}
    models = [m for m in (args.models or ("resnet50" if args.quick else "resnet50,transformer")).split(",") if m]
    unknown = sorted(set(models) - {"resnet50", "transformer"})
    if unknown:
        parser.error(f"--models: unknown {unknown} (valid: resnet50, transformer)")
    print(f"# scripts/bench/scaling.py: {_machine()}, 1 CPU thread per rank (4 ranks share the cores), "
          f"{'quick' if args.quick else 'full'} size; median of {steps} steps, warm-up excluded")
    reason = skip_reason()
    if reason:
        print(f"bench scaling: skipped: {reason}")
        result = {"bench": "scaling", "baseline": "dense", "skipped": reason, "ratio": None}
        print(json.dumps(result))
        return result
    runs = measure_all(args, models, steps)
    return report(runs, args, steps)


if __name__ == "__main__":
    main()
