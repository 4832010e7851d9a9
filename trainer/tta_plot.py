"""Time-to-accuracy curves (validation accuracy against wall-clock time) of one or more run folders, drawn to PNG.

Each run folder needs the `metrics.jsonl` the trainer writes (scripts/tta_baseline.py writes the same);
the target line defaults to the first run's configured target (train.target_top1 / target_top5 in its
summary.json). The legend gives each run's time to the target, or says that it never reached it. The command
line is scripts/plot_tta.py.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from trainer.dawnbench import read_summary  # noqa: E402
from trainer.tta_stats import first_reach, read_curve  # noqa: E402


def configured_target(run_dir: Path, metric: str) -> float | None:
    """The run's target for `metric` (trainer.dawnbench.read_summary), None when unset or without summary.json."""
    if not (run_dir / "summary.json").is_file():
        return None
    return read_summary(run_dir).targets.get(metric)


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
