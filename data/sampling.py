"""Which samples each rank reads, and the random crops and flips, as pure functions of (seed, epoch, rank, step).

Training order comes from torch's DistributedSampler (the torchvision backend uses the same): one
permutation per epoch, identical on every rank, each rank taking every world-th index, the tail that
does not fill a global batch dropped so every rank runs the same number of steps. Augmentation draws
come from a generator seeded by (seed, epoch, rank, step), so a resumed run sees the same crops as an
uninterrupted one, and the same numbers whichever cache level serves the pixels.
"""

from __future__ import annotations

import math

import numpy as np
from torch.utils.data import DistributedSampler

ASPECT_RATIOS = (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop default


def train_batches(n: int, world: int, rank: int, batch: int, seed: int, epoch: int) -> np.ndarray:
    """This rank's batches of epoch `epoch` as a (steps, batch) array of sample indices."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    mine = np.fromiter(iter(sampler), dtype=np.int64)
    steps = len(mine) // batch
    return mine[:steps * batch].reshape(steps, batch)


def val_batches(samples: int | np.ndarray, world: int, rank: int, batch: int) -> list[np.ndarray]:
    """This rank's share of the validation set in order (every world-th of `samples`: indices, or a count n
    for all of 0..n-1), the last batch possibly short."""
    indices = np.arange(samples, dtype=np.int64) if np.isscalar(samples) else np.asarray(samples, dtype=np.int64)
    mine = indices[rank::world]
    return [mine[i:i + batch] for i in range(0, len(mine), batch)]


def augment_rng(seed: int, epoch: int, rank: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, rank, step])


def random_resized_crops(heights: np.ndarray, widths: np.ndarray, scale: tuple[float, float],
                         rng: np.random.Generator, ratio: tuple[float, float] = ASPECT_RATIOS,
                         attempts: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(top, left, height, width) per image: torchvision's RandomResizedCrop.get_params, for a whole batch.

    Up to `attempts` tries of an area fraction in `scale` and a log-uniform aspect ratio in `ratio`; the
    first that fits is taken, else the central crop clamped to the ratio range (as torchvision does).
    """
    H, W = heights.astype(np.float64)[:, None], widths.astype(np.float64)[:, None]
    n = len(heights)
    area = H * W * rng.uniform(scale[0], scale[1], (n, attempts))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, attempts)))
    tries_w, tries_h = np.rint(np.sqrt(area * aspect)), np.rint(np.sqrt(area / aspect))
    fits = (tries_w > 0) & (tries_w <= W) & (tries_h > 0) & (tries_h <= H)
    first, found = fits.argmax(axis=1), fits.any(axis=1)
    rows = np.arange(n)
    H, W = H[:, 0], W[:, 0]
    in_ratio = W / H
    fallback_w = np.where(in_ratio > ratio[1], np.rint(H * ratio[1]), W)
    fallback_h = np.where(in_ratio < ratio[0], np.rint(W / ratio[0]), H)
    w = np.where(found, tries_w[rows, first], fallback_w)
    h = np.where(found, tries_h[rows, first], fallback_h)
    u_top, u_left = rng.random(n), rng.random(n)
    top = np.where(found, np.floor(u_top * (H - h + 1)), (H - h) // 2)
    left = np.where(found, np.floor(u_left * (W - w + 1)), (W - w) // 2)
    return top.astype(np.int64), left.astype(np.int64), h.astype(np.int64), w.astype(np.int64)


def shorter_side_sizes(heights: np.ndarray, widths: np.ndarray, short: int) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) after torchvision's Resize(short): the shorter side becomes `short`, the longer one
    is scaled and truncated (not rounded), so both backends crop the same pixels."""
    portrait = widths <= heights
    long = np.where(portrait, heights, widths) * short // np.where(portrait, widths, heights)
    return np.where(portrait, long, short), np.where(portrait, short, long)
