"""An ImageNet-like folder of real-photo JPEGs (varied sizes, 300-500 px) for the data benchmarks and tests.

No image set ships with the repository's packages beyond scikit-learn's two sample photos (china.jpg,
flower.jpg, 640x427), so each class is a region of one of them: 5 regions per photo, 10 classes. Every
image is a random crop around its region's centre (25-80% of the photo's height, aspect 3:4 to 4:3),
randomly mirrored, rotated by up to 15 degrees, with brightness, contrast and colour jitter, resized to
a random 300-500 x 300-500 px and saved as a JPEG of quality 70-95: natural-photo content at ImageNet's
typical resolution and file size, so JPEG decoding costs what it costs on ImageNet. Deterministic (seed).
`odd=True` adds, to each split, the file kinds ImageNet is known to contain: a CMYK JPEG, a grayscale JPEG,
a PNG named .JPEG, and a truncated JPEG. A `.complete` marker makes reruns a no-op. The command line is
scripts/make_imagenet_like.py (`make imagenet-like`).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance
from sklearn.datasets import load_sample_images
from tqdm import tqdm

REGIONS = ((0.5, 0.5), (0.25, 0.3), (0.75, 0.3), (0.25, 0.7), (0.75, 0.7))  # centres, as fractions of the photo


def photo_classes() -> list[tuple[Image.Image, tuple[float, float]]]:
    """(photo, region centre) for each class."""
    photos = [Image.fromarray(p) for p in load_sample_images().images]
    return [(photo, centre) for photo in photos for centre in REGIONS]


def random_view(photo: Image.Image, centre: tuple[float, float], rng: np.random.Generator) -> Image.Image:
    """One jittered crop of `photo` around `centre`, resized to a random 300-500 px rectangle."""
    pw, ph = photo.size
    h = ph * rng.uniform(0.25, 0.8)
    w = min(pw, h * rng.uniform(0.75, 4 / 3))
    cx = np.clip(centre[0] * pw + rng.normal(0, 0.05 * pw), w / 2, pw - w / 2)
    cy = np.clip(centre[1] * ph + rng.normal(0, 0.05 * ph), h / 2, ph - h / 2)
    img = photo.crop((round(cx - w / 2), round(cy - h / 2), round(cx + w / 2), round(cy + h / 2)))
    img = img.rotate(rng.uniform(-15, 15), resample=Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        img = enhance(img).enhance(rng.uniform(0.7, 1.3))
    size = (int(rng.integers(300, 501)), int(rng.integers(300, 501)))
    return img.resize(size, Image.Resampling.BICUBIC)


def jpeg_bytes(img: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality)
    return out.getvalue()


def write_odd_files(folder: Path, img: Image.Image) -> None:
    """The odd kinds of files ImageNet contains, made from a normal image."""
    img.convert("CMYK").save(folder / "odd_cmyk.JPEG", "JPEG", quality=90)
    img.convert("L").save(folder / "odd_gray.JPEG", "JPEG", quality=90)
    img.save(folder / "odd_png.JPEG", "PNG")
    data = jpeg_bytes(img, 90)
    (folder / "odd_truncated.JPEG").write_bytes(data[: len(data) // 2])


def prepare(out: Path, train: int = 3000, val: int = 500, odd: bool = False, seed: int = 0) -> Path:
    """Write the tree (if not complete already) and return `out`."""
    if (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    classes = photo_classes()
    rng = np.random.default_rng(seed)
    jobs = [("train", i) for i in range(train)] + [("val", i) for i in range(val)]
    for split, i in tqdm(jobs, desc=f"writing ImageNet-like JPEGs to {out}", unit="img"):
        label = i % len(classes)
        folder = out / split / f"n{label:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        img = random_view(*classes[label], rng)
        (folder / f"{split}_{i:06d}.JPEG").write_bytes(jpeg_bytes(img, int(rng.integers(70, 96))))
        if odd and i == 0:
            write_odd_files(folder, img)
    (out / ".complete").write_text(f"{train} train, {val} val, {len(classes)} classes, odd files: {odd}\n")
    return out

