"""Prepare a WMT-style parallel corpus for the Transformer recipe: raw text from the standard archives (optional),
shared BPE, then memory-mapped token ids.

    python scripts/prepare_wmt.py --root datasets/wmt16_en_de --archives ~/wmt16   # from the .tgz archives
    python scripts/prepare_wmt.py --root datasets/wmt16_en_de [--vocab-size 32000] [--src en --tgt de]
    python scripts/prepare_wmt.py --root datasets/wmt16_en_de --check     # is it ready? (exit 1 if not)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from data import wmt
from data.translation import TranslationDataError, prepare_corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"{__doc__}\n{wmt.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("datasets/wmt16_en_de"))
    parser.add_argument("--archives", type=Path, default=None,
                        help=f"folder holding {', '.join(wmt.TRAIN_ARCHIVES)} and dev.tgz (test-full.tgz optional): "
                             "the raw text files are written from them first (those already there are kept)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--vocab-size", type=int, default=32000, help="shared BPE vocabulary (fairseq: ~32k joined)")
    parser.add_argument("--max-len", type=int, default=1024,
                        help="training pairs with a side longer than this many BPE tokens are skipped and counted")
    parser.add_argument("--check", action="store_true", help="only check that ROOT is prepared")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        if args.archives is not None and not args.check:
            written = wmt.extract_raw(wmt.find_archives(args.archives), args.root, args.src, args.tgt,
                                      not args.no_progress)
            for split, n in written.items():
                print(f"{split}: {n:,} sentence pairs written from {args.archives}")
        if not args.check:
            prepare_corpus(args.root, args.src, args.tgt, args.vocab_size, wmt.SPLITS, args.max_len,
                           not args.no_progress)
        print(wmt.check(args.root, args.src, args.tgt))
    except TranslationDataError as e:
        raise SystemExit(f"dataset error: {e}") from None


if __name__ == "__main__":
    main()
