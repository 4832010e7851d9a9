"""train.compile and train.cuda_graphs (trainer/compiling.py): which candidates a config gives, compiling in place,
and a real torch.compile (inductor on the CPU) of a small CNN through `Trainer.fit`: compiled at both training
shapes before the clock, nothing compiled inside it (evaluation eager), the same checkpoint keys as eager and
weights within float tolerance of an eager run's."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from data import DataConfig, build_image_data
from trainer.classification import ClassificationTask, ClassificationTrainConfig
from trainer.comm import LocalCommunicator
from trainer.compiling import apply_compile, compile_candidates, compiled_mode, graph_blockers
from trainer.config import ConfigError
from trainer.dist import Topology
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.schedules import Phase, ScheduleConfig
from trainer.train_config import Components, LoopConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.unit
@pytest.mark.parametrize("compile_mode, graphs, device, world, expected", [
    ("off", "off", CPU, 1, ["off"]),
    ("on", "off", CPU, 1, ["default"]),
    ("auto", "off", CPU, 1, ["off", "default"]),
    ("auto", "auto", CPU, 1, ["off", "default"]),  # no CUDA: graphs are no candidate
    ("auto", "auto", CUDA, 1, ["off", "default", "reduce-overhead"]),
    ("on", "auto", CUDA, 1, ["default", "reduce-overhead"]),
    ("auto", "auto", CUDA, 2, ["off", "default"]),  # more than one rank: no graphs
    ("off", "auto", CUDA, 1, ["off"]),
    ("on", "on", CUDA, 1, ["reduce-overhead"]),
])
def test_compile_candidates(compile_mode: str, graphs: str, device: torch.device, world: int,
                            expected: list[str]) -> None:
    """A wrong table (graphs offered on the CPU or with a communicator, auto without eager) fails here."""
    assert compile_candidates(compile_mode, graphs, device, world) == expected


@pytest.mark.unit
@pytest.mark.parametrize("compile_mode, device, world, match", [
    ("on", CPU, 1, "need a CUDA device"),
    ("auto", CUDA, 4, "more than one rank"),
    ("off", CUDA, 1, "needs train.compile on or auto"),
])
def test_cuda_graphs_on_where_they_cannot_run_is_a_config_error(compile_mode: str, device: torch.device,
                                                                world: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compile_candidates(compile_mode, "on", device, world)


@pytest.mark.unit
def test_graph_blockers_name_every_reason() -> None:
    assert graph_blockers(CUDA, 1) == []
    assert len(graph_blockers(CPU, 2)) == 2


@pytest.mark.unit
def test_compiling_in_place_keeps_parameters_and_state_dict_keys() -> None:
    """nn.Module.compile, not torch.compile's wrapper: a wrapper would prefix every key with `_orig_mod.` and break
    checkpoints and export. Nothing is compiled until the model is called."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    keys, params = list(model.state_dict()), list(model.parameters())
    apply_compile(model, "default")
    assert compiled_mode(model) == "default" and model._compiled_call_impl is not None
    assert list(model.state_dict()) == keys and all(a is b for a, b in zip(model.parameters(), params))
    apply_compile(model, "off")
    assert compiled_mode(model) == "off" and model._compiled_call_impl is None
    with pytest.raises(ValueError, match="mode must be one of"):
        apply_compile(model, "max-speed")


# ---------------------------------------------------------------- through fit

