"""`dist.backend: horovod`: the same communicators and train loop on Horovod's collectives.

Launched by `horovodrun` (`make horovod` installs Horovod 0.28.1, see scripts/install_horovod.sh). The
node groups are Horovod process sets, registered at `hvd.init` in the same order on every rank. Horovod
has no per-call timeout, so `HorovodGroup` polls each handle against `dist.timeout_s` and raises the same
CommTimeoutError as the torch.distributed backend. This module is imported only when the backend is chosen.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch

from trainer.config import ConfigError
from trainer.dist.config import DistConfig
from trainer.dist.topology import CommTimeoutError, Topology, node_layout

try:
    import horovod.torch as hvd
except ImportError:  # reported when the backend is chosen, not at import
    hvd = None

POLL_S = 0.0002
"""Seconds between two polls of a pending Horovod handle."""


class HorovodGroup:
    """`Group` over a Horovod process set."""

    def __init__(self, process_set: Any, global_rank: int, timeout: datetime.timedelta) -> None:
        self.ps, self.global_rank, self.timeout = process_set, global_rank, timeout
        self.size, self.rank = process_set.size(), process_set.rank()
        self.members = list(process_set.ranks) if process_set.ranks else list(range(self.size))

    def _result(self, handle: Any, what: str) -> Any:
        """The output of a pending Horovod handle, polled until `timeout`."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"rank {self.global_rank}: {what} did not complete within {self.timeout.total_seconds():.0f}s "
                    f"(dist.timeout_s); a peer is hung, dead or unreachable")
            time.sleep(POLL_S)
        return hvd.synchronize(handle)

    def wait(self, work: Any, what: str) -> None:
        self._result(work, what)

    def all_reduce_async(self, t: torch.Tensor) -> Any:
        return hvd.allreduce_async_(t, op=hvd.Sum, process_set=self.ps)

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.wait(self.all_reduce_async(t), what)
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return self._result(hvd.allgather_async(t, process_set=self.ps), what)

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return self._result(hvd.reducescatter_async(t, op=hvd.Sum, process_set=self.ps), what)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        # Horovod needs contiguous tensors; channels-last conv weights are not.
        buf = t if t.is_contiguous() else t.contiguous()
        self.wait(hvd.broadcast_async_(buf, root_rank=src, process_set=self.ps), "broadcast")
        if buf is not t:
            t.copy_(buf)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src, process_set=self.ps)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.ps is not hvd.global_process_set:  # Horovod 0.28's allgather_object has no process_set
            raise NotImplementedError("gather_object on a Horovod process set other than the global one")
        gathered = hvd.allgather_object(obj)
        return gathered if self.rank == dst else None

    def twin(self) -> HorovodGroup:
        # one background thread runs every Horovod collective, in turn: a second process set would not let
        # one collective overtake another
        return self


_registered_sets: list = []


def setup_horovod(cfg: DistConfig) -> Topology:
    """Initialise Horovod with the node process sets; the Topology the rest of the trainer uses."""
    if hvd is None:
        raise ConfigError("dist.backend: horovod needs Horovod, which is not installed (run `make horovod`)")
    # the node process sets are fixed at hvd.init, so their layout comes from horovodrun's variables; hvd's own
    # sizes, read after init, must agree
    world = int(os.environ.get("HOROVOD_SIZE", "1"))
    per_node = cfg.ranks_per_node or int(os.environ.get("HOROVOD_LOCAL_SIZE", str(world)))
    nodes, peers = node_layout(world, per_node)
    split = 1 < per_node < world
    if hvd.is_initialized():  # process sets are fixed at init: a second setup must ask for the same layout
        sets = _registered_sets
        if [ps.ranks for ps in sets] != (nodes + peers if split else []):
            raise ConfigError("dist.ranks_per_node: Horovod is already initialised with another node layout")
    else:
        sets = [hvd.ProcessSet(r) for r in nodes + peers] if split else []
        hvd.init(process_sets=sets or None)
        _registered_sets[:] = sets
    if (hvd.size(), cfg.ranks_per_node or hvd.local_size()) != (world, per_node):
        raise ConfigError(f"dist.backend: horovod: {hvd.size()} ranks, {hvd.local_size()} on this machine, but "
                          f"HOROVOD_SIZE / HOROVOD_LOCAL_SIZE say {world} and {per_node}: launch with horovodrun, "
                          "which sets them (the node process sets are made from them before hvd.init)")
    rank = hvd.rank()
    local_rank = rank % per_node if cfg.ranks_per_node else hvd.local_rank()  # the (emulated) node's layout
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # the machine's own local rank picks the GPU, whatever the emulated layout: 2 emulated nodes of 4 on
        # one 8-GPU machine use GPUs 0-7, not 0-3 twice
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    topo = Topology(rank=rank, world_size=hvd.size(), local_rank=local_rank, ranks_per_node=per_node, device=device,
                    backend="horovod")
    if topo.world_size == 1:
        return topo
    timeout = datetime.timedelta(seconds=cfg.timeout_s)

    def node_groups() -> tuple[HorovodGroup, HorovodGroup]:
        intra, inter = (HorovodGroup(ps, rank, timeout) for ps in sets if ps.included())
        return intra, inter

    topo.set_groups(HorovodGroup(hvd.global_process_set, rank, timeout), node_groups)
    return topo


def teardown_horovod() -> None:
    """Shut Horovod down (if it is running)."""
    if hvd is not None and hvd.is_initialized():
        hvd.shutdown()
