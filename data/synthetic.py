"""`data.backend: synthetic`: random images with fixed labels, made on the device, without any files.

For measuring a machine's training throughput before the dataset is there. The interface is the other
backends' (data/__init__.py). A loader makes one batch of the phase's image size and per-rank batch when it
is built (float32 N,C,H,W values from a standard normal, like normalized pixels; labels drawn once from
the classes) and yields that same batch at every step, so a step costs what it costs on real data minus
decoding and host-to-device copies. The sizes are ImageNet's: 1000 classes and 1,281,167 training images
per epoch (the recipe's steps per epoch are the cluster's); validation is about 1024 images over all
ranks (at least one batch per rank), enough to run the evaluation path. The labels carry no signal:
accuracy stays at chance.
"""

from __future__ import annotations

from typing import Iterator

import torch

from data.config import DataConfig

NUM_CLASSES = 1000
"""ImageNet's classes."""
TRAIN_IMAGES = 1_281_167
"""ImageNet's training images: one synthetic epoch has as many steps as an ImageNet epoch."""
VAL_IMAGES = 1024
"""Validation images of all ranks together (in whole batches, at least one per rank)."""


class SyntheticLoader:
    """`steps` batches per epoch, every one the same (images, labels) pair; `set_epoch` only sets the start."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, steps: int) -> None:
        self.images, self.labels, self.steps = images, labels, steps
        self._start = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration yields the epoch's batches from `start_step` on (every epoch is alike)."""
        self._start = start_step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self._start, self.steps):
            yield self.images, self.labels

    def __len__(self) -> int:
        return self.steps


class SyntheticImageData:
    """The synthetic data source of one rank: batches generated on `device` with a generator seeded by
    (seed, rank)."""

    num_classes = NUM_CLASSES
    train_size = TRAIN_IMAGES
    val_size = VAL_IMAGES

    def __init__(self, cfg: DataConfig, rank: int, world_size: int, seed: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.cfg, self.rank, self.world_size, self.seed = cfg, rank, world_size, seed
        self.device = torch.device(device)

    def _batch(self, image_size: int, batch_size: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.rank * 2 + offset)
        images = torch.randn(batch_size, 3, image_size, image_size, generator=gen, device=self.device)
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=gen, device=self.device)
        return images, labels

    def train_loader(self, image_size: int, batch_size: int, min_scale: float = 0.0) -> SyntheticLoader:
        steps = self.train_size // self.world_size // batch_size
        return SyntheticLoader(*self._batch(image_size, batch_size, 0), steps)

    def val_loader(self, image_size: int, batch_size: int) -> SyntheticLoader:
        steps = max(1, VAL_IMAGES // self.world_size // batch_size)
        return SyntheticLoader(*self._batch(image_size, batch_size, 1), steps)

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
