"""The replica-consistency guard's cost against a quickstart training step, measured interleaved.

The guard (`trainer.dist.ReplicaGuard`, `dist.check_every_steps`) sums the weights' bit patterns and
all-gathers one number per rank every N steps. Columns: one quickstart-sized training step (ResNet-50,
10 classes, batch 32 at 32 px: forward, backward, SGD step) and one weight checksum of the same model.
ratio (JSON) = checksum ms / step ms (one check against one step); `share` = ratio / N, the guard's share of
training time at dist.check_every_steps = N (default 500).

    python -m scripts.bench.replica_guard [--quick] [--every 500]
"""

from __future__ import annotations

from typing import Sequence

import torch
import torchvision
from torch import nn

from scripts.bench.common import bench_parser, emit_result, median_ms, parse_args, print_table
from trainer.dist import weights_checksum


def main(argv: Sequence[str] | None = None) -> dict:
    parser = bench_parser("replica_guard", __doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=500, help="dist.check_every_steps to price (default 500)")
    args = parse_args(parser, argv)
    device = torch.device(args.device)
    model = torchvision.models.resnet50(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = 8 if args.quick else 32
    images, labels = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    def checksum() -> None:
        weights_checksum(model).item()

    times = median_ms({"train step": step, "weight checksum": checksum}, repeats=3 if args.quick else 7,
                      device=device)
    share = times["weight checksum"] / (args.every * times["train step"])
    print_table(["what", "ms (median)"], [[name, ms] for name, ms in times.items()])
    print(f"guard every {args.every} steps: {100 * share:.4f}% of training time")
    return emit_result("replica_guard", f"quickstart training step (ResNet-50, 32 px, batch {batch})",
                       times["weight checksum"] / times["train step"], every_steps=args.every,
                       share=share, step_ms=times["train step"], checksum_ms=times["weight checksum"])


if __name__ == "__main__":
    main()
