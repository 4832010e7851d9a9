"""The ImageNet folder layout: list a split (local path or any fsspec URL), and say clearly what is missing.

A split is `root/<split>/<class>/<file>` with class folders sorted by name (the label is the position, as
in torchvision's ImageFolder) and files sorted within their class. The listing carries each file's size
and a key (a hash of paths, sizes and modification times) that names the cache entries built from it.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
import numpy as np

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")

PREPARE_HINT = ("prepare it with `make digits` (the embedded default: scikit-learn's handwritten digits), or "
                "for ImageNet from the official archives with `make prepare-imagenet ARCHIVES=<folder of the "
                "ILSVRC2012 tars> DATA=<root>` (docs/data-and-cache.md)")
SORT_HINT = ("sort them into class folders with `python scripts/prepare_imagenet.py --out {root} --devkit "
             "ILSVRC2012_devkit_t12.tar.gz` (or --val-labels LOC_val_solution.csv)")

# ILSVRC2012 (the ImageNet of the recipes): its class folders are WordNet ids; every class has 50 validation
# images and between 732 and 1,300 training images.
IMAGENET_CLASSES, IMAGENET_TRAIN, IMAGENET_VAL = 1000, 1_281_167, 50_000
IMAGENET_VAL_PER_CLASS, IMAGENET_MIN_TRAIN_PER_CLASS = 50, 732
WNID = re.compile(r"n\d{8}")
STAGING = ".prepare"
"""scripts/prepare_imagenet.py's work folder inside the root (beside train/ and val/, never inside them)."""

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
    entries = fs.ls(folder, detail=True)
    classes = sorted(Path(e["name"]).name for e in entries if e["type"] == "directory")
    if not classes:
        flat = sum(e["type"] != "directory" and has_image_extension(e["name"]) for e in entries)
        if flat:  # the validation tar extracted as is: every label would be wrong (0.1% top-1 on ImageNet)
            raise DatasetNotFoundError(f"{shown} holds {flat} images that are not sorted into class folders "
                                       f"(training would validate at chance level); {SORT_HINT.format(root=root)}")
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


@dataclass
class SplitCounts:
    """Images per class folder of one split, and the images lying directly in the split folder."""

    per_class: dict[str, int]
    flat: int = 0
    examples_flat: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.per_class.values())


def count_split(root: str | Path, split: str) -> SplitCounts:
    """Images per class of `root/split` (one listing of the split); DatasetNotFoundError if it is missing."""
    fs, folder, shown = _split_folder(root, split)
    if not fs.isdir(folder):
        raise DatasetNotFoundError(f"no {split}/ at {shown}; {PREPARE_HINT}")
    prefix = folder.rstrip("/") + "/"
    per_class: Counter[str] = Counter({Path(e["name"]).name: 0 for e in fs.ls(folder, detail=True)
                                       if e["type"] == "directory"})
    flat: list[str] = []
    for path in fs.find(folder):
        rel = path[len(prefix):] if path.startswith(prefix) else path
        if not has_image_extension(rel):
            continue
        if "/" in rel:
            per_class[rel.split("/", 1)[0]] += 1
        else:
            flat.append(rel)
    return SplitCounts(dict(per_class), len(flat), sorted(flat)[:3])


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def is_imagenet(classes: list[str]) -> bool:
    """WordNet-id class folders, about a thousand of them: ILSVRC2012, possibly incomplete."""
    return len(classes) > 0.9 * IMAGENET_CLASSES and all(WNID.fullmatch(c) for c in classes)


