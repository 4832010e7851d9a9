"""The ImageNet folder layout: list a split (local path or any fsspec URL), and say clearly what is missing.

A split is `root/<split>/<class>/<file>` with class folders sorted by name (the label is the position, as
in torchvision's ImageFolder) and files sorted within their class. The listing carries each file's size
and a key (a hash of paths, sizes and modification times) that names the cache entries built from it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")

PREPARE_HINT = ("prepare it with `make digits` (the embedded default: scikit-learn's handwritten digits), or "
                "for ImageNet extract ILSVRC2012 into train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (README, "
                "'Running on a cluster')")

log = logging.getLogger(__name__)


class DatasetNotFoundError(ValueError):
    """The dataset folder, a split, or its class folders are missing or empty."""


def has_image_extension(path: str) -> bool:
    """The file filter of both backends (ImageFolder gets it as is_valid_file), so they list the same files."""
    return path.lower().endswith(IMAGE_EXTENSIONS)


@dataclass(frozen=True)
class Split:
    """The files of one split: `files[i]` (relative to `folder`, a path or URL) has label `labels[i]` and
    `sizes[i]` bytes."""

    name: str
    folder: str
    classes: list[str]
    files: list[str]
    labels: np.ndarray
    sizes: np.ndarray
    key: str

    def __len__(self) -> int:
        return len(self.files)

    def url(self, i: int) -> str:
        return f"{self.folder}/{self.files[i]}"


def _split_folder(root: str | Path, split: str) -> tuple[fsspec.AbstractFileSystem, str, str]:
    """(filesystem, folder path on it, folder as shown to the user: an absolute path or the URL)."""
    fs, base = fsspec.core.url_to_fs(str(root))
    folder = f"{base.rstrip('/')}/{split}".rstrip("/")
    return fs, folder, folder if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(folder)


def class_folders(root: str | Path, split: str) -> list[str]:
    """Sorted class folder names of `root/split`; raises DatasetNotFoundError naming what was looked for."""
    fs, folder, shown = _split_folder(root, split)
    if not fs.isdir(folder):
        raise DatasetNotFoundError(f"no dataset at {shown} (looked for {split}/<class>/*.JPEG under data.root="
                                   f"{root}); {PREPARE_HINT}")
    classes = sorted(Path(e["name"]).name for e in fs.ls(folder, detail=True) if e["type"] == "directory")
    if not classes:
        raise DatasetNotFoundError(f"{shown} has no class folders; {PREPARE_HINT}")
    return classes


def list_split(root: str | Path, split: str, classes: list[str] | None = None) -> Split:
    """Every image of `root/split` with its label; an empty class folder keeps its label with a warning."""
    fs, folder, shown = _split_folder(root, split)
    classes = classes if classes is not None else class_folders(root, split)
    found = fs.find(folder, detail=True)
    prefix = folder.rstrip("/") + "/"
    label_of = {c: i for i, c in enumerate(classes)}
    rows = []
    for path, info in found.items():
        rel = path[len(prefix):] if path.startswith(prefix) else path
        cls = rel.split("/", 1)[0]
        if "/" in rel and cls in label_of and has_image_extension(rel):
            rows.append((label_of[cls], rel, int(info.get("size") or 0), info.get("mtime") or info.get("LastModified")))
    if not rows:
        raise DatasetNotFoundError(f"{shown}: no images in any class folder (looked for *.JPEG, *.jpg, *.png); "
                                   f"{PREPARE_HINT}")
    rows.sort(key=lambda r: (r[0], r[1]))
    empty = sorted(set(classes) - {classes[r[0]] for r in rows})
    if empty:
        log.warning("%s: class folder(s) without images: %s%s; they keep their labels but have no samples",
                    shown, ", ".join(empty[:5]), " ..." if len(empty) > 5 else "")
    digest = hashlib.sha1(f"{folder}\n".encode())
    for _, rel, size, mtime in rows:
        digest.update(f"{rel}\t{size}\t{mtime}\n".encode())
    return Split(name=split, folder=shown, classes=classes, files=[r[1] for r in rows],
                 labels=np.array([r[0] for r in rows], dtype=np.int64),
                 sizes=np.array([r[2] for r in rows], dtype=np.int64), key=digest.hexdigest()[:16])


def check_dataset(root: str | Path) -> int:
    """Both splits exist with the same classes; returns the number of classes."""
    train, val = class_folders(root, "train"), class_folders(root, "val")
    if train != val:
        missing = sorted(set(train) ^ set(val))
        raise DatasetNotFoundError(f"{_split_folder(root, '')[2]}: train/ and val/ have different "
                                   f"classes (e.g. {', '.join(missing[:5])})")
    return len(train)
