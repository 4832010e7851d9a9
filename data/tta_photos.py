"""The time-to-accuracy task (`prepare` writes it): classes that are regions of 20 real photographs, training
JPEGs of 300-500 px and validation images already decoded to the evaluation resolution.

The photos are the real photographs that ship inside installed wheels: 18 of scikit-image's `skimage.data`
(astronaut, brick, camera, chelsea the cat, clock, coffee, coins, grass, gravel, the Hubble deep field, an
immunohistochemistry slide, the moon, a scanned page, a retina, a rocket launch, scanned text, a cell, the left
frame of stereo_motorcycle; grayscale ones become 3 equal channels) and scikit-learn's two (china.jpg,
flower.jpg). The drawings and synthetic images of skimage.data (checkerboard, colour wheel, logo, horse
silhouette, blobs) are left out. Each photo gives `regions` classes, centred along its horizontal mid-line
(2: at 30% and 70% of its width), so that 2 of every photo's classes are views of overlapping parts of one
picture: the model has to tell regions of the same photo apart, not only photos.

Every image is data.imagenet_like.random_view of its class: a random crop around the region's centre (25-80% of
the photo's height, aspect 3:4 to 4:3, centre jittered by 5% of the photo), mirrored half the time, rotated by up
to 15 degrees, with brightness, contrast and colour jitter, resized to a random 300-500 x 300-500 px. Training
images are saved as JPEGs of quality 70-95, so decoding them costs what it costs on ImageNet. Validation images
are the same kind of view, resized (PIL, antialiased bilinear) so the shorter side is 55 px, center-cropped to
55 x 55 and saved as lossless PNG: every reader decodes exactly the same pixels, and the evaluation's resize to a
shorter side of 55 px (round(48 x 1.14)) is the identity, so a 48 px center crop is the same input on every
side. Classes are balanced (image i has class i mod classes). Deterministic (seed); a `.complete` marker makes a
rerun a no-op.

What it is and is not: real photographic texture, colour and JPEG statistics at ImageNet's file sizes, with the
same photo behind training and validation images of a class (views differ by crop, angle, mirror and colour).
It is not ImageNet: there are no new objects at test time, and high accuracy comes within a few epochs.
The command line is scripts/make_tta_photos.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from data.imagenet_like import jpeg_bytes, random_view

SKIMAGE_PHOTOS = ("astronaut", "brick", "camera", "chelsea", "clock", "coffee", "coins", "grass", "gravel",
                  "hubble_deep_field", "immunohistochemistry", "moon", "page", "retina", "rocket", "text", "cell",
                  "stereo_motorcycle")
VAL_SIDE = 55  # the shorter side both sides' validation resizes to (48 px crop x 1.14)


def photos() -> list[tuple[str, Image.Image]]:
    """(name, RGB photo) for the 20 real photographs, in a fixed order."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    out = []
    for name in SKIMAGE_PHOTOS:
        pixels = getattr(skimage.data, name)()
        if isinstance(pixels, tuple):  # stereo_motorcycle: (left, right, disparity)
            pixels = pixels[0]
        out.append((name, Image.fromarray(np.asarray(pixels, dtype=np.uint8)).convert("RGB")))
    sample = load_sample_images()
    for path, pixels in zip(sample.filenames, sample.images):
        out.append((Path(path).stem, Image.fromarray(pixels).convert("RGB")))
    return out


def region_centres(regions: int) -> list[tuple[float, float]]:
    """`regions` centres evenly along the photo's horizontal mid-line, away from the edges."""
    if regions < 1:
        raise ValueError(f"regions: must be >= 1, got {regions}")
    if regions == 1:
        return [(0.5, 0.5)]
    return [(0.3 + 0.4 * k / (regions - 1), 0.5) for k in range(regions)]


def val_pixels(img: Image.Image) -> Image.Image:
    """Shorter side to VAL_SIDE (antialiased bilinear), center crop VAL_SIDE x VAL_SIDE."""
    w, h = img.size
    scale = VAL_SIDE / min(w, h)
    img = img.resize((max(VAL_SIDE, round(w * scale)), max(VAL_SIDE, round(h * scale))), Image.Resampling.BILINEAR)
    w, h = img.size
    left, top = (w - VAL_SIDE) // 2, (h - VAL_SIDE) // 2
    return img.crop((left, top, left + VAL_SIDE, top + VAL_SIDE))


def prepare(out: Path, train: int = 2000, val: int = 2000, regions: int = 2, seed: int = 0,
            photo_limit: int = 0) -> Path:
    """Write the tree (if not complete already) and return `out`; photo_limit > 0 uses only the first photos."""
    if (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    chosen = photos()[:photo_limit] if photo_limit > 0 else photos()
    classes = [(name, photo, centre) for name, photo in chosen for centre in region_centres(regions)]
    rng = np.random.default_rng(seed)
    jobs = [("train", i) for i in range(train)] + [("val", i) for i in range(val)]
    for split, i in tqdm(jobs, desc=f"writing {len(classes)}-class photo views to {out}", unit="img"):
        label = i % len(classes)
        name, photo, centre = classes[label]
        folder = out / split / f"{label:03d}_{name}_{round(100 * centre[0])}"
        folder.mkdir(parents=True, exist_ok=True)
        img = random_view(photo, centre, rng)
        if split == "train":
            (folder / f"{split}_{i:06d}.JPEG").write_bytes(jpeg_bytes(img, int(rng.integers(70, 96))))
        else:
            val_pixels(img).save(folder / f"{split}_{i:06d}.png", "PNG")
    (out / ".complete").write_text(f"{train} train, {val} val, {len(classes)} classes from {len(chosen)} photos, "
                                   f"seed {seed}\n")
    return out
