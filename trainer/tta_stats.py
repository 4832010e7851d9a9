"""Time-to-accuracy statistics: when a run reached a target, and how two contenders compare over seeds.

- `reached_at`: the evaluation that completes the first `consecutive` evaluations in a row at or above the
  target (one lucky epoch cannot cross it); `first_reach`: the time of a curve's first evaluation at a target.
- `read_curve` / `epoch_records`: a run folder's evaluated epochs from its metrics.jsonl (the recipe's trainer
  and scripts/tta_baseline.py write the same records); `read_run`: one whole run as a `Run`, from which the time
  to any target is read.
- `seed_order`, `paired_ratio`, `compare`, `accuracy`: both sides on the same seeds, alternating which goes first;
  per target and seed the ratio recipe time / baseline time where both reached it (a side that missed is listed
  as a miss, never as the other side's win); their median, a percentile-bootstrap interval of it and the range;
  each side's final and best top-1.
scripts/bench/tta.py runs the comparison; scripts/plot_tta.py draws the curves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trainer.run_record import read_run_record

SIDES = ("baseline", "recipe")
"""The two contenders, in the order the first seed runs them."""
TARGETS = (0.6, 0.65, 0.7, 0.75)
"""Top-1 targets the time-to-accuracy bench reads every run at."""
HEADLINE = (0.7, 0.75)
"""The targets its verdict is about."""
TARGET_CONSECUTIVE = 2
"""Evaluations in a row at or above a target before it counts as reached."""


def reached_at(top1: Sequence[float], target: float, consecutive: int) -> int | None:
    """Index of the evaluation that completes the first run of `consecutive` evaluations at or above `target`."""
    streak = 0
    for i, acc in enumerate(top1):
        streak = streak + 1 if acc >= target else 0
        if streak >= consecutive:
            return i
    return None


def first_reach(seconds: list[float], acc: list[float], target: float | None) -> float | None:
    """Seconds at the first evaluation of this curve at or above `target` (None: never, or no target): where the
    curve crosses the drawn line, for any --target and one metric (a run's own time to target is its
    summary.json's, trainer.dawnbench.RunSummary.time_to_target_s)."""
    at = reached_at(acc, target, 1) if target else None
    return None if at is None else seconds[at]


def paired_ratio(recipe_s: float | None, baseline_s: float | None) -> float | None:
    """recipe / baseline time to a target in one seed; None unless both sides reached it."""
    return None if recipe_s is None or baseline_s is None else recipe_s / baseline_s


def bootstrap_interval(values: Sequence[float], level: float = 0.9, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median: resample the values with replacement, take each resample's
    median, and return the (1 - level) / 2 and (1 + level) / 2 order statistics of those medians."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0 or np.isnan(data).any():
        raise ValueError("bootstrap_interval: needs at least one value and no nan")
    rng = np.random.default_rng(seed)
    medians = np.sort(np.median(data[rng.integers(0, data.size, size=(resamples, data.size))], axis=1))
    low = medians[int(math.floor((1 - level) / 2 * resamples))]
    high = medians[min(resamples - 1, int(math.ceil((1 + level) / 2 * resamples)) - 1)]
    return float(low), float(high)


# ---------------------------------------------------------------- run folders


def epoch_records(run_dir: Path, metric: str = "top1") -> list[dict[str, Any]]:
    """The run's per-epoch evaluation records with `eval/<metric>` from metrics.jsonl, by epoch (a resumed run's
    repeated epochs keep the last; a line still being written is skipped); [] without metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    by_epoch: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if rec.get("kind") == "epoch" and f"eval/{metric}" in rec:
            by_epoch[int(rec["epoch"])] = rec
    return [by_epoch[e] for e in sorted(by_epoch)]


def read_curve(run_dir: Path, metric: str) -> tuple[list[float], list[float]]:
    """(elapsed seconds, accuracy) of every evaluated epoch of a run folder."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: not found (is {run_dir} a run folder written by a "
                                "recipe?)")
    records = epoch_records(run_dir, metric)
    return [r["time/elapsed_s"] for r in records], [r[f"eval/{metric}"] for r in records]


@dataclass
class Run:
    """One training run as the bench saw it, to the end of its schedule: its evaluations (top-1 and the seconds
    at each, start-up included), the process's wall time and the load around it."""

    side: str
    seed: int
    process_s: float
    load_before: float
    load_after: float
    run_dir: str
    top1: list[float]
    elapsed_s: list[float]
    choices: dict[str, Any] = field(default_factory=dict)
    """The recipe's measured choices (precision, layout, convolutions) and how they were reached (env.json)."""
    choices_s: float = 0.0
    """Seconds the recipe spent deciding them before its clock started (measuring, or reading the cache):
    counted in `elapsed_s`."""
    config: str = ""
    """The config file the run trained with."""

    @property
    def final_top1(self) -> float:
        return self.top1[-1]

    @property
    def best_top1(self) -> float:
        return max(self.top1)

    def time_to(self, target: float, consecutive: int) -> float | None:
        """Seconds at the evaluation that completes `consecutive` in a row at or above `target`; None: missed."""
        at = reached_at(self.top1, target, consecutive)
        return None if at is None else round(self.elapsed_s[at], 1)

    def epochs_to(self, target: float, consecutive: int) -> int | None:
        at = reached_at(self.top1, target, consecutive)
        return None if at is None else at + 1


def read_run(side: str, seed: int, run_dir: Path, process_s: float, load_before: float, load_after: float,
             config: str = "") -> Run:
    """A Run from `run_dir/metrics.jsonl`; the recipe's start-up seconds (env.json) are added to its clock."""
    records = epoch_records(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no evaluated epoch; the {side} run failed "
                                f"(its log is {run_dir / 'train.log'})")
    choices = (read_run_record(run_dir) or {}).get("choices") or {}
    startup = float(choices.get("seconds", 0.0))  # before the trainer's clock: the bench counts it
    return Run(side=side, seed=seed, process_s=round(process_s, 1), load_before=load_before, load_after=load_after,
               run_dir=str(run_dir), top1=[float(r["eval/top1"]) for r in records],
               elapsed_s=[round(startup + float(r["time/elapsed_s"]), 3) for r in records], choices=choices,
               choices_s=startup, config=config)


# ---------------------------------------------------------------- the comparison


def seed_order(first_seed: int, seeds: int) -> list[tuple[int, str]]:
    """(seed, side) in running order: each seed runs both sides, which side goes first alternating from seed to
    seed, so that a drift in the machine's load falls on both alike."""
    return [(seed, side) for i, seed in enumerate(range(first_seed, first_seed + seeds))
            for side in (SIDES if i % 2 == 0 else SIDES[::-1])]


def by_seed(runs: Sequence[Run]) -> dict[int, dict[str, Run]]:
    """{seed: {side: run}}; ValueError unless every seed has exactly one run of each side."""
    out: dict[int, dict[str, Run]] = {}
    for r in runs:
        if r.side in out.setdefault(r.seed, {}):
            raise ValueError(f"compare: two {r.side} runs of seed {r.seed} ({out[r.seed][r.side].run_dir}, "
                             f"{r.run_dir}): read each target from one config's runs")
        out[r.seed][r.side] = r
    incomplete = [s for s in sorted(out) if set(out[s]) != set(SIDES)]
    if not out or incomplete:
        raise ValueError(f"compare: every seed needs one run of each side (incomplete: {incomplete or 'no runs'})")
    return dict(sorted(out.items()))


def compare(runs: Sequence[Run], target: float, consecutive: int) -> dict[str, Any]:
    """At one target: per seed each side's time (None: missed) and the paired ratio where both reached it; the
    median of those ratios, a bootstrap 90% interval of it and their range (the order-statistic interval); the
    misses per side. No seed both reached: ratio None."""
    seeds = by_seed(runs)
    times = {side: [seeds[s][side].time_to(target, consecutive) for s in seeds] for side in SIDES}
    ratios = [paired_ratio(r, b) for r, b in zip(times["recipe"], times["baseline"])]
    both = [x for x in ratios if x is not None]
    interval = bootstrap_interval(both) if both else (None, None)
    return {"target_top1": target, "seeds": list(seeds),
            "baseline_s": times["baseline"], "recipe_s": times["recipe"],
            "baseline_epochs": [seeds[s]["baseline"].epochs_to(target, consecutive) for s in seeds],
            "recipe_epochs": [seeds[s]["recipe"].epochs_to(target, consecutive) for s in seeds],
            "ratios": [None if x is None else round(x, 3) for x in ratios], "seeds_in_median": len(both),
            "missed": {side: [s for s, t in zip(seeds, times[side]) if t is None] for side in SIDES},
            "ratio": round(float(np.median(both)), 3) if both else None,
            "interval": [None if x is None else round(x, 3) for x in interval], "interval_level": 0.9,
            "range": [round(min(both), 3), round(max(both), 3)] if both else [None, None]}


def accuracy(runs: Sequence[Run]) -> dict[str, Any]:
    """Per side: every seed's final and best top-1 (fractions), and the means over seeds."""
    seeds = by_seed(runs)
    out: dict[str, Any] = {"seeds": list(seeds)}
    for side in SIDES:
        final = [round(seeds[s][side].final_top1, 4) for s in seeds]
        best = [round(seeds[s][side].best_top1, 4) for s in seeds]
        out[side] = {"final_top1": final, "best_top1": best, "mean_final_top1": round(float(np.mean(final)), 4),
                     "mean_best_top1": round(float(np.mean(best)), 4)}
    return out
