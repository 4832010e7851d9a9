"""MSTopK vs torch.topk on a ResNet-50-sized gradient (25,557,032 values), k = 0.1% and 1%.

Columns: torch.topk(|x|, k) (the baseline), mstopk_reference (the literal algorithm, one pass per
bisection step) and kernels.mstopk (the compiled CPU path, or Triton on CUDA). recall is the share
of the exact top-k that mstopk returns; "same as ref" the share of indices equal to the reference's.
ratio (JSON) = baseline ms / mstopk ms at k = 0.1%.

    python -m scripts.bench.topk [--quick] [--device cuda]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kernels import mstopk, mstopk_reference
from kernels.testing import gradient_like
from scripts.bench.common import bench_parser, emit_result, median_ms, parse_args, print_table

RESNET50_PARAMS = 25_557_032
DENSITIES = (0.001, 0.01)


def share(indices: torch.Tensor, of: torch.Tensor) -> float:
    return torch.isin(indices, of).sum().item() / of.numel()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(bench_parser("topk", __doc__.splitlines()[0]), argv)
    n = 1_000_000 if args.quick else RESNET50_PARAMS
    repeats = 3 if args.quick else 5
    x = gradient_like(n, device=args.device)
    rows, per_density = [], {}
    for density in DENSITIES:
        k = int(n * density)
        topk_ms, ref_ms, fast_ms = median_ms({
            "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
            "reference": lambda: mstopk_reference(x, k),
            "mstopk": lambda: mstopk(x, k)}, repeats, args.device).values()
        indices = mstopk(x, k)[1]
        recall = share(indices, torch.topk(x.abs(), k).indices)
        same = share(indices, mstopk_reference(x, k)[1])
        rows.append([f"{density:.1%}", k, topk_ms, ref_ms, fast_ms, topk_ms / fast_ms,
                     f"{recall:.5f}", f"{same:.5f}"])
        per_density[str(density)] = {"k": k, "baseline_ms": round(topk_ms, 2),
                                     "reference_ms": round(ref_ms, 2), "ms": round(fast_ms, 2),
                                     "ratio": round(topk_ms / fast_ms, 3), "recall": recall,
                                     "same_as_reference": same}
    print(f"n = {n:,} fp32 values on {args.device}")
    print_table(["density", "k", "torch.topk ms", "reference ms", "mstopk ms", "speedup",
                 "recall", "same as ref"], rows)
    head = per_density[str(DENSITIES[0])]
    return emit_result("topk", "torch.topk", head["ratio"], device=args.device, n=n,
                       k=head["k"], baseline_ms=head["baseline_ms"], ms=head["ms"],
                       recall=head["recall"], densities=per_density)


if __name__ == "__main__":
    main()
