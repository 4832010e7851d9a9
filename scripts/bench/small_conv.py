"""Convolutions on tiny maps: oneDNN (F.conv2d) against kernels/small_conv.py's GEMM path, per layer and per step.

Baseline: torchvision's ResNet as it comes, every convolution through F.conv2d (oneDNN on the CPU). Contender:
the same model after `use_gemm_for_small_maps` (the recipes' `model.small_map_gemm`), where convolutions with
at most 4 output positions run as one GEMM. Progressive resizing trains at 24-64 px on the CPU boxes, where
the last stages see 1x1 and 2x2 maps. Two tables: forward + backward of each distinct convolution that takes
the GEMM path (batch 32), and a whole training step (forward, loss, backward) per image size.
ratio (JSON) = the baseline's step time summed over the sizes / the contender's.

    python -m scripts.bench.small_conv [--quick] [--threads 1]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from kernels.small_conv import small_map_conv2d, takes_gemm, use_gemm_for_small_maps
from scripts.bench.common import bench_parser, emit_result, median_ms, parse_args, print_table, twin_resnets

BATCH = 32


def gemm_layers(model: nn.Module, size: int) -> list[tuple[tuple[int, ...], nn.Conv2d]]:
    """(input shape, conv) for each distinct convolution of `model` that takes the GEMM path at `size` px."""
    found: dict[tuple, tuple[tuple[int, ...], nn.Conv2d]] = {}

    def record(conv: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0]
        if takes_gemm(x, conv.weight, conv.stride, conv.padding, conv.dilation, conv.groups):
            key = (tuple(x.shape[1:]), tuple(conv.weight.shape), conv.stride, conv.padding)
            found.setdefault(key, ((BATCH, *x.shape[1:]), conv))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, size, size))  # eval: BatchNorm takes a batch of one
    model.train()
    for h in hooks:
        h.remove()
    return list(found.values())


def fwd_bwd(fn: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        fn().sum().backward()
        for t in leaves:
            t.grad = None
    return run


def layer_rows(arch: str, sizes: Sequence[int], repeats: int) -> list[list[Any]]:
    model = getattr(torchvision.models, arch)(num_classes=10)
    rows = []
    for size in sizes:
        for shape, conv in gemm_layers(model, size):
            x = torch.randn(shape, requires_grad=True)
            w = conv.weight.detach().clone().requires_grad_()
            args = (None, conv.stride, conv.padding, conv.dilation, conv.groups)
            ms = median_ms({"conv2d": fwd_bwd(lambda: F.conv2d(x, w, *args), (x, w)),
                            "gemm": fwd_bwd(lambda: small_map_conv2d(x, w, *args), (x, w))}, repeats)
            out = F.conv2d(x, w, *args)
            rows.append([arch, size, f"{shape[1]}x{shape[2]}x{shape[3]}", f"{w.shape[0]}x{w.shape[2]}x{w.shape[3]}"
                         f"/{conv.stride[0]}", f"{out.shape[2]}x{out.shape[3]}", ms["conv2d"], ms["gemm"],
                         f"{ms['conv2d'] / ms['gemm']:.2f}x"])
    return rows


def step_rows(arch: str, sizes: Sequence[int], repeats: int) -> tuple[list[list[Any]], float, float]:
    stock, fast = twin_resnets(arch, use_gemm_for_small_maps)
    loss_fn = nn.CrossEntropyLoss()
    rows, total_stock, total_fast = [], 0.0, 0.0
    for size in sizes:
        x, y = torch.randn(BATCH, 3, size, size), torch.randint(0, 10, (BATCH,))

        def step(model: nn.Module) -> Callable[[], None]:
            def run() -> None:
                loss_fn(model(x), y).backward()
                model.zero_grad(set_to_none=True)
            return run

        ms = median_ms({"stock": step(stock), "gemm": step(fast)}, repeats)
        total_stock, total_fast = total_stock + ms["stock"], total_fast + ms["gemm"]
        rows.append([arch, size, ms["stock"], ms["gemm"], f"{ms['stock'] / ms['gemm']:.2f}x"])
    return rows, total_stock, total_fast


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(bench_parser("small_conv", __doc__.splitlines()[0]), argv)
    if torch.device(args.device).type != "cpu":
        raise SystemExit("scripts/bench/small_conv.py: the GEMM path is for CPU tensors; run it with --device cpu")
    archs = ("resnet18",) if args.quick else ("resnet18", "resnet50")
    sizes = (32, 64) if args.quick else (24, 32, 48, 64)
    repeats = 3 if args.quick else 7
    layers = [row for arch in archs for row in layer_rows(arch, sizes, repeats)]
    print(f"forward + backward of each convolution that takes the GEMM path, batch {BATCH} (ms)")
    print_table(["model", "px", "input CxHxW", "weight OxKxK/stride", "output", "F.conv2d", "GEMM", "speed-up"],
                layers)
    steps, total_stock, total_fast = [], 0.0, 0.0
    for arch in archs:
        rows, s, f = step_rows(arch, sizes, repeats)
        steps, total_stock, total_fast = steps + rows, total_stock + s, total_fast + f
    print(f"\na training step (forward, cross-entropy, backward), batch {BATCH} (ms)")
    print_table(["model", "px", "stock ResNet", "small_map_gemm", "speed-up"], steps)
    return emit_result("small_conv", "torchvision ResNet, every convolution through F.conv2d (oneDNN)",
                       total_stock / total_fast, models=list(archs), sizes=list(sizes), threads=args.threads,
                       step_ms_stock=round(total_stock, 1), step_ms_gemm=round(total_fast, 1),
                       steps=[{"model": arch, "px": px, "stock_ms": round(a, 1), "gemm_ms": round(b, 1)}
                              for arch, px, a, b, _ in steps],
                       layer_speedups={"min": round(min(r[5] / r[6] for r in layers), 2),
                                       "max": round(max(r[5] / r[6] for r in layers), 2)})


if __name__ == "__main__":
    main()
