"""DAWNBench entry files and a markdown summary from a finished run folder.

    python scripts/dawnbench_report.py runs/quickstart [--out DIR] [--author NAME] [--hardware TEXT|auto]
                                       [--cost-per-hour USD] [--framework TEXT]

Writes into DIR (default RUN_DIR/dawnbench), in the format of the ImageNet training entries of
https://github.com/stanford-futuredata/dawn-bench-entries (README.md, "ImageNet Training"):

  <author>_<model>_<hardware tag>_<framework>.json   version, author, authorEmail, framework, codeURL, model,
                                                      hardware, costPerHour (USD), timestamp (yyyy-mm-dd), misc
  <author>_<model>_<hardware tag>_<framework>.tsv    epoch, hours, top1Accuracy, top5Accuracy (percent), one row
                                                      per evaluated epoch of the run
  report.md                                           the run beside published ImageNet entries

Everything about the run is read from its files (summary.json through trainer.dawnbench.read_summary,
config.yaml, dawnbench.tsv, and env.json, the run record of trainer.run_record: devices, driver, versions,
hosts); the published figures are the cited constants of trainer.dawnbench.PUBLISHED. The hardware is the
devices env.json records; `--hardware TEXT` overrides it, and `--hardware auto` describes the machine the
script runs on (use it only where the run itself ran).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.dawnbench_report import ReportError, report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished run folder (the recipe's log.dir)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/dawnbench)")
    parser.add_argument("--author", default="unknown", help="entry author (also the file name's first part)")
    parser.add_argument("--author-email", default="", help="entry authorEmail")
    parser.add_argument("--framework", default=None, help="default: PyTorch <installed version>")
    parser.add_argument("--code-url", default="", help="entry codeURL (optional in DAWNBench)")
    parser.add_argument("--hardware", default=None,
                        help="free text, or 'auto' to describe this machine; default: what the run folder records")
    parser.add_argument("--cost-per-hour", type=float, default=0.0, help="USD per hour for all machines; 0 = unknown")
    args = parser.parse_args(argv)
    try:
        paths = report(args.run_dir, args.out, args.author, args.author_email, args.framework, args.code_url,
                       args.hardware, args.cost_per_hour)
    except ReportError as e:
        raise SystemExit(f"dawnbench_report: {e}") from None
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
