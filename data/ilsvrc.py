"""The official ILSVRC2012 archives → the ImageNet folder layout of data/layout.py (train/<wnid>/*.JPEG,
val/<wnid>/*.JPEG), as image-net.org distributes them:

    ILSVRC2012_img_train.tar       one archive per class, n<8 digits>.tar, each holding that class's JPEGs
    ILSVRC2012_img_val.tar         50,000 JPEGs ILSVRC2012_val_<8 digits>.JPEG, without labels
    validation labels, one of:
      ILSVRC2012_devkit_t12.tar.gz   data/meta.mat (ILSVRC2012_ID -> WordNet id) and
                                     data/ILSVRC2012_validation_ground_truth.txt (line i: the ID of image i)
      LOC_val_solution.csv           Kaggle's ImageNet Object Localization Challenge (ImageId,PredictionString:
                                     the first word of the prediction string is the WordNet id)
      a text file                    "ILSVRC2012_val_00000001.JPEG n01751748" per line (a valprep.sh's
                                     "mv FILE WNID/" lines too), or one WordNet id per line in image order

Extraction streams from the archives (a class archive at a time, never the whole tar in memory) into a work
folder `root/.prepare/` and renames each finished class folder into place, so a folder under train/ is
complete by its presence: a run that was interrupted (killed, a full disk, a bad archive) is finished by
running it again, which skips the classes already there and redoes a half-written one. Validation images are
written one by one into `.prepare/val/<wnid>/` (a file there is complete) and the folder becomes val/ when
every image is in place. The work folder goes once both splits are done; data.layout.preflight reports one
left behind.

torchvision.datasets.ImageNet parses the same archives, but only after checking their MD5 against the
official files and by extracting each whole archive first; the devkit parser here reads the same two devkit
files by the same rules (the 1,000 leaf synsets of meta.mat: num_children == 0).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import tarfile
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from tqdm import tqdm

from data.layout import STAGING, WNID, has_image_extension

TRAIN_TAR, VAL_TAR, DEVKIT = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"
LABEL_FILES = ("LOC_val_solution.csv",)
DOWNLOADS = "https://image-net.org/challenges/LSVRC/2012/2012-downloads.php (an account is needed)"


class PrepareError(ValueError):
    """An archive or label file that is missing, damaged or does not match the others; the message says which."""


# ---------------------------------------------------------------- validation labels

def val_file_name(i: int) -> str:
    """The name of the i-th (1-based) validation image."""
    return f"ILSVRC2012_val_{i:08d}.JPEG"


def labels_from_devkit(path: Path) -> dict[str, str]:
    """Validation file name → WordNet id, from the devkit's meta.mat and validation ground truth."""
    import scipy.io

    try:
        with tarfile.open(path) as tar:
            members = {Path(m.name).name: m for m in tar if m.isfile()}
            missing = [n for n in ("meta.mat", "ILSVRC2012_validation_ground_truth.txt") if n not in members]
            if missing:
                raise PrepareError(f"{path}: no {' or '.join(missing)} in the archive (is it the ILSVRC2012 "
                                   f"devkit, {DEVKIT}?)")
            meta = io.BytesIO(tar.extractfile(members["meta.mat"]).read())
            truth = tar.extractfile(members["ILSVRC2012_validation_ground_truth.txt"]).read().decode().split()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepareError(f"{path}: not a readable .tar.gz ({e})") from None
    synsets = scipy.io.loadmat(meta, squeeze_me=True)["synsets"]
    wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
    try:
        return {val_file_name(i): wnid_of[int(idx)] for i, idx in enumerate(truth, start=1)}
    except (KeyError, ValueError) as e:
        raise PrepareError(f"{path}: the validation ground truth names class ID {e}, which meta.mat does not "
                           f"list among its leaf synsets") from None


