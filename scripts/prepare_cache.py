"""Fill the node-local cache levels ahead of a run: L1 (copies of the encoded files) and L3 (low-res arrays).

    python scripts/prepare_cache.py --config configs/resnet50_dawnbench.yaml [--threads 8] [section.key=value ...]
    python scripts/prepare_cache.py --config ... --nnodes 16 --node-rank 3 --ranks-per-node 8 data.root=...

Reads the run's own config, so the cache lands exactly where the run will look for it. Run it on every node (each
node has its own cache). With --nnodes/--node-rank/--ranks-per-node it fills only this node's shard: the samples
the node's ranks will read over the whole schedule, plus the node's share of the validation set; without them
every file of each split is filled. A rerun reads nothing that is already cached; --verify reads and checksums
it. data/prefill.py says how.
"""

from __future__ import annotations

import argparse
import logging

from tqdm.contrib.logging import logging_redirect_tqdm

from data.layout import DatasetNotFoundError, list_split
from data.prefill import node_shard, prepare
from recipes.resnet50 import Config
from trainer.config import ConfigError, load_config
from trainer.schedules import get_phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config (its data section is used)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"])
    parser.add_argument("--threads", type=int, default=4, help="files copied / decoded at once")
    parser.add_argument("--nnodes", type=int, help="nodes of the run: fill only this node's shard")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (with --nnodes)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="processes per node (with --nnodes)")
    parser.add_argument("--verify", action="store_true", help="read and checksum the entries already there")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. data.root=/data/imagenet")
    args = parser.parse_args()
    logging.basicConfig(format="%(message)s")
    try:
        run = load_config(Config, args.config, args.overrides)
        shard = None
        if args.nnodes is not None:
            sizes = {name: len(list_split(run.data.root, name)) for name in args.splits}
            epoch_phases = [get_phase(run.schedule.phases, epoch) for epoch in range(run.train.epochs)]
            shard = node_shard(run.data.cache, sizes, epoch_phases, run.train.seed, run.train.max_steps_per_epoch,
                               args.nnodes, args.node_rank, args.ranks_per_node)
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


if __name__ == "__main__":
    main()
