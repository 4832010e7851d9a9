"""Console progress on rank 0: the run's steps as a tqdm bar on a terminal, or as plain lines where output goes to
a file (Slurm, nohup, CI); and the item and data-wait counters behind the logged throughput.

What is logged where (TensorBoard, JSONL, the DAWNBench TSV) is trainer/metrics.py's; the progress output is
described in docs/reliability.md ("Progress").
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from trainer.dist import Topology
from trainer.schedules import Phase, Schedule
from trainer.task import Task

if TYPE_CHECKING:  # imported where a bar is drawn: the GPU check runs the trainer's step on Pythons without tqdm
    from tqdm import tqdm


@dataclass
class Meter:
    """Items trained and seconds waited for data since `start`: over an epoch, or over a logging window."""

    start: float = field(default_factory=time.perf_counter)
    units: int = 0
    data_s: float = 0.0
    steps: int = 0

    def add(self, units: int, waited_s: float) -> None:
        self.units, self.data_s, self.steps = self.units + units, self.data_s + waited_s, self.steps + 1


def timed_next(batches: Iterator[Any]) -> tuple[Any, float]:
    """The next batch (None at the end) and the seconds spent waiting for it."""
    start = time.perf_counter()
    batch = next(batches, None)
    return batch, time.perf_counter() - start


class ProgressLines:
    """The progress bar's stand-in where output goes to a file: one line every `every` steps, e.g.
    `step 120/1000 (12%) 3.1 steps/s, 4m 44s left  epoch=1 loss=2.310 lr=0.1`, on stderr (the stream the bar
    would draw on, and the one whose terminal check chose the lines)."""

    def __init__(self, total: int, initial: int, every: int) -> None:
        self.total, self.n, self.every = total, initial, every
        self.start, self.start_n = time.perf_counter(), initial
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            rate = (self.n - self.start_n) / max(1e-9, time.perf_counter() - self.start)
            left = (self.total - self.n) / rate if rate > 0 else 0.0
            minutes, seconds = divmod(int(left), 60)
            print(f"step {self.n}/{self.total} ({100 * self.n / max(1, self.total):.0f}%) {rate:.3g} steps/s, "
                  f"{minutes}m {seconds:02d}s left  {self.postfix}".rstrip(), file=sys.stderr, flush=True)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        pass


def write_line(line: str) -> None:
    """Print `line` on stdout without breaking a live tqdm bar (tqdm.write); a plain print where tqdm is not
    installed (the GPU check runs the trainer's step on such Pythons)."""
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        print(line, flush=True)
        return
    tqdm.write(line)


def build_progress_bar(steps: list[int], epoch: int, step_in_epoch: int, show: bool,
                       every: int) -> tqdm | ProgressLines:
    """The run's steps (`steps` per epoch), starting at `step_in_epoch` of `epoch` (where a resumed run left off),
    shown when `show` (rank 0 and log.progress): a tqdm bar on a terminal; in a log file (stderr not a terminal:
    Slurm, nohup, CI) a plain line on stderr every `every` steps (log.every_steps) instead of a bar redrawn into
    the file."""
    total = sum(steps)
    done = min(total, sum(steps[:epoch]) + step_in_epoch)
    if show and not sys.stderr.isatty():
        return ProgressLines(total, done, every)
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="step", dynamic_ncols=True, disable=not show)


def print_plan(topo: Topology, model: nn.Module, amp_dtype: torch.dtype | None, task: Task, schedule: Schedule,
               steps_per_epoch: Callable[[Phase], int], resumed: str | None = None) -> None:
    """The run's derived sizes, printed once on rank 0: world, precision, parameters, the phases' steps; then
    `resumed`, a line on where a resumed run continues."""
    if not topo.is_main:
        return
    n_params = sum(p.numel() for p in model.parameters())
    print(f"world {topo.world_size} = {topo.num_nodes} node(s) x {topo.ranks_per_node} rank(s) on {topo.device}; "
          f"amp {'off (fp32)' if amp_dtype is None else str(amp_dtype).removeprefix('torch.')}; "
          f"{n_params / 1e6:.2f} M parameters")
    for p in schedule.phases:
        print(f"  epochs {p.start_epoch:>3}-{p.end_epoch - 1:<3} {task.describe(p)}  {steps_per_epoch(p)} steps/epoch")
    print("  " + schedule.describe(lambda e: steps_per_epoch(schedule.phase(e))))
    if resumed:
        print(resumed)
