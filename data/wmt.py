"""A WMT-style parallel corpus on disk for the Transformer recipe: the raw files it needs and the check that it is
prepared (data.translation.prepare_corpus: shared BPE, then memory-mapped token ids).

Expected in the corpus root: raw, detokenized text, one sentence per line, line i of one side translating line i of
the other (no BPE, no Moses tokenization: sentencepiece works on raw text and sacreBLEU scores raw text):

    train.en train.de   WMT'16 En-De training data (Europarl v7, Common Crawl, News Commentary v11; ~4.5 M pairs)
    valid.en valid.de   newstest2013
    test.en  test.de    newstest2014 (the test set of the fairseq / Vaswani et al. results)

fairseq's examples/translation/prepare-wmt14en2de.sh downloads and extracts these (stop before its Moses
tokenization and BPE steps), and sacrebleu writes the test sets with `sacrebleu -t wmt14 -l en-de --echo src`
(and `--echo ref`). Nothing is downloaded here. A pair with an empty side is skipped and counted; files whose
line counts differ are an error naming both. The command line is scripts/prepare_wmt.py.
"""

from __future__ import annotations

from pathlib import Path

from data.translation import TranslationDataError, load_manifest, open_split

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
                                   f"line; see `python scripts/prepare_wmt.py --help`)\n  {raw}") from None
    sizes = {s: open_split(root, s, manifest) for s in manifest["splits"]}
    return (f"{root}: {manifest['src_lang']}->{manifest['tgt_lang']}, BPE vocabulary {manifest['vocab_size']}, "
            + ", ".join(f"{s} {len(split)} pairs" for s, split in sizes.items()))

