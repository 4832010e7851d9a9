"""The validation set as the DAWNBench entries evaluated it: rectangular batches and an exclusion list.

Rectangular validation (`data.rect_val_from_size`; fast.ai's imagenet18 and the DAWNBench entries'
"rect_val"): the validation images are sorted by aspect ratio (width / height, read from the file headers
without decoding and cached per listing), cut into batches of consecutive images, and every image of a
batch is center-cropped to the batch's rectangle: the phase's validation size on the shorter side, that size
x the batch's mean aspect ratio (clamped to ASPECT_RANGE, rounded down to a multiple of SIDE_MULTIPLE) on
the longer one. The network then sees most of each image instead of a square from its middle. As for the
square crop, each image is first resized to `data.val_resize_ratio` x size on its shorter side; an image
whose aspect ratio is far from its batch's is resized further, until it covers the rectangle. The batches
of the sorted order go to the ranks in turn, so every rank evaluates a disjoint share and the shares add up
to the whole set (the ranks' batch counts differ by at most one).

The exclusion list (`data.val_exclude`) names validation files to leave out, one per line: file names, or
image numbers n for ILSVRC2012_val_<n, 8 digits>.JPEG (the ILSVRC2014 devkit's blacklist format).

Both backends plan their batches and crop windows here, so they cut the same pixels.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import fsspec
import numpy as np
from PIL import Image
from tqdm import tqdm

from data.config import DataConfig, DataConfigError
from data.layout import Split
from data.sampling import shorter_side_sizes, val_batches

log = logging.getLogger(__name__)

ASPECT_RANGE = (0.5, 2.0)
"""A batch's aspect ratio (width / height) is clamped to this range: the few batches of panoramas or towers
at the ends of the sorted order would otherwise need several times the memory of a square batch."""
SIDE_MULTIPLE = 8
"""The longer side of a batch's rectangle is rounded down to a multiple of this (convolution kernels' preferred
tile; fewer distinct shapes for cudnn's autotuner), never below the shorter side."""
IMAGENET_VAL_NAME = "ILSVRC2012_val_{:08d}.JPEG"
"""The file of ImageNet validation image number n (1-based), for exclusion lists that hold numbers."""

_sizes_memo: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_memo_lock = threading.Lock()


# ---------------------------------------------------------------- image sizes from the headers


def header_size(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, int]:
    """(height, width) from the file's header (PIL parses it, decodes no pixels); (0, 0) if unreadable."""
    try:
        with fs.open(path, "rb") as f, Image.open(f) as img:
            width, height = img.size
    except (OSError, ValueError, SyntaxError):  # PIL: unidentified or truncated header; the loaders skip the file
        return 0, 0
    return height, width


def header_sizes(split: Split, cache_dir: Path | None = None, threads: int = 1,
                 progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(heights, widths) of every file of `split` (0 where the header cannot be read), read once per listing:
    kept in this process and, with a `cache_dir`, in `cache_dir/rect_val/<listing key>.npy` for later runs."""
    with _memo_lock:
        if split.key in _sizes_memo:
            return _sizes_memo[split.key]
    stored = cache_dir / "rect_val" / f"{split.key}.npy" if cache_dir is not None else None
    sizes = None
    if stored is not None and stored.is_file():
        try:
            sizes = np.load(stored)
        except (OSError, ValueError):
            sizes = None  # torn or foreign file: read the headers again
        if sizes is not None and sizes.shape != (len(split), 2):
            sizes = None
    if sizes is None:
        fs, base = fsspec.core.url_to_fs(split.folder)
        paths = [f"{base}/{f}" for f in split.files]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            read = pool.map(lambda p: header_size(fs, p), paths)
            sizes = np.array(list(tqdm(read, total=len(paths), desc=f"image sizes of {split.name}/",
                                       unit="img", disable=not progress, leave=False)),
                             dtype=np.int64).reshape(len(paths), 2)
        if stored is not None:
            store(stored, sizes)
    result = sizes[:, 0].copy(), sizes[:, 1].copy()
    with _memo_lock:
        _sizes_memo[split.key] = result
    return result


def store(path: Path, sizes: np.ndarray) -> None:
    """Write atomically (a rank of the same node may read it meanwhile); a failed write only costs a re-read."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, sizes)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("data: cannot store the validation image sizes at %s (%s); the next run reads the headers "
                    "again", path, err.strerror or err)
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- batches and crop windows


