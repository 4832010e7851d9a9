"""Where a process sits among the ranks, and the collective interface every backend implements.

Ranks are laid out node-major (rank = node * ranks_per_node + local_rank), as torchrun and Slurm do. The
hierarchical communicator needs two kinds of groups: the ranks of one node (dense reduce-scatter and
allgather over fast links) and the ranks with the same local rank on every node (sparse exchange over
the slow inter-node network).

`Group` is what the communicators and the train loop call. `TorchGroup` (torch.distributed) and
`HorovodGroup` implement it for many processes; `LocalGroup` is the world of a single process, whose
collectives are identities, so a `Topology` always has a `world` to call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import torch

from trainer.config import ConfigError


class CommTimeoutError(RuntimeError):
    """A collective did not complete in time: a peer is hung, dead or unreachable."""


@runtime_checkable
class Group(Protocol):
    """Collectives among the `members` of a group (sums; tensors of equal size on every member).

    The synchronous ones wait at most the run's `dist.timeout_s` and then raise CommTimeoutError naming
    this rank and the operation (`what`).
    """

    size: int
    """Number of members."""
    rank: int
    """This process's position in `members`."""
    members: list[int]
    """The members' global ranks, in group order."""

    def all_reduce_async(self, t: torch.Tensor) -> Any:
        """Start summing `t` in place over the members; returns the handle `wait` takes."""
        ...

    def wait(self, work: Any, what: str) -> None:
        """Wait for a handle of `all_reduce_async`."""
        ...

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """`t`, summed in place over the members."""
        ...

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every member's `t`, concatenated in group order along dim 0 (a new tensor)."""
        ...

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """This member's 1/size slice of the sum of every member's 1-d `t` (numel divisible by size)."""
        ...

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        """Member `src`'s `t`, copied into `t` on every member."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Member `src`'s picklable `obj`, on every member."""
        ...

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every member's `obj` on member `dst`, in group order (None elsewhere)."""
        ...

    def twin(self) -> Group:
        """A group of the same members whose collectives do not queue behind this one's (connections, or a
        stream, of its own), where the backend has such a thing; else this group. Collective: every rank of
        the world calls it, in the same order."""
        ...


class LocalGroup:
    """The only process of a run: every collective is the identity (nothing waits, nothing is sent)."""

    size = 1
    rank = 0

    def __init__(self, global_rank: int = 0) -> None:
        self.members = [global_rank]

    def all_reduce_async(self, t: torch.Tensor) -> None:
        return None

    def wait(self, work: Any, what: str) -> None:
        pass

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t.clone()

    def reduce_scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t.clone()

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj] if dst == self.rank else None

    def twin(self) -> LocalGroup:
        return self


def node_layout(world: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each node, and the ranks sharing each local rank (node-major numbering)."""
    if per_node < 1 or world % per_node:
        raise ConfigError(f"dist.ranks_per_node: {per_node} does not divide the world size {world}")
    nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)]
    peers = [list(range(lr, world, per_node)) for lr in range(per_node)]
    return nodes, peers


@dataclass
class Topology:
    """Where this process sits: global rank, node and rank within the node, with the groups that go with them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ranks_per_node: int = 1
    device: torch.device = torch.device("cpu")
    world: Group = field(default_factory=LocalGroup)
    """All ranks; a LocalGroup on a single process."""
    intra_node: Group | None = None
    """Ranks of this node; None when the node has one rank."""
    inter_node: Group | None = None
    """Ranks with this local rank on every node; None when there is one node."""
    backend: Literal["none", "gloo", "nccl", "horovod"] = "none"
    """The backend whose collectives the groups run; none on a single process."""

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

    def this_node(self) -> Topology:
        """This node's ranks as a world of their own, over the intra-node group (a single process when the node
        has one rank): collectives that never cross the links between nodes."""
        if self.intra_node is None:
            return Topology(device=self.device)
        return replace(self, rank=self.local_rank, world_size=self.ranks_per_node, world=self.intra_node,
                       inter_node=None)

    def set_groups(self, world: Group, node_groups: Callable[[], tuple[Group, Group]]) -> None:
        """Set the world group and the node groups. `node_groups()` returns this rank's (intra-node, inter-node)
        subgroups; it is called only when there are several nodes of several ranks. With one node, the world
        is the node; with one rank per node, the world is the inter-node group."""
        self.world = world
        if 1 < self.ranks_per_node < self.world_size:
            self.intra_node, self.inter_node = node_groups()
        elif self.ranks_per_node == self.world_size:
            self.intra_node = world
        else:
            self.inter_node = world
