"""The input pipelines for real: DALI (CPU mode) and torchvision on JPEG folders written in tmp_path."""

import logging
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from data import DataConfig, DatasetNotFoundError, build_image_data, resolve_backend
from data.layout import list_split
from data.sampling import ASPECT_RATIOS, random_resized_crops, train_batches
from tests.data_helpers import (ODD_FILES, dali_config, decoded_ids, write_folder, write_id_coded_folder,
                                write_odd_files)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=8, val_per_class=4)


def batches(loader, epoch=0):
    loader.set_epoch(epoch)
    return list(loader)


def test_backends_give_the_same_shapes_dtypes_and_value_ranges(folder, tmp_path):
    bounds = [((0 - m) / s, (1 - m) / s) for m, s in zip(DataConfig.mean, DataConfig.std)]
    out = {}
    for backend in ("dali", "torchvision"):
        cfg = dali_config(folder, tmp_path) if backend == "dali" else DataConfig(root=str(folder), backend=backend,
                                                                                   workers=0)
        data = build_image_data(cfg, rank=0, world_size=1, seed=0)
        assert (data.num_classes, data.train_size) == (3, 24)
        train = batches(data.train_loader(40, 8, min_scale=0.3))  # 40 px: above L3, decoded from JPEG
        val = batches(data.val_loader(40, 5))
        lowres_val = batches(data.val_loader(32, 5))  # 32 px: from L3 for dali
        for images, labels in train:
            assert images.shape == (8, 3, 40, 40) and images.dtype == torch.float32
            assert labels.shape == (8,) and labels.dtype == torch.int64
            assert 0 <= int(labels.min()) <= int(labels.max()) < 3
            for c, (lo, hi) in enumerate(bounds):
                assert lo - 1e-3 <= float(images[:, c].min()) and float(images[:, c].max()) <= hi + 1e-3
        assert [len(lb) for _, lb in val] == [len(lb) for _, lb in lowres_val] == [5, 5, 2]
        out[backend] = [torch.cat([im for im, _ in v]) for v in (val, lowres_val)] + [torch.cat([lb for _, lb in val])]
        data.close()
    # Validation is deterministic (resize the shorter side, center crop): the same pixels up to the decoders'
    # and resamplers' rounding (1 grey level = 0.017 in normalized units); from L3's pre-resized copies, close.
    (dali, dali_lowres, dali_labels), (tv, tv_lowres, tv_labels) = out["dali"], out["torchvision"]
    assert torch.equal(dali_labels, tv_labels)
    assert (dali - tv).abs().mean() < 0.01 and (dali - tv).abs().max() < 0.1
    assert (dali_lowres - tv_lowres).abs().mean() < 0.05


@pytest.mark.parametrize("fetch_lowres", [False, True], ids=["encoded", "lowres"])
def test_sharding_covers_every_sample_once_per_epoch(tmp_path, fetch_lowres):
    world, batch, n = 3, 2, 30
    root = write_id_coded_folder(tmp_path / "ids", n)
    cfg = dali_config(root, tmp_path, lowres_max_image_size=32 if fetch_lowres else 8)
    order = {}
    for epoch in (0, 1):
        per_rank = []
        for rank in range(world):  # each rank builds its own data object, as in a real run
            data = build_image_data(cfg, rank, world, seed=3)
            loader = data.train_loader(16, batch, min_scale=0.5)
            assert len(loader) == n // world // batch
            ids = [i for images, _ in batches(loader, epoch) for i in decoded_ids(images, cfg)]
            per_rank.append(ids)
            data.close()
        seen = sorted(i for ids in per_rank for i in ids)
        assert seen == list(range(n)), f"epoch {epoch}: every sample exactly once across ranks"
        # one permutation shared by the ranks (DistributedSampler's), rank r taking every world-th element
        id_of = [int(f.split("/")[1][:3]) for f in list_split(root, "train").files]  # listing index -> id
        for rank in range(world):
            assert per_rank[rank] == [id_of[i] for i in train_batches(n, world, rank, batch, 3, epoch).ravel()]
        order[epoch] = per_rank
    assert order[0] != order[1], "a new permutation each epoch"


