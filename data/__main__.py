"""`python -m data ROOT [--expect auto|imagenet|any]`: the launchers' pre-flight dataset check.

One line on success; on failure every problem found (missing or short classes, unsorted validation images,
an interrupted preparation), one per line, and exit status 1. ImageNet (ILSVRC2012) is recognised by its
WordNet-id class folders, or named with --expect imagenet: 1,000 classes, 1,281,167 training and 50,000
validation images (50 per class).
"""

import argparse

from data.layout import DatasetNotFoundError, preflight

parser = argparse.ArgumentParser(prog="python -m data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("root", help="the dataset folder (data.root): train/<class>/*, val/<class>/*")
parser.add_argument("--expect", choices=("auto", "imagenet", "any"), default="auto",
                    help="imagenet: check ILSVRC2012's counts; auto (default): when the classes are WordNet ids")
args = parser.parse_args()
try:
    print(preflight(args.root, args.expect))
except DatasetNotFoundError as e:
    raise SystemExit(f"dataset error: {e}") from None