def aspect_order(indices: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """`indices` sorted by aspect ratio (width / height of the whole split's arrays), ties in listing order;
    an unreadable header (size 0) counts as square."""
    indices = np.asarray(indices, dtype=np.int64)
    h, w = heights[indices].astype(np.float64), widths[indices].astype(np.float64)
    aspect = np.where((h > 0) & (w > 0), w / np.maximum(h, 1), 1.0)
    return indices[np.argsort(aspect, kind="stable")]


def rect_batches(indices: np.ndarray, heights: np.ndarray, widths: np.ndarray, world: int, rank: int,
                 batch: int) -> list[np.ndarray]:
    """This rank's rectangular batches: the aspect-sorted `indices` cut into batches of `batch`, dealt to the
    ranks in turn (batch j to rank j mod world)."""
    order = aspect_order(indices, heights, widths)
    return [order[i:i + batch] for i in range(rank * batch, len(order), world * batch)]


def rect_shape(heights: np.ndarray, widths: np.ndarray, size: int) -> tuple[int, int]:
    """(height, width) of a batch's rectangle: `size` on the shorter side, size x the batch's mean aspect ratio
    (clamped to ASPECT_RANGE, rounded down to a multiple of SIDE_MULTIPLE, at least `size`) on the longer."""
    h, w = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    readable = (h > 0) & (w > 0)
    aspect = float(np.mean(w[readable] / h[readable])) if readable.any() else 1.0
    aspect = min(max(aspect, ASPECT_RANGE[0]), ASPECT_RANGE[1])
    if aspect >= 1:
        return size, max(size, int(size * aspect) // SIDE_MULTIPLE * SIDE_MULTIPLE)
    return max(size, int(size / aspect) // SIDE_MULTIPLE * SIDE_MULTIPLE), size


def cover_sizes(heights: np.ndarray, widths: np.ndarray, short: int, crop_h: int,
                crop_w: int) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) to resize each image to before its center crop of crop_h x crop_w: torchvision's
    Resize(short) (shorter_side_sizes), or larger, keeping the aspect ratio, where that would not cover the crop."""
    new_h, new_w = shorter_side_sizes(heights, widths, short)
    h, w = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    scale = np.maximum(crop_h / h, crop_w / w)
    short_of_crop = (new_h < crop_h) | (new_w < crop_w)
    new_h = np.where(short_of_crop, np.maximum(crop_h, np.round(h * scale)), new_h).astype(np.int64)
    new_w = np.where(short_of_crop, np.maximum(crop_w, np.round(w * scale)), new_w).astype(np.int64)
    return new_h, new_w


def center_anchors(new_h: np.ndarray, new_w: np.ndarray, crop_h: int,
                   crop_w: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, left) of the center crop, rounded as torchvision's CenterCrop: round((resized - crop) / 2), halves
    to even."""
    return (np.round((np.asarray(new_h) - crop_h) / 2).astype(np.int64),
            np.round((np.asarray(new_w) - crop_w) / 2).astype(np.int64))


def uses_rect(cfg: DataConfig, image_size: int) -> bool:
    """Whether validation at `image_size` is rectangular (data.rect_val_from_size)."""
    return 0 < cfg.rect_val_from_size <= image_size


def plan_val(kept: np.ndarray, world: int, rank: int, batch: int, size: int,
             sizes: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """This rank's validation batches (indices into the split) and each batch's (height, width): with `sizes`
    (the split's header heights and widths) rectangular batches, else size x size crops of every world-th image
    of `kept` in listing order."""
    if sizes is None:
        batches = val_batches(kept, world, rank, batch)
        return batches, [(size, size)] * len(batches)
    batches = rect_batches(kept, *sizes, world, rank, batch)
    return batches, [rect_shape(sizes[0][b], sizes[1][b], size) for b in batches]


# ---------------------------------------------------------------- the exclusion list


def exclude_list_path(cfg: DataConfig) -> str:
    """data.val_exclude as opened: an absolute path or URL as given, a relative path inside data.root."""
    path = cfg.val_exclude
    if "://" in path or Path(path).is_absolute():
        return path
    return f"{cfg.root.rstrip('/')}/{path}"


def read_exclude_list(path: str) -> set[str]:
    """The names a list holds: one per line, a file name (any folder part dropped) or an image number n
    (ILSVRC2012_val_<n>.JPEG); blank lines and lines from '#' on are ignored."""
    try:
        with fsspec.open(path, "rt") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise DataConfigError(
            f"data.val_exclude: {path} not found; it lists validation files to leave out, one per line (file "
            f"names, or image numbers as in the ILSVRC2014 devkit's data/ILSVRC2014_clsloc_validation_blacklist"
            f".txt); a relative path is read inside data.root; set data.val_exclude= to validate on every "
            f"image") from None
    names = set()
    for line in lines:
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.add(IMAGENET_VAL_NAME.format(int(entry)) if entry.isdigit() else PurePosixPath(entry).name)
    return names


def kept_indices(files: list[str], excluded: set[str]) -> np.ndarray:
    """Indices of the `files` (paths relative to the split) whose name, with or without its extension, is
    not in `excluded`."""
    return np.array([i for i, f in enumerate(files)
                     if PurePosixPath(f).name not in excluded and PurePosixPath(f).stem not in excluded],
                    dtype=np.int64)


def validation_subset(cfg: DataConfig, files: list[str], rank: int) -> np.ndarray:
    """Indices of the validation `files` to evaluate: all of them, or those data.val_exclude does not name
    (rank 0 says once how many were left out)."""
    if not cfg.val_exclude:
        return np.arange(len(files), dtype=np.int64)
    path = exclude_list_path(cfg)
    excluded = read_exclude_list(path)
    kept = kept_indices(files, excluded)
    if rank == 0:
        left_out = len(files) - len(kept)
        log.warning("data.val_exclude: %d of %d validation images left out (%s lists %d%s)", left_out, len(files),
                    path, len(excluded), "" if left_out >= len(excluded) else
                    f"; {len(excluded) - left_out} of them are not in {cfg.root}/val")
    if len(kept) == 0:
        raise DataConfigError(f"data.val_exclude: {path} leaves out every one of the {len(files)} validation "
                              f"images")
    return kept
