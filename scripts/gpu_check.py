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
