"""torch.distributed (gloo, NCCL): joining the process group from torchrun's or Slurm's environment, the
node subgroups, `TorchGroup` collectives with timeouts that name the silent peer, and the heartbeat."""

from __future__ import annotations

import datetime
import os
import threading
import time
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist

from trainer.config import ConfigError
from trainer.dist.config import DistConfig
from trainer.dist.topology import CommTimeoutError, Topology, node_layout

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


# torch >= 2.14 names; the GPU machine's torch 2.11 has only the older ones (an optional API, hence getattr).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class TorchGroup:
    """`Group` over a torch.distributed process group (`pg` None: the default group of all ranks).

    The synchronous collectives wait at most `timeout` and then raise CommTimeoutError naming this rank, the
    operation and (from the heartbeats) the peers that stopped answering.
    """

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
        """The error for a collective `what` that failed with `cause`, naming the silent peers."""
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
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        self.wait(_all_gather_single(out, t, group=self.pg, async_op=True), what)
        return out

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
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
        out = [None] * self.size if self.rank == dst else None
        try:
            dist.gather_object(obj, out, dst=dst, group=self.pg)
        except RuntimeError as e:
            raise self.failure("gather_object", e) from e
        return out

    def twin(self) -> TorchGroup:
        """A new process group of the same members: gloo connections, or an NCCL communicator and stream, of its
        own."""
        pg = dist.new_group(ranks=self.members, timeout=self.timeout, backend=dist.get_backend(self.pg))
        return TorchGroup(pg, self.global_rank, self.timeout, self.liveness)


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name].split("(")[0])  # SLURM_TASKS_PER_NODE may read "4(x2)"
    return default


def resolve_backend(backend: str) -> Literal["nccl", "gloo"]:
    """`auto` -> nccl where CUDA exists, gloo otherwise; an explicit nccl without CUDA is an error."""
    if backend == "gloo":
        return "gloo"
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend != "nccl":
        raise ConfigError(f"dist.backend: {backend} is not a torch.distributed backend (auto, nccl or gloo)")
    if not torch.cuda.is_available():
        raise ConfigError("dist.backend: nccl needs CUDA, and none is available here (use auto or gloo)")
    return "nccl"


def elastic_attempt_store(world: int, timeout_s: float) -> Any | None:
    """Under torchrun's shared store, a view of it private to this restart; None elsewhere (env:// then).

    torchrun keeps one TCPStore for all restarts of a job and torch does not separate their keys, so a
    restarted job can read the dead attempt's gloo/NCCL addresses and hang in init_process_group
    (torch 2.14; upstream: pytorch/pytorch#135712). The restart count names the attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def gpu_index_of(local_rank: int, ranks_on_machine: int) -> int:
    """The GPU of this rank: its local rank, when this machine has a GPU for each of its ranks. NCCL cannot
    run two ranks on one GPU, so fewer GPUs than ranks is an error now rather than a failure at the first
    collective; a blocking NCCL wait (TORCH_NCCL_BLOCKING_WAIT=1) would block the host on every bucket."""
    visible = torch.cuda.device_count()
    if ranks_on_machine > visible:
        raise ConfigError(f"dist.backend: nccl: {ranks_on_machine} ranks on this machine but {visible} GPU(s) visible "
                          "(CUDA_VISIBLE_DEVICES); start one rank per GPU (torchrun --nproc_per_node)")
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        warnings.warn("TORCH_NCCL_BLOCKING_WAIT is set: every collective's wait blocks the host, so gradient "
                      "exchanges no longer overlap the backward pass; unset it (the process group's timeout and "
                      "its watchdog still end a hung collective)", stacklevel=2)
    return local_rank


def setup_torch(cfg: DistConfig) -> Topology:
    """Join (or reuse) the process group from torchrun's or Slurm's environment and build the node groups.

    A single process without launcher variables runs without a process group (its world is a LocalGroup).
    """
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if dist.is_initialized():  # e.g. a test harness that met through a FileStore
        rank, world = dist.get_rank(), dist.get_world_size()
    per_node = cfg.ranks_per_node or _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=world)
    nodes, peers = node_layout(world, per_node)
    gpu_index = local_rank  # the launcher's: which GPU of this machine, whatever the emulated layout
    if cfg.ranks_per_node:  # emulated nodes: derive the local rank from the layout
        local_rank = rank % per_node
    backend = resolve_backend(cfg.backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", gpu_index_of(gpu_index, _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE",
                                                                    default=world)))
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

    def node_groups() -> tuple[TorchGroup, TorchGroup]:
        # Every rank must create every subgroup, in the same order. The groups' own timeout matters: gloo's
        # reduce-scatter ignores Work.wait's (measured, torch 2.14).
        intra, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout, backend=backend)
        inter, _ = dist.new_subgroups_by_enumeration(peers, timeout=timeout, backend=backend)
        return TorchGroup(intra, rank, timeout, _liveness), TorchGroup(inter, rank, timeout, _liveness)

    topo.set_groups(TorchGroup(None, rank, timeout, _liveness), node_groups)
    return topo


def teardown_torch() -> None:
    """Stop the heartbeat and leave the process group (if this process is in one)."""
    global _liveness
    if _liveness is not None:
        _liveness.close()
        _liveness = None
    if dist.is_initialized():
        dist.destroy_process_group()
