"""Fill the node-local cache levels ahead of a run: L1 (copies of the encoded files) and L3 (low-res arrays).

    python scripts/prepare_cache.py --config configs/resnet50_dawnbench.yaml [--threads 8] [section.key=value ...]
    python scripts/prepare_cache.py --config ... --nnodes 16 --node-rank 3 --ranks-per-node 8 data.root=...

Reads the run's own config, so the cache lands exactly where the run will look for it (data.cache.dir,
the listing key, the L3 resolution). Without this script the first epoch fills the same entries; with
it, that epoch already reads from the node's disk. Run it on every node (each node has its own cache).

With --nnodes/--node-rank/--ranks-per-node it fills only this node's shard: the samples the node's ranks
(node-major, as torchrun numbers them) will read over the whole schedule, the same function of (seed,
epoch, rank) as the loaders' (data/sampling.py; a test checks they agree), per phase with the phase's batch size
and level (L3 for phases of at most data.cache.lowres_max_image_size, the encoded copies above), plus the
node's fixed share of the validation set. Each epoch is a new permutation, so over a whole schedule a
node reads most images; the first epoch's shard alone would leave the later epochs' reads cold. Without
these options every file of each split is filled.

L2 (RAM) is not filled here: it lives only as long as the run's processes (unless data.cache.ram_keep).
Bad files are reported as they are met, exactly as in training (the next good file, which training reads
instead, is filled in their place). A rerun skips the entries the L1 manifest and the L3 index already
list, reading nothing (the run checksums each entry on its first read and repairs a torn one); --verify
reads and checksums them here instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.contrib.concurrent import thread_map
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.cache import DiskLevel, cache_folder, lowres_short_side, open_split_cache, stats_dict  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.layout import DatasetNotFoundError, list_split  # noqa: E402
from data.reader import SampleReader  # noqa: E402
from data.sampling import val_batches  # noqa: E402

Shard = dict[str, tuple[np.ndarray, np.ndarray]]
"""Per split: (indices read as encoded bytes, indices read from L3) as boolean masks over the listing."""


def epoch_samples(n: int, world: int, ranks: range, batch: int, seed: int, epoch: int) -> np.ndarray:
    """The samples each of `ranks` reads in `epoch`, a (ranks, steps x batch) array, equal to data/sampling.py's
    `train_batches(n, world, rank, batch, seed, epoch).ravel()` per rank (DistributedSampler with shuffle and
    drop_last: one permutation seeded by seed + epoch, rank r taking every world-th element from r), from one
    permutation for all ranks instead of one per rank."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).numpy()
    per_rank = n // world
    steps = per_rank // batch
    return order[:per_rank * world].reshape(per_rank, world)[:steps * batch, ranks.start:ranks.stop].T


def node_shard(cfg: Any, sizes: dict[str, int], nnodes: int, node_rank: int, ranks_per_node: int) -> Shard:
    """What the ranks of node `node_rank` read in a run of the recipe config `cfg` (its data, schedule.phases
    and train sections), for splits of `sizes[split]` files: training over all epochs, validation at every
    phase's validation size."""
    from trainer.schedules import get_phase

    if nnodes < 1 or ranks_per_node < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nnodes {nnodes}, --node-rank {node_rank}, --ranks-per-node {ranks_per_node}: need "
                         f"nnodes >= 1, ranks per node >= 1 and 0 <= node rank < nnodes")
    world = nnodes * ranks_per_node
    ranks = range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node)
    l3 = cfg.data.cache.lowres and bool(cfg.data.cache.dir)

    def level(image_size: int) -> int:  # 0: encoded, 1: L3 (DaliImageData.fetch_for)
        return int(l3 and image_size <= cfg.data.cache.lowres_max_image_size)

    shard: Shard = {}
    if "train" in sizes:
        masks = np.zeros((2, sizes["train"]), dtype=bool)
        for epoch in range(cfg.train.epochs):
            phase = get_phase(cfg.schedule.phases, epoch)
            batch = phase.batch_size // world
            read = epoch_samples(sizes["train"], world, ranks, batch, cfg.train.seed, epoch)
            if cfg.train.max_steps_per_epoch:
                read = read[:, :cfg.train.max_steps_per_epoch * batch]
            masks[level(phase.image_size), read.ravel()] = True
        shard["train"] = (masks[0], masks[1])
    if "val" in sizes:
        masks = np.zeros((2, sizes["val"]), dtype=bool)
        mine = np.concatenate([np.zeros(0, np.int64)] + [b for r in ranks
                                                         for b in val_batches(sizes["val"], world, r, sizes["val"])])
        for phase in cfg.schedule.phases:
            masks[level(phase.val_image_size or phase.image_size), mine] = True
        shard["val"] = (masks[0], masks[1])
    return shard


