"""The ResNet recipe learns: one process on the real digits, a ResNet-18 at 16 px for two short epochs."""

import json

import pytest

from recipes.resnet50 import main

pytestmark = pytest.mark.e2e

EPOCHS, STEPS = 2, 12  # 12 steps of 64 images: about half of the 1,437 training digits per epoch


def test_the_resnet_recipe_learns_the_digits(tmp_path, digits_root):
    """The training loss falls epoch by epoch and validation top-1 ends far above chance (10 classes: 0.1)."""
    out = tmp_path / "run"
    summary = main(["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", f"log.dir={out}",
                    "model.arch=resnet18", f"train.epochs={EPOCHS}",
                    f"schedule.phases=[{{start_epoch: 0, end_epoch: {EPOCHS}, image_size: 16, batch_size: 64}}]",
                    f"train.max_steps_per_epoch={STEPS}", "comm.kind=dense", "data.workers=0", "train.threads=1",
                    "train.channels_last=false", "train.amp=off", "model.small_map_gemm=true", "train.target_top1=0", "train.checkpoint_every_epochs=0",
                    "train.deterministic=false", "log.progress=false", "log.tensorboard=false"])
    epochs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    losses = [r["loss/train_epoch"] for r in epochs]
    assert len(losses) == EPOCHS and losses == sorted(losses, reverse=True), losses
    assert losses[-1] < 0.8 * losses[0], losses
    assert summary["final_top1"] >= 0.3, summary["final"]
