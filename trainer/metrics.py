"""Metrics: one logger, several writers behind one interface (`Writer`): JSONL and TensorBoard for every run,
plus the writers a task adds (the DAWNBench TSV of image classification, trainer/classification.py).

Only rank 0 writes; other ranks get the null logger. Tags are grouped by prefix (`loss/`, `eval/`,
`time/`, `comm/`, `schedule/`, `memory/`), and every epoch record carries the wall-clock seconds since the
run started, so time-to-accuracy curves can be drawn from the JSONL or read in TensorBoard (`tta/` tags
use elapsed seconds as their step).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainer.config import require


@dataclass
class LogConfig:
    dir: str = "runs/default"
    """Run output folder: config.yaml, metrics.jsonl, TensorBoard events, checkpoints, and task files (the
    DAWNBench TSV of image recipes)."""
    tensorboard: bool = True
    """Write TensorBoard event files under dir/tensorboard."""
    every_steps: int = 20
    """Log training scalars every this many steps."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        require(bool(self.dir), "log.dir: must not be empty")
        require(self.every_steps > 0, f"log.every_steps: must be > 0, got {self.every_steps}")


class Writer:
    """A metrics sink. `step` is the global step; `record` has flat `prefix/name` keys."""

    def write(self, kind: str, step: int, record: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlWriter(Writer):
    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)

    def write(self, kind: str, step: int, record: dict[str, float]) -> None:
        self.file.write(json.dumps({"kind": kind, "step": step, **record}) + "\n")

    def close(self) -> None:
        self.file.close()


class TensorBoardWriter(Writer):
    def __init__(self, path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is in requirements.txt; say how to get it back
            raise ImportError("log.tensorboard: true needs the tensorboard package (pip install tensorboard, "
                              "or set log.tensorboard=false)") from e
        self.tb = SummaryWriter(str(path))

    def write(self, kind: str, step: int, record: dict[str, float]) -> None:
        wall = record.get("time/wall_clock")
        for tag, value in record.items():
            if isinstance(value, (int, float)) and not tag.startswith("time/wall_clock"):
                self.tb.add_scalar(tag, value, step, walltime=wall)
        if kind == "epoch" and "time/elapsed_s" in record:  # accuracy against wall-clock seconds
            for name in ("top1", "top5"):
                if f"eval/{name}" in record:
                    self.tb.add_scalar(f"tta/{name}_vs_seconds", record[f"eval/{name}"],
                                       int(record["time/elapsed_s"]), walltime=wall)

    def close(self) -> None:
        self.tb.close()


class MetricsLogger:
    """Fans records out to the writers; `summary()` writes the run's JSON summary at the end."""

    def __init__(self, writers: list[Writer], run_dir: Path | None = None) -> None:
        self.writers = writers
        self.run_dir = run_dir

    def log(self, kind: str, step: int, record: dict[str, Any]) -> None:
        record = {"time/wall_clock": time.time(), **record}
        for w in self.writers:
            w.write(kind, step, record)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        for w in self.writers:
            w.close()


RUN_OUTPUTS = ("metrics.jsonl", "dawnbench.tsv", "summary.json", "config.yaml", "env.json", "tensorboard", "checkpoints")


def archive_previous_run(run_dir: Path) -> Path | None:
    """Move an earlier run's outputs in `run_dir` to `run_dir/previous/<UTC time>/` (nothing is deleted).

    A fresh run must not append to another run's logs, nor leave its checkpoints for a later --resume.
    """
    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not found:
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(parents=True, exist_ok=True)
    for path in found:
        path.rename(dest / path.name)
    return dest


def no_writers(run_dir: Path) -> list[Writer]:
    """No writers beyond the JSONL and TensorBoard ones."""
    return []


def build_metrics(cfg: LogConfig, is_main: bool, fresh: bool = True,
                  extra: Callable[[Path], list[Writer]] = no_writers) -> MetricsLogger:
    """Rank 0 writes JSONL, (optionally) TensorBoard and the `extra` writers (made for log.dir, e.g. a
    task's `writers`) into log.dir; others write nothing.

    A `fresh` run (not a resume) first archives what an earlier run left in log.dir; a resume appends.
    """
    if not is_main:
        return MetricsLogger([])
    run_dir = Path(cfg.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh and (moved := archive_previous_run(run_dir)):
        print(f"log.dir {run_dir} held an earlier run: moved it to {moved}")
    writers: list[Writer] = [JsonlWriter(run_dir / "metrics.jsonl"), *extra(run_dir)]
    if cfg.tensorboard:
        writers.append(TensorBoardWriter(run_dir / "tensorboard"))
    return MetricsLogger(writers, run_dir)
