"""Generate the synthetic English → German corpus and its BPE ids (data/synthetic_translation.py: the grammar).

    python scripts/prepare_synthetic_translation.py [--out datasets/synthetic_en_de] [--train 20000]
    python scripts/prepare_synthetic_translation.py --show 10     # print 10 training pairs, write nothing
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data.synthetic_translation import generate, prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("datasets/synthetic_en_de"))
    parser.add_argument("--train", type=int, default=20000, help="training pairs")
    parser.add_argument("--valid", type=int, default=500, help="validation pairs (time-to-target BLEU)")
    parser.add_argument("--test", type=int, default=500, help="held-out test pairs (final BLEU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1000, help="shared BPE vocabulary size")
    parser.add_argument("--show", type=int, default=0, help="print this many training pairs and exit")
    args = parser.parse_args()
    if args.show:
        for en, de in generate(args.show, 0, 0, args.seed)["train"]:
            print(f"{en}\n    {de}")
        return
    print(prepare(args.out, args.train, args.valid, args.test, args.seed, args.vocab_size).resolve())


if __name__ == "__main__":
    main()
