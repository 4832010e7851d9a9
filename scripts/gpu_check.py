"""Checks every GPU path of the repository on a CUDA machine, unattended, ending in one table.

    PYTHON=python3 scripts/gpu_check.sh [--only NAME ...] [--device cuda]

Each check is a function registered with @check(name) that returns rows (check, result, detail)
with result PASS or FAIL, and raises Skip(reason) when what it needs is absent (no CUDA, no Triton,
no DALI). An exception in a check becomes a FAIL row and the other checks still run. The exit status
is 1 if any row failed. The whole script must finish in under 8 minutes on one H200; a new GPU path
adds its check here. `--device cpu` runs the checks that allow it on the CPU paths, as a dry run of
this script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from typing import Callable

import torch

from scripts.bench.common import print_table

Row = tuple[str, str, str]
CHECKS: list[tuple[str, Callable[[torch.device], list[Row]]]] = []


class Skip(Exception):
    """Raised by a check whose dependency is absent; the message says which."""


def check(name: str) -> Callable[[Callable[[torch.device], list[Row]]],
                                 Callable[[torch.device], list[Row]]]:
    def register(fn: Callable[[torch.device], list[Row]]) -> Callable[[torch.device], list[Row]]:
        CHECKS.append((name, fn))
        return fn
    return register


def require_cuda(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        raise Skip(f"{name} is not installed")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------- kernels (issue "Kernels")


@check("mstopk")
def check_mstopk(device: torch.device) -> list[Row]:
    """mstopk (Triton on CUDA) vs the torch reference and exact top-k, on fresh random inputs."""
    require_cuda(device)
    if device.type == "cuda":
        require_module("triton")
    from kernels import mstopk, mstopk_reference
    from scripts.bench.topk import RESNET50_PARAMS, gradient_like

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    rows = []
    for n in (10_000, 1_000_000, RESNET50_PARAMS):
        x = gradient_like(n, str(device), seed)
        worst_recall, worst_same, exact_k = 1.0, 1.0, True
        for density in (0.001, 0.01, 0.1):
            k = max(1, int(n * density))
            values, indices = mstopk(x, k)
            exact_k &= indices.numel() == k and indices.unique().numel() == k
            exact_k &= bool(torch.equal(values, x[indices]))
            expected = torch.topk(x.abs(), k).indices
            worst_recall = min(worst_recall, torch.isin(indices, expected).sum().item() / k)
            reference = mstopk_reference(x, k)[1]
            worst_same = min(worst_same, torch.isin(indices, reference).sum().item() / k)
        ok = exact_k and worst_recall >= 0.99 and worst_same >= 0.999
        rows.append(("mstopk", verdict(ok), f"n={n:,} seed={seed} k=0.1/1/10%: exact k {exact_k}, "
                     f"min recall {worst_recall:.4f}, min same-as-reference {worst_same:.4f}"))
    rows.append(_mstopk_guards(device, mstopk, mstopk_reference))
    return rows


def _mstopk_guards(device: torch.device, mstopk: Callable, reference: Callable) -> Row:
    from scripts.bench.topk import gradient_like

    x = gradient_like(100_000, str(device), seed=1)
    cases = {"all zero": (torch.zeros(50_000, device=device), 100),
             "ties at max": (torch.tensor([1.0, -5.0, 0.5, 5.0, 5.0], device=device), 2),
             "fallback": (x, 60_000), "float16": (x.half(), 1_000),
             "bfloat16": (x.bfloat16(), 1_000)}
    failed = [name for name, (t, k) in cases.items()
              if not all(torch.equal(a, b) for a, b in zip(mstopk(t, k), reference(t, k)))]
    try:
        mstopk(torch.tensor([1.0, float("nan")], device=device), 1)
        failed.append("NaN accepted")
    except ValueError as err:
        if "NaN or inf" not in str(err):
            failed.append(f"NaN message: {err}")
    detail = f"{', '.join(cases)}, NaN error: " + ("same as reference" if not failed
                                                    else f"differ: {', '.join(failed)}")
    return ("mstopk guards", verdict(not failed), detail)


@check("FusedLARS")
def check_lars(device: torch.device) -> list[Row]:
    """FusedLARS vs the per-tensor loop over 10 steps, every option combination, float64."""
    require_cuda(device)
    require_module("torchvision")  # scripts.bench.optim, home of the loop, builds ResNet-50
    from kernels import FusedLARS
    from scripts.bench.optim import LoopLARS

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32, 3, 3), (1000, 512), (64,), (64,), (5, 5)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64).to(device) for s in shapes]
    start[4].zero_()
    grads = [[(torch.randn(s, generator=gen, dtype=torch.float64) * 0.01).to(device)
              for s in shapes] for _ in range(10)]
    worst = 0.0
    for nesterov in (False, True):
        for trust_clip in (False, True):
            finals = []
            for cls in (LoopLARS, FusedLARS):
                weights = [torch.nn.Parameter(p.clone()) for p in start]
                opt = cls([{"params": weights[:2] + weights[4:]},
                           {"params": weights[2:4], "lars_exclude": True}], lr=0.5,
                          weight_decay=5e-2, trust_coefficient=0.02, nesterov=nesterov,
                          trust_clip=trust_clip)
                for step, g in enumerate(grads):
                    for group in opt.param_groups:
                        group["lr"] = 0.5 * (step + 1) / 10
                    for w, gw in zip(weights, g):
                        w.grad = gw.clone()
                    opt.step()
                finals.append(weights)
            worst = max(worst, max(((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item()
                                   for a, b in zip(*finals)))
    return [("FusedLARS", verdict(worst <= 1e-6),
             f"vs per-tensor loop, 10 steps, nesterov x trust_clip, exclusion group: "
             f"max relative difference {worst:.1e} (limit 1e-6)")]


@check("bench topk")
def check_bench_topk(device: torch.device) -> list[Row]:
    require_cuda(device)
    if device.type == "cuda":
        require_module("triton")
    from scripts.bench import topk

    result = topk.main(["--device", str(device)])
    return [("bench topk", "PASS", f"n={result['n']:,} k={result['k']:,}: mstopk {result['ms']} ms "
             f"vs torch.topk {result['baseline_ms']} ms ({result['ratio']}x), "
             f"recall {result['recall']:.4f}")]


@check("bench optim")
def check_bench_optim(device: torch.device) -> list[Row]:
    require_cuda(device)
    require_module("torchvision")
    from scripts.bench import optim

    result = optim.main(["--device", str(device)])
    return [("bench optim", "PASS", f"{result['model']}: FusedLARS {result['ms']} ms vs loop "
             f"{result['baseline_ms']} ms ({result['ratio']}x), SGD foreach "
             f"{result['sgd_foreach_ms']} ms")]


# ---------------------------------------------------------------- input pipeline (issue 3)


def _batches_per_s(loader, epochs: int = 2) -> tuple[list, float]:
    """All batches of the last epoch, and its images/s (the first epoch warms up)."""
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        batches = [(images.float().cpu(), labels) for images, labels in loader]
        seconds = time.perf_counter() - start
    return batches, sum(len(labels) for _, labels in batches) / seconds


@check("DALI mixed decode")
def check_dali(device: torch.device) -> list[Row]:
    """DALI `mixed` (nvJPEG) decoding vs DALI's CPU decoding on the same files, and the GPU pipeline's images/s.

    With --device cpu: DALI's CPU pipeline vs the torchvision backend (the same deterministic validation
    transform), as a dry run.
    """
    require_cuda(device)
    if importlib.util.find_spec("nvidia.dali") is None:
        raise Skip("NVIDIA DALI is not installed in this Python (its wheels are too large to travel with the "
                   "code); the data pipeline falls back to torchvision here")
    import tempfile
    from pathlib import Path

    from data import CacheConfig, DataConfig, build_image_data
    from scripts.make_imagenet_like import prepare

    with tempfile.TemporaryDirectory() as tmp:
        root = prepare(Path(tmp) / "images", train=512, val=128)
        cfg = DataConfig(root=str(root), backend="dali", workers=2, dtype="float32",
                         cache=CacheConfig(ram=False, dir=""))
        other_cfg = cfg if device.type == "cuda" else DataConfig(root=str(root), backend="torchvision", workers=2)
        cpu, other = (build_image_data(c, 0, 1, 0, d) for c, d in ((cfg, torch.device("cpu")), (other_cfg, device)))
        name = "DALI mixed (GPU)" if device.type == "cuda" else "torchvision"
        val_cpu, val_other = (torch.cat([im.float().cpu() for im, _ in d.val_loader(224, 64)]) for d in (cpu, other))
        diff = (val_cpu - val_other).abs()
        # 1 grey level = 0.017 here. nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a few
        # levels; PIL and DALI CPU (both libjpeg-turbo, the same resize sizes and crop window) by about one
        limits = (0.02, 1.0) if device.type == "cuda" else (0.01, 0.1)
        ok = diff.mean().item() < limits[0] and diff.max().item() < limits[1]
        rows = [("DALI mixed decode", verdict(ok),
                 f"{name} vs DALI CPU, 128 JPEGs (300-500 px) resized+center-cropped to 224: mean |diff| "
                 f"{diff.mean().item():.4f}, max {diff.max().item():.3f} (normalized units; limits {limits})")]
        rates = {}
        for label, data in (("DALI CPU", cpu), (name, other)):
            batches, rates[label] = _batches_per_s(data.train_loader(224, 128))
            ok = all(im.shape == (128, 3, 224, 224) and torch.isfinite(im).all() for im, _ in batches)
            rows.append((f"data {label}", verdict(ok), f"train 224 px, batch 128, 512 JPEGs: {rates[label]:.0f} "
                         f"images/s (epoch 2)"))
            data.close()
    return rows


# ---------------------------------------------------------------- communicators (issue 5)


def _comm_rank(rank: int, world: int, store: str, device_type: str, results) -> None:
    """One rank of the communicator check: NCCL on its own GPU (gloo on the CPU for --device cpu)."""
    import datetime
    import statistics

    import torch.distributed as dist
    import torchvision

    from trainer.comm.dense import DenseAllreduce
    from trainer.comm.sparse import SparseAllgather
    from trainer.dist import Group, Topology

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.FileStore(store, world),
                            rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    topo = Topology(rank=rank, world_size=world, local_rank=rank, ranks_per_node=world, device=device)
    topo.world = Group(None, rank, datetime.timedelta(seconds=120))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def build(kind: str, model: torch.nn.Module, density: float):
        if kind == "dense":
            return DenseAllreduce(model, topo, 25.0)
        # topk: every rank a node (sparse between all); hitopk here: one node, dense inside it
        intra, inter = (None, topo.world) if kind == "topk" else (topo.world, None)
        return SparseAllgather(model, topo, 25.0, density, 16384, 0, intra, inter)

    def step(model, comm, grads) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()
        comm.finish()
        return [p.grad.clone() for p in model.parameters()]

    out = {}
    gen = torch.Generator(device=device).manual_seed(rank)
    model = torchvision.models.resnet50().to(device)
    params = list(model.parameters())
    integer = [torch.randint(-8, 9, p.shape, generator=gen, device=device).float() for p in params]
    real = [torch.randn(p.shape, generator=gen, device=device) for p in params]
    dense_grads = None
    for kind in ("dense", "topk", "hitopk"):
        m = torchvision.models.resnet50().to(device)
        got = step(m, build(kind, m, 1.0), integer)
        dense_grads = dense_grads or got
        exact = all(torch.equal(a, b) for a, b in zip(got, dense_grads))
        m = torchvision.models.resnet50().to(device)
        comm = build(kind, m, 0.01)
        averaged = torch.cat([g.reshape(-1) for g in step(m, comm, real)])
        conserved = None  # checked where residuals exist
        if kind == "topk":  # W * averaged + sum of residuals == sum of gradients (bucket order = reversed params)
            residual = torch.cat([comm.residuals[b.index] if b.index in comm.residuals else
                                  torch.zeros(b.numel, device=device) for b in comm.buckets])
            incoming = torch.cat([g.reshape(-1) for b in comm.buckets for g in
                                  (real[[id(q) for q in m.parameters()].index(id(p))] for p in b.params)])
            sent = torch.cat([p.grad.reshape(-1) for b in comm.buckets for p in b.params]) * world
            dist.all_reduce(residual)
            dist.all_reduce(incoming)
            conserved = torch.allclose(sent + residual, incoming, rtol=1e-4, atol=1e-3)
        times = []
        for _ in range(6):
            sync()
            start = time.perf_counter()
            step(m, comm, real)
            sync()
            times.append(time.perf_counter() - start)
        out[kind] = {"exact": exact, "conserved": conserved, "ms": statistics.median(times[1:]) * 1e3,
                     "finite": bool(torch.isfinite(averaged).all())}
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


@check("communicators")
def check_communicators(device: torch.device) -> list[Row]:
    """dense / topk / hitopk over NCCL on every GPU present (one rank per GPU; 2 gloo ranks with --device cpu):
    density 1.0 equals dense exactly, density 0.01 conserves gradient mass, time per ResNet-50 step."""
    require_cuda(device)
    import os
    import tempfile

    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if device.type == "cuda" else 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_comm_rank, args=(r, world, os.path.join(tmp, "store"), device.type, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
            if p.is_alive():
                p.kill()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    out = results.get()
    backend = f"NCCL, {world} GPU(s)" if device.type == "cuda" else f"gloo, {world} CPU ranks"
    return [(f"comm {kind}", verdict(r["exact"] and r["conserved"] is not False and r["finite"]),
             f"{backend}: density 1.0 == dense {r['exact']}; density 0.01 mass conserved "
             f"{'n/a' if r['conserved'] is None else r['conserved']}; "
             f"ResNet-50 step {r['ms']:.1f} ms") for kind, r in out.items()]


# ---------------------------------------------------------------- runner


def run(names: list[str] | None, device: torch.device) -> list[Row]:
    rows: list[Row] = []
    for name, fn in CHECKS:
        if names and name not in names:
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            rows += fn(device)
        except Skip as reason:
            rows.append((name, "SKIP", str(reason)))
        except Exception as err:  # a broken check must not stop the others
            traceback.print_exc()
            rows.append((name, "FAIL", f"{type(err).__name__}: {err}"))
        print(f"   {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name for name, _ in CHECKS]
    parser.add_argument("--only", nargs="+", choices=names, help="run only these checks")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run of the checks that allow it, on the CPU paths")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.only, torch.device(args.device))
    print(f"\nGPU check: {time.perf_counter() - start:.0f} s, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
    print_table(["check", "result", "detail"], rows)
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
