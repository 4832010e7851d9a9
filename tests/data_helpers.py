"""Small ImageNet-layout folders written for the data tests: real JPEG/PNG files, made with PIL."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from data import CacheConfig, DataConfig

GRAY_STEP = 7  # image k of an id-coded folder is uniformly gray at 10 + 7k, so a decoded pixel names it


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A smooth random RGB image (gradients and blobs compress and resize like photos, unlike noise)."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [np.sin(x * rng.uniform(2, 9) + y * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)]
    return Image.fromarray(((np.stack(channels, -1) + 1) * 127.5).astype(np.uint8))


def write_folder(root: Path, classes: int = 3, per_class: int = 4, val_per_class: int = 2, seed: int = 0,
                 sizes: tuple[int, int] = (40, 72)) -> Path:
    """root/{train,val}/c<k>/<n>.JPEG: photo-like JPEGs of random sizes in `sizes`."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(count):
                w, h = (int(v) for v in rng.integers(*sizes, size=2))
                photo(rng, w, h).save(folder / f"{n:03d}.JPEG", quality=92)
    return root


def write_id_coded_folder(root: Path, n: int, classes: int = 3) -> Path:
    """n uniformly gray training images (image k has level 10 + 7k), varied sizes; 3 validation images."""
    rng = np.random.default_rng(1)
    for split, count in (("train", n), ("val", classes)):
        for k in range(count):
            folder = root / split / f"c{k % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            w, h = (int(v) for v in rng.integers(24, 48, size=2))
            Image.new("RGB", (w, h), (10 + GRAY_STEP * k,) * 3).save(folder / f"{k:03d}.JPEG", quality=95)
    return root


def decoded_ids(images, cfg: DataConfig) -> list[int]:
    """The ids of id-coded images from a normalized batch (the mean pixel of channel 0, un-normalized)."""
    level = (images[:, 0].float().mean(dim=(1, 2)) * cfg.std[0] + cfg.mean[0]) * 255
    return [round((float(v) - 10) / GRAY_STEP) for v in level]


def jpeg_bytes(img: Image.Image, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, **kw)
    return out.getvalue()


def broken_huffman_jpeg(img: Image.Image) -> bytes:
    """A JPEG whose header parses (size, end marker) but whose scan names undefined Huffman tables:
    PIL's header check passes it, the decoders fail — it is only found once DALI fails on it."""
    data = bytearray(jpeg_bytes(img))
    sos = data.find(b"\xff\xda")
    for c in range(data[sos + 4]):
        data[sos + 6 + 2 * c] = 0x33
    return bytes(data)


ODD_FILES = {"cmyk.JPEG": "decoded", "gray.JPEG": "decoded", "png_named.JPEG": "decoded",
             "truncated.JPEG": "skipped", "not_an_image.JPEG": "skipped", "broken_huffman.JPEG": "skipped"}


def write_odd_files(folder: Path, seed: int = 5) -> None:
    """The kinds of odd files ImageNet holds, next to normal ones."""
    img = photo(np.random.default_rng(seed), 60, 50)
    img.convert("CMYK").save(folder / "cmyk.JPEG", "JPEG", quality=90)
    img.convert("L").save(folder / "gray.JPEG", "JPEG", quality=90)
    img.save(folder / "png_named.JPEG", "PNG")
    whole = jpeg_bytes(img)
    (folder / "truncated.JPEG").write_bytes(whole[: len(whole) // 2])
    (folder / "not_an_image.JPEG").write_bytes(b"<html>404 not found</html>")
    (folder / "broken_huffman.JPEG").write_bytes(broken_huffman_jpeg(img))


def dali_config(root: Path, tmp: Path, **cache: object) -> DataConfig:
    """The DALI backend on `root` with L2 in `tmp/ram` and L1/L3 in `tmp/cache` unless overridden."""
    (tmp / "ram").mkdir(exist_ok=True)
    options = {"dir": str(tmp / "cache"), "ram_dir": str(tmp / "ram"), "lowres_max_image_size": 32, **cache}
    return DataConfig(root=str(root), backend="dali", workers=1, cache=CacheConfig(**options))
