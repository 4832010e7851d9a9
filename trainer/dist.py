"""Distributed setup: torchrun / Slurm environment, backend choice, node topology and its process groups.

Ranks are laid out node-major (rank = node * ranks_per_node + local_rank), as torchrun and Slurm do. The
hierarchical communicator needs two kinds of groups: the ranks of one node (dense reduce-scatter and
allgather over fast links) and the ranks with the same local rank on every node (sparse exchange over
the slow inter-node network).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from trainer.config import ConfigError, require


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto = NCCL where CUDA exists, gloo otherwise."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer before the run fails with an error naming the operation."""
    ranks_per_node: int = 0
    """Ranks per node; 0 = from the launcher (LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE). Set it to emulate
    several nodes on one machine (2 processes as 2 nodes x 1 rank, say)."""

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, f"dist.timeout_s: must be > 0, got {self.timeout_s}")
        require(self.ranks_per_node >= 0, f"dist.ranks_per_node: must be >= 0, got {self.ranks_per_node}")


@dataclass
class Topology:
    """Where this process sits: global rank, node and rank within the node, with the groups that go with them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ranks_per_node: int = 1
    device: torch.device = torch.device("cpu")
    intra_node: dist.ProcessGroup | None = None
    """Ranks of this node; None when the node has one rank."""
    inter_node: dist.ProcessGroup | None = None
    """Ranks with this local rank on every node; None when there is one node."""

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(*names: str, default: int | None = None) -> int | None:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name].split("(")[0])  # SLURM_TASKS_PER_NODE may read "4(x2)"
    return default


def resolve_backend(backend: str) -> str:
    """`auto` -> nccl where CUDA exists, gloo otherwise; an explicit nccl without CUDA is an error."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend: nccl needs CUDA, and none is available here (use auto or gloo)")
    return backend


def setup_distributed(cfg: DistConfig) -> Topology:
    """Join (or reuse) the process group from torchrun's or Slurm's environment and build the node groups.

    A single process without launcher variables runs without a process group.
    """
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if dist.is_initialized():  # e.g. a test harness that met through a FileStore
        rank, world = dist.get_rank(), dist.get_world_size()
    per_node = cfg.ranks_per_node or _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=world)
    if world % per_node:
        raise ConfigError(f"dist.ranks_per_node: {per_node} does not divide the world size {world}")
    if cfg.ranks_per_node:  # emulated nodes: derive the local rank from the layout
        local_rank = rank % per_node
    backend = resolve_backend(cfg.backend)
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    topo = Topology(rank=rank, world_size=world, local_rank=local_rank, ranks_per_node=per_node, device=device)
    if world == 1:
        return topo
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError("distributed run without MASTER_ADDR/MASTER_PORT: launch with torchrun, or set them "
                              "in the Slurm script (see scripts/slurm/)")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s), device_id=device
                                if device.type == "cuda" else None)
    # Every rank must create every subgroup, in the same order.
    if 1 < per_node < world:
        nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)]
        peers = [list(range(lr, world, per_node)) for lr in range(per_node)]
        topo.intra_node, _ = dist.new_subgroups_by_enumeration(nodes, backend=backend)
        topo.inter_node, _ = dist.new_subgroups_by_enumeration(peers, backend=backend)
    elif per_node == world:
        topo.intra_node = dist.group.WORLD
    else:
        topo.inter_node = dist.group.WORLD
    return topo


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], topo: Topology) -> list[float]:
    """Sum a few Python numbers over all ranks (eval counts, loss sums); a no-op on one process."""
    if not topo.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=topo.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_flag(flag: bool, topo: Topology) -> bool:
    """Rank 0's decision, on every rank (e.g. 'target reached, stop'), so that all ranks leave together."""
    if not topo.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=topo.device)
    dist.broadcast(t, src=0)
    return bool(t.item())
