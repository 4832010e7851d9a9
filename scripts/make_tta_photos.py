"""Write the time-to-accuracy task (data/tta_photos.py): classes that are regions of 20 real photographs, training
JPEGs of 300-500 px and validation images already decoded to the evaluation resolution.

    python -m scripts.make_tta_photos [--out datasets/tta_photos] [--train 2000] [--val 2000] [--regions 2]

Deterministic (--seed); a `.complete` marker makes a rerun a no-op.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.tta_photos import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("datasets/tta_photos"))
    parser.add_argument("--train", type=int, default=2000, help="training images")
    parser.add_argument("--val", type=int, default=2000, help="validation images")
    parser.add_argument("--regions", type=int, default=2, help="classes per photo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.train < 1 or args.val < 1:
        parser.error("--train and --val must be >= 1")
    print(prepare(args.out, args.train, args.val, args.regions, args.seed).resolve())


if __name__ == "__main__":
    main()