def labels_from_file(path: Path) -> dict[str, str]:
    """Validation file name → WordNet id, from a Kaggle LOC_val_solution.csv or a text list (see the module doc)."""
    text = path.read_text()
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if lines and lines[0] and lines[0][0].startswith("ImageId,"):
        rows = list(csv.reader(io.StringIO(text)))[1:]
        pairs = [(r[0], r[1].split()[0]) for r in rows if len(r) >= 2 and r[1].strip()]
    elif lines and all(len(words) == 1 for words in lines):
        pairs = [(val_file_name(i), words[0]) for i, words in enumerate(lines, start=1)]
    else:
        pairs = []
        for n, words in enumerate(lines, start=1):
            words = [w for w in words if w != "mv"]
            if len(words) != 2:
                raise PrepareError(f"{path}:{n}: expected 'FILE WNID', 'mv FILE WNID/' or one WordNet id per "
                                   f"line, got {' '.join(words)!r}")
            pairs.append((words[0], words[1].rstrip("/")))
    labels = {}
    for name, wnid in pairs:
        name = Path(name).name
        labels[name if has_image_extension(name) else f"{name}.JPEG"] = wnid
    bad = sorted({w for w in labels.values() if not WNID.fullmatch(w)})
    if not labels or bad:
        raise PrepareError(f"{path}: " + (f"labels that are not WordNet ids (n + 8 digits): {', '.join(bad[:5])}"
                                          if bad else "no labels found"))
    return labels


def copy_blacklists(devkit: Path, out: Path) -> list[str]:
    """The validation blacklists a devkit archive holds (*validation_blacklist.txt: the ILSVRC2014 devkit's is
    the DAWNBench configs' data.val_exclude), copied into `out`; returns their names."""
    if not devkit.name.endswith((".tar.gz", ".tgz", ".tar")):
        return []
    copied = []
    with tarfile.open(devkit) as tar:
        for m in tar:
            if m.isfile() and m.name.endswith("validation_blacklist.txt"):
                data = tar.extractfile(m).read()
                with _writing(out):
                    (out / Path(m.name).name).write_bytes(data)
                copied.append(Path(m.name).name)
    return copied


def read_val_labels(path: Path) -> dict[str, str]:
    """Validation labels from the devkit archive or a label file."""
    if not path.is_file():
        raise PrepareError(f"{path}: no such file (validation labels: {DEVKIT} from {DOWNLOADS}, or "
                           f"LOC_val_solution.csv from Kaggle's ImageNet Object Localization Challenge)")
    return labels_from_devkit(path) if path.name.endswith((".tar.gz", ".tgz", ".tar")) else labels_from_file(path)


# ---------------------------------------------------------------- extraction

@contextlib.contextmanager
def _writing(out: Path | str) -> Iterator[None]:
    """A failed write (a full disk, no permission) as a PrepareError naming the output folder, apart from a
    damaged archive: the remedy is space, not a new download."""
    try:
        yield
    except OSError as e:
        raise PrepareError(f"could not write to {out}: {e.strerror or e}; free space and run again") from None


def _copy(src: IO[bytes], dest: Path, out: Path | str) -> None:
    """The bytes of `src` into the file `dest`; a read error (a damaged archive) propagates as it is, a write error
    becomes _writing's PrepareError."""
    with _writing(out):
        dst = open(dest, "wb")
    written = False
    try:
        while chunk := src.read(1 << 20):
            with _writing(out):
                dst.write(chunk)
        written = True
    finally:
        if written:
            with _writing(out):
                dst.close()  # flushes the last buffer: a full disk may show only here
        else:
            with contextlib.suppress(OSError):
                dst.close()


class _Window(io.RawIOBase):
    """Bytes [offset, offset + size) of a file: one class archive inside the training tar, read as a stream."""

    def __init__(self, path: Path, offset: int, size: int) -> None:
        self._f = open(path, "rb")
        self._f.seek(offset)
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: bytearray | memoryview) -> int:
        n = self._f.readinto(memoryview(buf)[:min(len(buf), self._left)])
        self._left -= n or 0
        return n or 0

    def close(self) -> None:
        self._f.close()
        super().close()


def extract_class(train_tar: str, name: str, offset: int, size: int, out: str) -> tuple[str, int]:
    """Extract one class archive (bytes at `offset` of the training tar) into out/train/<wnid>: first into the
    work folder, then renamed into place. Returns (wnid, images written)."""
    wnid = Path(name).name.removesuffix(".tar")
    work, final = Path(out) / STAGING / "train" / wnid, Path(out) / "train" / wnid
    shutil.rmtree(work, ignore_errors=True)  # what a killed run left half-written
    with _writing(out):
        work.mkdir(parents=True)
    n = 0
    try:
        with io.BufferedReader(_Window(Path(train_tar), offset, size), 1 << 20) as raw, \
                tarfile.open(fileobj=raw, mode="r|") as tar:
            for member in tar:
                if member.isfile() and has_image_extension(member.name):
                    # the class archives are flat: the base name only, never a path outside `work`
                    with tar.extractfile(member) as src:
                        _copy(src, work / Path(member.name).name, out)
                    n += 1
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepareError(f"{train_tar}: the class archive {name} is damaged ({e}); the classes extracted so far "
                           f"are kept: replace the archive and run again") from None
    if n == 0:
        raise PrepareError(f"{train_tar}: the class archive {name} holds no images")
    with _writing(out):
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(work, final)
    return wnid, n


