"""Distributed setup: torchrun / Slurm environment, backend choice, node topology and its process groups.

Ranks are laid out node-major (rank = node * ranks_per_node + local_rank), as torchrun and Slurm do. The
hierarchical communicator needs two kinds of groups: the ranks of one node (dense reduce-scatter and
allgather over fast links) and the ranks with the same local rank on every node (sparse exchange over
the slow inter-node network).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ConfigError, require


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo", "horovod"] = "auto"
    """Collective backend: auto = NCCL where CUDA exists, gloo otherwise; horovod = Horovod's collectives
    (launch with horovodrun; install with `make horovod`)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for a peer before the run fails with an error naming the operation."""
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


class CommTimeoutError(RuntimeError):
    """A collective did not complete in time: a peer is hung, dead or unreachable."""


class ReplicaDivergenceError(RuntimeError):
    """The ranks' copies of the weights are no longer bitwise equal."""


HEARTBEAT_S = 0.5
"""Seconds between a rank's heartbeats; a peer whose counter stands still for 3 beats is named as silent."""


class Liveness:
    """Heartbeats in the rendezvous store, to say *which* peer stopped answering when a collective fails.

    gloo's timeout error names no peer ("Operation timed out!"). Every rank bumps a counter in the store from
    a daemon thread; after a failed collective, the peers whose counters stood still are stopped (SIGSTOP),
    dead, or stuck holding the GIL. With torchrun the store lives in the launcher, so it outlives any rank.
    """

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = dist.PrefixStore("liveness", store), rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone (shutdown): nobody is left to read our beats
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    def silent(self, ranks: list[int], window_s: float = 3 * HEARTBEAT_S) -> list[int]:
        """The ranks among `ranks` whose heartbeat did not advance within `window_s` (blocks that long)."""
        before = [self.store.add(f"beat/{r}", 0) for r in ranks]
        time.sleep(window_s)
        return [r for r, b in zip(ranks, before) if self.store.add(f"beat/{r}", 0) == b]

    def close(self) -> None:
        """Stop the heartbeat and wait for it to leave the store.

        A daemon thread still inside a store call when the interpreter exits is killed with pthread_exit on
        its way back to the GIL, and the forced unwind through C++ aborts the process ("terminate called
        without an active exception", exit -6, seen on CI) after a run that had succeeded.
        """
        self._stop.set()
        self._thread.join(timeout=10 * HEARTBEAT_S)


_liveness: Liveness | None = None


