"""ImageNet from miniature official archives (the same structure as ILSVRC2012's: a tar of per-class tars, a
flat validation tar, a devkit with meta.mat and the ground truth, or Kaggle's label file), prepared, checked by
`python -m data`, resumed after a failure, and read by a 1-epoch run of the ResNet recipe."""

from __future__ import annotations

import io
import json
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from data import ilsvrc
from data.layout import DatasetNotFoundError, preflight
from scripts.prepare_imagenet import main as prepare_main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475", "n01496331"]
TRAIN_PER_CLASS, VAL_PER_CLASS = 8, 2


def jpeg(seed: int, size: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    color = rng.integers(0, 255, 3)
    pixels = np.clip(color + rng.integers(-30, 30, (size, size, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def class_tar(wnid: str, n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            add_bytes(tar, f"{wnid}_{i + 1}.JPEG", jpeg(hash((wnid, i)) % 2**32))
    return buf.getvalue()


def val_assignment() -> list[str]:
    """The class of validation image i (1-based, i - 1 in the list), shuffled as in the real set."""
    order = [w for w in WNIDS for _ in range(VAL_PER_CLASS)]
    np.random.default_rng(0).shuffle(order)
    return order


def make_archives(folder: Path, wnids: list[str] = WNIDS) -> Path:
    """ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar, ILSVRC2012_devkit_t12.tar.gz and LOC_val_solution.csv."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / ilsvrc.TRAIN_TAR, "w") as tar:
        for wnid in wnids:
            add_bytes(tar, f"{wnid}.tar", class_tar(wnid, TRAIN_PER_CLASS))
    order = val_assignment()
    with tarfile.open(folder / ilsvrc.VAL_TAR, "w") as tar:
        for i in range(len(order)):
            add_bytes(tar, ilsvrc.val_file_name(i + 1), jpeg(10_000 + i))
    # meta.mat as the devkit's: leaf synsets first (ILSVRC2012_ID 1..n, num_children 0), then inner synsets
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    synsets = np.zeros(len(WNIDS) + 1, dtype=[(f, object) for f in fields])
    for i, wnid in enumerate(WNIDS):
        synsets[i] = (i + 1, wnid, f"class {i}", "", 0, np.zeros(0), 0, TRAIN_PER_CLASS)
    synsets[len(WNIDS)] = (len(WNIDS) + 1, "n00001740", "entity", "", len(WNIDS), np.arange(1, 7), 19, 0)
    meta = io.BytesIO()
    scipy.io.savemat(meta, {"synsets": synsets})
    truth = "".join(f"{WNIDS.index(w) + 1}\n" for w in order).encode()
    with tarfile.open(folder / ilsvrc.DEVKIT, "w:gz") as tar:
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue())
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth)
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/ILSVRC2014_clsloc_validation_blacklist.txt", b"3\n")
    rows = [f"ILSVRC2012_val_{i + 1:08d},{w} 1 2 10 12 {w} 3 3 9 9" for i, w in enumerate(order)]
    (folder / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archives(tmp_path_factory.mktemp("archives"))


def listing(root: Path) -> dict[str, list[str]]:
    return {split: sorted(str(p.relative_to(root / split)) for p in (root / split).rglob("*") if p.is_file())
            for split in ("train", "val")}


def expected_val(root: Path) -> dict[str, str]:
    return {ilsvrc.val_file_name(i + 1): w for i, w in enumerate(val_assignment())}


def check_prepared(root: Path) -> None:
    files = listing(root)
    assert len(files["train"]) == len(WNIDS) * TRAIN_PER_CLASS
    assert sorted({f.split("/")[0] for f in files["train"]}) == WNIDS
    assert {Path(f).name: f.split("/")[0] for f in files["val"]} == expected_val(root)  # the devkit's labels
    assert not (root / ".prepare").exists()


@pytest.mark.e2e
def test_devkit_and_kaggle_labels_give_the_same_sorted_folders(archives, tmp_path, capsys):
    prepare_main(["--archives", str(archives), "--out", str(tmp_path / "a"), "--no-progress", "--workers", "2"])
    out = capsys.readouterr().out
    assert f"train: {len(WNIDS)} classes extracted" in out and "ok" in out.splitlines()[-1]
    check_prepared(tmp_path / "a")
    assert (tmp_path / "a" / "ILSVRC2014_clsloc_validation_blacklist.txt").read_text() == "3\n"  # from the devkit
    prepare_main(["--train-tar", str(archives / ilsvrc.TRAIN_TAR), "--val-tar", str(archives / ilsvrc.VAL_TAR),
                  "--val-labels", str(archives / "LOC_val_solution.csv"), "--out", str(tmp_path / "b"),
                  "--no-progress"])
    assert listing(tmp_path / "a") == listing(tmp_path / "b")
    assert "note: configs/resnet50_dawnbench.yaml leaves out" in capsys.readouterr().out  # no devkit: no blacklist
    # a "FILE WNID" list and a valprep.sh's mv lines read the same
    labels = expected_val(tmp_path)
    (tmp_path / "list.txt").write_text("".join(f"{f} {w}\n" for f, w in labels.items()))
    (tmp_path / "valprep.sh").write_text("".join(f"mv {f} {w}/\n" for f, w in labels.items()))
    assert ilsvrc.read_val_labels(tmp_path / "list.txt") == ilsvrc.read_val_labels(tmp_path / "valprep.sh") == labels


@pytest.mark.e2e
def test_an_unsorted_val_folder_is_named_by_the_check_and_sorted_in_place(archives, tmp_path):
    root = tmp_path / "data"
    prepare_main(["--train-tar", str(archives / ilsvrc.TRAIN_TAR), "--out", str(root), "--no-progress"])
    (root / "val").mkdir()
    with tarfile.open(archives / ilsvrc.VAL_TAR) as tar:  # extracted as is: the classic 0.1% failure
        tar.extractall(root / "val", filter="data")
    result = subprocess.run([sys.executable, "-m", "data", str(root)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert "val/ holds 12 images outside class folders" in result.stderr
    assert f"prepare_imagenet.py --out {root} --devkit" in result.stderr
    (root / ".prepare" / "val" / WNIDS[0]).mkdir(parents=True)  # and a validation extraction left unfinished
    with pytest.raises(SystemExit, match=r"both .*val and .*\.prepare/val \(an unfinished extraction .* exist: remove"):
        prepare_main(["--val-tar", str(archives / ilsvrc.VAL_TAR), "--val-labels",
                      str(archives / "LOC_val_solution.csv"), "--out", str(root), "--no-progress"])
    assert len(list((root / "val").glob("*.JPEG"))) == 12  # untouched
    shutil.rmtree(root / ".prepare")
    prepare_main(["--val-labels", str(archives / "LOC_val_solution.csv"), "--out", str(root), "--no-progress"])
    check_prepared(root)
    assert preflight(root).endswith("6 classes, 48 training and 12 validation images: ok")


def test_an_interrupted_preparation_resumes_without_redoing_finished_classes(archives, tmp_path):
    """A damaged class archive stops the run after the classes before it; a killed run's half-written class is
    left in the work folder. The rerun, with the archive replaced, extracts only what is missing."""
    broken = tmp_path / "broken"
    make_archives(broken)
    with tarfile.open(broken / ilsvrc.TRAIN_TAR, "w") as tar:  # class 4 of 6 cut short
        for k, wnid in enumerate(WNIDS):
            data = class_tar(wnid, TRAIN_PER_CLASS)
            add_bytes(tar, f"{wnid}.tar", data[:len(data) // 2] if k == 3 else data)
    root = tmp_path / "data"
    args = ["--archives", str(broken), "--out", str(root), "--no-progress"]
    with pytest.raises(SystemExit, match=rf"class archive {WNIDS[3]}.tar is damaged .* run again"):
        prepare_main(args)
    done = sorted(p.name for p in (root / "train").iterdir())
    assert done == WNIDS[:3] and not (root / "val").exists()
    with pytest.raises(DatasetNotFoundError, match="a preparation was interrupted"):
        preflight(root)
    marks = {w: (root / "train" / w / "untouched").touch() for w in done}  # gone if a class were redone
    (root / ".prepare" / "train" / WNIDS[4]).mkdir(parents=True, exist_ok=True)  # as a killed run leaves it
    (root / ".prepare" / "train" / WNIDS[4] / "half.JPEG").write_bytes(b"\xff\xd8 cut")
    (broken / ilsvrc.TRAIN_TAR).write_bytes((archives / ilsvrc.TRAIN_TAR).read_bytes())  # the download repaired
    prepare_main(args)
    assert all((root / "train" / w / "untouched").exists() for w in marks)
    assert not (root / "train" / WNIDS[4] / "half.JPEG").exists()
    for f in (root / "train").rglob("untouched"):
        f.unlink()
    check_prepared(root)


@pytest.mark.e2e
def test_a_killed_validation_extraction_resumes(tmp_path):
    """The process is killed once the first validation images are in the work folder (a validation set large
    enough that it is still writing); the rerun completes the same folder."""
    n = 4000
    order = [WNIDS[i % len(WNIDS)] for i in range(n)]
    images = [jpeg(i, 8) for i in range(8)]
    val_tar = tmp_path / ilsvrc.VAL_TAR
    with tarfile.open(val_tar, "w") as tar:
        for i in range(n):
            add_bytes(tar, ilsvrc.val_file_name(i + 1), images[i % len(images)])
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{ilsvrc.val_file_name(i + 1)} {w}\n" for i, w in enumerate(order)))
    root = tmp_path / "data"
    work = root / ".prepare" / "val"
    cmd = [sys.executable, str(ROOT / "scripts" / "prepare_imagenet.py"), "--val-tar", str(val_tar),
           "--val-labels", str(labels), "--out", str(root), "--no-progress"]
    proc = subprocess.Popen(["nice", "-n", "19", *cmd], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (work.is_dir() and any(work.rglob("*.JPEG"))):
        assert proc.poll() is None and time.monotonic() < deadline, "no validation image was written"
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    written = list(work.rglob("*.JPEG"))
    assert 0 < len(written) < n and not (root / "val").exists()  # killed part way
    # a power cut after a rename can also leave a complete-named image short: its size tells, and it is redone
    written[0].write_bytes(written[0].read_bytes()[:10])
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    assert not (root / ".prepare").exists()
    assert sorted(p.name for p in (root / "val").rglob("*") if p.is_file()) == sorted(
        ilsvrc.val_file_name(i + 1) for i in range(n))
    for i, w in enumerate(order):
        assert (root / "val" / w / ilsvrc.val_file_name(i + 1)).read_bytes() == images[i % len(images)]


@pytest.mark.e2e
def test_a_failed_write_is_named_as_a_write_not_as_a_damaged_archive(archives, tmp_path):
    """A file size limit (RLIMIT_FSIZE: writes fail with EFBIG, as they fail with ENOSPC on a full disk) stops
    both the class extraction and the validation extraction with one line naming the output folder."""
    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    for split, given in (("train", ["--train-tar", str(archives / ilsvrc.TRAIN_TAR)]),
                         ("val", ["--val-tar", str(archives / ilsvrc.VAL_TAR), "--devkit",
                                  str(archives / ilsvrc.DEVKIT)])):
        out = tmp_path / split
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_imagenet.py"), *given, "--out",
                                 str(out), "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                                preexec_fn=small_files)
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines() == [
            f"prepare_imagenet: could not write to {out}: File too large; free space and run again"]


def test_bad_inputs_get_one_clear_line(archives, tmp_path):
    with pytest.raises(SystemExit, match="no archives found in .*ILSVRC2012_img_train.tar"):
        prepare_main(["--archives", str(tmp_path), "--out", str(tmp_path / "d")])
    (tmp_path / "wrong.tar").write_bytes((archives / ilsvrc.VAL_TAR).read_bytes())
    with pytest.raises(SystemExit, match=r"expected one archive per class named n<8 digits>\.tar"):
        prepare_main(["--train-tar", str(tmp_path / "wrong.tar"), "--out", str(tmp_path / "d"), "--no-progress"])
    (tmp_path / "labels.txt").write_text("ILSVRC2012_val_00000001.JPEG cat\n")
    with pytest.raises(SystemExit, match="not WordNet ids"):
        prepare_main(["--val-tar", str(archives / ilsvrc.VAL_TAR), "--val-labels", str(tmp_path / "labels.txt"),
                      "--out", str(tmp_path / "d"), "--no-progress"])
    data = (archives / ilsvrc.VAL_TAR).read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:len(data) // 2 + 700])  # cut inside an image
    with pytest.raises(SystemExit, match=r"cut.tar: .*(cannot be read|cut short)"):
        prepare_main(["--val-tar", str(tmp_path / "cut.tar"), "--devkit", str(archives / ilsvrc.DEVKIT),
                      "--out", str(tmp_path / "c"), "--no-progress"])
    few = {ilsvrc.val_file_name(1): WNIDS[0]}
    (tmp_path / "few.txt").write_text("".join(f"{f} {w}\n" for f, w in few.items()))
    with pytest.raises(SystemExit, match="11 images have no label"):
        prepare_main(["--val-tar", str(archives / ilsvrc.VAL_TAR), "--val-labels", str(tmp_path / "few.txt"),
                      "--out", str(tmp_path / "e"), "--no-progress"])


def test_the_imagenet_check_names_what_is_missing(archives, tmp_path):
    """1,000 WordNet-id classes make a folder ImageNet: short classes, a missing class, wrong val counts."""
    with pytest.raises(DatasetNotFoundError, match=r"holds the ILSVRC2012 archives .*prepare_imagenet.py --archives"):
        preflight(archives)  # the archives' folder given as the dataset
    root = tmp_path / "imagenet"
    wnids = [f"n{10_000_000 + i:08d}" for i in range(1000)]
    for split in ("train", "val"):
        for w in wnids[:-1] if split == "train" else wnids:
            (root / split / w).mkdir(parents=True)
    for w in wnids[:3]:
        (root / "train" / w / "a.JPEG").write_bytes(b"x")
    (root / "val" / wnids[0] / "ILSVRC2012_val_00000001.JPEG").write_bytes(b"x")
    with pytest.raises(DatasetNotFoundError) as e:
        preflight(root)
    text = str(e.value)
    assert "ImageNet (ILSVRC2012) not ready" in text
    assert f"1 classes in val/ have no folder in train/: {wnids[-1]}" in text
    assert "train/ has 999 class folders, ImageNet has 1,000" in text
    assert "train/ has 3 images, ImageNet has 1,281,167" in text and f"{wnids[0]} (1)" in text
    assert "val/ has 1 images in class folders, ImageNet has 50,000" in text
    assert "996 class folders of train/ hold no images" in text
    with pytest.raises(DatasetNotFoundError, match="ImageNet has 1,000"):  # named explicitly, any folder names
        preflight(tmp_path / "imagenet", expect="imagenet")


@pytest.mark.e2e
def test_a_one_epoch_run_reads_the_prepared_folder(archives, tmp_path):
    from recipes.resnet50 import main as train

    root = tmp_path / "data"
    prepare_main(["--archives", str(archives), "--out", str(root), "--no-progress"])
    out = tmp_path / "run"
    summary = train(["--config", str(ROOT / "configs" / "quickstart_cpu.yaml"), f"data.root={root}",
                     f"log.dir={out}", "model.arch=resnet18", "train.epochs=1",
                     "schedule.phases=[{start_epoch: 0, end_epoch: 1, image_size: 16, batch_size: 8}]",
                     "schedule.warmup_epochs=0", "comm.kind=dense", "data.workers=0", "train.threads=1",
                     "train.channels_last=false", "train.amp=off", "model.small_map_gemm=true", "train.target_top1=0", "train.checkpoint_every_epochs=0",
                     "log.progress=false", "log.tensorboard=false", "data.cache.dir="])
    assert summary["epochs_run"] == 1 and summary["world_size"] == 1
    epochs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    assert len(epochs) == 1
    assert 0 <= summary["final_top1"] <= 1