def preflight(root: str | Path, expect: str = "auto") -> str:
    """The launchers' check of a dataset folder before a run: one line on success; DatasetNotFoundError listing
    every problem found otherwise. `expect`: "imagenet" checks ILSVRC2012's 1,000 classes, 1,281,167 training
    and 50,000 validation images; "auto" does so when the class folders are WordNet ids; "any" checks only
    that both splits exist, have the same classes, no empty class and no unsorted images."""
    if expect not in ("auto", "imagenet", "any"):
        raise ValueError(f"expect: one of auto, imagenet, any; got {expect!r}")
    shown = _split_folder(root, "")[2].rstrip("/")
    fs, base = fsspec.core.url_to_fs(str(root))
    if not fs.isdir(base):
        raise DatasetNotFoundError(f"no dataset at {shown}; {PREPARE_HINT}")
    problems = []
    if fs.isdir(f"{base.rstrip('/')}/{STAGING}"):
        problems.append(f"{STAGING}/ is there: a preparation was interrupted; run scripts/prepare_imagenet.py "
                        f"again with the same arguments to finish it")
    archives = sorted(Path(a).name for a in fs.glob(f"{base.rstrip('/')}/ILSVRC2012_img_*.tar"))
    if archives:
        problems.append(f"it holds the ILSVRC2012 archives ({', '.join(archives)}), not the prepared folders: "
                        f"`python scripts/prepare_imagenet.py --archives {root} --out <dataset root>` prepares them")
    counts = []
    for split in ("train", "val"):
        try:
            counts.append(count_split(root, split))
        except DatasetNotFoundError:
            problems.append(f"no {split}/ folder")
            counts.append(SplitCounts({}))
    train, val = counts
    imagenet = expect == "imagenet" or (expect == "auto" and is_imagenet(sorted(train.per_class)))
    if val.flat:
        problems.append(f"val/ holds {val.flat} images outside class folders (e.g. {_some(val.examples_flat, 3)}): "
                        f"an unsorted validation set scores at chance level; {SORT_HINT.format(root=root)}")
    if train.flat:
        problems.append(f"train/ holds {train.flat} images outside class folders (e.g. "
                        f"{_some(train.examples_flat, 3)}); each image belongs in train/<class>/")
    only_train = sorted(set(train.per_class) - set(val.per_class))
    only_val = sorted(set(val.per_class) - set(train.per_class))
    if only_train and val.per_class:  # (no class folder at all in val/ is said above)
        problems.append(f"{len(only_train)} classes in train/ have no folder in val/: {_some(only_train)}")
    if only_val and train.per_class:
        problems.append(f"{len(only_val)} classes in val/ have no folder in train/: {_some(only_val)}")
    for name, split_counts in (("train", train), ("val", val)):
        if not split_counts.per_class and not split_counts.flat and fs.isdir(f"{base.rstrip('/')}/{name}"):
            problems.append(f"{name}/ has no class folders")
        empty = sorted(c for c, n in split_counts.per_class.items() if n == 0)
        if empty:
            problems.append(f"{len(empty)} class folders of {name}/ hold no images: {_some(empty)}")
    if imagenet:
        problems += _imagenet_problems(train, val)
    what = "ImageNet (ILSVRC2012)" if imagenet else "dataset"
    if problems:
        interrupted = problems[0].startswith(STAGING)  # the rerun is the whole answer
        hint = f"\n  ({PREPARE_HINT})" if (not train.per_class or not val.per_class) and not interrupted else ""
        raise DatasetNotFoundError(f"{shown}: {what} not ready:\n  " + "\n  ".join(problems) + hint)
    return (f"{shown}: {what}, {len(train.per_class)} classes, {train.total:,} training and {val.total:,} "
            f"validation images: ok")


def _imagenet_problems(train: SplitCounts, val: SplitCounts) -> list[str]:
    problems = []
    bad_names = sorted(c for c in set(train.per_class) | set(val.per_class) if not WNID.fullmatch(c))
    if bad_names:
        problems.append(f"{len(bad_names)} class folders are not WordNet ids (n + 8 digits): {_some(bad_names)}")
    if len(train.per_class) != IMAGENET_CLASSES:
        problems.append(f"train/ has {len(train.per_class)} class folders, ImageNet has {IMAGENET_CLASSES:,}")
    if train.total != IMAGENET_TRAIN:
        short = sorted(c for c, n in train.per_class.items() if 0 < n < IMAGENET_MIN_TRAIN_PER_CLASS)
        problems.append(f"train/ has {train.total:,} images, ImageNet has {IMAGENET_TRAIN:,} "
                        f"({IMAGENET_TRAIN - train.total:+,} to go)"
                        + (f"; classes under ImageNet's smallest ({IMAGENET_MIN_TRAIN_PER_CLASS}): "
                           + _some([f"{c} ({train.per_class[c]})" for c in short]) if short else ""))
    if len(val.per_class) != IMAGENET_CLASSES and val.per_class:
        problems.append(f"val/ has {len(val.per_class)} class folders, ImageNet has {IMAGENET_CLASSES:,}")
    if val.total != IMAGENET_VAL:
        problems.append(f"val/ has {val.total:,} images in class folders, ImageNet has {IMAGENET_VAL:,}")
    off = sorted(c for c, n in val.per_class.items() if n != IMAGENET_VAL_PER_CLASS)
    if off and val.total:
        problems.append(f"{len(off)} classes of val/ do not hold {IMAGENET_VAL_PER_CLASS} images (wrongly sorted "
                        f"or incomplete): " + _some([f"{c} ({val.per_class[c]})" for c in off]))
    return problems
