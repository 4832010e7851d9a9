"""Prepare a WMT-style parallel corpus for the Transformer recipe: shared BPE, then memory-mapped token ids.

    python scripts/prepare_wmt.py --root datasets/wmt16_en_de [--vocab-size 32000] [--src en --tgt de]
    python scripts/prepare_wmt.py --root datasets/wmt16_en_de --check     # is it ready? (exit 1 if not)

Expected in ROOT: raw, detokenized text, one sentence per line, line i of one side translating line i of
the other (no BPE, no Moses tokenization: sentencepiece works on raw text and sacreBLEU scores raw text):

    train.en train.de   WMT'16 En-De training data (Europarl v7, Common Crawl, News Commentary v11; ~4.5 M pairs)
    valid.en valid.de   newstest2013
    test.en  test.de    newstest2014 (the test set of the fairseq / Vaswani et al. results)

fairseq's examples/translation/prepare-wmt14en2de.sh downloads and extracts these (stop before its Moses
tokenization and BPE steps), and sacrebleu writes the test sets with `sacrebleu -t wmt14 -l en-de --echo src`
(and `--echo ref`). Nothing is downloaded here. A pair with an empty side is skipped and counted; files whose
line counts differ are an error naming both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.translation import TranslationDataError, load_manifest, open_split, prepare_corpus  # noqa: E402

SPLITS = ("train", "valid", "test")


def check(root: Path, src: str, tgt: str) -> str:
    """One line describing the prepared corpus; TranslationDataError naming what is missing otherwise."""
    try:
        manifest = load_manifest(root)
    except TranslationDataError as e:
        expected = [f"{s}.{lang}" for s in SPLITS for lang in (src, tgt)]
        missing = [name for name in expected if not (root / name).is_file()]
        raw = (f"raw files missing: {', '.join(missing)}" if missing else
               f"raw files present; run `python scripts/prepare_wmt.py --root {root}`")
        raise TranslationDataError(f"{e}\n  expected in {root}: {', '.join(expected)} (raw text, one sentence per "
                                   f"line; see scripts/prepare_wmt.py)\n  {raw}") from None
    sizes = {s: open_split(root, s, manifest) for s in manifest["splits"]}
    return (f"{root}: {manifest['src_lang']}->{manifest['tgt_lang']}, BPE vocabulary {manifest['vocab_size']}, "
            + ", ".join(f"{s} {len(split)} pairs" for s, split in sizes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("datasets/wmt16_en_de"))
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--vocab-size", type=int, default=32000, help="shared BPE vocabulary (fairseq: ~32k joined)")
    parser.add_argument("--max-len", type=int, default=1024,
                        help="training pairs with a side longer than this many BPE tokens are skipped and counted")
    parser.add_argument("--check", action="store_true", help="only check that ROOT is prepared")
    args = parser.parse_args()
    try:
        if not args.check:
            prepare_corpus(args.root, args.src, args.tgt, args.vocab_size, SPLITS, args.max_len)
        print(check(args.root, args.src, args.tgt))
    except TranslationDataError as e:
        raise SystemExit(f"dataset error: {e}") from None


if __name__ == "__main__":
    main()
