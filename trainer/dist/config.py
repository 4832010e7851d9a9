"""The `dist` section: the collective backend, how long a peer may stay silent, the node layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config import require

BackendName = Literal["auto", "nccl", "gloo", "horovod"]
"""The values of `dist.backend`."""


@dataclass
class DistConfig:
    backend: BackendName = "auto"
    """Collective backend: auto = NCCL where CUDA exists, gloo otherwise; horovod = Horovod's collectives
    (launch with horovodrun; install with `make horovod`)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer. gloo: the run fails with an error naming the operation and the
    silent peers; NCCL: the process group's watchdog aborts the ranks (waits are stream-ordered, not timed
    on the host, so that exchanges overlap the backward pass)."""
    ranks_per_node: int = 0
    """Ranks per node; 0 = from the launcher (LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE). Set it to emulate
    several nodes on one machine (2 processes as 2 nodes x 1 rank, say)."""
    check_every_steps: int = 500
    """Every this many optimizer steps, compare a checksum of every rank's weights (one small all-gather);
    replicas that differ stop the run naming the first diverged rank; 0 = never."""

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, f"dist.timeout_s: must be > 0, got {self.timeout_s}")
        require(self.check_every_steps >= 0, f"dist.check_every_steps: must be >= 0, got {self.check_every_steps}")
        require(self.ranks_per_node >= 0, f"dist.ranks_per_node: must be >= 0, got {self.ranks_per_node}")
