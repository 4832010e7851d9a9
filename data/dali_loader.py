"""The DALI backend: per-rank loaders over the cached splits, one pipeline per phase.

Python decides what each batch holds (sampling.py: the epoch's permutation, this rank's shard, crops and
flips) and hands DALI the bytes (or L3 pixels) through fn.external_source; DALI decodes, crops, resizes
and normalizes on its threads (or the GPU). A phase change builds a new pipeline for the new image and
batch size; the cache, the listings and the screening verdicts live on in the data object.
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np
import torch
from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

from data.cache import cache_folder, lowres_short_side, open_split_cache, stats_dict
from data.config import DataConfig
from data.dali_pipelines import PipelineSpec, build_pipeline, dali_decodes
from data.layout import check_dataset, list_split
from data.reader import SampleReader
from data.sampling import augment_rng, random_resized_crops, shorter_side_sizes, train_batches, val_batches

log = logging.getLogger(__name__)


class BatchSource:
    """A fn.external_source callback over precomputed batches of sample indices (`self.batches`).

    `served[step]` records which samples went into a batch (after bad files were replaced), so a batch
    DALI failed on can be rechecked; `first_step` lets a pipeline rebuilt mid-epoch continue there.
    """

    def __init__(self, reader: SampleReader, fetch: str) -> None:
        self.reader, self.fetch = reader, fetch
        self.batches: list[np.ndarray] | np.ndarray = []
        self.served: dict[int, list[int]] = {}
        self.first_step = 0

    def __len__(self) -> int:
        return len(self.batches)

    def step_of(self, info) -> int:
        """The epoch's step for DALI's iteration counter; StopIteration past the last one ends DALI's epoch."""
        step = self.first_step + info.iteration
        if step >= len(self.batches):
            raise StopIteration
        return step

    def pixel_sizes(self, step: int, data: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(heights, widths) of a batch: L3 arrays carry theirs, the screening measured the encoded files."""
        if self.fetch == "lowres":
            return np.array([d.shape[0] for d in data]), np.array([d.shape[1] for d in data])
        return self.reader.heights[self.served[step]], self.reader.widths[self.served[step]]


class TrainSource(BatchSource):
    """Batch `step` of this rank's shard of the epoch's permutation, with crop windows and flips."""

    def __init__(self, reader: SampleReader, fetch: str, world: int, rank: int, batch: int, seed: int,
                 min_scale: float, hflip: bool) -> None:
        super().__init__(reader, fetch)
        self.world, self.rank, self.batch, self.seed = world, rank, batch, seed
        self.scale, self.hflip = (min_scale, 1.0), hflip
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches = train_batches(len(self.reader.split), self.world, self.rank, self.batch, self.seed, epoch)
        self.served = {}

    def __call__(self, info) -> tuple:
        step = self.step_of(info)
        picked = [self.reader.first_good(int(i), self.fetch) for i in self.batches[step]]
        self.served[step] = [j for j, _ in picked]
        data = [d for _, d in picked]
        rng = augment_rng(self.seed, self.epoch, self.rank, step)
        top, left, h, w = random_resized_crops(*self.pixel_sizes(step, data), self.scale, rng)
        mirror = rng.random(len(data)) < 0.5 if self.hflip else np.zeros(len(data), dtype=bool)
        labels = self.reader.split.labels[self.served[step]]
        return (data, np.stack([left, top], 1).astype(np.float32), np.stack([w, h], 1).astype(np.float32),
                mirror.astype(np.int32), labels)


class ValSource(BatchSource):
    """This rank's validation images in order (bad files left out), with the resize and center-crop window
    torchvision's Resize + CenterCrop would use on each."""

    def __init__(self, reader: SampleReader, fetch: str, world: int, rank: int, batch: int, short_side: int,
                 crop: int) -> None:
        super().__init__(reader, fetch)
        self.short_side, self.crop = short_side, crop
        self.batches = val_batches(len(reader.split), world, rank, batch)

    def set_epoch(self, epoch: int) -> None:
        pass

    def __call__(self, info) -> tuple:
        step = self.step_of(info)
        read = getattr(self.reader, self.fetch)
        picked = [(int(i), read(int(i))) for i in self.batches[step]]
        picked = [(i, d) for i, d in picked if d is not None] or [self.reader.first_good(int(self.batches[step][0]),
                                                                                          self.fetch)]
        self.served[step] = [i for i, _ in picked]
        data = [d for _, d in picked]
        new_h, new_w = shorter_side_sizes(*self.pixel_sizes(step, data), self.short_side)
        # torchvision's CenterCrop: int(round((resized - crop) / 2)), Python's round-half-to-even
        top, left = np.round((new_h - self.crop) / 2), np.round((new_w - self.crop) / 2)
        return (data, self.reader.split.labels[self.served[step]], new_w.astype(np.float32),
                new_h.astype(np.float32), np.stack([left, top], 1).astype(np.int32))


class DaliDecodeError(RuntimeError):
    """DALI failed on a batch again after its files were rechecked and transcoded."""


class DaliEpochLoader:
    """An iterable of (images, labels) per epoch for one phase; `set_epoch` chooses the permutation.

    DALI cannot reset a pipeline in the middle of an epoch, so an epoch left unfinished (train.max_steps
    _per_epoch) is followed by a rebuild, which costs milliseconds. A decode error inside DALI kills its
    pipeline: the batch's files are tried one by one (a file DALI rejects is transcoded if PIL decodes it,
    else skipped) and a new pipeline resumes at that batch.
    """

    def __init__(self, spec: PipelineSpec, source: BatchSource, device: torch.device) -> None:
        self.spec, self.source, self.device = spec, source, device
        self.pipe = None
        self.needs_rebuild = True
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration yields `epoch`'s batches from `start_step` on (a mid-epoch resume)."""
        self.source.set_epoch(epoch)
        self.start_step = start_step

    def __len__(self) -> int:
        return len(self.source)

    def rebuild(self, first_step: int) -> None:
        self.pipe = None  # free the old pipeline's buffers first
        self.source.first_step = first_step
        self.pipe = build_pipeline(self.spec, self.source)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.start_step = self.start_step, 0
        if self.needs_rebuild or start:
            self.rebuild(start)  # the source computes any step's batch and crops: skipping costs nothing
        self.needs_rebuild = True
        steps = len(self.source)
        for step in range(start, steps):
            batch = self.run(step)
            if step == steps - 1:
                self.end_epoch()
            yield batch

    def run(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.to_torch(self.pipe.run())
        except RuntimeError as err:  # DALI's decode errors are RuntimeErrors; the pipeline is now unusable
            suspects = self.source.served.get(step, []) + self.source.served.get(step + 1, [])
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            reason = next((line for line in lines if "fail" in line.lower()), lines[-1])
            log.warning("data: DALI failed on batch %d (%s); rechecking its %d files", step, reason[:200],
                        len(suspects))
            if self.source.fetch == "encoded":
                self.source.reader.recheck(suspects, dali_decodes)
            self.rebuild(step)
        try:
            return self.to_torch(self.pipe.run())
        except RuntimeError as err:
            raise DaliDecodeError(f"DALI failed twice on batch {step} of {self.source.reader.split.folder} "
                                  f"(files: {', '.join(self.source.reader.split.url(i) for i in suspects[:4])}): "
                                  f"{err}") from err

    def end_epoch(self) -> None:
        """Let the pipeline see the end of the epoch and reset it, so the next epoch needs no rebuild."""
        try:
            self.pipe.run()
        except StopIteration:
            self.pipe.reset()
            self.source.first_step = 0
            self.needs_rebuild = False

    def to_torch(self, outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = (tl.as_tensor() for tl in outputs)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        out = torch.empty(images.shape(), dtype=to_torch_type[images.dtype], device=self.device)
        feed_ndarray(images, out, cuda_stream=stream)
        if self.spec.layout == "HWC":
            out = out.permute(0, 3, 1, 2)  # N,C,H,W-shaped with channels-last strides: no copy
        return out, torch.from_numpy(np.array(labels))


class DaliImageData:
    """ImageNet-layout folders through the cache and DALI; one instance per run, pipelines rebuilt per phase."""

    def __init__(self, cfg: DataConfig, rank: int, world_size: int, seed: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.num_classes = check_dataset(cfg.root)
        self.cfg, self.rank, self.world_size, self.seed = cfg, rank, world_size, seed
        gpu = device.type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self.device_id = self.device.index if gpu else None
        self.float16 = cfg.dtype == "float16" or (cfg.dtype == "auto" and gpu)
        short_side = lowres_short_side(cfg.cache, cfg.val_resize_ratio)
        train = list_split(cfg.root, "train")
        folder = cache_folder(cfg.cache, cfg.root)
        self.readers = {split.name: SampleReader(split, open_split_cache(cfg.cache, split, folder, short_side),
                                                 short_side, cfg.cache.lowres_max_aspect)
                        for split in (train, list_split(cfg.root, "val", classes=train.classes))}
        self._val_loaders: dict[tuple[int, int], DaliEpochLoader] = {}

    @property
    def train_size(self) -> int:
        return len(self.readers["train"].split)

    def fetch_for(self, split: str, image_size: int) -> str:
        """`lowres` when L3 is on and the image size is small enough for it, else `encoded`."""
        lowres = self.readers[split].cache.lowres is not None and image_size <= self.cfg.cache.lowres_max_image_size
        return "lowres" if lowres else "encoded"

    def spec(self, train: bool, fetch: str, image_size: int, batch_size: int) -> PipelineSpec:
        cfg = self.cfg
        return PipelineSpec(train=train, encoded=fetch == "encoded", image_size=image_size, batch_size=batch_size,
                            threads=cfg.workers, device_id=self.device_id, mean=cfg.mean, std=cfg.std,
                            layout="HWC" if cfg.layout == "NHWC" else "CHW", float16=self.float16, seed=self.seed)

    def train_loader(self, image_size: int, batch_size: int, min_scale: float = 0.0) -> DaliEpochLoader:
        """Per-rank batches of random-resized crops at `image_size` (scale from `min_scale` or data.min_scale)."""
        fetch = self.fetch_for("train", image_size)
        source = TrainSource(self.readers["train"], fetch, self.world_size, self.rank, batch_size, self.seed,
                             min_scale or self.cfg.min_scale, self.cfg.hflip)
        return DaliEpochLoader(self.spec(True, fetch, image_size, batch_size), source, self.device)

    def val_loader(self, image_size: int, batch_size: int) -> DaliEpochLoader:
        """This rank's share of the validation set, resized and center-cropped, each image exactly once overall."""
        key = (image_size, batch_size)
        if key not in self._val_loaders:
            fetch = self.fetch_for("val", image_size)
            source = ValSource(self.readers["val"], fetch, self.world_size, self.rank, batch_size,
                               round(image_size * self.cfg.val_resize_ratio), image_size)
            self._val_loaders[key] = DaliEpochLoader(self.spec(False, fetch, image_size, batch_size), source,
                                                     self.device)
        return self._val_loaders[key]

    def stats(self) -> dict[str, float]:
        """Cumulative counters of this rank: per cache level hits, misses, bytes, repaired; skipped images."""
        out = stats_dict([r.cache for r in self.readers.values()])
        for reader in self.readers.values():
            for key, value in reader.stats().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def close(self) -> None:
        self._val_loaders.clear()
        for reader in self.readers.values():
            reader.cache.close()
