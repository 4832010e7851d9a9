"""One optimizer step over ResNet-50's 161 parameter tensors: loop LARS vs FusedLARS vs SGD.

Baseline: kernels.lars.LARSReference, FusedLARS's update as a per-tensor Python loop (the way
timm.optim.Lars is written). Reference: torch.optim.SGD(foreach=True) with momentum, the same step
without norms or trust ratios (not a lower bound: FusedLARS can beat it). Conv/linear weights decay and get trust ratios; BN weights and biases
(tensors of rank <= 1) form a lars_exclude group. ratio (JSON) = loop ms / FusedLARS ms. On the
CPU, FusedLARS runs the compiled kernel (kernels/csrc/lars_cpu.cpp) where it builds; the header
line says which path ran.

    python -m scripts.bench.optim [--quick] [--device cuda]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torchvision
from torch import Tensor

from kernels import FusedLARS
from kernels.lars import LARSReference, native_library
from scripts.bench.common import bench_parser, emit_result, median_ms, parse_args, print_table

LR, MOMENTUM, WEIGHT_DECAY, TRUST = 0.1, 0.9, 5e-5, 0.001


def parameter_groups(model: torch.nn.Module, device: str) -> tuple[list[Tensor], list[Tensor]]:
    """(decayed, excluded) parameter copies with random gradients of the real sizes."""
    gen = torch.Generator().manual_seed(0)
    decayed, excluded = [], []
    for p in model.parameters():
        copy = torch.nn.Parameter(p.detach().clone().to(device))
        copy.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device)
        (decayed if p.ndim > 1 else excluded).append(copy)
    return decayed, excluded


def lars_groups(decayed: list[Tensor], excluded: list[Tensor]) -> list[dict[str, Any]]:
    return [{"params": decayed}, {"params": excluded, "lars_exclude": True}]


OPTIMIZERS: dict[str, Callable[[list[Tensor], list[Tensor]], torch.optim.Optimizer]] = {
    "per-tensor loop LARS": lambda d, e: LARSReference(lars_groups(d, e), LR, MOMENTUM,
                                                       WEIGHT_DECAY, TRUST, trust_clip=True),
    "FusedLARS": lambda d, e: FusedLARS(lars_groups(d, e), LR, MOMENTUM, WEIGHT_DECAY, TRUST,
                                        trust_clip=True),
    "SGD foreach (reference)": lambda d, e: torch.optim.SGD(
        [{"params": d, "weight_decay": WEIGHT_DECAY}, {"params": e, "weight_decay": 0.0}],
        lr=LR, momentum=MOMENTUM, foreach=True),
}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(bench_parser("optim", __doc__.splitlines()[0]), argv)
    name = "resnet18" if args.quick else "resnet50"
    model = getattr(torchvision.models, name)()
    repeats = 3 if args.quick else 20
    steps, weights = {}, {}
    for label, build in OPTIMIZERS.items():
        decayed, excluded = parameter_groups(model, args.device)
        steps[label] = build(decayed, excluded).step
        weights[label] = decayed + excluded
    ms = median_ms(steps, repeats, args.device)
    loop, fused, sgd = ms.values()
    # Both LARS runs took the same 1 + repeats steps from the same start: they must agree.
    diff = max(((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()
               for a, b in zip(weights["per-tensor loop LARS"], weights["FusedLARS"]))
    tensors = len(weights["FusedLARS"])
    # The tensors here are float32 and contiguous: on the CPU only a failed build skips the kernel.
    path = ("kernels/csrc/lars_cpu.cpp" if torch.device(args.device).type == "cpu"
            and native_library() is not None else "torch foreach")
    print(f"{name}: {tensors} tensors, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"on {args.device}; FusedLARS path: {path}; FusedLARS vs loop LARS max relative "
          f"difference {diff:.1e}")
    print_table(["optimizer", "ms/step", "vs loop LARS", "vs SGD foreach"],
                [[label, t, loop / t, t / sgd] for label, t in ms.items()])
    return emit_result("optim", "per-tensor loop LARS", loop / fused, device=args.device,
                       model=name, tensors=tensors, path=path, baseline_ms=round(loop, 2),
                       ms=round(fused, 2), sgd_foreach_ms=round(sgd, 2),
                       vs_sgd_foreach=round(fused / sgd, 3), max_rel_diff=diff)


if __name__ == "__main__":
    main()
