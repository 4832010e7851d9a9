"""The evaluation knobs of the ResNet recipe: a moving average of the weights (train.ema_decay,
train.ema_every_steps; trainer/ema.py) and test-time flip (train.eval_flip). Closed-form expectations on tiny
models, one process; then the recipe for real on the digits: a resumed run with the average ends bitwise as an
uninterrupted one, and export takes the average."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from trainer.classification import ClassificationTask, ClassificationTrainConfig, flip_averaged_log_probs
from trainer.comm import LocalCommunicator
from trainer.config import ConfigError
from trainer.dist import Topology
from trainer.ema import WeightEma, averaged_weights
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.schedules import Phase
from trainer.train_config import Components, LoopConfig

PHASE = Phase(image_size=2, batch_size=4)


class Images:
    """A validation split of fixed images and labels, in one batch (what ClassificationTask reads of a data
    source)."""

    num_classes, train_size = 2, 4

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def val_loader(self, size: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.images, self.labels)]

    def stats(self) -> dict[str, float]:
        return {}


def linear_net(bias: tuple[float, float] = (0.0, 0.0)) -> nn.Module:
    """Flatten + Linear over 3x2x2 images, zero weights and the given bias; a BatchNorm ahead so that buffers
    are part of the average."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.copy_(torch.tensor(bias))
    return model


def task_of(model: nn.Module, data: Images, **train: object) -> ClassificationTask:
    cfg = ClassificationTrainConfig(channels_last=False, **train)
    return ClassificationTask(model, data, Topology(), [PHASE], cfg)


# ---------------------------------------------------------------- the average


@pytest.mark.unit
@pytest.mark.parametrize("every", [1, 2])
def test_the_average_after_known_updates_is_the_hand_computed_one(every):
    decay = 0.7  # not 0.5: decay and 1 - decay swapped would give another average
    model = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))
    ema = WeightEma(model, decay, every)
    values = [1.0, 3.0, -2.0, 5.0, 4.0]
    want = None
    for step, value in enumerate(values, start=1):
        with torch.no_grad():
            for tensor in [*model.parameters(), model[1].running_mean, model[1].running_var]:
                tensor.fill_(value)
        ema.maybe_update(step)
        if step % every == 0:
            want = value if want is None else decay * want + (1 - decay) * value  # the first update copies
    for name, tensor in [*ema.module.named_parameters(), ("1.running_mean", ema.module[1].running_mean),
                         ("1.running_var", ema.module[1].running_var)]:
        torch.testing.assert_close(tensor, torch.full_like(tensor, want), rtol=1e-6, atol=1e-6, msg=name)
    assert int(ema.averaged.n_averaged) == len(values) // every
    assert not any(p.requires_grad for p in ema.module.parameters())
    state = averaged_weights(ema.state_dict())
    assert state.keys() == model.state_dict().keys()


@pytest.mark.unit
@pytest.mark.parametrize("decay", [0.0, 0.999])
def test_evaluation_runs_the_average_when_on_and_the_trained_weights_when_off(decay):
    data = Images(torch.randn(4, 3, 2, 2), torch.ones(4, dtype=torch.long))
    model = linear_net(bias=(0.0, 1.0))  # predicts class 1: every label
    task = task_of(model, data, ema_decay=decay)
    task.after_step(1)  # the first update copies the weights into the average
    with torch.no_grad():
        model[2].bias.copy_(torch.tensor([1.0, 0.0]))  # the trained weights now predict class 0
    record = task.evaluate(PHASE)
    if decay:
        assert record["eval/top1"] == 1.0 and record["eval/ema"] == 1.0
        assert [s for s in task.state_dict()["ema"] if s.startswith("module.")]
    else:
        assert record["eval/top1"] == 0.0 and "eval/ema" not in record
        assert task.state_dict() == {}


@pytest.mark.unit
def test_a_step_the_loss_scaler_skips_leaves_the_average_alone(tmp_path):
    data = Images(torch.randn(4, 3, 2, 2), torch.ones(4, dtype=torch.long))
    model = linear_net()
    cfg = ClassificationTrainConfig(channels_last=False, amp="off", loss_scale="dynamic", ema_decay=0.5)
    task = ClassificationTask(model, data, Topology(), [PHASE], cfg)
    topo = Topology()
    trainer = Trainer(LoopConfig(cfg, log=LogConfig(dir=str(tmp_path), progress=False)), topo, task,
                      Components(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator(topo)))
    averaged = task.eval_weights.averaged
    good = (torch.randn(4, 3, 2, 2), torch.ones(4, dtype=torch.long))
    trainer.train_step(good)
    assert int(averaged.n_averaged) == 1
    before = {k: v.clone() for k, v in averaged.state_dict().items()}
    trainer.train_step((torch.full((4, 3, 2, 2), math.inf), torch.ones(4, dtype=torch.long)))
    assert trainer.skipped_in_a_row == 1
    for key, value in averaged.state_dict().items():
        assert torch.equal(value, before[key]), key
    trainer.train_step(good)
    assert int(averaged.n_averaged) == 2