class Group:
    """Collectives over a torch.distributed process group (sums; tensors of equal size on every rank).

    The synchronous ones wait at most `timeout` and then raise CommTimeoutError naming this rank, the
    operation and (from the heartbeats) the peers that stopped answering. The communicators and the train
    loop use only this interface, so Horovod can stand in (`HorovodGroup`).
    """

    liveness: Liveness | None = None

    def __init__(self, pg: Any, global_rank: int, timeout: datetime.timedelta,
                 liveness: Liveness | None = None) -> None:
        self.pg, self.global_rank, self.timeout, self.liveness = pg, global_rank, timeout, liveness
        self.size, self.rank = dist.get_world_size(pg), dist.get_rank(pg)
        self.members = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.size))
        self.host_wait = dist.get_backend(pg) != "nccl"
        """gloo: wait on the host, bounded by the timeout. NCCL: `Work.wait()` only orders the current CUDA
        stream after the collective (no host sync); a timed wait would block the host on every bucket. A hung
        NCCL collective is ended by the process group's own timeout (dist.timeout_s) and its watchdog."""
        self._reduce_scatter_ok = True

    def wait(self, work: Any, what: str) -> None:
        """Wait for an async handle, turning a timeout or a dead peer into a CommTimeoutError."""
        try:
            if self.host_wait:
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as e:
            raise self.failure(what, e) from e

    def failure(self, what: str, cause: Exception) -> CommTimeoutError:
        return CommTimeoutError(
            f"rank {self.global_rank}: {what} did not complete within {self.timeout.total_seconds():.0f}s "
            f"(dist.timeout_s); {self.suspects()}: {cause}")

    def suspects(self) -> str:
        """Which peers of this group stopped answering, from their heartbeats."""
        peers = [r for r in self.members if r != self.global_rank]
        if self.liveness is None:
            return "a peer is hung, dead or unreachable"
        try:
            silent = self.liveness.silent(peers)
        except Exception:  # noqa: BLE001 - the store itself is unreachable: say so rather than mask the error
            return "a peer is hung, dead or unreachable (the rendezvous store did not answer either)"
        if silent:
            return (f"rank {', '.join(map(str, silent))} stopped answering (no heartbeat for "
                    f"{3 * HEARTBEAT_S:g}s: stopped, dead or stuck)")
        return f"ranks {peers} are alive: a peer is stuck elsewhere or in a different collective"

    def all_reduce_async(self, t: torch.Tensor) -> Any:
        return dist.all_reduce(t, group=self.pg, async_op=True)

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        self.wait(self.all_reduce_async(t), what)
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t`, concatenated in rank order along dim 0."""
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        self.wait(_all_gather_single(out, t, group=self.pg, async_op=True), what)
        return out

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's 1/size slice of the sum of every rank's `t` (t.numel() divisible by size)."""
        shard = t.numel() // self.size
        if self._reduce_scatter_ok:
            out = t.new_empty(shard)
            try:
                self.wait(_reduce_scatter_single(out, t, group=self.pg, async_op=True), what)
                return out
            except (RuntimeError, ValueError) as e:
                if isinstance(e, CommTimeoutError) or "not supported" not in str(e).lower():
                    raise
                # Some gloo builds lack reduce-scatter for some dtypes: allreduce and keep our slice (sends
                # 2x the bytes, same result). Every rank takes the same path: support depends on dtype only.
                self._reduce_scatter_ok = False
        self.all_reduce_(t, what)
        return t[self.rank * shard:(self.rank + 1) * shard].clone()

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        self.wait(dist.broadcast(t, src=dist.get_global_rank(self.pg, src) if self.pg is not None else src,
                                 group=self.pg, async_op=True), "broadcast")

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        try:  # no async form: bounded by the group's own timeout (dist.timeout_s, set at creation)
            dist.broadcast_object_list(box, src=src, group=self.pg)
        except RuntimeError as e:
            raise self.failure("broadcast_object", e) from e
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj` on `dst` (None elsewhere)."""
        out = [None] * self.size if self.rank == dst else None
        try:
            dist.gather_object(obj, out, dst=dst, group=self.pg)
        except RuntimeError as e:
            raise self.failure("gather_object", e) from e
        return out


# torch >= 2.14 names; the GPU machine's torch 2.11 has only the older ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class Topology:
    """Where this process sits: global rank, node and rank within the node, with the groups that go with them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ranks_per_node: int = 1
    device: torch.device = torch.device("cpu")
    world: Group | None = None
    """All ranks; None on a single process."""
    intra_node: Group | None = None
    """Ranks of this node; None when the node has one rank."""
    inter_node: Group | None = None
    """Ranks with this local rank on every node; None when there is one node."""
    backend: str = "none"

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


