"""The ImageNet folder layout, and the clear error when a dataset is not where the config says."""

from __future__ import annotations

from pathlib import Path

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")

PREPARE_HINT = ("prepare it with `make digits` (the embedded default: scikit-learn's handwritten digits), or "
                "for ImageNet extract ILSVRC2012 into train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (README, "
                "'Running on a cluster')")


class DatasetNotFoundError(ValueError):
    """The dataset folder, a split, or its class folders are missing or empty."""


def class_folders(root: str | Path, split: str) -> list[str]:
    """Sorted class folder names of `root/split`; raises DatasetNotFoundError naming what was looked for."""
    split_dir = Path(root) / split
    if not split_dir.is_dir():
        raise DatasetNotFoundError(
            f"no dataset at {split_dir.resolve()} (looked for {split}/<class>/*.JPEG under data.root="
            f"{root}); {PREPARE_HINT}")
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not classes:
        raise DatasetNotFoundError(f"{split_dir.resolve()} has no class folders; {PREPARE_HINT}")
    empty = [c for c in classes if not any(f.suffix.lower() in IMAGE_EXTENSIONS for f in (split_dir / c).iterdir())]
    if empty:
        raise DatasetNotFoundError(f"{split_dir.resolve()}: class folder(s) without images: {', '.join(empty[:5])}"
                                   f"{' ...' if len(empty) > 5 else ''}")
    return classes


def check_dataset(root: str | Path) -> int:
    """Both splits exist with the same classes; returns the number of classes."""
    train, val = class_folders(root, "train"), class_folders(root, "val")
    if train != val:
        missing = sorted(set(train) ^ set(val))
        raise DatasetNotFoundError(f"{Path(root).resolve()}: train/ and val/ have different classes "
                                   f"(e.g. {', '.join(missing[:5])})")
    return len(train)
