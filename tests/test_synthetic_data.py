"""`data.backend: synthetic`: the loaders' shapes and resume behaviour, and a recipe run without any dataset."""

import json

import pytest
import torch

from data import DataConfig, build_image_data
from data.synthetic import NUM_CLASSES, TRAIN_IMAGES, VAL_IMAGES
from recipes.resnet50 import main

pytestmark = pytest.mark.e2e


def test_synthetic_batches_have_the_phase_size_and_fixed_labels():
    data = build_image_data(DataConfig(backend="synthetic", root="/nowhere"), rank=1, world_size=2, seed=0)
    assert (data.num_classes, data.train_size) == (1000, 1_281_167)  # ImageNet-sized epochs
    loader = data.train_loader(24, 6, 0.5)
    assert len(loader) == TRAIN_IMAGES // 2 // 6
    loader.set_epoch(3, start_step=len(loader) - 2)
    (images, labels), (images_, labels_) = list(loader)
    assert images.shape == (6, 3, 24, 24) and images.dtype == torch.float32 and labels.shape == (6,)
    assert torch.equal(images, images_) and torch.equal(labels, labels_)
    assert 0 <= int(labels.min()) and int(labels.max()) < NUM_CLASSES
    other_rank = build_image_data(DataConfig(backend="synthetic"), rank=0, world_size=2, seed=0)
    assert not torch.equal(next(iter(other_rank.train_loader(24, 6)))[0], images)
    assert len(data.val_loader(32, 8)) == VAL_IMAGES // 2 // 8
    assert data.stats() == {}
    data.close()


def test_a_recipe_epoch_on_synthetic_data_needs_no_dataset(tmp_path):
    out = tmp_path / "run"
    summary = main(["--config", "configs/quickstart_cpu.yaml", "data.backend=synthetic",
                    f"data.root={tmp_path / 'nowhere'}", f"log.dir={out}", "train.epochs=1",
                    "schedule.phases=[{start_epoch: 0, end_epoch: 1, image_size: 16, batch_size: 16}]",
                    "train.max_steps_per_epoch=2", "train.target_top1=0", "model.arch=resnet18",
                    "train.channels_last=false", "train.amp=off", "model.small_map_gemm=true", "train.threads=1", "log.progress=false", "log.tensorboard=false",
                    "schedule.warmup_epochs=0"])
    assert summary["steps"] == 2 and summary["epochs_run"] == 1
    epoch = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert epoch["eval/images"] == VAL_IMAGES and epoch["time/images_per_s_epoch"] > 0
