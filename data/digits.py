"""scikit-learn's handwritten digits (real data: 1,797 8x8 scans, 10 classes) as an ImageFolder tree.

Each 8x8 image (16 grey levels) is upscaled with bicubic interpolation and saved as a JPEG in ImageNet layout:
out/{train,val}/<digit>/<index>.JPEG. The split is stratified and deterministic (20% held out). A `.complete`
marker makes reruns a no-op; a half-written tree (no marker) is rebuilt from scratch. The command line is
scripts/prepare_digits.py (`make digits`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm


def prepare(out: Path, size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """Write the tree (if not complete already) and return `out`."""
    if (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    idx_train, idx_val = train_test_split(np.arange(len(images)), test_size=val_fraction, random_state=seed,
                                          stratify=digits.target)
    jobs = [("train", i) for i in idx_train] + [("val", i) for i in idx_val]
    for split, i in tqdm(jobs, desc=f"writing digits to {out}", unit="img"):
        folder = out / split / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(images[i], mode="L").resize((size, size), Image.BICUBIC)
        img.save(folder / f"{i:05d}.JPEG", quality=95)
    (out / ".complete").write_text(f"{len(idx_train)} train, {len(idx_val)} val, {size}px\n")
    return out

