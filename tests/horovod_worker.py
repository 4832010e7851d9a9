"""Run under `horovodrun --gloo -np 4` by tests/test_horovod.py: every communicator on Horovod's collectives.

Four ranks as 2 nodes x 2 ranks (Horovod process sets for the node groups), checked against the same
single-process reference as the torch.distributed tests.
"""

import os

import torch

from tests.test_comm import _matches_reference
from trainer.dist import teardown_distributed


def main() -> None:
    import horovod.torch as hvd
    torch.set_num_threads(1)
    rank = int(os.environ["HOROVOD_RANK"])
    world = int(os.environ["HOROVOD_SIZE"])
    for kind in ("dense", "topk", "hitopk"):
        _matches_reference(rank, world, kind, 2, 1.0, 0, True, 2, backend="horovod")
        if kind != "dense":
            _matches_reference(rank, world, kind, 2, 0.05, 0, False, 3, backend="horovod")
        print(f"rank {rank}: {kind} OK on horovod {hvd.__version__ if hasattr(hvd, '__version__') else ''}",
              flush=True)
    teardown_distributed()


if __name__ == "__main__":
    main()