@dataclass
class Prepared:
    """What a preparation left in the root: images per class, per split."""

    train: dict[str, int]
    val: dict[str, int]


def _class_members(train_tar: Path) -> list[tarfile.TarInfo]:
    try:
        with tarfile.open(train_tar) as tar:  # seekable: reads only the 1,000 headers
            members = [m for m in tar if m.isfile()]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepareError(f"{train_tar}: not a readable tar ({e})") from None
    wrong = [m.name for m in members if not WNID.fullmatch(Path(m.name).name.removesuffix(".tar"))
             or not m.name.endswith(".tar")]
    if wrong or not members:
        raise PrepareError(f"{train_tar}: expected one archive per class named n<8 digits>.tar (as in {TRAIN_TAR}), "
                           f"found {', '.join(wrong[:3]) or 'no files'}")
    return members


def prepare_train(train_tar: Path, out: Path, workers: int = 1, progress: bool = True) -> dict[str, int]:
    """Every class archive of the training tar into out/train/<wnid>/ (classes already there are skipped).
    Returns the images per class extracted by this call."""
    members = _class_members(train_tar)
    todo = [m for m in members if not (out / "train" / Path(m.name).name.removesuffix(".tar")).is_dir()]
    with _writing(out):
        (out / "train").mkdir(parents=True, exist_ok=True)
    jobs = [(str(train_tar), m.name, m.offset_data, m.size, str(out)) for m in todo]
    done: dict[str, int] = {}
    bar = tqdm(total=len(members), initial=len(members) - len(todo), desc=f"train classes -> {out / 'train'}",
               unit="class", disable=not progress)
    with bar:
        if workers <= 1:
            for job in jobs:
                wnid, n = extract_class(*job)
                done[wnid] = n
                bar.update()
        else:
            pool = ProcessPoolExecutor(workers, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))
            try:  # Ctrl-C reaches the workers too: they ignore it, and this process stops the pool
                for future in as_completed([pool.submit(extract_class, *job) for job in jobs]):
                    wnid, n = future.result()
                    done[wnid] = n
                    bar.update()
            finally:  # classes being extracted finish (they are renamed into place); queued ones never start
                pool.shutdown(wait=True, cancel_futures=True)
    return done


def _val_members(val_tar: Path) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    try:
        with tarfile.open(val_tar) as tar:
            for member in tar:
                if member.isfile():
                    yield tar, member
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PrepareError(f"{val_tar}: not a readable tar, or cut short ({e}); the images written so far are "
                           f"kept: replace the archive and run again") from None


def prepare_val(val_tar: Path | None, labels: dict[str, str], out: Path, classes: list[str] | None = None,
                progress: bool = True) -> dict[str, int]:
    """Every validation image into out/val/<wnid>/ by its label: from the validation tar, or, with `val_tar`
    None, by sorting the images of an out/val/ extracted as is. `classes` (the training classes), when given,
    must include every label. Returns the images per class."""
    if classes is not None:
        foreign = sorted(set(labels.values()) - set(classes))
        if foreign:
            raise PrepareError(f"the validation labels name {len(foreign)} classes that the training set does not "
                               f"have (e.g. {', '.join(foreign[:5])}): do the label file and the archives match?")
    val, work = out / "val", out / STAGING / "val"
    if val.is_dir() and work.is_dir():
        if any(val.iterdir()):  # the extraction could not be renamed into place
            raise PrepareError(f"both {val} and {work} (an unfinished extraction from {VAL_TAR}) exist: remove "
                               f"{work} to use {val} as it is, or move {val} away to finish the extraction")
        val.rmdir()
    flat = sorted(e.name for e in os.scandir(val) if e.is_file() and has_image_extension(e.name)) \
        if val.is_dir() and not work.is_dir() else []
    if flat:
        _sort_in_place(val, flat, labels, progress)
    elif val.is_dir() and not work.is_dir():
        pass  # prepared before
    elif val_tar is None:
        raise PrepareError(f"{val}: no validation images to sort; give the validation archive ({VAL_TAR})")
    else:
        _extract_val(val_tar, labels, work, progress)
        with _writing(out):
            os.replace(work, val)
    return {e.name: sum(has_image_extension(f) for f in os.listdir(e.path)) for e in sorted(os.scandir(val),
            key=lambda e: e.name) if e.is_dir()}


