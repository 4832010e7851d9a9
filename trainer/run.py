"""One run of a recipe: parse and validate → check the GPU settings → process group → build → train → print
the result → close, in `finally`. Every recipe's `main` is this, given its config class and builders:

    def main(argv: list[str] | None = None) -> dict:
        return run(Config, build_data, build_task, argv, prog="python -m recipes.transformer")

The recipe builds what is its own (data, model, parameter groups, the task); this module builds what every
run shares (communicator, metrics, replica guard, the Trainer) from the config's sections.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from data import DataConfigError, DatasetNotFoundError
from trainer.checkpoint import CheckpointFolderError, require_writable
from trainer.cli import parse_config
from trainer.comm import build_communicator
from trainer.config import ConfigError, save_config
from trainer.devices import gpu_requests, require_cuda_for
from trainer.dist import ReplicaGuard, Topology, setup_distributed, teardown_distributed
from trainer.loop import Trainer
from trainer.metrics import RUN_OUTPUTS, build_metrics
from trainer.precision import amp_candidates
from trainer.rng import seed_everything
from trainer.run_record import write_run_record
from trainer.task import Task
from trainer.train_config import Components

C = TypeVar("C")
D = TypeVar("D")

BuildData = Callable[[C, Topology], D]
"""A recipe's data source for this rank, from the config (closed at the end when it has a `close`)."""
BuildTask = Callable[[C, Topology, D], tuple[Task, torch.optim.Optimizer]]
"""A recipe's task (its model on this rank's device) and the optimizer over the model's parameter groups."""


def run(config_cls: type[C], build_data: BuildData, build_task: BuildTask, argv: list[str] | None = None,
        prog: str | None = None) -> dict[str, Any]:
    """Train one run of a recipe; returns the run summary (also in log.dir/summary.json).

    A user mistake (a dataset or config error, an unwritable checkpoint folder) raises for a caller that passes
    `argv` (tests match its text); from the command line (`argv` None) it ends the process with one line instead
    of a traceback from every rank.
    """
    try:
        return train(parse_config(config_cls, argv, prog), build_data, build_task)
    except (DatasetNotFoundError, DataConfigError, ConfigError, CheckpointFolderError) as e:
        if argv is not None:
            raise
        kind = ("config" if isinstance(e, ConfigError) else "checkpoint" if isinstance(e, CheckpointFolderError)
                else "dataset")
        raise SystemExit(f"{kind} error: {e}") from None


def train(cfg: Any, build_data: BuildData, build_task: BuildTask) -> dict[str, Any]:
    """`run` after parsing: `cfg` is a recipe's root config (sections model, data, optim, schedule, comm,
    dist, train, log)."""
    require_cuda_for(gpu_requests(cfg.dist.backend, cfg.train.amp))  # before any process group or data
    require_writable(Path(cfg.log.dir) / "checkpoints")  # every rank, before anything is written to log.dir
    if cfg.dist.backend == "nccl":
        amp_candidates(cfg.train.amp, torch.device("cuda"))  # a pinned precision this GPU cannot run
    topo = setup_distributed(cfg.dist)
    with contextlib.ExitStack() as cleanup:  # closes in reverse: metrics, data, then the process group
        cleanup.callback(teardown_distributed)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed, cfg.train.deterministic)  # the same initial weights on every rank
        data = build_data(cfg, topo)
        cleanup.callback(getattr(data, "close", lambda: None))
        task, optimizer = build_task(cfg, topo, data)
        comm = build_communicator(cfg.comm, task.model, topo, optimizer)
        metrics = build_metrics(cfg.log, topo.is_main, fresh=not cfg.train.should_resume(), extra=task.writers)
        cleanup.callback(metrics.close)
        write_run_record(Path(cfg.log.dir), topo, fresh=not cfg.train.should_resume())  # env.json, every rank's host
        if topo.is_main:
            save_config(cfg, Path(cfg.log.dir) / "config.yaml")
        guard = ReplicaGuard(cfg.dist.check_every_steps, topo)
        summary = Trainer(cfg, topo, task, Components(task.model, optimizer, comm, metrics, guard)).fit()
        if topo.is_main:
            print_result(summary, task, Path(cfg.log.dir))
        return summary


def print_result(summary: dict[str, Any], task: Task, log_dir: Path) -> None:
    """The result on rank 0: the task's final scores, epochs and seconds, the target, where the outputs are."""
    for line in task.report(summary):
        print(line)
    tta = summary["time_to_target_s"]
    reached = ("no target set" if not any(task.targets.values()) else
               "target NOT reached" if tta is None else f"target reached in {tta:.1f} s")
    print(f"{summary['epochs_run']} epochs, {summary['elapsed_s']:.1f} s; {reached}")
    print(f"outputs in {log_dir}: {', '.join(name for name in RUN_OUTPUTS if (log_dir / name).exists())}")