# ---------------------------------------------------------------- test-time flip


@pytest.mark.unit
def test_flip_evaluation_is_the_mean_of_the_two_passes_and_differs_from_the_plain_one():
    torch.manual_seed(1)
    images = torch.randn(4, 3, 2, 2)
    labels = torch.tensor([0, 1, 0, 1])
    model = linear_net()
    nn.init.normal_(model[2].weight)  # an asymmetric model: its mirror image gives other logits
    model.eval()
    with torch.no_grad():
        mean = (model(images).softmax(1) + model(images.flip(-1)).softmax(1)) / 2
        torch.testing.assert_close(flip_averaged_log_probs(model, images).exp(), mean)
        plain = nn.functional.cross_entropy(model(images), labels)
    want = float(nn.functional.nll_loss(mean.log(), labels))
    flipped = task_of(model, Images(images, labels), eval_flip=True).evaluate(PHASE)
    assert flipped["eval/flip"] == 1.0
    assert flipped["eval/loss"] == pytest.approx(want, rel=1e-5)
    assert flipped["eval/loss"] != pytest.approx(float(plain), rel=1e-3)
    unflipped = task_of(model, Images(images, labels)).evaluate(PHASE)
    assert unflipped["eval/loss"] == pytest.approx(float(plain), rel=1e-5) and "eval/flip" not in unflipped


# ---------------------------------------------------------------- config


@pytest.mark.unit
@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_a_decay_outside_zero_to_one_is_a_config_error(decay):
    with pytest.raises(ConfigError, match=rf"train\.ema_decay: must be in \[0, 1\) .*got {decay}"):
        ClassificationTrainConfig(ema_decay=decay)
    with pytest.raises(ConfigError, match=r"train\.ema_every_steps: must be >= 1, got 0"):
        ClassificationTrainConfig(ema_decay=0.9, ema_every_steps=0)


@pytest.mark.unit
def test_the_knobs_are_off_by_default():
    cfg = ClassificationTrainConfig()
    assert (cfg.ema_decay, cfg.ema_every_steps, cfg.eval_flip) == (0.0, 1, False)


# ---------------------------------------------------------------- the recipe


@pytest.mark.long
def test_resume_with_the_average_is_bitwise_and_export_takes_it(tmp_path, digits_root):
    from trainer.export import main as export
    from tests.test_trainer import TINY, straight_and_resumed
    common = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", "train.max_steps_per_epoch=4",
              "train.target_top1=0", "train.deterministic=true", "train.ema_decay=0.9", "train.ema_every_steps=3",
              "train.eval_flip=true", *TINY]
    straight, split = straight_and_resumed(common, tmp_path)
    ema = straight["task"]["ema"]
    assert int(ema["n_averaged"]) == 4  # steps 3, 6, 9, 12 (the resume continues at step 9)
    for name, value in [*straight["model"].items(), *ema.items()]:
        other = split["model"][name] if name in straight["model"] else split["task"]["ema"][name]
        assert torch.equal(value, other), name
    assert any(not torch.equal(value, straight["model"][name]) for name, value in averaged_weights(ema).items()
               if value.is_floating_point())
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "epoch"]
    assert [(r["epoch"], r["eval/ema"], r["eval/flip"]) for r in evals] == [(0, 1, 1), (1, 1, 1), (2, 1, 1)]
    last = json.loads((tmp_path / "straight" / "summary.json").read_text())["final"]
    assert last["eval/top1"] == evals[-1]["eval/top1"] and last["eval/loss"] == evals[-1]["eval/loss"]

    exported = torch.load(export([str(tmp_path / "straight"), "--format", "torchvision", "--out",
                                  str(tmp_path / "ema.pth")]), weights_only=True)
    for name, value in averaged_weights(ema).items():
        assert torch.equal(exported[name], value.contiguous()), name
    raw = torch.load(export([str(tmp_path / "straight"), "--format", "torchvision", "--raw-weights", "--out",
                             str(tmp_path / "raw.pth")]), weights_only=True)
    for name, value in straight["model"].items():
        assert torch.equal(raw[name], value.contiguous()), name
