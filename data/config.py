"""The `data` section: where the images are and how they are read and augmented."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class DataConfigError(ValueError):
    """A mistake in the data section (the trainer's ConfigError carries the same meaning)."""


@dataclass
class DataConfig:
    root: str = "datasets/digits"
    """Dataset folder in ImageNet layout: root/train/<class>/*.JPEG and root/val/<class>/*.JPEG."""
    backend: Literal["auto", "torchvision"] = "auto"
    """Input pipeline: torchvision ImageFolder + DataLoader (auto picks the best one available)."""
    workers: int = 2
    """Decoding worker processes per rank."""
    min_scale: float = 0.35
    """Random-resized-crop lower bound on the crop's area fraction (phases may override it)."""
    hflip: bool = True
    """Random horizontal flips in training (turn off for data whose classes are not mirror-symmetric)."""
    val_resize_ratio: float = 1.14
    """Validation: resize the shorter side to ratio x crop size, then center-crop."""
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    """Per-channel mean subtracted after scaling pixels to [0, 1]."""
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    """Per-channel standard deviation divided out after the mean."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise DataConfigError(f"data.workers: must be >= 0, got {self.workers}")
        if not 0 < self.min_scale <= 1:
            raise DataConfigError(f"data.min_scale: must be in (0, 1], got {self.min_scale}")
        if self.val_resize_ratio < 1:
            raise DataConfigError(f"data.val_resize_ratio: must be >= 1, got {self.val_resize_ratio}")
        if any(s <= 0 for s in self.std):
            raise DataConfigError(f"data.std: every value must be > 0, got {self.std}")
