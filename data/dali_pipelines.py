"""The DALI graphs: training (decode the crop → resize → flip → normalize) and validation (decode → resize
→ center crop → normalize), fed by fn.external_source from the cache.

The crop window and the flip are inputs (drawn in data/sampling.py), not DALI random operators, so
augmentation is reproducible per (seed, epoch, rank, step) and one pipeline serves a whole phase. So are
validation's resize and crop sizes, per sample: a square, or each batch's own rectangle (data/rect_val.py). With a
device id, JPEGs are decoded on the GPU (`mixed`) and batches come out as fp16 CUDA tensors; with none,
everything runs in DALI's CPU-only mode. Pre-decoded L3 pixels skip the decoder and are only cropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from nvidia.dali import Pipeline, fn, types


@dataclass(frozen=True)
class PipelineSpec:
    """Everything that fixes a pipeline's graph and buffers: rebuilt when any of it changes (a new phase)."""

    train: bool
    encoded: bool
    """True: the inputs are encoded files (decoded here); False: HWC uint8 pixels from L3."""
    image_size: int
    """Training: the output's side; validation: the crop's shorter side (the source gives each sample's crop)."""
    batch_size: int
    threads: int
    device_id: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    layout: str
    """DALI output layout per sample: CHW or HWC."""
    float16: bool
    seed: int = 0


def build_pipeline(spec: PipelineSpec, source: Callable) -> Pipeline:
    """A built pipeline whose external source calls `source(batch_info)` for each batch."""
    gpu = spec.device_id is not None
    pipe = Pipeline(batch_size=spec.batch_size, num_threads=max(1, spec.threads), device_id=spec.device_id,
                    prefetch_queue_depth=2, seed=spec.seed)
    with pipe:
        if spec.train:
            data, anchor, shape, mirror, labels = fn.external_source(source=source, num_outputs=5, batch=True,
                                                                     batch_info=True)
            if spec.encoded:  # ROI decoding: only the crop window is decoded
                images = fn.decoders.image_slice(data, anchor, shape, device="mixed" if gpu else "cpu",
                                                 output_type=types.RGB, axis_names="WH", normalized_anchor=False,
                                                 normalized_shape=False, adjust_orientation=False)
            else:
                images = fn.slice(data.gpu() if gpu else data, anchor, shape, axis_names="WH",
                                  normalized_anchor=False, normalized_shape=False)
            images = fn.resize(images, resize_x=spec.image_size, resize_y=spec.image_size,
                               interp_type=types.INTERP_LINEAR, antialias=True)
        else:
            data, labels, width, height, anchor, shape = fn.external_source(source=source, num_outputs=6,
                                                                            batch=True, batch_info=True)
            if spec.encoded:
                # EXIF orientation is ignored, as PIL (the torchvision backend) and the screening do
                images = fn.decoders.image(data, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                           adjust_orientation=False)
            else:
                images = data.gpu() if gpu else data
            # sizes and crop window (x, y; width, height) from Python, with torchvision's rounding: both
            # backends see the same pixels
            images = fn.resize(images, resize_x=width, resize_y=height, interp_type=types.INTERP_LINEAR,
                               antialias=True)
            images = fn.slice(images, start=anchor, shape=shape, axis_names="WH")
            mirror = 0
        images = fn.crop_mirror_normalize(
            images, mirror=mirror, mean=[255 * m for m in spec.mean], std=[255 * s for s in spec.std],
            dtype=types.FLOAT16 if spec.float16 else types.FLOAT, output_layout=spec.layout)
        pipe.set_outputs(images, labels)
    pipe.build()
    return pipe


def dali_decodes(data: np.ndarray) -> bool:
    """Whether DALI's CPU decoder accepts these bytes (a throw-away one-sample pipeline: a failure kills it)."""
    pipe = Pipeline(batch_size=1, num_threads=1, device_id=None)
    with pipe:
        pipe.set_outputs(fn.decoders.image(fn.external_source(source=lambda: [data], batch=True),
                                           output_type=types.RGB))
    try:
        pipe.build()
        pipe.run()
        return True
    except RuntimeError:
        return False
