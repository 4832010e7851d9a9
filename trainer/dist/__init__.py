"""Distributed setup and collectives: `setup_distributed(cfg)` joins the ranks and returns their `Topology`.

- `config`: the `dist` section (`DistConfig`);
- `topology`: `Topology`, the `Group` protocol the communicators and the loop call, and `LocalGroup`, the
  world of a single process (collectives are identities, so callers need no single-process branch);
- `torch_backend`: gloo/NCCL (`TorchGroup`, the `Liveness` heartbeat that names a silent peer);
- `horovod_backend`: Horovod (`HorovodGroup`), imported only when `dist.backend: horovod`;
- `backends`: `dist.backend` -> setup function; `setup_distributed`, `teardown_distributed`;
- `sync`: sums of a few numbers, rank 0's flags and weights everywhere, the replica guard.
"""

from trainer.dist.backends import setup_distributed, teardown_distributed
from trainer.dist.config import DistConfig
from trainer.dist.sync import (ReplicaDivergenceError, ReplicaGuard, all_reduce_sum, broadcast_flag,
                               broadcast_module, weights_checksum)
from trainer.dist.topology import CommTimeoutError, Group, LocalGroup, Topology, node_layout
from trainer.dist.torch_backend import HEARTBEAT_S, Liveness, TorchGroup, elastic_attempt_store, resolve_backend

__all__ = ["HEARTBEAT_S", "CommTimeoutError", "DistConfig", "Group", "Liveness", "LocalGroup", "ReplicaDivergenceError",
           "ReplicaGuard", "Topology", "TorchGroup", "all_reduce_sum", "broadcast_flag", "broadcast_module",
           "elastic_attempt_store", "node_layout", "resolve_backend", "setup_distributed", "teardown_distributed",
           "weights_checksum"]
