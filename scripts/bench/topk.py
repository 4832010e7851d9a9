"""MSTopK vs torch.topk at equal threads, on ResNet-50 gradients from a real training step and on synthetic ones.

Inputs (25,557,032 fp32 values each, ResNet-50's parameter count):
  real       the flattened gradients of torchvision's ResNet-50 after a few SGD steps on real photos (the
             ImageNet-like folder's JPEGs, random-resized crops to 128 px): the gradient of the last step
  synthetic  kernels.testing.gradient_like (a normal times a log-normal: heavy-tailed like gradients)
Contenders, both given the same torch.set_num_threads (1, then 2): torch.topk(|x|, k, sorted=False) (the
baseline; on a 1-D tensor it selects on one thread whatever the setting) and kernels.mstopk (the compiled
CPU path, which splits its scans over torch.get_num_threads() threads; Triton on CUDA). Calls are
interleaved. recall = share of the exact top-k indices that mstopk returns; "same as ref" = share equal to
mstopk_reference's (the literal one-pass-per-bisection algorithm).
JSON: ratio_1thread / ratio_2threads = torch.topk ms / mstopk ms on the real gradients at k = 0.1%;
ratio = ratio_2threads; recall_real_gradients at k = 0.1%.

    python -m scripts.bench.topk [--quick] [--device cuda]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torchvision
from torch import nn

from kernels import mstopk, mstopk_reference
from kernels.testing import gradient_like
from scripts.bench.common import (bench_parser, emit_result, median_ms, parse_args, print_table,
                                  real_image_batches)

DENSITIES = (0.001, 0.01)
THREADS = (1, 2)
SGD_STEPS = 3  # steps before the recorded one: gradients of a model that has started to learn


def share(indices: torch.Tensor, of: torch.Tensor) -> float:
    return torch.isin(indices, of).sum().item() / of.numel()


def real_gradients(arch: str, quick: bool) -> torch.Tensor:
    """The flattened gradients of the last of SGD_STEPS + 1 training steps of `arch` on real photo batches."""
    batch, size = (8, 64) if quick else (16, 128)
    batches, _ = real_image_batches(SGD_STEPS + 1, batch, size, quick=quick)
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for images, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(bench_parser("topk", __doc__.splitlines()[0]), argv)
    repeats = 3 if args.quick else 7
    arch = "resnet18" if args.quick else "resnet50"
    real = real_gradients(arch, args.quick)
    inputs = {"real": real.to(args.device), "synthetic": gradient_like(real.numel(), device=args.device)}
    rows, results = [], {}
    for source, x in inputs.items():
        for density in DENSITIES:
            k = int(x.numel() * density)
            exact = torch.topk(x.abs(), k).indices
            indices = mstopk(x, k)[1]
            entry: dict[str, Any] = {"k": k, "recall": round(share(indices, exact), 6)}
            if density == DENSITIES[0]:
                entry["same_as_reference"] = round(share(indices, mstopk_reference(x, k)[1]), 6)
            for threads in THREADS:
                torch.set_num_threads(threads)
                base_ms, fast_ms = median_ms({
                    "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
                    "mstopk": lambda: mstopk(x, k)}, repeats, args.device).values()
                entry[f"{threads}t"] = {"baseline_ms": round(base_ms, 2), "ms": round(fast_ms, 2),
                                        "ratio": round(base_ms / fast_ms, 3)}
                rows.append([source, f"{density:.1%}", k, threads, base_ms, fast_ms, f"{base_ms / fast_ms:.2f}x",
                             f"{entry['recall']:.5f}", f"{entry.get('same_as_reference', '')}"])
            results[f"{source} {density}"] = entry
    torch.set_num_threads(args.threads)
    print(f"n = {real.numel():,} fp32 values on {args.device} ({arch} gradients); median of {repeats}, interleaved")
    print_table(["gradients", "density", "k", "threads", "torch.topk ms", "mstopk ms", "speed-up", "recall",
                 "same as ref"], rows)
    head = results[f"real {DENSITIES[0]}"]
    return emit_result("topk", "torch.topk(|x|, k) at the same torch.set_num_threads", head["2t"]["ratio"],
                       device=args.device, n=real.numel(), arch=arch, k=head["k"],
                       ratio_1thread=head["1t"]["ratio"], ratio_2threads=head["2t"]["ratio"],
                       recall_real_gradients=head["recall"],
                       ratio_synthetic_1thread=results[f"synthetic {DENSITIES[0]}"]["1t"]["ratio"],
                       ratio_synthetic_2threads=results[f"synthetic {DENSITIES[0]}"]["2t"]["ratio"],
                       recall_synthetic=results[f"synthetic {DENSITIES[0]}"]["recall"], results=results)


if __name__ == "__main__":
    main()
