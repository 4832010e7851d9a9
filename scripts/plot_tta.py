"""Draw time-to-accuracy curves (validation accuracy against wall-clock time) of one or more runs to PNG.

    python scripts/plot_tta.py runs/quickstart [runs/other ...] --out tta.png [--metric top1] [--target 0.95]

Each run folder needs the `metrics.jsonl` the trainer writes (scripts/tta_baseline.py writes the same);
the target line defaults to the first run's configured target (train.target_top1 / target_top5 in its
summary.json). The legend gives each run's time to the target, or says that it never reached it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from trainer.dawnbench import read_summary  # noqa: E402


def read_curve(run_dir: Path, metric: str) -> tuple[list[float], list[float]]:
    """(elapsed seconds, accuracy) of every evaluated epoch; a resumed run's repeated epochs keep the last."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a run folder written by a recipe?)")
    by_epoch: dict[int, tuple[float, float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "epoch" and f"eval/{metric}" in rec:
            by_epoch[int(rec["epoch"])] = (rec["time/elapsed_s"], rec[f"eval/{metric}"])
    points = [by_epoch[e] for e in sorted(by_epoch)]
    return [p[0] for p in points], [p[1] for p in points]


def configured_target(run_dir: Path, metric: str) -> float | None:
    """The run's target for `metric` (trainer.dawnbench.read_summary), None when unset or without summary.json."""
    if not (run_dir / "summary.json").is_file():
        return None
    return read_summary(run_dir).targets.get(metric)


def first_reach(seconds: list[float], acc: list[float], target: float | None) -> float | None:
    """Seconds at the first evaluation of this curve at or above `target` (None: never, or no target): where the
    curve crosses the drawn line, for any --target and one metric (a run's own time to target is its
    summary.json's, trainer.dawnbench.RunSummary.time_to_target_s)."""
    if not target:
        return None
    return next((s for s, a in zip(seconds, acc) if a >= target), None)


def plot(run_dirs: list[Path], out: Path, metric: str = "top1", target: float | None = None,
         labels: list[str] | None = None, colors: list[str] | None = None) -> Path:
    """Write the PNG and return its path. Each run's first evaluation at the target is starred and its time is in
    the legend; a run that never reached the target is drawn in full and says so in the legend. `colors` (any
    matplotlib colour, one per run) lets repeated runs of one contender share a colour."""
    for name, given in (("labels", labels), ("colors", colors)):
        if given is not None and len(given) != len(run_dirs):
            raise ValueError(f"--{name}: {len(given)} given for {len(run_dirs)} run(s)")
    curves = [read_curve(run, metric) for run in run_dirs]
    for run, (seconds, _) in zip(run_dirs, curves):
        if not seconds:
            raise ValueError(f"{run}: no evaluated epochs with eval/{metric} in metrics.jsonl")
    target = target if target is not None else configured_target(run_dirs[0], metric)
    longest = max(max(seconds) for seconds, _ in curves)
    scale, unit = (60.0, "min") if longest > 300 else (1.0, "s")  # one unit for every curve
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (run, (seconds, acc)) in enumerate(zip(run_dirs, curves)):
        label = labels[i] if labels else run.name
        reach = first_reach(seconds, acc, target)
        if target:
            label += f" (target at {reach / scale:.3g} {unit})" if reach is not None else " (target not reached)"
        (line,) = ax.plot([s / scale for s in seconds], [100 * a for a in acc], marker="o", markersize=3,
                          label=label, color=colors[i] if colors else None)
        if reach is not None:
            ax.plot(reach / scale, 100 * acc[seconds.index(reach)], marker="*", markersize=12,
                    color=line.get_color())
    if target:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target {100 * target:g}%")
    ax.set_xlabel(f"wall-clock time ({unit})")
    ax.set_ylabel(f"validation {metric} accuracy (%)")
    ax.set_title("Time to accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (log.dir of each run)")
    parser.add_argument("--out", type=Path, default=Path("tta.png"))
    parser.add_argument("--metric", choices=["top1", "top5"], default="top1")
    parser.add_argument("--target", type=float, default=None, help="target accuracy as a fraction")
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run")
    parser.add_argument("--colors", nargs="+", help="line colours, one per run (e.g. tab:blue tab:blue tab:orange)")
    args = parser.parse_args()
    print(plot(args.runs, args.out, args.metric, args.target, args.labels, args.colors))


if __name__ == "__main__":
    main()
