"""What the device-side paths read back to the host, counted at the dispatcher (a `TorchDispatchMode` sees every
aten op, `aten._local_scalar_dense` being `.item()`, `float()`, `int()` and `bool()` of a tensor; `tolist()`
reads a CPU tensor's memory below the dispatcher, so it is counted by wrapping it).

- A training step of the GPU path's configuration (train.nonfinite_check=device, the preemption check at auto,
  FusedLARS on its foreach path, which CUDA takes without Triton; the Triton path's reads are counted in
  tests/test_optim_triton.py) reads nothing back between log steps, and a NaN gradient still leaves the weights
  and momentum untouched: the run stops at the next log step naming the first bad step.
- Evaluation accumulates on the device and reads its sums once, however many batches it runs, with cuDNN's
  autotuning off (rectangular validation batches come in many shapes)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.lars
from kernels import FusedLARS, build_adam
from trainer.classification import ClassificationTask, ClassificationTrainConfig
from trainer.comm import LocalCommunicator
from trainer.config import ConfigError
from trainer.dist import DistConfig, Topology, setup_distributed
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.schedules import Phase
from trainer.train_config import Components, LoopConfig, TrainConfig

HOST_READS = ("aten._local_scalar_dense", "aten.item")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it, by name (overload dropped), and notes `at()` (e.g. the trainer's
    step) for every host read."""

    def __init__(self, at: Any = lambda: None) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.at, self.reads_at = at, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._schema.name.replace("::", ".")
        self.ops[name] += 1
        if name in HOST_READS:
            self.reads_at.append(self.at())
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> int:
        return sum(self.ops[name] for name in HOST_READS)


@pytest.fixture
def tolist_calls(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Every `Tensor.tolist()` (a host read the dispatcher does not see on the CPU): `.at()` when it came (set
    it: e.g. the trainer's step), in `.calls`."""
    log, real = SimpleNamespace(calls=[], at=lambda: None), torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        log.calls.append(log.at())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return log


# ---------------------------------------------------------------- a training step


class Planted:
    """A task of 8 steps of a linear classifier; the batch of step `nan_at` holds a NaN."""

    unit, targets = "images", {}

    def __init__(self, model: nn.Module, nan_at: int = 0) -> None:
        self.model, self.nan_at = model, nan_at
        self.weights_before: dict[int, list[torch.Tensor]] = {}

    def steps_per_epoch(self, phase: Phase) -> int:
        return 8

    def train_batches(self, phase: Phase, epoch: int, start_step: int = 0) -> Iterator[Any]:
        g = torch.Generator().manual_seed(epoch)
        for step in range(start_step + 1, 9):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            if step == self.nan_at:
                x[3, 2] = float("nan")
            yield step, x, y

    def loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        step, x, y = batch
        self.weights_before[step] = [p.detach().clone() for p in self.model.parameters()]
        return nn.functional.cross_entropy(self.model(x), y), len(y)

    def state_dict(self) -> dict:
        return {}


def device_path_trainer(tmp_path: Any, optimizer: str, nan_at: int = 0) -> tuple[Trainer, Planted]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    params = [{"params": [model[0].weight, model[2].weight], "weight_decay": 1e-4},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "lars_exclude": True}]
    opt = (FusedLARS(params, lr=0.1, momentum=0.9, trust_coefficient=0.02) if optimizer == "lars" else
           build_adam([{k: v for k, v in g.items() if k != "lars_exclude"} for g in params], lr=0.01))
    topo = setup_distributed(DistConfig())
    task = Planted(model, nan_at)
    train = TrainConfig(epochs=1, nonfinite_check="device", loss_scale="off", amp="off")
    trainer = Trainer(LoopConfig(train, log=LogConfig(dir=str(tmp_path), every_steps=4, progress=False,
                                                      tensorboard=False)),
                      topo, task, Components(model, opt, LocalCommunicator(topo)))  # type: ignore[arg-type]
    return trainer, task


BAR = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kw: None)


@pytest.mark.unit
@pytest.mark.parametrize("optimizer", ["lars", "adam"])
def test_a_training_step_on_the_device_path_reads_the_host_only_at_log_steps(tmp_path, monkeypatch, optimizer,
                                                                                tolist_calls):
    monkeypatch.setattr(kernels.lars, "native_library", lambda: None)  # FusedLARS's foreach path
    trainer, _ = device_path_trainer(tmp_path, optimizer)
    assert trainer.nonfinite is not None and trainer.preemption.check_every_steps is None  # device flag, auto
    tolist_calls.at = lambda: trainer.step
    with OpCounter(at=lambda: trainer.step) as counter:
        trainer.train_epoch(trainer.schedule.phase(0), BAR)
    assert trainer.step == 8
    # at log steps 4 and 8 (the second also the epoch's end), never in steps 1-3 and 5-7
    reads = sorted(set(counter.reads_at + tolist_calls.calls))
    assert reads == [4, 8], f"host reads at steps {counter.reads_at}, tolist() at steps {tolist_calls.calls}"


