"""Fill the node-local cache levels ahead of a run: L1 (copies of the encoded files) and L3 (low-res arrays).

    python scripts/prepare_cache.py --config configs/resnet50_dawnbench.yaml [--threads 8] [section.key=value ...]

Reads the run's own config, so the cache lands exactly where the run will look for it (data.cache.dir,
the listing key, the L3 resolution). Without this script the first epoch fills the same entries; with
it, that epoch already reads from the node's disk. Run it on every node (each node has its own cache).
L2 (RAM) is not filled here: it lives only as long as the run's processes (unless data.cache.ram_keep).
Bad files are reported as they are met, exactly as in training. Reruns only check what is there.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from tqdm.contrib.concurrent import thread_map
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.cache import cache_folder, lowres_short_side, open_split_cache, stats_dict  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.layout import DatasetNotFoundError, list_split  # noqa: E402
from data.reader import SampleReader  # noqa: E402


def prepare(cfg: DataConfig, splits: tuple[str, ...] = ("train", "val"), threads: int = 4) -> dict[str, float]:
    """Fill L1 and L3 of `splits` as configured (with a progress bar); returns the cache counters."""
    folder = cache_folder(cfg.cache, cfg.root)
    if folder is None or not (cfg.cache.disk or cfg.cache.lowres):
        raise ValueError("data.cache.dir is empty or both data.cache.disk and data.cache.lowres are off: "
                         "nothing to prepare")
    cache_cfg = replace(cfg.cache, ram=False)
    short_side = lowres_short_side(cfg.cache, cfg.val_resize_ratio)
    classes = None
    caches, skipped = [], 0
    for name in splits:
        split = list_split(cfg.root, name, classes)
        classes = split.classes
        cache = open_split_cache(cache_cfg, split, folder, short_side)
        reader = SampleReader(split, cache, short_side, cfg.cache.lowres_max_aspect)
        def fill(i: int, reader: SampleReader = reader) -> None:
            reader.encoded(i)  # L1, also for files whose L3 entry exists already (the large phases need them)
            if reader.cache.lowres is not None:
                reader.lowres(i)

        levels = "+".join(level.name for level in cache.levels()[1:])
        thread_map(fill, range(len(split)), max_workers=threads, chunksize=16, unit="img",
                   desc=f"{name}: {levels} in {folder}")
        caches.append(cache)
        skipped += reader.skipped
    stats = {**stats_dict(caches), "data/skipped_images": float(skipped)}
    for cache in caches:
        cache.close()
    return stats


def main(argv: list[str] | None = None) -> None:
    from recipes.resnet50 import Config
    from trainer.config import ConfigError, load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config (its data section is used)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"])
    parser.add_argument("--threads", type=int, default=4, help="files copied / decoded at once")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. data.root=/data/imagenet")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    try:
        cfg = load_config(Config, args.config, args.overrides).data
        with logging_redirect_tqdm():  # warnings (bad files, torn copies) print above the bar, not into it
            stats = prepare(cfg, tuple(args.splits), args.threads)
    except (ConfigError, DatasetNotFoundError, ValueError) as err:
        raise SystemExit(f"prepare_cache: {err}") from None
    print(f"L1: {stats['cache/l1_misses']:.0f} files copied now ({stats['cache/l1_repaired']:.0f} of them torn "
          f"copies redone); L3: {stats['cache/l3_misses']:.0f} images decoded now ({stats['cache/l3_repaired']:.0f} "
          f"corrupt entries redone); {stats['data/skipped_images']:.0f} bad files skipped (named above)")

if __name__ == "__main__":
    main()
