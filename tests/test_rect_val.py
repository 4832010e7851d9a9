"""Rectangular validation and the validation exclusion list (data/rect_val.py), through both real backends:
DALI in CPU mode and torchvision, on JPEG folders of mixed aspect ratios written in tmp_path."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from data import DataConfig, DataConfigError, build_image_data
from data.layout import list_split
from data.rect_val import (ASPECT_RANGE, SIDE_MULTIPLE, cover_sizes, header_sizes, plan_val, rect_batches,
                           rect_shape)
from tests.data_helpers import GRAY_STEP, dali_config, decoded_ids, photo

pytestmark = pytest.mark.unit

BACKENDS = ("dali", "torchvision")
SHAPES = [(60, 40), (40, 60), (80, 40), (40, 40), (50, 44), (36, 90), (70, 48), (44, 64)]
"""(width, height) of the validation images in turn: landscape, portrait, panorama-ish, square."""


def write_val_folder(root, n, classes=3, gray=False, seed=0):
    """root/{train,val}/c<k>/: 2 training photos per class; n validation images named as ImageNet's
    (ILSVRC2012_val_<k+1>.JPEG in class k mod classes), sized by SHAPES in turn; `gray`: image k uniformly
    gray at 10 + GRAY_STEP x k, so a decoded pixel names it."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / "train" / f"c{c}").mkdir(parents=True, exist_ok=True)
        for j in range(2):
            photo(rng, 48, 48).save(root / "train" / f"c{c}" / f"{j:03d}.JPEG", quality=92)
    for k in range(n):
        folder = root / "val" / f"c{k % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        w, h = SHAPES[k % len(SHAPES)]
        img = Image.new("RGB", (w, h), (10 + GRAY_STEP * k,) * 3) if gray else photo(rng, w, h)
        img.save(folder / f"ILSVRC2012_val_{k + 1:08d}.JPEG", quality=95)
    return root


def config(backend, root, tmp, **data):
    """`backend` on `root` with the DALI cache in `tmp` (L3 only up to 16 px: the tests' sizes decode JPEGs)."""
    if backend == "dali":
        cfg = dali_config(root, tmp, lowres_max_image_size=16)
    else:
        cfg = DataConfig(root=str(root), backend="torchvision", workers=0)
    return dataclasses.replace(cfg, **data)


def val_batches_of(cfg, size, batch, rank=0, world=1):
    data = build_image_data(cfg, rank, world, seed=0)
    try:
        loader = data.val_loader(size, batch)
        loader.set_epoch(0)
        return [(images.clone(), labels.clone()) for images, labels in loader]
    finally:
        data.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_val_folder(tmp_path_factory.mktemp("mixed"), 24)


# ---------------------------------------------------------------- the plan


