"""Time-to-accuracy statistics: when a run reached its target, and how two contenders compare over seeds.

- `reached_at`: the evaluation that completes the first `consecutive` evaluations in a row at or above the
  target (one lucky epoch cannot cross it); `first_reach`: the time of a curve's first evaluation at a target.
- `read_curve` / `epoch_records`: a run folder's evaluated epochs from its metrics.jsonl (the recipe's trainer
  and scripts/tta_baseline.py write the same records); `read_run`: one run as a `Run`.
- `seed_order`, `paired_ratio`, `compare`, `bootstrap_interval`: both sides on the same seeds, alternating which
  goes first; per seed the ratio recipe time / baseline time (a side that missed counts as infinitely slow);
  their median and a percentile-bootstrap interval of it.
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


def paired_ratio(recipe_s: float | None, baseline_s: float | None) -> float:
    """recipe / baseline time to target in one seed; a side that missed counts as infinitely slow (both: nan)."""
    recipe, baseline = (math.inf if t is None else t for t in (recipe_s, baseline_s))
    if math.isinf(recipe) and math.isinf(baseline):
        return math.nan
    return 0.0 if math.isinf(baseline) else recipe / baseline


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


def finite_or_none(x: float) -> float | None:
    """x rounded to 3 digits; None for an infinite or undefined value (plain JSON has neither)."""
    return None if math.isinf(x) or math.isnan(x) else round(x, 3)


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
    """One training run as the bench saw it: its epoch records, the target rule, the process's wall time."""

    side: str
    seed: int
    time_to_target_s: float | None
    epochs_to_target: int | None
    best_top1: float
    epochs_run: int
    process_s: float
    load_before: float
    load_after: float
    run_dir: str
    top1: list[float] = field(default_factory=list)
    elapsed_s: list[float] = field(default_factory=list)
    choices: dict[str, Any] = field(default_factory=dict)
    """The recipe's measured choices (precision, layout, convolutions) and how they were reached (env.json)."""
    choices_s: float = 0.0
    """Seconds the recipe spent deciding them before its clock started (measuring, or reading the cache):
    counted in `time_to_target_s`."""

    @property
    def reached(self) -> bool:
        return self.time_to_target_s is not None


def read_run(side: str, seed: int, run_dir: Path, target: float, consecutive: int, process_s: float,
             load_before: float, load_after: float) -> Run:
    """A Run from `run_dir/metrics.jsonl`, the time to target by `reached_at`."""
    records = epoch_records(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: no evaluated epoch; the {side} run failed "
                                f"(its log is {run_dir / 'train.log'})")
    top1 = [float(r["eval/top1"]) for r in records]
    choices = (read_run_record(run_dir) or {}).get("choices") or {}
    startup = float(choices.get("seconds", 0.0))  # before the trainer's clock: the bench counts it
    elapsed = [startup + float(r["time/elapsed_s"]) for r in records]
    at = reached_at(top1, target, consecutive)
    return Run(side=side, seed=seed, time_to_target_s=None if at is None else round(elapsed[at], 1),
               epochs_to_target=None if at is None else at + 1, best_top1=max(top1), epochs_run=len(records),
               process_s=round(process_s, 1), load_before=load_before, load_after=load_after, run_dir=str(run_dir),
               top1=top1, elapsed_s=elapsed, choices=choices, choices_s=startup)


# ---------------------------------------------------------------- the comparison


def seed_order(first_seed: int, seeds: int) -> list[tuple[int, str]]:
    """(seed, side) in running order: each seed runs both sides, which side goes first alternating from seed to
    seed, so that a drift in the machine's load falls on both alike."""
    return [(seed, side) for i, seed in enumerate(range(first_seed, first_seed + seeds))
            for side in (SIDES if i % 2 == 0 else SIDES[::-1])]


def compare(runs: Sequence[Run]) -> dict[str, Any]:
    """Per seed the paired ratio; their median and bootstrap 90% interval."""
    by_seed: dict[int, dict[str, Run]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, {})[r.side] = r
    seeds = sorted(by_seed)
    incomplete = [s for s in seeds if set(by_seed[s]) != set(SIDES)]
    if not seeds or incomplete:
        raise ValueError(f"compare: every seed needs one run of each side (incomplete: {incomplete or 'no runs'})")
    ratios = [paired_ratio(by_seed[s]["recipe"].time_to_target_s, by_seed[s]["baseline"].time_to_target_s)
              for s in seeds]
    usable = [x for x in ratios if not math.isnan(x)]
    median = float(np.median(usable)) if usable else math.nan
    interval = bootstrap_interval(usable) if usable else (math.nan, math.nan)
    return {"seeds": seeds, "ratios": [finite_or_none(x) for x in ratios], "seeds_in_median": len(usable),
            "both_missed": [s for s, x in zip(seeds, ratios) if math.isnan(x)],
            "baseline_s": [by_seed[s]["baseline"].time_to_target_s for s in seeds],
            "recipe_s": [by_seed[s]["recipe"].time_to_target_s for s in seeds],
            "baseline_epochs": [by_seed[s]["baseline"].epochs_to_target for s in seeds],
            "recipe_epochs": [by_seed[s]["recipe"].epochs_to_target for s in seeds],
            "missed": [f"{side} seed {s}" for s in seeds for side in SIDES if not by_seed[s][side].reached],
            "interval": [finite_or_none(x) for x in interval], "interval_level": 0.9,
            "ratio": finite_or_none(median)}