PHASES = [Phase(start_epoch=0, end_epoch=1, image_size=12, batch_size=16),
          Phase(start_epoch=1, end_epoch=2, image_size=16, batch_size=16)]


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def fit(tmp_path: Any, digits_root: Any, compile_mode: str, monkeypatch: pytest.MonkeyPatch,
        phases: list[Phase] = PHASES, **train: Any) -> tuple[Trainer, dict[str, int]]:
    """An epoch of 3 steps per phase (default: 12 and 16 px), deterministic, an evaluation after each; returns the
    trainer and dynamo's count of compiled graphs at the end of `settle_choices` and at the end of fit."""
    import torch._dynamo.utils as dynamo_utils

    graphs: dict[str, int] = {}
    settle = Trainer.settle_choices

    def counted(self: Trainer) -> None:
        settle(self)
        graphs["before the clock"] = dynamo_utils.counters["stats"]["unique_graphs"]

    monkeypatch.setattr(Trainer, "settle_choices", counted)
    topo = Topology()
    model = small_cnn()
    data = build_image_data(DataConfig(root=str(digits_root), backend="torchvision", workers=0), 0, 1, seed=0)
    cfg = ClassificationTrainConfig(**{**dict(epochs=len(phases), channels_last=False, amp="off", compile=compile_mode,
                                              deterministic=True, max_steps_per_epoch=3, calibration_rounds=1,
                                              choices_cache="none", target_top1=0), **train})
    task = ClassificationTask(model, data, topo, phases, cfg)
    trainer = Trainer(LoopConfig(cfg, ScheduleConfig(phases=phases, total_epochs=len(phases), warmup_epochs=0),
                                 LogConfig(dir=str(tmp_path / compile_mode), progress=False, tensorboard=False)),
                      topo, task, Components(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                             LocalCommunicator(topo)))
    trainer.fit()
    data.close()
    graphs["after fit"] = dynamo_utils.counters["stats"]["unique_graphs"]
    return trainer, graphs


@pytest.mark.long  # inductor compiles a small CNN at two shapes, twice: about 30 s on 2 cores
def test_compiled_training_compiles_before_the_clock_and_matches_eager(tmp_path, digits_root, monkeypatch) -> None:
    """Would fail if the model were compiled lazily inside the clock (graphs counted after settle_choices grow
    during fit), if evaluation ran compiled (each validation shape compiles), if a wrapper changed the checkpoint
    keys, or if `auto` did not time both candidates."""
    torch._dynamo.reset()
    eager, _ = fit(tmp_path, digits_root, "off", monkeypatch)
    compiled, graphs = fit(tmp_path, digits_root, "on", monkeypatch)
    assert compiled_mode(compiled.task.model) == "default"
    assert graphs["before the clock"] == graphs["after fit"] >= 2, graphs  # one graph per training shape at least
    assert list(compiled.task.model.state_dict()) == list(eager.task.model.state_dict())
    for a, b in zip(compiled.task.model.state_dict().values(), eager.task.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    measured, graphs = fit(tmp_path, digits_root, "auto", monkeypatch)
    assert measured.decision is not None and measured.decision.source == "measured"
    assert {"compile_off", "compile_default"} <= {part for label in measured.decision.costs_s
                                                  for part in label.split("-")}, measured.decision.costs_s
    assert graphs["before the clock"] == graphs["after fit"], graphs


@pytest.mark.long  # 8 candidates measured at 3 shapes, then a run: about 20 s on 2 cores
def test_every_measured_combination_and_shape_stays_compiled(tmp_path, digits_root, monkeypatch) -> None:
    """compile, precision and memory layout all at auto over 3 training shapes: 24 combinations of choice and shape,
    beyond dynamo's default limit of 8 graphs, past which it runs eager without a word. With the limit left alone
    this raises (the test makes a hit fail, as the trainer does); dynamo's eager backend stands in for inductor (the
    same guards and recompilations, nothing generated)."""
    import trainer.compiling as compiling

    monkeypatch.setattr(compiling, "BACKEND", "eager")
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    torch._dynamo.reset()
    phases = [Phase(start_epoch=i, end_epoch=i + 1, image_size=px, batch_size=16) for i, px in enumerate((8, 12, 16))]
    trainer, graphs = fit(tmp_path, digits_root, "auto", monkeypatch, phases, amp="auto", channels_last="auto")
    decision = trainer.decision
    assert decision is not None and decision.source == "measured" and len(decision.costs_s) == 8, decision.costs_s
    assert all(cost is not None and math.isfinite(cost) for cost in decision.costs_s.values()), decision.costs_s
    assert graphs["before the clock"] == graphs["after fit"], graphs