@pytest.mark.unit
@pytest.mark.parametrize("optimizer", ["lars", "adam"])
def test_a_nan_gradient_on_the_device_path_leaves_the_weights_and_stops_at_the_next_log_step(
        tmp_path, monkeypatch, optimizer):
    monkeypatch.setattr(kernels.lars, "native_library", lambda: None)
    trainer, task = device_path_trainer(tmp_path, optimizer, nan_at=2)
    with pytest.raises(FloatingPointError, match=r"in 1 step\(s\), the first at step 2; found at a log step at "
                                                 r"step 4"):
        trainer.train_epoch(trainer.schedule.phase(0), BAR)
    assert trainer.step == 4  # steps 3 and 4 ran (skipped on the device) before the host looked
    before_the_nan = task.weights_before[2]
    for p, want in zip(trainer.model.parameters(), before_the_nan):
        assert torch.equal(p.detach(), want)  # bitwise: the NaN step and the ones after it changed nothing
    assert all(torch.isfinite(s).all() for state in trainer.optimizer.state.values() for s in state.values()
               if isinstance(s, torch.Tensor))


@pytest.mark.unit
def test_the_device_check_with_an_optimizer_that_cannot_skip_on_the_device_is_a_config_error(tmp_path):
    topo = setup_distributed(DistConfig())
    model = nn.Linear(2, 2)
    train = TrainConfig(epochs=1, nonfinite_check="device")
    with pytest.raises(ConfigError, match="train.nonfinite_check=device: SGD cannot skip"):
        Trainer(LoopConfig(train, log=LogConfig(dir=str(tmp_path))), topo, Planted(model),  # type: ignore[arg-type]
                Components(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator(topo)))


@pytest.mark.unit
@pytest.mark.parametrize("native", [False, True])
def test_fused_lars_with_found_inf_keeps_every_tensor_when_set_and_steps_as_without_it_when_clear(monkeypatch,
                                                                                                   native):
    if not native:
        monkeypatch.setattr(kernels.lars, "native_library", lambda: None)
    elif kernels.lars.native_library() is None:
        pytest.skip("the C++ LARS kernel is not built here")
    results = {}
    for flag in (None, 0.0, 1.0):
        torch.manual_seed(0)
        w = [torch.randn(5, 4, requires_grad=True), torch.randn(7, requires_grad=True)]
        opt = FusedLARS([{"params": [w[0]], "weight_decay": 1e-3}, {"params": [w[1]], "lars_exclude": True}],
                        lr=0.5, momentum=0.9, trust_coefficient=0.02)
        for step in range(3):  # momentum buffers hold something before the flagged step
            for p in w:
                p.grad = torch.full_like(p, float("nan")) if step == 2 and flag == 1.0 else torch.randn_like(p)
            if step == 2 and flag is not None:
                opt.found_inf = torch.tensor(flag)
            opt.step()
            if step == 1:
                kept = [t.detach().clone() for t in w] + [opt.state[p]["momentum_buffer"].clone() for p in w]
        results[flag] = [t.detach().clone() for t in w] + [opt.state[p]["momentum_buffer"].clone() for p in w]
    assert all(torch.equal(a, b) for a, b in zip(results[1.0], kept))  # the flagged step changed nothing
    assert all(torch.equal(a, b) for a, b in zip(results[0.0], results[None]))  # a clear flag: the plain step
    assert not any(torch.equal(a, b) for a, b in zip(results[None], kept))  # which changes every tensor


class Batches:
    """A validation split served in batches of `batch` (what ClassificationTask reads of a data source)."""

    num_classes, train_size = 4, 8

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch: int) -> None:
        self.images, self.labels, self.batch = images, labels, batch

    def val_loader(self, size: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.images[i:i + self.batch], self.labels[i:i + self.batch])
                for i in range(0, len(self.labels), self.batch)]

    def stats(self) -> dict[str, float]:
        return {}


@pytest.mark.unit
def test_evaluation_reads_the_host_once_whatever_the_batches_and_scores_right(tolist_calls):
    torch.manual_seed(0)
    images, labels = torch.randn(40, 3, 2, 2), torch.randint(0, 4, (40,))
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).eval()
    with torch.no_grad():
        logits = model(images)
    want_top1 = float((logits.argmax(1) == labels).float().mean())
    want_loss = float(nn.functional.cross_entropy(logits, labels))
    phase = Phase(image_size=2, batch_size=8)
    reads = {}
    for batch in (40, 4):  # one batch, then ten
        task = ClassificationTask(model, Batches(images, labels, batch), Topology(), [phase],
                                  ClassificationTrainConfig(channels_last=False))
        tolist_calls.calls.clear()
        with torch.no_grad(), OpCounter() as counter:
            record = task.evaluate(phase)
        reads[batch] = counter.host_reads() + len(tolist_calls.calls)
        assert record["eval/images"] == 40
        assert record["eval/top1"] == pytest.approx(want_top1)
        assert record["eval/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert reads[4] == reads[40] == 1, f"host reads per evaluation: {reads} (batches of 4 and of 40)"


@pytest.mark.unit
def test_evaluation_runs_without_cudnn_autotuning_and_gives_it_back(tmp_path):
    from tests.test_checkpoint import one_process_trainer
    trainer = one_process_trainer(tmp_path)
    seen = []
    trainer.task.evaluate = lambda phase: seen.append(torch.backends.cudnn.benchmark) or {}
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True  # as a phase of training sets it
        trainer.evaluate(Phase(image_size=2, batch_size=8))
        assert seen == [False] and torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
