"""Draw time-to-accuracy curves (validation accuracy against wall-clock time) of one or more runs to PNG.

    python scripts/plot_tta.py runs/quickstart [runs/other ...] --out tta.png [--metric top1] [--target 0.95]

Each run folder needs the `metrics.jsonl` the trainer writes (scripts/tta_baseline.py writes the same);
the target line defaults to the first run's configured target (train.target_top1 / target_top5 in its
summary.json). The legend gives each run's time to the target, or says that it never reached it.
The drawing is trainer/tta_plot.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.tta_plot import plot


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