def node_layout(world: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each node, and the ranks sharing each local rank (node-major numbering)."""
    nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)]
    peers = [list(range(lr, world, per_node)) for lr in range(per_node)]
    return nodes, peers


def elastic_attempt_store(world: int, timeout_s: float) -> Any | None:
    """Under torchrun's shared store, a view of it private to this restart; None elsewhere (env:// then).

    torchrun keeps one TCPStore for all restarts of a job and torch does not separate their keys, so a
    restarted job can read the dead attempt's gloo/NCCL addresses and hang in init_process_group
    (measured here with torch 2.14; pytorch/pytorch#135712). The restart count names the attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def setup_distributed(cfg: DistConfig) -> Topology:
    """Join (or reuse) the process group from torchrun's or Slurm's environment and build the node groups.

    A single process without launcher variables runs without a process group. `dist.backend: horovod`
    hands over to `trainer.horovod_backend` (Horovod's own launcher and collectives).
    """
    if cfg.backend == "horovod":
        from trainer.horovod_backend import setup_horovod  # optional dependency, imported only when chosen
        return setup_horovod(cfg)
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if dist.is_initialized():  # e.g. a test harness that met through a FileStore
        rank, world = dist.get_rank(), dist.get_world_size()
    per_node = cfg.ranks_per_node or _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=world)
    if world % per_node:
        raise ConfigError(f"dist.ranks_per_node: {per_node} does not divide the world size {world}")
    gpu_index = local_rank  # the launcher's: which GPU of this machine, whatever the emulated layout
    if cfg.ranks_per_node:  # emulated nodes: derive the local rank from the layout
        local_rank = rank % per_node
    backend = resolve_backend(cfg.backend)
    device = torch.device("cuda", gpu_index % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    topo = Topology(rank=rank, world_size=world, local_rank=local_rank, ranks_per_node=per_node, device=device,
                    backend=backend)
    if world == 1:
        return topo
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError("distributed run without MASTER_ADDR/MASTER_PORT: launch with torchrun, or set them "
                              "in the Slurm script (see scripts/slurm/)")
        dist.init_process_group(backend, store=elastic_attempt_store(world, cfg.timeout_s), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    global _liveness
    if _liveness is None:
        # the default store is private API, but the only handle on the rendezvous store torchrun set up
        _liveness = Liveness(dist.distributed_c10d._get_default_store(), rank)
    topo.world = Group(None, rank, timeout, _liveness)
    # Every rank must create every subgroup, in the same order.
    if 1 < per_node < world:
        nodes, peers = node_layout(world, per_node)
        # The groups' own timeout matters: gloo's reduce-scatter ignores Work.wait's (measured, torch 2.14).
        intra, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout, backend=backend)
        inter, _ = dist.new_subgroups_by_enumeration(peers, timeout=timeout, backend=backend)
        topo.intra_node, topo.inter_node = Group(intra, rank, timeout, _liveness), Group(inter, rank, timeout,
                                                                                         _liveness)
    elif per_node == world:
        topo.intra_node = topo.world
    else:
        topo.inter_node = topo.world
    return topo


def teardown_distributed() -> None:
    global _liveness
    if _liveness is not None:
        _liveness.close()
        _liveness = None
    if dist.is_initialized():
        dist.destroy_process_group()
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        hvd.shutdown()


def all_reduce_sum(values: list[float], topo: Topology) -> list[float]:
    """Sum a few Python numbers over all ranks (eval counts, loss sums); a no-op on one process."""
    if not topo.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=topo.device)
    return topo.world.all_reduce_(t, "all_reduce_sum").tolist()


def broadcast_flag(flag: bool, topo: Topology) -> bool:
    """Rank 0's decision, on every rank (e.g. 'target reached, stop'), so that all ranks leave together."""
    if not topo.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=topo.device)
    topo.world.broadcast_(t, src=0)
    return bool(t.item())


def broadcast_module(module: nn.Module, topo: Topology, buffers_only: bool = False) -> None:
    """Rank 0's weights (or only its buffers, e.g. BatchNorm statistics) on every rank."""
    if not topo.distributed:
        return
    tensors = list(module.buffers()) + ([] if buffers_only else list(module.parameters()))
    with torch.no_grad():
        for t in tensors:
            topo.world.broadcast_(t.data, src=0)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_checksum(module: nn.Module) -> torch.Tensor:
    """A 0-d int64 tensor on the weights' device: the parameters' bit patterns summed as integers, each tensor
    weighted by its position. Equal weights give equal sums; one changed bit changes the sum. No host sync."""
    total = None
    for position, p in enumerate(module.parameters(), start=1):
        bits = p.detach().view(_BITS[p.element_size()]).sum(dtype=torch.int64) * position
        total = bits if total is None else total + bits
    return total if total is not None else torch.zeros((), dtype=torch.int64)


class ReplicaGuard:
    """Every `every` steps, all-gathers each rank's `weights_checksum` and stops the run if they differ.

    Nothing re-synchronises the replicas after the first broadcast, so an update that differs by one bit on
    one rank (a nondeterministic reduction, a bad GPU) would otherwise go on forever; evaluation and
    checkpoints assume every rank holds rank 0's weights.
    """

    def __init__(self, every: int, topo: Topology) -> None:
        self.every, self.topo = every, topo

    def should_check(self, step: int) -> bool:
        return self.topo.distributed and self.every > 0 and step % self.every == 0

    def maybe_check(self, module: nn.Module, step: int) -> None:
        if not self.should_check(step):
            return
        sums = self.topo.world.all_gather(weights_checksum(module).reshape(1).to(self.topo.device),
                                          "all-gather of the weight checksums").tolist()
        diverged = [r for r, value in enumerate(sums) if value != sums[0]]
        if diverged:
            raise ReplicaDivergenceError(
                f"step {step}: the model replicas differ: rank {diverged[0]}'s weights are not bitwise equal to "
                f"rank 0's (diverged ranks: {diverged}); every rank stops (dist.check_every_steps)")
