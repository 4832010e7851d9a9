"""The torchvision backend: ImageFolder + DataLoader with the same augmentations as the DALI pipelines.

Training batches come from a DistributedSampler (one permutation per epoch, identical on every rank,
each rank taking its shard; the tail that does not fill a global batch is dropped so that every rank
runs the same number of steps). Validation is split without padding, so every image counts once; its
exclusion list and rectangular batches are planned in data/rect_val.py, as for DALI.
It reads data.root directly (no cache levels) and lists the same files as the DALI backend. An image
PIL cannot decode is replaced by the next one and named in the log (by the worker that met it).
Crops and flips are seeded per (seed, epoch, sample), so an epoch can restart at any step (a mid-epoch
resume) and see the same augmentation as an uninterrupted run, whatever data.workers is.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets, transforms
from torchvision.transforms import functional as F

from data.cache import cache_folder
from data.config import DataConfig, worker_candidates
from data.layout import check_dataset, has_image_extension, list_split
from data.rect_val import center_anchors, cover_sizes, header_sizes, plan_val, uses_rect, validation_subset

log = logging.getLogger(__name__)


class TolerantImageFolder(datasets.ImageFolder):
    """ImageFolder whose unreadable images are replaced by the next readable one (batch sizes stay fixed)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, is_valid_file=has_image_extension, allow_empty=True)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        for k in range(len(self.samples)):
            j = (index + k) % len(self.samples)
            try:
                return super().__getitem__(j)
            except (OSError, ValueError, SyntaxError) as err:  # PIL: truncated, unidentified, broken streams
                log.warning("data: skipped %s: %s", self.samples[j][0], err)
        raise ValueError(f"{self.root}: none of the {len(self.samples)} images can be decoded")


class SeededImageFolder(TolerantImageFolder):
    """Training images whose random crop and flip are drawn from a generator seeded by (seed, epoch, index):
    the same sample gets the same augmentation whichever worker loads it and wherever the epoch (re)started."""

    def __init__(self, base: TolerantImageFolder, seed: int) -> None:  # noqa: D107 - shares base's listing
        self.__dict__.update(base.__dict__)
        self.seed, self.epoch = seed, 0

    def __getitem__(self, index: int) -> tuple[Any, int]:
        draw = int(np.random.SeedSequence([self.seed, self.epoch, index]).generate_state(1, np.uint64)[0])
        with torch.random.fork_rng(devices=[]):  # the transforms draw from torch's global generator
            torch.manual_seed(draw)
            return super().__getitem__(index)


class RectValDataset(Dataset):
    """Validation images each resized and center-cropped to its batch's rectangle (`crops[index]`, (height,
    width)), the sizes from data/rect_val.py's rules applied to the decoded image (a replaced bad file too)."""

    def __init__(self, base: TolerantImageFolder, crops: dict[int, tuple[int, int]], short_side: int,
                 normalize: Callable) -> None:
        self.base, self.crops, self.short_side, self.normalize = base, crops, short_side, normalize

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        img, label = self.base[index]
        crop_h, crop_w = self.crops[index]
        new_h, new_w = cover_sizes(np.array([img.height]), np.array([img.width]), self.short_side, crop_h, crop_w)
        top, left = center_anchors(new_h, new_w, crop_h, crop_w)
        img = F.resize(img, [int(new_h[0]), int(new_w[0])], antialias=True)
        return self.normalize(F.crop(img, int(top[0]), int(left[0]), crop_h, crop_w)), label


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into its epoch, at sample `start` of this rank's shard."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return super().__len__() - self.start


