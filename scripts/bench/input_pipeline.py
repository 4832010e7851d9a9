"""Input pipeline images/s on an ImageNet-like folder (real-photo JPEGs, 300-500 px): torchvision vs DALI + cache.

Contenders, all training loaders of rank 0 of 1 with the same augmentation (random-resized crop to
128 px, flip, normalize) at batch 64, read in the same process one after the other:
  (a) torchvision: the repository's seeded ImageFolder (torchvision's, with a per-image seed for the
      augmentation) + DataLoader, 2 worker processes started afresh every epoch: the baseline
  (b) DALI (CPU mode here) decoding the files from data.root (L0, the OS page cache warm)
  (c) DALI decoding the encoded bytes from the RAM level (L2, a memory-mapped file in /dev/shm)
  (d) DALI from the pre-decoded low-resolution level (L3: uint8, shorter side 146 px), no JPEG decoding
(a)-(c) decode the original JPEG and crop from it: the same kind of output. (d) crops from a 146 px copy
and resizes to 128 px: a different, less detailed output than decoding the original (the recipes use it for
the low-resolution phases only).
Each contender is measured quiet and loaded: for the loaded figure the bench itself runs --load-procs
processes that spin on the CPU (default: one per core), so the figure is reproducible. Epoch 1 is a warm-up
(it also fills the caches); then rounds of quiet and loaded epochs, interleaved (a, b, c, d under each
condition), median reported. ratio (JSON) = best contender / baseline images/s, quiet; loaded_ratio the same
under load. "CPU ms/image" (all threads and worker processes, quiet epochs) is the cost per image.

    python -m scripts.bench.input_pipeline [--quick] [--root datasets/imagenet_like] [--load-procs 2]
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from data import CacheConfig, DataConfig, build_image_data
from data.imagenet_like import prepare
from scripts.bench.common import bench_parser, cpu_burners, emit_result, parse_args, print_table

IMAGE_SIZE, BATCH = 128, 64
CONDITIONS = ("quiet", "loaded")
LABELS = {"torchvision": "(a) torchvision ImageFolder + DataLoader", "dali_files": "(b) DALI, files (L0)",
          "dali_ram": "(c) DALI, RAM level (L2)", "dali_lowres_128": "(d) DALI, pre-decoded low-res level (L3)"}
OUTPUTS = {"torchvision": "crop of the decoded original", "dali_files": "crop of the decoded original",
           "dali_ram": "crop of the decoded original",
           "dali_lowres_128": "crop of a 146 px copy, not the original's pixels"}


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


def interleaved(datas: dict[str, Any], epochs: int, load_procs: int
                ) -> dict[str, dict[str, tuple[float, float]]]:
    """Median (images/s, CPU ms/image) per condition ("quiet", "loaded") and contender over `epochs` timed
    epochs each, after one warm-up epoch per contender (which also fills the caches). Conditions alternate
    round by round and contenders run in turn within each, so that load from other processes falls on
    every contender alike."""
    loaders = {name: data.train_loader(IMAGE_SIZE, BATCH) for name, data in datas.items()}
    for loader in loaders.values():
        timed_epoch(loader, 0)
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {
        cond: {name: [] for name in loaders} for cond in CONDITIONS}
    epoch = 0
    for _ in range(epochs):
        for cond in CONDITIONS:
            with cpu_burners(load_procs if cond == "loaded" else 0):
                for name, loader in loaders.items():
                    epoch += 1
                    runs[cond][name].append(timed_epoch(loader, epoch))
    for data in datas.values():
        data.close()
    return {cond: {name: (statistics.median(r for r, _ in rs), statistics.median(c for _, c in rs))
                   for name, rs in by_name.items()} for cond, by_name in runs.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("input_pipeline", __doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None,
                        help="ImageNet-layout folder (default: generate datasets/imagenet_like[_quick])")
    parser.add_argument("--load-procs", type=int, default=os.cpu_count() or 2,
                        help="CPU-spinning processes during the loaded epochs (default: one per core)")
    args = parse_args(parser, argv)
    train = 1000 if args.quick else 3000
    root = args.root or prepare(Path(f"datasets/imagenet_like{'_quick' if args.quick else ''}"), train=train, val=64)
    epochs = 1 if args.quick else 2
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
        results = interleaved({name: build_image_data(cfg, 0, 1, seed=0) for name, cfg in contenders.items()},
                              epochs, args.load_procs)
    quiet, loaded = results["quiet"], results["loaded"]
    base, base_loaded = quiet["torchvision"][0], loaded["torchvision"][0]
    rows = []
    for name in contenders:
        parallelism = f"{workers} {'workers' if name == 'torchvision' else 'threads'}"
        rows.append([LABELS[name], OUTPUTS[name], parallelism, quiet[name][0], f"{quiet[name][0] / base:.2f}x",
                     loaded[name][0], f"{loaded[name][0] / base_loaded:.2f}x", quiet[name][1]])
    print(f"{train} JPEGs of 300-500 px from {root}, random-resized crop to {IMAGE_SIZE} px, batch {BATCH}, "
          f"median of {epochs} epoch(s) per condition after a warm-up epoch; loaded = {args.load_procs} "
          f"CPU-spinning processes started by the bench")
    print_table(["pipeline", "output", "parallelism", "quiet images/s", "vs (a)", "loaded images/s", "vs (a)",
                 "CPU ms/image"], rows)
    ratios = {cond: {name: round(results[cond][name][0] / results[cond]["torchvision"][0], 3) for name in contenders
                     if name != "torchvision"} for cond in CONDITIONS}
    best = max(ratios["quiet"], key=ratios["quiet"].get)
    return emit_result("input_pipeline", f"torchvision ImageFolder + DataLoader ({workers} workers)", ratios["quiet"][best],
                       image_size=IMAGE_SIZE, images=train, load_procs=args.load_procs,
                       best=best, loaded_ratio=ratios["loaded"][best],
                       results={name: {"label": LABELS[name], "output": OUTPUTS[name],
                                       "quiet_img_s": round(quiet[name][0], 1),
                                       "loaded_img_s": round(loaded[name][0], 1),
                                       "quiet_ratio": ratios["quiet"].get(name, 1.0),
                                       "loaded_ratio": ratios["loaded"].get(name, 1.0),
                                       "cpu_ms_per_img": round(quiet[name][1], 3)}
                                for name in contenders})


if __name__ == "__main__":
    main()
