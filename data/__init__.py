"""Input pipelines for ImageNet-layout image folders, chosen by `data.backend`."""

from __future__ import annotations

from data.config import DataConfig, DataConfigError
from data.layout import DatasetNotFoundError, check_dataset
from data.torchvision_loader import EpochLoader, TorchvisionImageData

__all__ = ["DataConfig", "DataConfigError", "DatasetNotFoundError", "EpochLoader", "build_image_data",
           "check_dataset"]


def build_image_data(cfg: DataConfig, rank: int, world_size: int, seed: int,
                     pin_memory: bool = False) -> TorchvisionImageData:
    """The image data source for `cfg.backend` (auto = the best backend installed)."""
    return TorchvisionImageData(cfg, rank, world_size, seed, pin_memory)
