"""Gradient exchange of ResNet-50-sized buckets on 4 gloo processes as 2 nodes x 2 ranks: dense vs sparse.

Each step is a real backward pass over ResNet-50's 161 parameter tensors (25.6 M gradients; the hooks
launch 25 MB buckets) followed by the communicator's `finish()`. "compute only" runs the same backward
with no exchange; comm ms = step ms - compute ms is what the exchange adds. Bytes are what one rank
sends per step (ring allreduce: 2 (W-1)/W of the buffer), all links and inter-node links only.

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

from kernels.testing import gradient_like
from scripts.bench.common import bench_parser, emit_result, parse_args, print_table
from trainer.comm import CommConfig, build_communicator
from trainer.dist import DistConfig, setup_distributed
from trainer.testing import run_ranks

WORLD, PER_NODE = 4, 2
KINDS = {  # name -> comm config overrides (None = compute only)
    "compute only": None,
    "dense": {"kind": "dense"},
    "dense fp16": {"kind": "dense", "compression": "fp16"},
    "topk": {"kind": "topk"},
    "hitopk": {"kind": "hitopk"},
}


def _rank(rank: int, world: int, steps: int, density: float, arch: str) -> dict[str, dict[str, float]]:
    """One rank (of trainer.testing.run_ranks, 1 thread each): every kind's median step and mean stats."""
    topo = setup_distributed(DistConfig(ranks_per_node=PER_NODE, timeout_s=600))
    out = {}
    for name, overrides in KINDS.items():
        model = getattr(torchvision.models, arch)()
        params = list(model.parameters())
        grads = [gradient_like(p.shape, seed=WORLD * i + rank) for i, p in enumerate(params)]  # per rank
        comm = None
        if overrides is not None:
            comm = build_communicator(CommConfig(**overrides, density=density, bucket_mb=25.0), model, topo)
        times, stats = [], []
        for step in range(steps + 1):  # the first step is warm-up (allocations, kernel build)
            dist.barrier()
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            step_stats = comm.finish() if comm is not None else {}
            elapsed = time.perf_counter() - start
            if step:
                times.append(elapsed)
                stats.append(step_stats)
        slowest = torch.tensor([statistics.median(times)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        mean = {k: statistics.mean(s[k] for s in stats) for k in stats[0]} if stats and stats[0] else {}
        out[name] = {"step_ms": slowest.item() * 1e3, **mean}
        if comm is not None:
            comm.detach()  # its hooks would keep it and this model alive through the next kinds
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("comm", __doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01, help="topk/hitopk density (default 0.01)")
    args = parse_args(parser, argv)
    steps, arch = (2, "resnet18") if args.quick else (4, "resnet50")
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_rank, WORLD, tmp, steps, args.density, arch, timeout=3600)[0]
    compute = out["compute only"]["step_ms"]
    rows = []
    for name, r in out.items():
        rows.append([name, r["step_ms"], r["step_ms"] - compute, r.get("wait_s", 0) * 1e3,
                     r.get("bytes_sent", 0) / 2**20, r.get("bytes_inter_node", 0) / 2**20,
                     r.get("select_s", 0) * 1e3, r.get("density", 1.0)])
    print(f"{arch} gradients, {WORLD} processes = {WORLD // PER_NODE} nodes x {PER_NODE} ranks (gloo, loopback), "
          f"density {args.density}, median of {steps} steps, slowest rank")
    print_table(["exchange", "step ms", "comm ms", "not hidden ms", "MB sent/rank", "inter-node MB/rank",
                 "select ms", "density"], rows)
    dense, hitopk = out["dense"], out["hitopk"]
    return emit_result("comm", "dense", dense["step_ms"] / hitopk["step_ms"], arch=arch, world=WORLD,
                       ranks_per_node=PER_NODE, density=args.density,
                       inter_node_bytes_ratio=round(dense["bytes_inter_node"] / hitopk["bytes_inter_node"], 2),
                       results={k: {m: round(v, 4) for m, v in r.items()} for k, r in out.items()})


if __name__ == "__main__":
    main()
