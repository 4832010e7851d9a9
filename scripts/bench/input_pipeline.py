"""Input pipeline images/s on an ImageNet-like folder (real-photo JPEGs, 300-500 px): torchvision vs DALI + cache.

Contenders, all training loaders of rank 0 of 1 with the same augmentation (random-resized crop to
128 px, flip, normalize) at batch 64, read in the same process one after the other:
  (a) torchvision ImageFolder + DataLoader, 2 worker processes: the baseline
  (b) DALI (CPU mode here) decoding the files from data.root (L0, the OS page cache warm)
  (c) DALI decoding the encoded bytes from the RAM level (L2, a memory-mapped file in /dev/shm)
  (d) DALI from the pre-decoded low-resolution level (L3: uint8, shorter side 146 px), no JPEG decoding
Epoch 1 is a warm-up (it also fills the caches); epochs 2.. are timed, interleaved, median reported.
ratio (JSON: best_ratio) = best contender images/s / baseline images/s. "CPU ms/image" (all threads and
worker processes) is the cost per image, which load from other jobs on a shared machine leaves alone.

    python -m scripts.bench.input_pipeline [--quick] [--root datasets/imagenet_like]
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from data import CacheConfig, DataConfig, build_image_data
from data.imagenet_like import prepare
from scripts.bench.common import bench_parser, emit_result, parse_args, print_table

IMAGE_SIZE, BATCH = 128, 64


def cpu_seconds() -> float:
    """CPU time of this process's threads and of its finished children (the DataLoader's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_epoch(loader: Any, epoch: int) -> tuple[float, float]:
    """(images/s, CPU ms per image) of one epoch; the CPU cost is the figure that load from other jobs leaves alone."""
    loader.set_epoch(epoch)
    start, cpu, seen = time.perf_counter(), cpu_seconds(), 0
    for images, labels in loader:
        seen += len(labels)
    return seen / (time.perf_counter() - start), 1e3 * (cpu_seconds() - cpu) / seen


def interleaved(datas: dict[str, Any], epochs: int) -> dict[str, tuple[float, float]]:
    """Median (images/s, CPU ms/image) per contender over `epochs` timed epochs, after one warm-up epoch each
    (which also fills the caches). The timed epochs are interleaved (a, b, c, d, a, b, ...) so that load from
    other processes on a shared machine falls on every contender alike."""
    loaders = {name: data.train_loader(IMAGE_SIZE, BATCH) for name, data in datas.items()}
    for loader in loaders.values():
        timed_epoch(loader, 0)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for epoch in range(1, epochs + 1):
        for name, loader in loaders.items():
            runs[name].append(timed_epoch(loader, epoch))
    for data in datas.values():
        data.close()
    return {name: (statistics.median(r for r, _ in rs), statistics.median(c for _, c in rs))
            for name, rs in runs.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("data", __doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None,
                        help="ImageNet-layout folder (default: generate datasets/imagenet_like[_quick])")
    args = parse_args(parser, argv)
    train = 1000 if args.quick else 3000
    root = args.root or prepare(Path(f"datasets/imagenet_like{'_quick' if args.quick else ''}"), train=train, val=64)
    epochs = 1 if args.quick else 3
    workers = args.threads
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as ram, \
            tempfile.TemporaryDirectory() as disk:
        off = CacheConfig(ram=False, dir="")
        contenders = {
            "torchvision": DataConfig(root=str(root), backend="torchvision", workers=workers),
            "dali_files": DataConfig(root=str(root), backend="dali", workers=workers, cache=off),
            "dali_ram": DataConfig(root=str(root), backend="dali", workers=workers,
                                   cache=CacheConfig(ram=True, ram_dir=ram, dir="")),
            "dali_lowres_128": DataConfig(root=str(root), backend="dali", workers=workers,
                                          cache=CacheConfig(ram=False, dir=disk, disk=False, lowres=True,
                                                            lowres_max_image_size=IMAGE_SIZE)),
        }
        results = interleaved({name: build_image_data(cfg, 0, 1, seed=0) for name, cfg in contenders.items()}, epochs)
    base, base_cpu = results.pop("torchvision")
    labels = {"dali_files": "(b) DALI, files (L0)", "dali_ram": "(c) DALI, RAM level (L2)",
              "dali_lowres_128": "(d) DALI, pre-decoded low-res level (L3)"}
    rows = [["(a) torchvision ImageFolder + DataLoader", f"{workers} workers", base, "1.00x", base_cpu]]
    rows += [[labels[name], f"{workers} threads", rate, f"{rate / base:.2f}x", cpu]
             for name, (rate, cpu) in results.items()]
    print(f"{train} JPEGs of 300-500 px from {root}, random-resized crop to {IMAGE_SIZE} px, batch {BATCH}, "
          f"median of {epochs} epoch(s) after a warm-up epoch")
    print_table(["pipeline", "parallelism", "images/s", "vs baseline", "CPU ms/image"], rows)
    ratios = {name: round(rate / base, 3) for name, (rate, _) in results.items()}
    return emit_result("data", "torchvision ImageFolder + DataLoader (2 workers)", max(ratios.values()),
                       image_size=IMAGE_SIZE, images=train, baseline_img_s=round(base, 1),
                       baseline_cpu_ms_per_img=round(base_cpu, 3),
                       results={name: {"img_s": round(rate, 1), "ratio": ratios[name], "cpu_ms_per_img": round(cpu, 3)}
                                for name, (rate, cpu) in results.items()},
                       best_ratio=max(ratios.values()))

if __name__ == "__main__":
    main()
