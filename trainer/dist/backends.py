"""`dist.backend` -> the function that joins the ranks and returns their Topology, and the way out.

The torch.distributed backend is always available; Horovod is an optional dependency, so its module is
imported only when `dist.backend: horovod` is chosen.
"""

from __future__ import annotations

from typing import Callable

from trainer.config import ConfigError
from trainer.dist.config import BackendName, DistConfig
from trainer.dist.topology import Topology
from trainer.dist.torch_backend import setup_torch, teardown_torch

_teardowns: list[Callable[[], None]] = [teardown_torch]
"""What `teardown_distributed` runs: torch.distributed's always (a harness may have joined a process group
without `setup_distributed`), and every other backend this process set up."""


def _setup_horovod(cfg: DistConfig) -> Topology:
    from trainer.dist.horovod_backend import setup_horovod, teardown_horovod  # only when chosen
    if teardown_horovod not in _teardowns:
        _teardowns.append(teardown_horovod)
    return setup_horovod(cfg)


BACKENDS: dict[BackendName, Callable[[DistConfig], Topology]] = {
    "auto": setup_torch,
    "gloo": setup_torch,
    "nccl": setup_torch,
    "horovod": _setup_horovod,
}


def setup_distributed(cfg: DistConfig) -> Topology:
    """Join the ranks with the backend `cfg.backend` names; the Topology the rest of the trainer uses."""
    setup = BACKENDS.get(cfg.backend)
    if setup is None:
        raise ConfigError(f"dist.backend: unknown backend {cfg.backend!r} (valid: {', '.join(BACKENDS)})")
    return setup(cfg)


def teardown_distributed() -> None:
    """Leave every backend this process joined (safe to call when it joined none, and more than once)."""
    for teardown in _teardowns:
        teardown()
