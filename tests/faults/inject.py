"""Fault injection for tests/faults: the ResNet recipe, with one fault planted in its model from outside.

    FAULT=kill:1:8 torchrun --nproc-per-node 2 --max-restarts 1 -m tests.faults.inject --config ... key=value

`FAULT=kind:rank:step[:attempt]` strikes on `rank` during training step `step` (1-based: the step-th
forward pass in train mode of that process, so a resumed attempt counts from its first step) of torchrun
attempt `attempt` (TORCHELASTIC_RESTART_COUNT, default 0, so a restarted job runs clean); several faults are
separated by commas (`kill:1:8,term:1:1:1`: the restarted attempt is preempted in its first step):

- `kill`: the process SIGKILLs itself (a crashed node, an OOM kill);
- `stop`: it SIGSTOPs itself (a hung process: alive, holding its sockets, answering nothing);
- `nan`: the gradient of the model's first parameter is NaN for that step (a numerical blow-up);
- `term`, `usr1`: it sends itself SIGTERM or SIGUSR1 (a preemption notice: spot instances, Slurm).

The recipe itself has no test hooks: `install` wraps `recipes.resnet50.build_model`. `full_disk_in` makes one
checkpoint write of trainer/checkpoint.py meet a full filesystem (a ballast file takes every free byte), and
`stop_in_bursts` slows a running rank down from outside with SIGSTOP and SIGCONT.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

import recipes.resnet50 as recipe
import trainer.checkpoint


SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "usr1": signal.SIGUSR1}


@dataclass(frozen=True)
class Fault:
    kind: Literal["kill", "stop", "nan", "term", "usr1"]
    rank: int
    step: int
    attempt: int = 0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        kind, rank, step, *attempt = spec.split(":")
        if kind not in SIGNALS and kind != "nan":
            raise ValueError(f"FAULT={spec!r}: kind must be one of {', '.join(SIGNALS)} or nan")
        return cls(kind, int(rank), int(step), int(attempt[0]) if attempt else 0)  # type: ignore[arg-type]


def arm(model: nn.Module, fault: Fault) -> None:
    """Plant `fault` in `model` if it is meant for this rank and attempt."""
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if rank != fault.rank or attempt != fault.attempt:
        return
    steps = 0

    def count_step(module: nn.Module, args: tuple) -> None:
        nonlocal steps
        if not module.training:
            return  # evaluation
        steps += 1
        if steps == fault.step and fault.kind in SIGNALS:
            sys.stdout.flush()
            os.kill(os.getpid(), SIGNALS[fault.kind])

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan")) if steps == fault.step else grad

    model.register_forward_pre_hook(count_step)
    if fault.kind == "nan":
        next(model.parameters()).register_hook(poison)


def install(fault: Fault) -> None:
    """Make the recipe's `build_model` return models carrying `fault`."""
    build = recipe.build_model

    def build_with_fault(cfg: recipe.ModelConfig, num_classes: int, *args: Any, **kwargs: Any) -> nn.Module:
        model = build(cfg, num_classes, *args, **kwargs)
        arm(model, fault)
        return model

    recipe.build_model = build_with_fault


@contextlib.contextmanager
def full_disk(folder: Path) -> Iterator[None]:
    """The filesystem of `folder` full for the duration: a ballast file in `folder` takes every free byte."""
    ballast = folder / ".ballast"
    chunk = bytes(1 << 20)
    try:
        with open(ballast, "wb", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)  # a short write takes the last bytes; the next one fails
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        yield
    finally:
        ballast.unlink(missing_ok=True)


def full_disk_in(function: Literal["write_rank_files", "write_manifest"], step: int,
                 after_rank: int | None = None) -> Callable[[], None]:
    """Make trainer.checkpoint's `function` meet a full disk in the checkpoint of `step`, in this process: the
    run's folder (the checkpoints' parent) is filled just before the call and freed when it returns or raises.
    With `after_rank`, write_rank_files first waits for that rank's record of the same write (its part is on
    disk). Returns the function that puts the original back."""
    original = getattr(trainer.checkpoint, function)

    def on_a_full_disk(ckpt_dir: Path, *args: Any) -> Any:
        if ckpt_dir.name != trainer.checkpoint.step_dir_name(step):
            return original(ckpt_dir, *args)
        if after_rank is not None:
            token, record = args[2], ckpt_dir / f"rank-{after_rank:05d}.json"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(record.read_text()).get("token") == token:
                        break
                time.sleep(0.05)
        with full_disk(ckpt_dir.parent.parent):
            return original(ckpt_dir, *args)

    setattr(trainer.checkpoint, function, on_a_full_disk)
    return lambda: setattr(trainer.checkpoint, function, original)


def stop_in_bursts(pid: int, stopped_s: float, running_s: float, until: Callable[[], bool]) -> int:
    """SIGSTOP `pid` for `stopped_s`, then let it run for `running_s` (SIGCONT), until `until()` says so or
    the process is gone; it is left running. Returns the number of bursts."""
    bursts = 0
    try:
        while not until():
            os.kill(pid, signal.SIGSTOP)
            bursts += 1
            try:
                time.sleep(stopped_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        pass
    return bursts


if __name__ == "__main__":
    for spec in filter(None, os.environ.get("FAULT", "").split(",")):
        install(Fault.parse(spec))
    recipe.main(sys.argv[1:])
