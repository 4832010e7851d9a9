"""NCHW max pooling on the CPU: ATen's NCHW kernel against kernels/max_pool.py's channels-last path, for the pool
alone and for whole ResNet steps.

Baseline: torchvision's ResNet as it comes (its stem's `nn.MaxPool2d` takes ATen's NCHW kernel). Contender:
the same model after `use_channels_last_max_pool` (the ResNet recipe's `model.max_pool_channels_last`), whose
pool runs on a channels-last copy and hands NCHW back; outputs and gradients are the same bit for bit. Both in
NCHW, at each precision (fp32, and bf16 autocast); batch 32. Three tables: the stem's pool alone (forward +
backward), a training step (forward, cross-entropy, backward) and an evaluation forward, per image size.
Each at 1 thread (each process of the CPU recipes) and at --threads. ratio (JSON) = the baseline's training
steps and evaluation forwards summed over thread counts, models, sizes and precisions / the contender's.

    python -m scripts.bench.max_pool [--quick] [--threads 1]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.max_pool import use_channels_last_max_pool
from scripts.bench.common import bench_parser, emit_result, median_ms, parse_args, print_table, twin_resnets
from trainer.precision import autocast

BATCH = 32
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
CPU = torch.device("cpu")


def pool_row(size: int, precision: str, repeats: int) -> list[Any]:
    """The stem's pool alone: ResNet's 3x3/2 pool of the stem's 64 x size/2 x size/2 map."""
    dtype = PRECISIONS[precision] or torch.float32
    x = torch.randn(BATCH, 64, size // 2, size // 2, dtype=dtype, requires_grad=True)
    stock = nn.MaxPool2d(3, 2, 1)
    switched = nn.MaxPool2d(3, 2, 1)
    use_channels_last_max_pool(switched)

    def fwd_bwd(pool: nn.Module) -> Callable[[], None]:
        def run() -> None:
            pool(x).sum().backward()
            x.grad = None
        return run

    ms = median_ms({"stock": fwd_bwd(stock), "switched": fwd_bwd(switched)}, repeats)
    return [size, precision, f"64x{size // 2}x{size // 2}", ms["stock"], ms["switched"],
            f"{ms['stock'] / ms['switched']:.2f}x"]


def model_rows(arch: str, sizes: Sequence[int], repeats: int) -> tuple[list[list[Any]], list[list[Any]], float, float]:
    """Training-step and evaluation-forward rows per size and precision, and both sides' summed ms."""
    stock, switched = twin_resnets(arch, use_channels_last_max_pool)
    train_rows, eval_rows, total_stock, total_switched = [], [], 0.0, 0.0
    for size in sizes:
        x, y = torch.randn(BATCH, 3, size, size), torch.randint(0, 10, (BATCH,))
        for precision in PRECISIONS:
            def step(model: nn.Module) -> Callable[[], None]:
                def run() -> None:
                    model.train()
                    with autocast(CPU, PRECISIONS[precision]):
                        loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                return run

            def forward(model: nn.Module) -> Callable[[], None]:
                def run() -> None:
                    model.eval()
                    with torch.no_grad(), autocast(CPU, PRECISIONS[precision]):
                        model(x)
                return run

            for rows, make in ((train_rows, step), (eval_rows, forward)):
                ms = median_ms({"stock": make(stock), "switched": make(switched)}, repeats)
                total_stock, total_switched = total_stock + ms["stock"], total_switched + ms["switched"]
                rows.append([arch, size, precision, ms["stock"], ms["switched"],
                             f"{ms['stock'] / ms['switched']:.2f}x"])
    return train_rows, eval_rows, total_stock, total_switched


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(bench_parser("max_pool", __doc__.splitlines()[0]), argv)
    if torch.device(args.device).type != "cpu":
        raise SystemExit("scripts/bench/max_pool.py: the channels-last path is for CPU tensors; run it with "
                         "--device cpu")
    archs = ("resnet18",) if args.quick else ("resnet18", "resnet50")
    sizes = (48,) if args.quick else (32, 48, 64)
    repeats = 3 if args.quick else 9
    pools, train, evals, total_stock, total_switched = [], [], [], 0.0, 0.0
    for threads in sorted({1, args.threads}):  # 1: each process of the CPU recipes
        torch.set_num_threads(threads)
        pools += [[threads, *pool_row(size, p, repeats * 3)] for size in sizes for p in PRECISIONS]
        for arch in archs:
            t, e, s, w = model_rows(arch, sizes, repeats)
            train, evals = train + [[threads, *r] for r in t], evals + [[threads, *r] for r in e]
            total_stock, total_switched = total_stock + s, total_switched + w
    print(f"the stem's max pool alone, forward + backward, batch {BATCH} (ms)")
    print_table(["threads", "px", "precision", "input CxHxW", "NCHW kernel", "channels-last path", "speed-up"], pools)
    header = ["threads", "model", "px", "precision", "stock ResNet", "max_pool_channels_last", "speed-up"]
    print(f"\na training step (forward, cross-entropy, backward), batch {BATCH} (ms)")
    print_table(header, train)
    print(f"\nan evaluation forward, batch {BATCH} (ms)")
    print_table(header, evals)
    return emit_result(
        "max_pool", "torchvision ResNet, its max pool through ATen's NCHW kernel", total_stock / total_switched,
        models=list(archs), sizes=list(sizes), threads=sorted({1, args.threads}), batch=BATCH,
        ms_stock=round(total_stock, 1), ms_switched=round(total_switched, 1),
        pool=[{"threads": n, "px": px, "precision": p, "stock_ms": round(a, 2), "switched_ms": round(b, 2)}
              for n, px, p, _, a, b, _ in pools],
        **{key: [{"threads": n, "model": m, "px": px, "precision": p, "stock_ms": round(a, 1),
                  "switched_ms": round(b, 1)} for n, m, px, p, a, b, _ in rows]
           for key, rows in (("train", train), ("eval", evals))})


if __name__ == "__main__":
    main()
