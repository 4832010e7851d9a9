"""The DALI backend: per-rank loaders over the cached splits, one pipeline per phase.

Python decides what each batch holds (sampling.py: the epoch's permutation, this rank's shard, crops and
flips; rect_val.py: validation's batches and crop windows) and hands DALI the bytes (or L3 pixels) through
fn.external_source; DALI decodes, crops, resizes and normalizes on its threads (or the GPU). A phase change
builds a new pipeline for the new image and batch size; the cache, the listings and the screening verdicts
live on in the data object.

The Python side of a batch (cache reads, misses filled from the levels below, screening, L3 decoding,
crop windows) runs on a prefetch thread, up to `prefetch_batches` batches ahead of DALI, so a cache miss
overlaps the training step instead of stalling it; DALI's callback on the training thread only takes the
finished batch. A thread, not DALI's parallel external source (worker processes): the readers' verdicts,
transcoded replacements, skip counts and cache counters must stay in this process, where the recheck
after a decode error and `stats()` read them; forked workers would have to start before CUDA is
initialized, which a pipeline rebuilt per phase or after a decode error cannot do, and spawned ones would
need the readers' open files and mappings pickled.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch
from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

from data.cache import cache_folder, lowres_short_side, open_split_cache, stats_dict
from data.config import DataConfig, batch_dtype, worker_candidates
from data.dali_pipelines import PipelineSpec, build_pipeline, dali_decodes
from data.layout import check_dataset, list_split
from data.reader import Fetch, SampleReader
from data.rect_val import center_anchors, cover_sizes, header_sizes, plan_val, uses_rect, validation_subset
from data.sampling import augment_rng, random_resized_crops, train_batches

log = logging.getLogger(__name__)

PREFETCH_BATCHES = 4
"""Batches the prefetch thread prepares ahead of DALI's requests (0: the sequential callback)."""


class Prefetcher:
    """`make(step)` for steps start, start+1, ..., stop-1, computed in order on one background thread and
    at most `depth` batches ahead of `take`. An exception of `make` is raised again by the `take` of its
    step, on the consumer's thread; `close` discards what is ready and waits for the batch in progress."""

    def __init__(self, make: Callable[[int], tuple], start: int, stop: int, depth: int) -> None:
        self.make, self.depth, self.next_step = make, depth, start
        self.ready: collections.deque[tuple[int, tuple | None, BaseException | None]] = collections.deque()
        self.cond = threading.Condition()
        self.closed = self.done = False
        self.thread = threading.Thread(target=self.work, args=(start, stop), name="dali-source-prefetch",
                                       daemon=True)
        self.thread.start()

    def work(self, start: int, stop: int) -> None:
        try:
            for step in range(start, stop):
                try:
                    item = (step, self.make(step), None)
                except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
                    item = (step, None, err)
                with self.cond:
                    while len(self.ready) >= self.depth and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    self.ready.append(item)
                    self.cond.notify_all()
                if item[2] is not None:
                    return
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def take(self, step: int) -> tuple:
        """The outputs of `step`, which must be the next one (DALI asks for its iterations in order)."""
        if step != self.next_step:
            raise RuntimeError(f"prefetch: asked for step {step}, next prepared is {self.next_step}")
        with self.cond:
            while not self.ready and not self.done:
                self.cond.wait()
            if not self.ready:
                raise RuntimeError(f"prefetch: the thread ended before step {step}")
            got, outputs, err = self.ready.popleft()
            self.cond.notify_all()
        self.next_step = got + 1
        if err is not None:
            raise err
        return outputs

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.ready.clear()
            self.cond.notify_all()
        self.thread.join()


