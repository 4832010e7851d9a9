"""Write scikit-learn's handwritten digits as an ImageFolder tree (data/digits.py says how).

    python scripts/prepare_digits.py [--out datasets/digits] [--size 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.digits import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("datasets/digits"))
    parser.add_argument("--size", type=int, default=64, help="side of the written JPEGs in pixels")
    args = parser.parse_args()
    print(prepare(args.out, args.size).resolve())


if __name__ == "__main__":
    main()
