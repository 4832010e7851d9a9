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
`stop_in_bursts` slows a running rank down from outside with SIGSTOP and SIGCONT. `link_rate_at_steps` reshapes
the emulated cluster's links (scripts/netem/cluster.sh rate) when the run's metrics.jsonl reaches given steps;
`CONSERVATION=FILE` makes every rank measure, after each exchange, the gradient mass error feedback lost or
added (`check_conservation`), rank 0 writing one JSON line per step to FILE.
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
import subprocess
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
from torch import nn

import recipes.resnet50 as recipe
import trainer.checkpoint
import trainer.run
from trainer.comm import Communicator, CommConfig, PlanExecutor
from trainer.dist import Topology

CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "netem" / "cluster.sh"


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


def logged_step(metrics: Path) -> int:
    """The newest training step the run's metrics.jsonl records (0 before the first)."""
    step = 0
    with contextlib.suppress(OSError):
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                record = json.loads(line)
                if record.get("kind") == "step":
                    step = max(step, int(record["step"]))
    return step


def link_rate_at_steps(metrics: Path, changes: Sequence[tuple[int, str]], running: Callable[[], bool],
                       env: dict[str, str] | None = None, poll_s: float = 0.05) -> list[tuple[int, str]]:
    """For each (step, rate) in order: once the run's `metrics` (log.every_steps 1) records that step, reshape
    every link of the emulated cluster to `rate` (`cluster.sh rate`, with `env`'s NETEM_PREFIX). Stops early
    when `running()` turns false. Returns (the step logged when the rate was set, rate) per change made."""
    done = []
    for step, rate in changes:
        seen = logged_step(metrics)
        while seen < step and running():
            time.sleep(poll_s)
            seen = logged_step(metrics)
        if seen < step:
            break
        proc = subprocess.run([str(CLUSTER), "rate", rate], env=env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"cluster.sh rate {rate} failed: {proc.stderr.strip()}")
        done.append((seen, rate))
    return done


SAMPLE = 2**14
"""Elements of each bucket the conservation check compares (the same positions on every rank)."""


def placed(comm: PlanExecutor, index: int, n: int, at: torch.Tensor) -> torch.Tensor:
    """Bucket `index`'s residual (n elements, zero where it keeps none) at the positions `at`, in float64."""
    out = torch.zeros(n, dtype=torch.float64)
    residual = comm.residuals.get(index)
    if residual is not None:
        lo, _ = comm.placement(comm._residual_kind[index], n)
        hi = min(n, lo + residual.numel())
        out[lo:hi] = residual[:hi - lo].double().cpu()
    return out[at]


def check_conservation(comm: Communicator, topo: Topology, out: Path) -> None:
    """After every exchange of `comm`, measure at `SAMPLE` fixed positions per bucket how far the ranks' gradients
    plus their residuals before the step are from W x the averaged gradient plus their residuals after it (error
    feedback promises rounding only: nothing lost, nothing counted twice); rank 0 appends one JSON line per step
    to `out`: per bucket the kind that ran, whether it folded a residual, |error| and |mass| (L1 over the sample)
    and the residuals' L1 mass before the step."""
    if not isinstance(comm, PlanExecutor):
        raise TypeError(f"CONSERVATION needs a plan executor, got {type(comm).__name__}")
    generator = torch.Generator().manual_seed(0)
    at = {b.index: torch.randint(0, b.numel, (min(SAMPLE, b.numel),), generator=generator) for b in comm.buckets}
    sent: dict[int, torch.Tensor] = {}
    before: dict[int, torch.Tensor] = {}
    kinds: dict[int, str] = {}
    launch, finish = comm.launch, comm.finish
    steps = 0

    def launch_and_keep(bucket: Any) -> None:
        # before the exchange thread folds a residual into the buffer: this rank's own gradient
        sent[bucket.index] = bucket.buffer.double().cpu()[at[bucket.index]]
        before[bucket.index] = placed(comm, bucket.index, bucket.numel, at[bucket.index])
        kinds[bucket.index] = comm.choice_of(bucket).kind  # a window's end may change the plan inside finish()
        launch(bucket)

    def finish_and_check() -> dict[str, float]:
        nonlocal steps
        stats = finish()
        steps += 1
        rows = []
        for b in comm.buckets:
            p_at = at[b.index]
            flat = torch.cat([p.grad.reshape(-1) for p in b.params]).double().cpu()[p_at]
            mine = sent[b.index] + before[b.index] - placed(comm, b.index, b.numel, p_at)
            rows.append(torch.stack([mine, mine.abs(), before[b.index].abs(), flat]))
        mass = torch.stack(rows)
        summed = mass.clone()
        topo.world.all_reduce_(summed, "conservation check")
        if topo.is_main:
            folded = {index for index, _, _ in comm._folded}
            record = {"step": steps, "buckets": [
                {"index": b.index, "kind": kinds[b.index], "folded": b.index in folded,
                 "error": (summed[i, 0] - topo.world_size * mass[i, 3]).abs().sum().item(),
                 "mass": summed[i, 1].sum().item(), "residual": summed[i, 2].sum().item()}
                for i, b in enumerate(comm.buckets)]}
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        return stats

    comm.launch, comm.finish = launch_and_keep, finish_and_check  # type: ignore[method-assign]


def install_conservation_check(out: Path) -> None:
    """Make the recipe's communicator run `check_conservation` (writing to `out`)."""
    build = trainer.run.build_communicator

    def build_and_check(cfg: CommConfig, model: nn.Module, topo: Topology, *rest: Any) -> Communicator:
        comm = build(cfg, model, topo, *rest)
        check_conservation(comm, topo, out)
        return comm

    trainer.run.build_communicator = build_and_check


if __name__ == "__main__":
    for spec in filter(None, os.environ.get("FAULT", "").split(",")):
        install(Fault.parse(spec))
    if os.environ.get("CONSERVATION"):
        install_conservation_check(Path(os.environ["CONSERVATION"]))
    recipe.main(sys.argv[1:])
