"""Input pipelines for ImageNet-layout image folders, chosen by `data.backend`, behind the cache of data/cache.py
(and `synthetic`: generated batches, no folder).

Every backend gives the trainer the same interface: `num_classes`, `train_size`, `val_size`, `train_loader(image_size,
per_rank_batch, min_scale)` and `val_loader(image_size, per_rank_batch)` (iterables of (images, labels)
with `set_epoch` and `len`), `stats()` (counters for the epoch log) and `close()`.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from data.cache import CacheConfig
from data.config import DataConfig, DataConfigError, batch_dtype
from data.layout import DatasetNotFoundError, check_dataset

if TYPE_CHECKING:  # the backends import DALI or torchvision: only when used
    from data.dali_loader import DaliImageData
    from data.synthetic import SyntheticImageData
    from data.torchvision_loader import TorchvisionImageData

__all__ = ["CacheConfig", "DataConfig", "DataConfigError", "DatasetNotFoundError", "batch_dtype", "build_image_data",
           "check_dataset", "dali_available", "resolve_backend"]

log = logging.getLogger(__name__)

DALI_HINT = "pip install nvidia-dali-cuda130==2.4.0 (requirements.txt), or set data.backend=torchvision"


def dali_available() -> bool:
    try:  # find_spec of a dotted name imports its parent: no `nvidia` package at all raises
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:
        return False


def resolve_backend(backend: str) -> str:
    """`auto` → dali where it is installed, else torchvision; `dali` without DALI is a one-line error."""
    if backend == "dali" and not dali_available():
        raise DataConfigError(f"data.backend: dali needs NVIDIA DALI, which is not installed; {DALI_HINT}")
    if backend == "auto":
        return "dali" if dali_available() else "torchvision"
    return backend


def build_image_data(cfg: DataConfig, rank: int, world_size: int, seed: int,
                     device: torch.device = torch.device("cpu"), amp: str = "off"
                     ) -> SyntheticImageData | DaliImageData | TorchvisionImageData:
    """The image data source for `cfg.backend`, delivering batches for `device` (DALI decodes on it if CUDA)
    to a model trained at train.amp `amp` (DALI's element type follows it: `batch_dtype`)."""
    backend = resolve_backend(cfg.backend)
    if backend == "synthetic":
        from data.synthetic import SyntheticImageData
        return SyntheticImageData(cfg, rank, world_size, seed, device)
    if backend == "dali":
        from data.dali_loader import DaliImageData  # imports DALI: only when it is used
        return DaliImageData(cfg, rank, world_size, seed, device, prefetch_batches=cfg.prefetch_batches, amp=amp)
    from data.torchvision_loader import TorchvisionImageData  # imports torchvision: only when it is used
    if cfg.backend == "auto" and rank == 0:
        log.warning("data.backend=auto: DALI is not installed, using torchvision (no cache levels); %s", DALI_HINT)
    return TorchvisionImageData(cfg, rank, world_size, seed, pin_memory=torch.device(device).type == "cuda")
