"""The replica-consistency guard's cost against a quickstart training step, measured interleaved.

The guard (`trainer.dist.ReplicaGuard`, `dist.check_every_steps`) sums the weights' bit patterns and
all-gathers one number per rank every N steps and at every epoch end (before evaluation and checkpoints).
Columns: one quickstart-sized training step (ResNet-50, 10 classes, batch 32 at 32 px: forward, backward, SGD
step) and one weight checksum of the same model. ratio (JSON) = checksum ms / step ms (one check against one
step); `share` = the guard's share of a run's training time: E epochs of S steps, checked every N steps and at
each epoch end, (E*S // N + E) checks over E*S steps (default: the quickstart, 12 epochs of 22 steps, N = 500).
The all-gather of one number per rank is not timed (one process here).

    python -m scripts.bench.replica_guard [--quick] [--every 500] [--epochs 12] [--steps-per-epoch 22]
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
    parser.add_argument("--epochs", type=int, default=12, help="epochs of the run priced (default: the quickstart's)")
    parser.add_argument("--steps-per-epoch", type=int, default=22,
                        help="steps per epoch of the run priced (default: the quickstart's, 1,437 images / 64)")
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
    steps = args.epochs * args.steps_per_epoch
    checks = steps // args.every + args.epochs
    share = checks * times["weight checksum"] / (steps * times["train step"])
    print_table(["what", "ms (median)"], [[name, ms] for name, ms in times.items()])
    print(f"guard every {args.every} steps and at each of {args.epochs} epoch ends ({checks} checks in {steps} "
          f"steps): {100 * share:.4f}% of training time")
    return emit_result("replica_guard", f"quickstart training step (ResNet-50, 32 px, batch {batch})",
                       times["weight checksum"] / times["train step"], every_steps=args.every, epochs=args.epochs,
                       steps_per_epoch=args.steps_per_epoch, checks=checks, share=share,
                       step_ms=times["train step"], checksum_ms=times["weight checksum"])


if __name__ == "__main__":
    main()