def test_phase_change_rebuilds_only_the_pipeline(folder, tmp_path):
    data = build_image_data(dali_config(folder, tmp_path), rank=0, world_size=1, seed=0)
    readers = dict(data.readers)
    first = data.train_loader(24, 4)
    shapes = {tuple(im.shape) for im, _ in batches(first)}
    reads_after_phase_1 = data.stats()["cache/l0_hits"]
    second = data.train_loader(48, 6)
    assert second.pipe is None  # built on first use, for the new size
    shapes_2 = {tuple(im.shape) for im, _ in batches(second, epoch=1)}
    assert shapes == {(4, 3, 24, 24)} and shapes_2 == {(6, 3, 48, 48)}
    assert second.pipe is not first.pipe and data.readers == readers  # cache and verdicts live on
    stats = data.stats()
    assert stats["cache/l0_hits"] == reads_after_phase_1 == 24  # phase 2 read the RAM level, not the files
    assert stats["cache/l2_hits"] >= 24
    data.close()


def test_an_unfinished_epoch_is_followed_by_a_full_one(folder, tmp_path):
    data = build_image_data(dali_config(folder, tmp_path, ram=False), rank=0, world_size=1, seed=0)
    loader = data.train_loader(40, 4)
    loader.set_epoch(0)
    it = iter(loader)
    next(it)  # train.max_steps_per_epoch stops here
    full = batches(loader, epoch=1)
    again = batches(loader, epoch=1)
    assert len(full) == len(loader) == 6
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, again)), "augmentation is a function of the epoch"
    data.close()


@pytest.mark.parametrize("backend,threads", [("dali", (1, 2)),
                                               pytest.param("torchvision", (0, 2), marks=pytest.mark.e2e)])
def test_the_input_threads_leave_the_batches_alone(folder, tmp_path, backend, threads):
    """data.workers is measured at start-up and not kept in checkpoints: every thread count gives the same
    augmented batches (each image's crop and flip come from its own seed, not from the thread or worker process that loads it;
    torchvision's worker processes put the test in the e2e tier)."""
    cfg = dali_config(folder, tmp_path) if backend == "dali" else DataConfig(root=str(folder), backend=backend,
                                                                               workers=0)
    data = build_image_data(cfg, rank=0, world_size=1, seed=3)
    try:
        seen = [batches(data.train_loader(40, 8, min_scale=0.3, workers=n), epoch=1) for n in threads]
    finally:
        data.close()
    assert len(seen[0]) == len(seen[1]) == 3
    for (images, labels), (other_images, other_labels) in zip(*seen):
        assert torch.equal(labels, other_labels) and torch.equal(images, other_images)


def test_odd_images_are_decoded_or_skipped_and_named(tmp_path, caplog):
    root = write_folder(tmp_path / "odd", classes=2, per_class=5, val_per_class=2)
    write_odd_files(root / "train" / "c1")
    cfg = dali_config(root, tmp_path, lowres_max_image_size=16)
    data = build_image_data(cfg, rank=0, world_size=1, seed=0)
    with caplog.at_level(logging.WARNING):
        for epoch in (0, 1):
            seen = batches(data.train_loader(32, 4), epoch)  # 32 > 16: DALI decodes the JPEGs
            assert [len(lb) for _, lb in seen] == [4] * 4 and all(torch.isfinite(im).all() for im, _ in seen)
    assert sum("DALI failed on batch" in m for m in caplog.messages) == 1  # broken_huffman: found by DALI, once
    skipped = sorted(name for name, fate in ODD_FILES.items() if fate == "skipped")
    assert data.stats()["data/skipped_images"] == len(skipped)
    assert data.stats()["data/transcoded_images"] == 0  # the recheck singled out the one file DALI rejects
    for name in skipped:
        assert sum(f"skipped {root}/train/c1/{name}" in m for m in caplog.messages) == 1, name
    reader = data.readers["train"]
    decoded = [reader.split.files.index(f"c1/{name}") for name, fate in ODD_FILES.items() if fate == "decoded"]
    assert all(reader.state[i] == 1 and reader.heights[i] == 50 for i in decoded)
    # the L3 path (decoded by PIL) and the torchvision backend cope with the same files
    lowres = [lb for _, lb in batches(data.train_loader(16, 4))]
    assert len(lowres) == 4
    data.close()
    tv = build_image_data(DataConfig(root=str(root), backend="torchvision", workers=0), 0, 1, seed=0)
    with caplog.at_level(logging.WARNING):
        assert [len(lb) for _, lb in batches(tv.train_loader(32, 4))] == [4] * 4
    assert any("truncated.JPEG" in m for m in caplog.messages)


