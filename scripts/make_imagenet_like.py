"""Write an ImageNet-like folder of real-photo JPEGs, 300-500 px (data/imagenet_like.py says how).

    python scripts/make_imagenet_like.py [--out datasets/imagenet_like] [--train 3000] [--val 500] [--odd]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.imagenet_like import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("datasets/imagenet_like"))
    parser.add_argument("--train", type=int, default=3000, help="training images")
    parser.add_argument("--val", type=int, default=500, help="validation images")
    parser.add_argument("--odd", action="store_true", help="add a CMYK, a grayscale, a PNG-named and a truncated JPEG")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(prepare(args.out, args.train, args.val, args.odd, args.seed).resolve())


if __name__ == "__main__":
    main()