class EpochLoader:
    """An iterable of (images, labels) batches for one phase; `set_epoch` reshuffles and reseeds augmentation."""

    def __init__(self, loader: DataLoader, sampler: ResumableSampler | None, seed: int) -> None:
        self.loader, self.sampler, self.seed = loader, sampler, seed

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from `start_step` on (a mid-epoch resume)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.start = start_step * self.loader.batch_size
        if isinstance(self.loader.dataset, SeededImageFolder):
            self.loader.dataset.epoch = epoch  # workers are started per epoch and copy it

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class TorchvisionImageData:
    """ImageNet-layout folders read with torchvision; one instance per run, loaders rebuilt per phase."""

    def __init__(self, cfg: DataConfig, rank: int, world_size: int, seed: int, pin_memory: bool = False) -> None:
        self.num_classes = check_dataset(cfg.root)
        self.cfg, self.rank, self.world_size, self.seed, self.pin_memory = cfg, rank, world_size, seed, pin_memory
        self.workers = 2 if cfg.workers == "auto" else cfg.workers
        """Worker processes of the loaders built from now on (data.workers; under auto, the measured value once
        the trainer has set it)."""
        self._train = TolerantImageFolder(f"{cfg.root}/train")
        self._val = TolerantImageFolder(f"{cfg.root}/val")
        self._val_files = [os.path.relpath(path, self._val.root).replace(os.sep, "/") for path, _ in self._val.samples]
        self._val_kept = validation_subset(cfg, self._val_files, rank)

    @property
    def train_size(self) -> int:
        return len(self._train)

    @property
    def val_size(self) -> int:
        """Validation images evaluated (all ranks together)."""
        return len(self._val_kept)

    def _normalize(self) -> list:
        return [transforms.ToTensor(), transforms.Normalize(self.cfg.mean, self.cfg.std)]

    def worker_candidates(self, cores: int) -> list[int]:
        """data.workers: auto's candidates for a rank with `cores` cores (0 = loading in the training process)."""
        return worker_candidates(0, cores) if self.cfg.workers == "auto" else [self.workers]

    def train_loader(self, image_size: int, batch_size: int, min_scale: float = 0.0, workers: int | None = None
                     ) -> EpochLoader:
        """Per-rank batches of random-resized crops at `image_size` (scale from `min_scale` or data.min_scale),
        loaded by `workers` processes (default: `self.workers`)."""
        scale = (min_scale or self.cfg.min_scale, 1.0)
        aug = [transforms.RandomResizedCrop(image_size, scale=scale, antialias=True)]
        if self.cfg.hflip:
            aug.append(transforms.RandomHorizontalFlip())
        ds = SeededImageFolder(self._train, self.seed)
        ds.transform = transforms.Compose(aug + self._normalize())
        sampler = ResumableSampler(ds, num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=self.seed,
                                   drop_last=True)
        # Its own generator: without one, each epoch's iterator would draw worker seeds from the global RNG.
        loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True,
                            num_workers=self.workers if workers is None else workers,
                            pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed),
                            persistent_workers=False)
        return EpochLoader(loader, sampler, self.seed)

    def val_loader(self, image_size: int, batch_size: int) -> EpochLoader:
        """This rank's share of the validation set (less data.val_exclude), resized and center-cropped to
        `image_size` squares or, from data.rect_val_from_size on, to each batch's rectangle; each image exactly
        once overall."""
        short_side = round(image_size * self.cfg.val_resize_ratio)
        if not uses_rect(self.cfg, image_size):
            ds = copy.copy(self._val)
            ds.transform = transforms.Compose([transforms.Resize(short_side, antialias=True),
                                               transforms.CenterCrop(image_size)] + self._normalize())
            shard = Subset(ds, self._val_kept[self.rank::self.world_size].tolist())
            loader = DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=self.workers,
                                pin_memory=self.pin_memory)
            return EpochLoader(loader, None, self.seed)
        batches, crops = plan_val(self._val_kept, self.world_size, self.rank, batch_size, image_size,
                                  self._val_sizes())
        ds = RectValDataset(copy.copy(self._val), {int(i): crop for b, crop in zip(batches, crops) for i in b},
                            short_side, transforms.Compose(self._normalize()))
        loader = DataLoader(ds, batch_sampler=[b.tolist() for b in batches], num_workers=self.workers,
                            pin_memory=self.pin_memory)
        return EpochLoader(loader, None, self.seed)

    def _val_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """The validation images' header sizes in ImageFolder's order (the DALI backend's listing, checked)."""
        split = list_split(self.cfg.root, "val", classes=self._val.classes)
        if split.files != self._val_files:
            raise RuntimeError(f"{split.folder}: ImageFolder and data.layout list different validation files")
        return header_sizes(split, cache_folder(self.cfg.cache, self.cfg.root), self.workers,
                            progress=self.rank == 0)

    def stats(self) -> dict[str, float]:
        """No cache levels here; skipped images are named in the log by the worker processes."""
        return {}

    def close(self) -> None:
        pass
