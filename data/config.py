"""The `data` section: where the images are, which pipeline reads them, how they are augmented and cached."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data.cache import CacheConfig


def worker_candidates(least: int, cores: int) -> list[int]:
    """data.workers: auto's candidates: `least` (0 = in-process), then 1, 2, 4, ... up to `cores` (a rank's
    share of the cores), and `cores` itself; at least 1 and 2 threads."""
    out, n = {least, 1, 2, max(1, cores)}, 4
    while n <= cores:
        out.add(n)
        n *= 2
    return sorted(out)


class DataConfigError(ValueError):
    """A mistake in the data section (the trainer's ConfigError carries the same meaning)."""


def batch_dtype(dtype: str, amp: str, gpu: bool) -> Literal["float32", "float16"]:
    """The element type of dali batches for data.dtype `dtype` and a model trained at train.amp `amp`, decoded
    on the GPU or not (`gpu`). auto: float16 on the GPU under fp16 autocast or train.amp auto (its CUDA
    candidates, bf16 and fp16, both autocast, which casts the batch at the first layer), else float32 (an fp32
    model; a bf16 one too, as DALI emits no bfloat16). An explicit float16 with train.amp off raises: an fp32
    model rejects float16 inputs, on any device."""
    if dtype == "float16" and amp == "off":
        raise DataConfigError("data.dtype: float16 batches need train.amp fp16, bf16 or auto (a model trained in "
                              "fp32 rejects them); set data.dtype to auto or float32, or change train.amp")
    if dtype != "auto":
        return "float16" if dtype == "float16" else "float32"
    return "float16" if gpu and amp in ("fp16", "auto") else "float32"


@dataclass
class DataConfig:
    root: str = "datasets/digits"
    """Dataset folder in ImageNet layout: root/train/<class>/*.JPEG and root/val/<class>/*.JPEG (a path or
    an fsspec URL)."""
    backend: Literal["auto", "dali", "torchvision", "synthetic"] = "auto"
    """Input pipeline: dali (GPU decoding where CUDA exists, else DALI's CPU mode), torchvision, auto = dali
    where it is installed, or synthetic = random images with fixed labels made on the device, ImageNet-sized
    epochs, no files and `root` unused (a throughput check before the dataset is there; data/synthetic.py)."""
    workers: int | Literal["auto"] = "auto"
    """Decoding threads (dali) or worker processes (torchvision) per rank; auto = measured at start-up on the
    run's own loader and model (trainer/run_choices.py) among 1, 2, 4, ... up to the cores per rank (0, in-process
    loading, too for torchvision)."""
    min_scale: float = 0.35
    """Random-resized-crop lower bound on the crop's area fraction (phases may override it)."""
    hflip: bool = True
    """Random horizontal flips in training (turn off for data whose classes are not mirror-symmetric)."""
    val_resize_ratio: float = 1.14
    """Validation: resize the shorter side to ratio x crop size, then center-crop."""
    rect_val_from_size: int = 0
    """Rectangular validation at phases whose validation image size is at least this (px): images sorted by
    aspect ratio, each batch center-cropped to its own rectangle, the crop size on the shorter side
    (data/rect_val.py); 0 = never (square center crops)."""
    val_exclude: str = ""
    """Text file of validation images to leave out, one per line: file names (ILSVRC2012_val_00000001.JPEG)
    or ImageNet validation image numbers (the ILSVRC2014 devkit's blacklist); a relative path lies inside
    data.root; empty = validate on every image."""
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    """Per-channel mean subtracted after scaling pixels to [0, 1]."""
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    """Per-channel standard deviation divided out after the mean."""
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    """Memory layout of dali batches (always N,C,H,W-shaped); NHWC = channels-last strides, no copy for
    train.channels_last."""
    dtype: Literal["auto", "float32", "float16"] = "auto"
    """Element type of dali batches: auto = float16 when decoding on the GPU for a model under fp16 autocast
    (train.amp fp16 or auto), else float32 (train.amp off or bf16: DALI has no bfloat16); float16 with
    train.amp off is a config error (`batch_dtype`)."""
    prefetch_batches: int = 4
    """dali backend: batches a background thread prepares ahead of DALI (cache reads, misses, crop windows),
    so a cache miss never stalls the training step; 0 = inside DALI's callback, on the training thread."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The multi-level cache in front of the dali backend (data/cache.py): L1 disk, L2 RAM, L3 low-res."""

    def __post_init__(self) -> None:
        if self.prefetch_batches < 0:
            raise DataConfigError(f"data.prefetch_batches: must be >= 0, got {self.prefetch_batches}")
        if self.workers != "auto" and (not isinstance(self.workers, int) or self.workers < 0):
            raise DataConfigError(f"data.workers: must be auto or an integer >= 0, got {self.workers!r}")
        if not 0 < self.min_scale <= 1:
            raise DataConfigError(f"data.min_scale: must be in (0, 1], got {self.min_scale}")
        if self.val_resize_ratio < 1:
            raise DataConfigError(f"data.val_resize_ratio: must be >= 1, got {self.val_resize_ratio}")
        if self.rect_val_from_size < 0:
            raise DataConfigError(f"data.rect_val_from_size: must be >= 0 (0 = never), got {self.rect_val_from_size}")
        if any(s <= 0 for s in self.std):
            raise DataConfigError(f"data.std: every value must be > 0, got {self.std}")
        if self.cache.dir and "://" in self.root and not self.cache.dir.startswith("/"):
            raise DataConfigError(f"data.cache.dir: {self.cache.dir!r} is relative, i.e. inside data.root, but "
                                  f"data.root is a URL ({self.root}); give an absolute node-local path")
