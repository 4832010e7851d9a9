"""Metrics: one logger, several writers behind one interface (`Writer`): JSONL and TensorBoard for every run,
plus the writers a task adds (the DAWNBench TSV of image classification, trainer/classification.py).

Only rank 0 writes; other ranks get the null logger. Tags are grouped by prefix (`loss/`, `eval/`,
`time/`, `comm/`, `schedule/`, `memory/`), and every epoch record carries the wall-clock seconds since the
run started, so time-to-accuracy curves can be drawn from the JSONL or read in TensorBoard (`tta/` tags
use elapsed seconds as their step). Step records carry the ranks' spread of seconds per step (`StepTimeSpread`:
`time/step_s_slowest_rank_ratio` and friends), and a rank much slower than the others is named in the log.
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


SLOW_RANK_RATIO = 1.5
"""A rank busy this many times the median of the others' seconds per step is named as slow in the log."""


def steps(first: int, last: int) -> str:
    """'step 6' or 'steps 3-4 (2 steps)', for messages."""
    return f"step {first}" if first == last else f"steps {first}-{last} ({last - first + 1} steps)"


class StepTimeSpread:
    """Which rank is slow, by how much and since when, from each rank's seconds per step over a log window.

    A rank's own seconds per step: its wait for data, and its forward and backward pass up to the wait for the
    gradient exchange, on the host's clock. A slower rank (a throttled or shared CPU, a process stopped for a
    while, a slow loader) makes every other rank wait for it in the exchange, so the ranks' step times are equal
    while their own seconds are not. Per step this costs a host clock read; the ranks' means travel in the log
    step's own all-reduce (`share` gives this rank's part of it) and `observe` reads them.
    """

    def __init__(self, rank: int, world_size: int, threshold: float = SLOW_RANK_RATIO) -> None:
        self.rank, self.world_size, self.threshold = rank, world_size, threshold
        self.busy_s, self.steps = 0.0, 0
        self.episode: tuple[int, int, int, float] | None = None
        """The slow rank now: (rank, first step, last step of its slow windows, seconds lost to it so far)."""

    def add(self, busy_s: float) -> None:
        """One step of this rank: `busy_s` seconds of its own (not waiting for the exchange or for data)."""
        self.busy_s, self.steps = self.busy_s + busy_s, self.steps + 1

    def reset(self) -> None:
        """Start a new window (where the loop starts its throughput window: a log step, an epoch's start)."""
        self.busy_s, self.steps = 0.0, 0

    def share(self, data_wait_s: float) -> list[float]:
        """This rank's mean own seconds per step over the window (with `data_wait_s`, its wait for data in the
        window) at its index, zeros elsewhere: summed over the ranks, every rank's mean. Starts a new window."""
        mean = (self.busy_s + data_wait_s) / self.steps if self.steps else 0.0
        self.reset()
        return [mean if r == self.rank else 0.0 for r in range(self.world_size)]

    def observe(self, seconds: list[float], first_step: int, last_step: int) -> tuple[dict[str, float], list[str]]:
        """The window's scalars (steps `first_step`-`last_step`; `seconds`: every rank's mean, by rank) and the
        log lines: the slow rank of a window whose slowest is `threshold` times the median of the others, with
        how long it has been slow and the seconds the others waited for it; the end of its slowness."""
        if len(seconds) < 2 or min(seconds) <= 0.0:
            return {}, []
        slowest = max(range(len(seconds)), key=seconds.__getitem__)
        others = sorted(s for r, s in enumerate(seconds) if r != slowest)
        median = (others[(len(others) - 1) // 2] + others[len(others) // 2]) / 2
        ratio = seconds[slowest] / median
        record = {"time/step_s_slowest_rank": float(slowest), "time/step_s_slowest": seconds[slowest],
                  "time/step_s_median_others": median, "time/step_s_slowest_rank_ratio": ratio}
        lines = []
        slow = ratio >= self.threshold
        if self.episode is not None and (not slow or self.episode[0] != slowest):
            rank, first, last, lost = self.episode
            lines.append(f"step {last_step}: rank {rank} is no longer slow (it was slow in {steps(first, last)}, "
                         f"{lost:.1f} s of waiting for it)")
            self.episode = None
        if slow:
            lost = (seconds[slowest] - median) * (last_step - first_step + 1)
            since, lost = (self.episode[1], self.episode[3] + lost) if self.episode else (first_step, lost)
            self.episode = (slowest, since, last_step, lost)
            lines.append(f"step {last_step}: rank {slowest} is slow: {seconds[slowest]:.3g} s per step of its own in "
                         f"{steps(first_step, last_step)}, {ratio:.1f}x the median of the other ranks "
                         f"({median:.3g} s); slow since step {since}, {lost:.1f} s of waiting for it so far")
        return record, lines


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