def test_empty_class_keeps_its_label_and_missing_val_is_one_clear_error(tmp_path, caplog):
    root = write_folder(tmp_path / "ds", classes=3, per_class=2, val_per_class=1)
    for f in (root / "train" / "c1").iterdir():
        f.unlink()
    with caplog.at_level(logging.WARNING):
        split = list_split(root, "train")
    assert split.classes == ["c0", "c1", "c2"] and sorted(set(split.labels.tolist())) == [0, 2]
    assert any("class folder(s) without images: c1" in m for m in caplog.messages)
    tv = build_image_data(DataConfig(root=str(root), backend="torchvision", workers=0), 0, 1, seed=0)
    assert tv.train_size == split.labels.size == 4 and tv.num_classes == 3
    for f in (root / "val" / "c0").iterdir():
        f.unlink()
    (root / "val" / "c0").rmdir()
    with pytest.raises(DatasetNotFoundError, match=r"train/ and val/ have different classes \(e\.g\. c0\)"):
        build_image_data(dali_config(root, tmp_path), 0, 1, seed=0)
    for d in sorted((root / "val").rglob("*"), reverse=True):
        d.unlink() if d.is_file() else d.rmdir()
    (root / "val").rmdir()
    with pytest.raises(DatasetNotFoundError, match=r"no dataset at .*/ds/val \(looked for val/<class>/\*\.JPEG"):
        build_image_data(dali_config(root, tmp_path), 0, 1, seed=0)


def test_both_backends_list_the_same_files(folder):
    from torchvision.datasets import ImageFolder
    from data.layout import has_image_extension
    split = list_split(folder, "train")
    tv = ImageFolder(str(folder / "train"), is_valid_file=has_image_extension, allow_empty=True)
    assert [(f"{split.folder}/{f}", int(lb)) for f, lb in zip(split.files, split.labels)] == tv.samples


def test_crop_windows_follow_torchvision_rules():
    rng = np.random.default_rng(0)
    heights, widths = rng.integers(200, 400, 2000), rng.integers(200, 400, 2000)
    widths[:5] = heights[:5] * 5  # panoramas: no try fits the ratio range, the central fallback is taken
    top, left, h, w = random_resized_crops(heights, widths, (0.25, 1.0), rng)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= heights).all() and (left + w <= widths).all()
    assert np.allclose(w[:5] / h[:5], ASPECT_RATIOS[1], rtol=0.01) and (h[:5] == heights[:5]).all()
    area, aspect = (h * w / (heights * widths))[5:], (w / h)[5:]
    within = ((area > 0.25 * 0.98) & (area <= 1) & (aspect > ASPECT_RATIOS[0] * 0.98)
              & (aspect < ASPECT_RATIOS[1] * 1.02))
    assert within.mean() > 0.99  # the rest: all ten tries failed, the central fallback
    # the same distribution as torchvision's own draws on the same image sizes (large tries often do not fit)
    torch.manual_seed(0)
    reference = np.array([RandomResizedCrop.get_params(torch.empty(1, 1, 1).expand(1, int(y), int(x)), [0.25, 1.0],
                                                       list(ASPECT_RATIOS)) for y, x in zip(heights[5:], widths[5:])])
    ref_area = reference[:, 2] * reference[:, 3] / (heights[5:] * widths[5:])
    assert math.isclose(float(area.mean()), float(ref_area.mean()), abs_tol=0.02)
    assert math.isclose(float(np.log(aspect).mean()), float(np.log(reference[:, 3] / reference[:, 2]).mean()),
                        abs_tol=0.02)


def test_auto_picks_dali_where_installed():
    assert resolve_backend("auto") == "dali" and resolve_backend("torchvision") == "torchvision"


@pytest.mark.e2e
def test_the_data_layer_imports_torchvision_only_for_its_backend():
    """The Transformer's data (data, data.translation) works where torchvision is not installed."""
    code = ("import sys; import data, data.translation; print('torchvision' in sys.modules); "
            "from data.torchvision_loader import TorchvisionImageData; print('torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