def prepare(cfg: DataConfig, splits: tuple[str, ...] = ("train", "val"), threads: int = 4,
            shard: Shard | None = None, verify: bool = False) -> dict[str, float]:
    """Fill L1 and L3 of `splits` as configured (with a progress bar): every file, or the (encoded, L3) index
    masks of `shard[split]`. Entries already listed are skipped unless `verify`. Returns the cache counters
    and `prepare/already_cached` (entries skipped)."""
    folder = cache_folder(cfg.cache, cfg.root)
    if folder is None or not (cfg.cache.disk or cfg.cache.lowres):
        raise ValueError("data.cache.dir is empty or both data.cache.disk and data.cache.lowres are off: "
                         "nothing to prepare")
    cache_cfg = replace(cfg.cache, ram=False)
    short_side = lowres_short_side(cfg.cache, cfg.val_resize_ratio)
    classes = None
    caches, skipped, present = [], 0, 0
    for name in splits:
        split = list_split(cfg.root, name, classes)
        classes = split.classes
        cache = open_split_cache(cache_cfg, split, folder, short_side)
        reader = SampleReader(split, cache, short_side, cfg.cache.lowres_max_aspect)
        disk = next((level for level in cache.upper if isinstance(level, DiskLevel)), None)
        everything = np.ones(len(split), dtype=bool)
        want_encoded, want_lowres = shard[name] if shard is not None else (everything, everything)
        if cache.lowres is None:  # L3 off: the low-res phases decode the encoded files
            want_encoded, want_lowres = want_encoded | want_lowres, np.zeros_like(want_lowres)
        elif disk is None:  # L1 off: only L3 entries can be prepared
            want_encoded = np.zeros_like(want_encoded)
        if not verify:  # the manifest and the index say what is there: nothing is read
            none = np.zeros(len(split), dtype=bool)
            there_encoded = want_encoded & (disk.listed() if disk is not None else none)
            there_lowres = want_lowres & (cache.lowres.listed() if cache.lowres is not None else none)
            present += int(there_encoded.sum()) + int(there_lowres.sum())
            want_encoded, want_lowres = want_encoded & ~there_encoded, want_lowres & ~there_lowres
        todo = np.flatnonzero(want_encoded | want_lowres)

        def fill(i: int, reader: SampleReader = reader, encoded: np.ndarray = want_encoded,
                 lowres: np.ndarray = want_lowres) -> None:
            if encoded[i]:  # L1; a bad file: the next good one, which training reads in its place
                reader.first_good(int(i), "encoded")
            if lowres[i]:
                reader.first_good(int(i), "lowres")

        levels = "+".join(level.name for level in cache.levels()[1:])
        thread_map(fill, todo, max_workers=threads, chunksize=16, unit="img",
                   desc=f"{name}: {levels} in {folder}", total=len(todo))
        caches.append(cache)
        skipped += reader.skipped
    stats = {**stats_dict(caches), "data/skipped_images": float(skipped), "prepare/already_cached": float(present)}
    for cache in caches:
        cache.close()
    return stats


def main(argv: list[str] | None = None) -> dict[str, float]:
    from recipes.resnet50 import Config
    from trainer.config import ConfigError, load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config (its data section is used)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"])
    parser.add_argument("--threads", type=int, default=4, help="files copied / decoded at once")
    parser.add_argument("--nnodes", type=int, help="nodes of the run: fill only this node's shard")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (with --nnodes)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="processes per node (with --nnodes)")
    parser.add_argument("--verify", action="store_true", help="read and checksum the entries already there")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. data.root=/data/imagenet")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    try:
        run = load_config(Config, args.config, args.overrides)
        shard = None
        if args.nnodes is not None:
            sizes = {name: len(list_split(run.data.root, name)) for name in args.splits}
            shard = node_shard(run, sizes, args.nnodes, args.node_rank, args.ranks_per_node)
            wanted = sum(int((enc | low).sum()) for enc, low in shard.values())
            print(f"node {args.node_rank} of {args.nnodes} ({args.ranks_per_node} ranks): {wanted} of "
                  f"{sum(sizes.values())} files are read on this node in this run")
        with logging_redirect_tqdm():  # warnings (bad files, torn copies) print above the bar, not into it
            stats = prepare(run.data, tuple(args.splits), args.threads, shard, args.verify)
    except (ConfigError, DatasetNotFoundError, ValueError) as err:
        raise SystemExit(f"prepare_cache: {err}") from None
    print(f"L1: {stats['cache/l1_misses']:.0f} files copied now ({stats['cache/l1_repaired']:.0f} of them torn "
          f"copies redone); L3: {stats['cache/l3_misses']:.0f} images decoded now ({stats['cache/l3_repaired']:.0f} "
          f"corrupt entries redone); {stats['prepare/already_cached']:.0f} entries already cached; "
          f"{stats['data/skipped_images']:.0f} bad files skipped (named above)")
    return stats


if __name__ == "__main__":
    main()
