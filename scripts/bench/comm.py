"""Gradient exchange during real ResNet training steps on 4 gloo processes as 2 nodes x 2 ranks: dense vs sparse.

Every rank trains one copy of torchvision's ResNet-18 per exchange kind (same initial weights), each with its
communicator hooked into autograd as in training: forward and cross-entropy on a batch of real photos (the
ImageNet-like folder's JPEGs, random-resized crops; each rank its own images), backward (the hooks launch the
buckets as their gradients are ready), the communicator's `finish()`, then an SGD step (not timed). The kinds
are interleaved step by step, in an order that rotates every step, so that load from other processes falls
on every kind alike. "compute only" is the same step with no exchange; comm ms = step ms - compute ms is what
the exchange adds. `auto` (measure, then choose per bucket) runs where trainer/comm offers it; its
calibration falls within the untimed warm-up steps. Bytes are what one rank sends per step (ring
allreduce: 2 (W-1)/W of the buffer), all links and inter-node links only.

On this box every "link" is loopback memory copies, so time favours dense exchanges more than a cloud
network would; the bytes columns are what the slow links would carry (scripts/netem/ emulates them).
ratio (JSON) = dense step ms / hitopk step ms.

    python -m scripts.bench.comm [--quick] [--density 0.01]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from scripts.bench.common import bench_parser, emit_result, parse_args, print_table, real_image_batches
from trainer.comm import CommConfig, build_communicator
from trainer.dist import DistConfig, setup_distributed
from trainer.testing import run_ranks

WORLD, PER_NODE, ARCH = 4, 2, "resnet18"
CONTENDERS: dict[str, dict[str, Any] | None] = {  # name -> comm config overrides (None = compute only)
    "compute only": None,
    "dense": {"kind": "dense"},
    "dense fp16": {"kind": "dense", "compression": "fp16"},
    "topk": {"kind": "topk"},
    "hitopk": {"kind": "hitopk"},
    "auto": {"kind": "auto", "calibration_steps": 3},  # its fewest: decided within the warm-up
}


def _rank(rank: int, world: int, warmup: int, batches: list[list[tuple[torch.Tensor, torch.Tensor]]],
          classes: int, density: float) -> dict[str, dict[str, float]]:
    """One rank (of trainer.testing.run_ranks, 1 thread each): every kind's median step and mean stats."""
    topo = setup_distributed(DistConfig(ranks_per_node=PER_NODE, timeout_s=600))
    runs = {}
    for name, overrides in CONTENDERS.items():
        torch.manual_seed(0)  # every kind starts from the same weights on every rank
        model = getattr(torchvision.models, ARCH)(num_classes=classes)
        comm = None
        if overrides is not None:
            comm = build_communicator(CommConfig(**overrides, density=density, bucket_mb=25.0), model, topo)
        runs[name] = (model, comm, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    stats: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for step, (images, labels) in enumerate(batches[rank]):
        for name in names[step % len(names):] + names[:step % len(names)]:
            model, comm, optimizer = runs[name]
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(images), labels).backward()
            step_stats = comm.finish() if comm is not None else {}
            elapsed = time.perf_counter() - start
            optimizer.step()
            if step >= warmup:
                times[name].append(elapsed)
                stats[name].append(step_stats)
    out = {}
    for name in CONTENDERS:
        slowest = torch.tensor([statistics.median(times[name])])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        numeric = {k for s in stats[name] for k, v in s.items() if isinstance(v, (int, float))}
        mean = {k: statistics.mean(s[k] for s in stats[name] if k in s) for k in sorted(numeric)}
        out[name] = {"step_ms": slowest.item() * 1e3, **mean}
    for _, comm, _ in runs.values():
        if comm is not None:
            comm.detach()
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("comm", __doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01, help="topk/hitopk density (default 0.01)")
    args = parse_args(parser, argv)
    steps, batch, size = (2, 4, 32) if args.quick else (5, 8, 64)
    warmup = CONTENDERS["auto"]["calibration_steps"] + 2 if "auto" in CONTENDERS else 2
    per_rank, classes = real_image_batches(WORLD * (warmup + steps), batch, size, quick=args.quick)
    batches = [per_rank[r::WORLD] for r in range(WORLD)]
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_rank, WORLD, tmp, warmup, batches, classes, args.density, timeout=3600)[0]
    compute = out["compute only"]["step_ms"]
    rows = []
    for name, r in out.items():
        rows.append([name, r["step_ms"], r["step_ms"] - compute, r.get("wait_s", 0) * 1e3,
                     r.get("bytes_sent", 0) / 2**20, r.get("bytes_inter_node", 0) / 2**20,
                     r.get("select_s", 0) * 1e3, r.get("density", 1.0)])
    n_params = sum(p.numel() for p in getattr(torchvision.models, ARCH)(num_classes=classes).parameters())
    print(f"{ARCH} ({n_params:,} gradients) training on real photos at {size} px, batch {batch}/rank, {WORLD} "
          f"processes = {WORLD // PER_NODE} nodes x {PER_NODE} ranks (gloo, loopback), density {args.density}; "
          f"kinds interleaved step by step, median of {steps} steps after {warmup} warm-up, slowest rank")
    print_table(["exchange", "step ms", "comm ms", "not hidden ms", "MB sent/rank", "inter-node MB/rank",
                 "select ms", "density"], rows)
    dense, hitopk = out["dense"], out["hitopk"]
    return emit_result("comm", "dense", dense["step_ms"] / hitopk["step_ms"], arch=ARCH, params=n_params,
                       image_size=size, batch_per_rank=batch, world=WORLD, ranks_per_node=PER_NODE,
                       density=args.density, steps=steps, warmup_steps=warmup,
                       inter_node_bytes_ratio=round(dense["bytes_inter_node"] / hitopk["bytes_inter_node"], 2),
                       results={k: {m: round(v, 4) for m, v in r.items()} for k, r in out.items()})


if __name__ == "__main__":
    main()