def _sort_in_place(val: Path, flat: list[str], labels: dict[str, str], progress: bool) -> None:
    """The classic repair: images of a validation tar extracted as is, moved into their class folders."""
    unlabelled = [name for name in flat if name not in labels]
    if unlabelled:
        raise PrepareError(f"{val}: {len(unlabelled)} images have no label (e.g. {', '.join(unlabelled[:3])}): is "
                           f"the label file the one of these images?")
    for name in tqdm(flat, desc=f"sorting {val} into class folders", unit="img", disable=not progress):
        with _writing(val):
            (val / labels[name]).mkdir(exist_ok=True)
            os.replace(val / name, val / labels[name] / name)


def _extract_val(val_tar: Path, labels: dict[str, str], work: Path, progress: bool) -> None:
    out = work.parent.parent
    with _writing(out):
        for wnid in set(labels.values()):
            (work / wnid).mkdir(parents=True, exist_ok=True)
    unlabelled: list[str] = []
    seen: set[str] = set()
    with tqdm(desc=f"validation images -> {out / 'val'}", unit="img", total=len(labels),
              disable=not progress) as bar:
        for tar, member in _val_members(val_tar):
            name = Path(member.name).name
            if not has_image_extension(name):
                continue
            wnid = labels.get(name)
            if wnid is None:
                unlabelled.append(name)
                continue
            seen.add(name)
            dest = work / wnid / name
            if not (dest.is_file() and dest.stat().st_size == member.size):  # present = written completely
                part = dest.with_name(f".{name}.part")
                try:
                    with tar.extractfile(member) as src:
                        _copy(src, part, out)
                except (tarfile.TarError, OSError, EOFError) as e:  # reading: _copy turns write errors into its own
                    raise PrepareError(f"{val_tar}: {name} cannot be read ({e}); the images written so far are "
                                       f"kept: replace the archive and run again") from None
                with _writing(out):
                    os.replace(part, dest)
            bar.update()
    if unlabelled:
        raise PrepareError(f"{val_tar}: {len(unlabelled)} images have no label (e.g. {', '.join(unlabelled[:3])}): "
                           f"is the label file the one of these archives?")
    absent = sorted(set(labels) - seen)
    if absent:
        raise PrepareError(f"{val_tar}: {len(absent)} labelled images are not in the archive (e.g. "
                           f"{', '.join(absent[:3])}): is it cut short? (the images written so far are kept)")
    for part in work.glob("*/.*.part"):  # a killed run's half-written image (written again above, or not ours)
        part.unlink()


def prepare(out: Path, train_tar: Path | None, val_tar: Path | None, labels: Path | None, workers: int = 1,
            progress: bool = True) -> Prepared:
    """Both splits (either may be skipped with None), the work folder removed at the end."""
    train = prepare_train(train_tar, out, workers, progress) if train_tar is not None else {}
    val: dict[str, int] = {}
    if val_tar is not None or labels is not None:
        if labels is None:
            raise PrepareError(f"validation labels needed to sort {val_tar}: --devkit {DEVKIT} or --val-labels "
                               f"LOC_val_solution.csv (see --help)")
        classes = sorted(e.name for e in os.scandir(out / "train") if e.is_dir()) \
            if (out / "train").is_dir() else None
        val = prepare_val(val_tar, read_val_labels(labels), out, classes, progress)
        copy_blacklists(labels, out)
    finish(out)
    return Prepared(train, val)


def finish(out: Path) -> None:
    """Remove the work folder once both splits are in place."""
    staging = out / STAGING
    if staging.is_dir() and not (staging / "val").exists():
        shutil.rmtree(staging)
