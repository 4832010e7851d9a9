"""Fill the node-local cache levels ahead of a run: L1 (copies of the encoded files) and L3 (low-res arrays).

The entries land exactly where the run will look for them (data.cache.dir, the listing key, the L3 resolution of
the run's data config). Without this the first epoch fills the same entries; with it, that epoch already reads from
the node's disk. Each node has its own cache, so each node fills its own.

`node_shard` says what one node's ranks (node-major, as torchrun numbers them) will read over the whole schedule:
the same function of (seed, epoch, rank) as the loaders' (data/sampling.py; a test checks they agree), per phase
with the phase's batch size and level (L3 for phases of at most data.cache.lowres_max_image_size, the encoded copies
above), plus the node's fixed share of the validation set. Each epoch is a new permutation, so over a whole schedule
a node reads most images; the first epoch's shard alone would leave the later epochs' reads cold. Without a shard
every file of each split is filled.

L2 (RAM) is not filled here: it lives only as long as the run's processes (unless data.cache.ram_keep). Bad files
are reported as they are met, exactly as in training (the next good file, which training reads instead, is filled
in their place). A refill skips the entries the L1 manifest and the L3 index already list, reading nothing (the run
checksums each entry on its first read and repairs a torn one); `verify` reads and checksums them here instead.
The command line is scripts/prepare_cache.py (`make cache`, and before each cluster run).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, Sequence

import numpy as np
import torch
from tqdm.contrib.concurrent import thread_map

from data.cache import CacheConfig, DiskLevel, cache_folder, lowres_short_side, open_split_cache, stats_dict
from data.config import DataConfig
from data.layout import list_split
from data.reader import SampleReader
from data.sampling import val_batches

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


class ReadPhase(Protocol):
    """What the cache needs of a phase of the schedule (trainer.schedules.Phase is one)."""

    image_size: int
    batch_size: int
    """Global: all ranks together."""
    val_image_size: int
    """0: image_size."""


def node_shard(cache: CacheConfig, sizes: dict[str, int], epoch_phases: Sequence[ReadPhase], seed: int,
               max_steps_per_epoch: int, nnodes: int, node_rank: int, ranks_per_node: int) -> Shard:
    """What the ranks of node `node_rank` read in a run whose epoch e is in phase `epoch_phases[e]` (seeded by
    `seed`; 0 `max_steps_per_epoch` = whole epochs), for splits of `sizes[split]` files: training over all epochs,
    validation at every phase's validation size. `cache` (the run's data.cache) says which phases read L3."""
    if nnodes < 1 or ranks_per_node < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--nnodes {nnodes}, --node-rank {node_rank}, --ranks-per-node {ranks_per_node}: need "
                         f"nnodes >= 1, ranks per node >= 1 and 0 <= node rank < nnodes")
    world = nnodes * ranks_per_node
    ranks = range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node)
    l3 = cache.lowres and bool(cache.dir)

    def level(image_size: int) -> int:  # 0: encoded, 1: L3 (DaliImageData.fetch_for)
        return int(l3 and image_size <= cache.lowres_max_image_size)

    shard: Shard = {}
    if "train" in sizes:
        masks = np.zeros((2, sizes["train"]), dtype=bool)
        for epoch, phase in enumerate(epoch_phases):
            batch = phase.batch_size // world
            read = epoch_samples(sizes["train"], world, ranks, batch, seed, epoch)
            if max_steps_per_epoch:
                read = read[:, :max_steps_per_epoch * batch]
            masks[level(phase.image_size), read.ravel()] = True
        shard["train"] = (masks[0], masks[1])
    if "val" in sizes:
        masks = np.zeros((2, sizes["val"]), dtype=bool)
        mine = np.concatenate([np.zeros(0, np.int64)] + [b for r in ranks
                                                         for b in val_batches(sizes["val"], world, r, sizes["val"])])
        for phase in epoch_phases:
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

