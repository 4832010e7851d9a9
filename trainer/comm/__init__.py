"""Gradient communicators, chosen by `comm.kind`; `build_communicator` returns one for a model."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainer.comm.auto import AutoCommunicator
from trainer.comm.base import CommTimeoutError, Communicator, LocalCommunicator
from trainer.comm.config import CommConfig, CommKind
from trainer.comm.dense import DenseAllreduce
from trainer.comm.execute import PlanExecutor
from trainer.comm.local import LocalSGD
from trainer.comm.powersgd import PowerSGDCommunicator
from trainer.comm.sparse import TopKCommunicator, flat_topk, hierarchical_topk
from trainer.dist import Topology

__all__ = ["AutoCommunicator", "CommConfig", "CommKind", "CommTimeoutError", "Communicator", "DenseAllreduce",
           "LocalCommunicator", "LocalSGD", "PlanExecutor", "PowerSGDCommunicator", "TopKCommunicator",
           "build_communicator", "flat_topk", "hierarchical_topk"]


def _dense(cfg: CommConfig, model: nn.Module, topo: Topology) -> DenseAllreduce:
    return DenseAllreduce(model, topo, cfg.bucket_mb, cfg.compression)


BUILDERS: dict[str, Callable[[CommConfig, nn.Module, Topology], Communicator]] = {
    "dense": _dense,
    "topk": flat_topk,
    "hitopk": hierarchical_topk,
    "powersgd": PowerSGDCommunicator,
    "auto": AutoCommunicator,
}
"""`comm.kind` -> the builder of that gradient exchange for a run of several processes (`local`, which also
steps the optimizer's state, is built by `build_communicator` itself)."""


def build_communicator(cfg: CommConfig, model: nn.Module, topo: Topology,
                       optimizer: torch.optim.Optimizer | None = None) -> Communicator:
    """The communicator named by `cfg.kind`, hooked into `model`'s gradients (`local` needs the run's
    `optimizer`: it averages its state); on one process the LocalCommunicator (nothing to exchange, so the
    gradients are not even copied)."""
    if not topo.distributed:
        return LocalCommunicator(topo)
    if cfg.kind == "local":
        if optimizer is None:
            raise ValueError("build_communicator: comm.kind local needs the run's optimizer")
        return LocalSGD(cfg, model, topo, optimizer)
    return BUILDERS[cfg.kind](cfg, model, topo)