def test_rect_shapes_follow_the_batch_aspect_clamped_and_rounded():
    assert rect_shape(np.array([40, 40]), np.array([60, 64]), 32) == (32, int(32 * 1.55) // 8 * 8)
    assert rect_shape(np.array([60, 64]), np.array([40, 40]), 32) == (int(32 / (0.5 * (40 / 60 + 40 / 64))) // 8 * 8,
                                                                      32)
    assert rect_shape(np.array([10]), np.array([100]), 40) == (40, int(40 * ASPECT_RANGE[1]))  # a panorama: clamped
    assert rect_shape(np.array([100]), np.array([10]), 40) == (int(40 / ASPECT_RANGE[0]), 40)
    assert rect_shape(np.array([50]), np.array([51]), 36) == (36, 36)  # never below the shorter side
    assert rect_shape(np.array([0]), np.array([0]), 36) == (36, 36)  # unreadable headers: square
    assert rect_shape(np.array([40]), np.array([70]), 288)[1] % SIDE_MULTIPLE == 0


def test_resize_covers_the_crop_and_is_torchvisions_where_that_suffices():
    heights, widths = np.array([40, 60, 40, 90]), np.array([60, 40, 120, 36])
    new_h, new_w = cover_sizes(heights, widths, 36, 32, 48)
    assert (new_h >= 32).all() and (new_w >= 48).all()
    assert (new_h[0], new_w[0]) == (36, 54)  # torchvision's Resize(36): 60 x 36 // 40
    assert abs(new_w[1] / new_h[1] - 40 / 60) < 0.02  # a portrait in a landscape batch: grown, aspect kept
    assert (new_h[2], new_w[2]) == (36, 108)


def test_rect_batches_partition_the_kept_images_across_ranks():
    rng = np.random.default_rng(0)
    heights, widths = rng.integers(20, 200, 103), rng.integers(20, 200, 103)
    kept = np.setdiff1d(np.arange(103), [5, 17, 40])
    for world in (1, 2, 3):
        per_rank = [rect_batches(kept, heights, widths, world, r, 8) for r in range(world)]
        seen = np.concatenate([b for batches in per_rank for b in batches])
        assert sorted(seen.tolist()) == kept.tolist()
        counts = [len(batches) for batches in per_rank]
        assert max(counts) - min(counts) <= 1 and all(len(b) == 8 for bs in per_rank for b in bs[:-1])
    aspects = [float(np.mean(widths[b] / heights[b])) for b in rect_batches(kept, heights, widths, 1, 0, 8)]
    assert aspects == sorted(aspects)
    square, crops = plan_val(kept, 2, 1, 8, 32)
    assert np.concatenate(square).tolist() == kept[1::2].tolist() and set(crops) == {(32, 32)}


def test_header_sizes_are_read_once_and_stored_per_listing(mixed, tmp_path):
    split = list_split(mixed, "val")
    heights, widths = header_sizes(split, tmp_path, threads=2)
    assert [(w, h) for h, w in zip(heights, widths)] == [Image.open(split.url(i)).size for i in range(len(split))]
    stored = tmp_path / "rect_val" / f"{split.key}.npy"
    assert np.array_equal(np.load(stored), np.stack([heights, widths], 1))


# ---------------------------------------------------------------- both backends


@pytest.mark.parametrize("backend", BACKENDS)
def test_rect_batches_have_one_shape_each_and_several_across_batches(mixed, tmp_path, backend):
    cfg = config(backend, mixed, tmp_path, rect_val_from_size=32)
    got = val_batches_of(cfg, 32, 5)
    split = list_split(mixed, "val")
    heights, widths = header_sizes(split)
    batches, crops = plan_val(np.arange(len(split)), 1, 0, 5, 32, (heights, widths))
    assert [tuple(im.shape) for im, _ in got] == [(len(b), 3, h, w) for b, (h, w) in zip(batches, crops)]
    assert len({im.shape[2:] for im, _ in got}) >= 4  # portraits, squares, landscapes, panoramas
    assert [lb.tolist() for _, lb in got] == [split.labels[b].tolist() for b in batches]
    aspects = [im.shape[3] / im.shape[2] for im, _ in got]
    assert aspects == sorted(aspects) and aspects[0] < 1 < aspects[-1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rect_off_is_the_square_center_crop(mixed, tmp_path, backend):
    """rect_val_from_size 0, or above the phase's size: batches in listing order, square center crops (the
    torchvision backend exactly torchvision's Resize + CenterCrop)."""
    for rect_from in (0, 40):
        got = val_batches_of(config(backend, mixed, tmp_path, rect_val_from_size=rect_from), 32, 5)
        assert {tuple(im.shape[1:]) for im, _ in got} == {(3, 32, 32)}
        split = list_split(mixed, "val")
        assert torch.cat([lb for _, lb in got]).tolist() == split.labels.tolist()
    if backend == "torchvision":
        reference = transforms.Compose([transforms.Resize(round(32 * DataConfig.val_resize_ratio), antialias=True),
                                        transforms.CenterCrop(32), transforms.ToTensor(),
                                        transforms.Normalize(DataConfig.mean, DataConfig.std)])
        expected = torch.stack([reference(Image.open(split.url(i)).convert("RGB")) for i in range(len(split))])
        assert torch.equal(torch.cat([im for im, _ in got]), expected)


def test_backends_agree_on_rect_batches(mixed, tmp_path):
    dali, tv = (val_batches_of(config(b, mixed, tmp_path, rect_val_from_size=32), 40, 6) for b in BACKENDS)
    assert [im.shape for im, _ in dali] == [im.shape for im, _ in tv]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(dali, tv))
    # the same crop windows: the same pixels up to the decoders' and resamplers' rounding (1 grey level = 0.017)
    for (a, _), (b, _) in zip(dali, tv):
        assert (a - b).abs().mean() < 0.01 and (a - b).abs().max() < 0.15


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_image_once_across_two_ranks_and_excluded_ones_never(tmp_path, backend, caplog):
    n = 30
    root = write_val_folder(tmp_path / "ids", n, gray=True)
    # image numbers as in the ILSVRC2014 devkit's list, a file name, a name without extension, a comment,
    # and a name that is not in the set
    (root / "blacklist.txt").write_text("3\n12\n\nc0/ILSVRC2012_val_00000020.JPEG  # by name\n"
                                        "ILSVRC2012_val_00000027\nILSVRC2012_val_00099999.JPEG\n")
    excluded = {2, 11, 19, 26}  # ids (image number - 1)
    cfg = config(backend, root, tmp_path, rect_val_from_size=24, val_exclude="blacklist.txt")
    with caplog.at_level(logging.WARNING):
        per_rank = [[i for images, _ in val_batches_of(cfg, 24, 4, rank, 2) for i in decoded_ids(images, cfg)]
                    for rank in range(2)]
    seen = sorted(per_rank[0] + per_rank[1])
    assert seen == sorted(set(range(n)) - excluded)  # disjoint shards: no image twice, none missing
    assert all(per_rank)
    reports = [m for m in caplog.messages if m.startswith("data.val_exclude")]
    assert reports == [f"data.val_exclude: 4 of {n} validation images left out ({root}/blacklist.txt lists 5; "
                       f"1 of them are not in {root}/val)"]  # rank 0 only, once
    square = val_batches_of(dataclasses.replace(cfg, rect_val_from_size=0), 24, 4)
    assert sorted(i for images, _ in square for i in decoded_ids(images, cfg)) == seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_exclude_list_is_one_clear_error(mixed, tmp_path, backend):
    cfg = config(backend, mixed, tmp_path, val_exclude=str(tmp_path / "nowhere.txt"))
    with pytest.raises(DataConfigError, match=rf"data.val_exclude: {tmp_path}/nowhere.txt not found; it lists "
                                              r"validation files to leave out"):
        build_image_data(cfg, 0, 1, seed=0)


def test_rect_val_from_size_must_not_be_negative():
    with pytest.raises(DataConfigError, match=r"data.rect_val_from_size: must be >= 0 \(0 = never\), got -1"):
        DataConfig(rect_val_from_size=-1)


def test_the_dawnbench_configs_validate_the_last_phase_rectangular():
    from recipes.resnet50 import Config
    from trainer.config import load_config
    for name in ("resnet50_dawnbench", "resnet50_1node"):
        cfg = load_config(Config, f"configs/{name}.yaml")
        sizes = [p.val_image_size or p.image_size for p in cfg.schedule.phases]
        assert cfg.data.rect_val_from_size == 288 and [s >= 288 for s in sizes] == [False, False, False, True]
