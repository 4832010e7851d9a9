"""Data wait per training step, DALI backend + cache: the sequential external source vs the prefetch thread.

The training loop of the quickstart recipe's shape on one process: DALI (CPU mode here) fed by the cache
levels of configs/quickstart_cpu.yaml (L1 + L2 + L3 in fresh temporary folders), random-resized crops at
the quickstart's 32 px (read from L3), 32 images per step (its per-rank batch), consumed by a real
training step of a small model (the recipe's ResNet-18: forward, backward, SGD). Each step's data wait
is the time the loop spends in `next(loader)`, as the trainer's `time/data_wait_s` measures it.

Contenders (DaliImageData's prefetch_batches):
  (a) sequential: the external source's callback reads the cache, fills its misses, screens and draws the
      crops inside DALI's `run()`, on the training thread: the baseline
  (b) prefetch: a thread prepares the next batches while the training step runs (data/dali_loader.py)
Each run is two epochs on a fresh cache: epoch 0 finds every level empty (cold: each image is read from
data.root, copied to L1 and L2, decoded into L3; the OS page cache holds the dataset files), epoch 1 reads
L3 only (warm). The first step of each epoch (pipeline start, DALI's own prefetch) is excluded. Runs are
interleaved (a, b, b, a, ...); the table gives the median over repeats of the mean wait per step.
ratio = (b) / (a) mean data wait per step on the cold cache (lower is better).

    python -m scripts.bench.data_wait [--quick] [--root datasets/imagenet_like] [--repeats 3]

The training step's torch threads share the cores with the prefetch and DALI threads: on a 2-core machine
--threads 1 keeps them from oversubscribing it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from data.dali_loader import PREFETCH_BATCHES, DaliImageData
from data.imagenet_like import prepare
from data.layout import check_dataset
from recipes.resnet50 import Config, ModelConfig, build_model
from scripts.bench.common import bench_parser, emit_result, machine, parse_args, print_table
from trainer.config import load_config

IMAGE_SIZE, BATCH = 32, 32
MODES = {"sequential": 0, "prefetch": PREFETCH_BATCHES}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()


def run_epochs(root: Path, prefetch: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """One fresh cache, epochs 0 (cold) and 1 (warm): mean data wait and training step (ms) per step."""
    base = load_config(Config, "configs/quickstart_cpu.yaml", [f"data.root={root}"]).data
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as ram, \
            tempfile.TemporaryDirectory() as disk:
        cfg = replace(base, cache=replace(base.cache, dir=disk, ram_dir=ram))
        data = DaliImageData(cfg, rank=0, world_size=1, seed=0, prefetch_batches=prefetch)
        loader = data.train_loader(IMAGE_SIZE, BATCH)
        out = {}
        for epoch, name in ((0, "cold"), (1, "warm")):
            loader.set_epoch(epoch)
            waits, computes = [], []
            asked = time.perf_counter()
            for step, (images, labels) in enumerate(loader):
                got = time.perf_counter()
                train_step(model, optimizer, images, labels)
                done = time.perf_counter()
                if step:  # the first step starts the pipeline and DALI's own prefetch: excluded
                    waits.append(got - asked)
                    computes.append(done - got)
                asked = done
            out[f"{name}_wait_ms"] = 1e3 * statistics.mean(waits)
            out[f"{name}_step_ms"] = 1e3 * statistics.mean(computes)
        data.close()
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("data_wait", __doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None,
                        help="ImageNet-layout folder (default: generate datasets/imagenet_like[_quick])")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender (default 3, --quick 1)")
    args = parse_args(parser, argv)
    train = 1000 if args.quick else 3000
    root = args.root or prepare(Path(f"datasets/imagenet_like{'_quick' if args.quick else ''}"), train=train, val=64)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet18"), check_dataset(root)).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(3):  # warm-up: first-call costs of the model's kernels
        images, labels = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE), torch.zeros(BATCH, dtype=torch.long)
        train_step(model, optimizer, images, labels)
    info = machine()
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            runs[mode].append(run_epochs(root, MODES[mode], model, optimizer))
    med = {mode: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for mode, rs in runs.items()}
    flags = ", ".join(info["cpu_flags"]) or "none of AVX2/AVX-512/AMX"
    print(f"{info['cpu']} ({info['cores']} cores; flags: {flags}); "
          f"{root} ({train} training images): ResNet-18 training steps at {IMAGE_SIZE} px, {BATCH} images/step, "
          f"{args.threads} torch threads, 1 DALI thread; median of {repeats} run(s), first step of each epoch "
          f"excluded")
    rows = []
    for cache in ("cold", "warm"):
        for mode in MODES:
            m = med[mode]
            label = "(a) sequential external source" if mode == "sequential" else \
                f"(b) prefetch thread ({MODES[mode]} batches)"
            rows.append([cache, label, m[f"{cache}_wait_ms"], m[f"{cache}_step_ms"],
                         f"{m[f'{cache}_wait_ms'] / med['sequential'][f'{cache}_wait_ms']:.2f}x"])
    print_table(["cache", "external source", "data wait ms/step", "train step ms", "wait vs (a)"], rows)
    seq, par = med["sequential"], med["prefetch"]
    return emit_result("data_wait", "sequential external source", par["cold_wait_ms"] / seq["cold_wait_ms"],
                       image_size=IMAGE_SIZE, batch=BATCH, images=train, repeats=repeats,
                       cold_wait_ms={mode: round(m["cold_wait_ms"], 2) for mode, m in med.items()},
                       warm_wait_ms={mode: round(m["warm_wait_ms"], 2) for mode, m in med.items()},
                       step_ms=round(statistics.median([seq["cold_step_ms"], par["cold_step_ms"]]), 1),
                       warm_ratio=round(par["warm_wait_ms"] / seq["warm_wait_ms"], 3))


if __name__ == "__main__":
    main()