class BatchSource:
    """A fn.external_source callback over precomputed batches of sample indices (`self.batches`).

    `make(step)` computes a batch's outputs; with `prefetch` > 0 a Prefetcher computes them ahead, started
    at the step DALI first asks for and restarted wherever it asks out of order (a rebuilt pipeline).
    `served[step]` records which samples went into a batch (after bad files were replaced), so a batch
    DALI failed on can be rechecked; `first_step` lets a pipeline rebuilt mid-epoch continue there. Call
    `stop_prefetch` before changing the batches, the first step or the reader's verdicts.
    """

    def __init__(self, reader: SampleReader, fetch: Fetch, prefetch: int = PREFETCH_BATCHES) -> None:
        self.reader, self.fetch, self.prefetch = reader, fetch, prefetch
        self.batches: list[np.ndarray] | np.ndarray = []
        self.served: dict[int, list[int]] = {}
        self.first_step = 0
        self.prefetcher: Prefetcher | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def step_of(self, info: Any) -> int:
        """The epoch's step for DALI's iteration counter; StopIteration past the last one ends DALI's epoch."""
        step = self.first_step + info.iteration
        if step >= len(self.batches):
            raise StopIteration
        return step

    def __call__(self, info) -> tuple:
        step = self.step_of(info)
        if self.prefetch <= 0:
            return self.make(step)
        if self.prefetcher is None or self.prefetcher.next_step != step:
            self.stop_prefetch()
            self.prefetcher = Prefetcher(self.make, step, len(self.batches), self.prefetch)
        try:
            return self.prefetcher.take(step)
        except BaseException:
            self.stop_prefetch()  # the thread ended with this error: a later call starts a new one
            raise

    def stop_prefetch(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def make(self, step: int) -> tuple:
        raise NotImplementedError

    def pixel_sizes(self, step: int, data: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(heights, widths) of a batch: L3 arrays carry theirs, the screening measured the encoded files."""
        if self.fetch == "lowres":
            return np.array([d.shape[0] for d in data]), np.array([d.shape[1] for d in data])
        return self.reader.heights[self.served[step]], self.reader.widths[self.served[step]]


class TrainSource(BatchSource):
    """Batch `step` of this rank's shard of the epoch's permutation, with crop windows and flips."""

    def __init__(self, reader: SampleReader, fetch: Fetch, world: int, rank: int, batch: int, seed: int,
                 min_scale: float, hflip: bool, prefetch: int = PREFETCH_BATCHES) -> None:
        super().__init__(reader, fetch, prefetch)
        self.world, self.rank, self.batch, self.seed = world, rank, batch, seed
        self.scale, self.hflip = (min_scale, 1.0), hflip
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.stop_prefetch()
        self.epoch = epoch
        self.batches = train_batches(len(self.reader.split), self.world, self.rank, self.batch, self.seed, epoch)
        self.served = {}

    def make(self, step: int) -> tuple:
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
    """This rank's validation batches (bad files left out) with each batch's crop, (height, width) in `crops`,
    and the resize and center-crop window the torchvision backend uses on each image (data/rect_val.py)."""

    def __init__(self, reader: SampleReader, fetch: Fetch, batches: list[np.ndarray], crops: list[tuple[int, int]],
                 short_side: int, prefetch: int = PREFETCH_BATCHES) -> None:
        super().__init__(reader, fetch, prefetch)
        self.short_side, self.crops = short_side, crops
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        self.stop_prefetch()

    def make(self, step: int) -> tuple:
        picked = [(int(i), self.reader.read(int(i), self.fetch)) for i in self.batches[step]]
        picked = [(i, d) for i, d in picked if d is not None] or [self.reader.first_good(int(self.batches[step][0]),
                                                                                          self.fetch)]
        self.served[step] = [i for i, _ in picked]
        data = [d for _, d in picked]
        crop_h, crop_w = self.crops[step]
        new_h, new_w = cover_sizes(*self.pixel_sizes(step, data), self.short_side, crop_h, crop_w)
        top, left = center_anchors(new_h, new_w, crop_h, crop_w)
        return (data, self.reader.split.labels[self.served[step]], new_w.astype(np.float32),
                new_h.astype(np.float32), np.stack([left, top], 1).astype(np.int32),
                np.tile(np.array([crop_w, crop_h], dtype=np.int32), (len(data), 1)))


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
        self.source.stop_prefetch()
        self.source.first_step = first_step
        self.pipe = build_pipeline(self.spec, self.source)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self.start_step = self.start_step, 0
        if self.needs_rebuild or start:
            self.rebuild(start)  # the source computes any step's batch and crops: skipping costs nothing
        self.needs_rebuild = True
        steps = len(self.source)
        try:
            for step in range(start, steps):
                batch = self.run(step)
                if step == steps - 1:
                    self.end_epoch()
                yield batch
        finally:  # also when the consumer stops early (train.max_steps_per_epoch): no batch is prepared for nobody
            self.source.stop_prefetch()

    def run(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.to_torch(self.pipe.run())
        except RuntimeError as err:  # DALI's decode errors are RuntimeErrors; the pipeline is now unusable
            suspects = self.source.served.get(step, []) + self.source.served.get(step + 1, [])
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            reason = next((line for line in lines if "fail" in line.lower()), lines[-1])
            log.warning("data: DALI failed on batch %d (%s); rechecking its %d files", step, reason[:200],
                        len(suspects))
            self.source.stop_prefetch()  # the recheck changes verdicts the prefetch thread reads
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
    """ImageNet-layout folders through the cache and DALI; one instance per run, pipelines rebuilt per phase.

    `prefetch_batches`: batches each loader's prefetch thread prepares ahead (0: the Python side of every
    batch runs inside DALI's callback, on the training thread). `amp`: train.amp of the model the batches feed,
    which data.dtype's auto follows (`batch_dtype`).
    """

    def __init__(self, cfg: DataConfig, rank: int, world_size: int, seed: int,
                 device: torch.device = torch.device("cpu"), prefetch_batches: int = PREFETCH_BATCHES,
                 amp: str = "off") -> None:
        self.num_classes = check_dataset(cfg.root)
        self.cfg, self.rank, self.world_size, self.seed = cfg, rank, world_size, seed
        self.prefetch_batches = prefetch_batches
        self.workers = 1 if cfg.workers == "auto" else cfg.workers
        """Decoding threads of the loaders built from now on (data.workers; under auto, the measured value once
        the trainer has set it)."""
        self._sources: weakref.WeakSet[BatchSource] = weakref.WeakSet()  # their threads stop before the cache closes
        gpu = device.type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self.device_id = self.device.index if gpu else None
        self.float16 = batch_dtype(cfg.dtype, amp, gpu) == "float16"
        short_side = lowres_short_side(cfg.cache, cfg.val_resize_ratio)
        train = list_split(cfg.root, "train")
        self.cache_dir = cache_folder(cfg.cache, cfg.root)
        self.readers = {split.name: SampleReader(split, open_split_cache(cfg.cache, split, self.cache_dir, short_side),
                                                 short_side, cfg.cache.lowres_max_aspect)
                        for split in (train, list_split(cfg.root, "val", classes=train.classes))}
        self.val_kept = validation_subset(cfg, self.readers["val"].split.files, rank)
        self._val_loaders: dict[tuple[int, int], DaliEpochLoader] = {}

    @property
    def train_size(self) -> int:
        return len(self.readers["train"].split)

    @property
    def val_size(self) -> int:
        """Validation images evaluated (all ranks together)."""
        return len(self.val_kept)

    @property
    def batch_format(self) -> tuple[torch.memory_format, torch.dtype]:
        """How batches arrive: the memory layout (data.layout) and element type (data.dtype)."""
        layout = torch.channels_last if self.cfg.layout == "NHWC" else torch.contiguous_format
        return layout, torch.float16 if self.float16 else torch.float32

    def fetch_for(self, split: str, image_size: int) -> str:
        """`lowres` when L3 is on and the image size is small enough for it, else `encoded`."""
        lowres = self.readers[split].cache.lowres is not None and image_size <= self.cfg.cache.lowres_max_image_size
        return "lowres" if lowres else "encoded"

    def spec(self, train: bool, fetch: Fetch, image_size: int, batch_size: int, workers: int | None = None
             ) -> PipelineSpec:
        cfg = self.cfg
        return PipelineSpec(train=train, encoded=fetch == "encoded", image_size=image_size, batch_size=batch_size,
                            threads=self.workers if workers is None else workers, device_id=self.device_id,
                            mean=cfg.mean, std=cfg.std,
                            layout="HWC" if cfg.layout == "NHWC" else "CHW", float16=self.float16, seed=self.seed)

    def worker_candidates(self, cores: int) -> list[int]:
        """data.workers: auto's candidates for a rank with `cores` cores (DALI needs a thread)."""
        return worker_candidates(1, cores) if self.cfg.workers == "auto" else [self.workers]

    def train_loader(self, image_size: int, batch_size: int, min_scale: float = 0.0, workers: int | None = None
                     ) -> DaliEpochLoader:
        """Per-rank batches of random-resized crops at `image_size` (scale from `min_scale` or data.min_scale),
        decoded by `workers` threads (default: `self.workers`)."""
        fetch = self.fetch_for("train", image_size)
        source = TrainSource(self.readers["train"], fetch, self.world_size, self.rank, batch_size, self.seed,
                             min_scale or self.cfg.min_scale, self.cfg.hflip, self.prefetch_batches)
        self._sources.add(source)
        return DaliEpochLoader(self.spec(True, fetch, image_size, batch_size, workers), source, self.device)

    def val_loader(self, image_size: int, batch_size: int) -> DaliEpochLoader:
        """This rank's share of the validation set (less data.val_exclude), resized and center-cropped to
        `image_size` squares or, from data.rect_val_from_size on, to each batch's rectangle; each image exactly
        once overall."""
        key = (image_size, batch_size)
        if key not in self._val_loaders:
            fetch = self.fetch_for("val", image_size)
            split = self.readers["val"].split
            sizes = (header_sizes(split, self.cache_dir, self.workers, progress=self.rank == 0)
                     if uses_rect(self.cfg, image_size) else None)
            batches, crops = plan_val(self.val_kept, self.world_size, self.rank, batch_size, image_size, sizes)
            source = ValSource(self.readers["val"], fetch, batches, crops,
                               round(image_size * self.cfg.val_resize_ratio), self.prefetch_batches)
            self._sources.add(source)
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
        for source in list(self._sources):
            source.stop_prefetch()
        self._val_loaders.clear()
        for reader in self.readers.values():
            reader.cache.close()
