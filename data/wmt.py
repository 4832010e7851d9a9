"""A WMT-style parallel corpus on disk for the Transformer recipe: the raw files it needs and the check that it is
prepared (data.translation.prepare_corpus: shared BPE, then memory-mapped token ids).

Expected in the corpus root: raw, detokenized text, one sentence per line, line i of one side translating line i of
the other (no BPE, no Moses tokenization: sentencepiece works on raw text and sacreBLEU scores raw text):

    train.en train.de   WMT'16 En-De training data (Europarl v7, Common Crawl, News Commentary v11; ~4.5 M pairs)
    valid.en valid.de   newstest2013
    test.en  test.de    newstest2014 (the test set of the fairseq / Vaswani et al. results)

`extract_raw` writes them from the standard archives, as fairseq's examples/translation/prepare-wmt14en2de.sh
downloads them (nothing is downloaded here; its Moses tokenization and BPE steps are not used):

    training-parallel-europarl-v7.tgz   training/europarl-v7.de-en.{de,en}
    training-parallel-commoncrawl.tgz   commoncrawl.de-en.{de,en}
    training-parallel-nc-v11.tgz        training-parallel-nc-v11/news-commentary-v11.de-en.{de,en}
    dev.tgz                             dev/newstest2013-{src,ref}.*.sgm (or newstest2013.{en,de}) and
                                        dev/newstest2014-deen-{src,ref}.*.sgm; test-full.tgz's newstest2014
                                        (3,003 sentences) is used instead when it is given too

Training text is the three corpora back to back, in that order; SGM files keep their <seg> contents, as
sacrebleu reads them (surrounding and repeated whitespace collapsed). Each split's two files are written
under temporary names and renamed when both are complete, so a split that is there is finished and a rerun
skips it. A pair with an empty side is skipped and counted at encoding; files whose line counts differ are
an error naming both. The command line is scripts/prepare_wmt.py.
"""

from __future__ import annotations

import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from data.translation import TranslationDataError, load_manifest, open_split

SPLITS = ("train", "valid", "test")
TRAIN_ARCHIVES = ("training-parallel-europarl-v7.tgz", "training-parallel-commoncrawl.tgz",
                  "training-parallel-nc-v11.tgz")
DEV_ARCHIVES = ("test-full.tgz", "dev.tgz")
"""Searched in this order for the test and validation sets: the first archive holding a file wins."""
SOURCES = ("http://www.statmt.org/wmt13/ (europarl-v7, commoncrawl), http://data.statmt.org/wmt16/translation-task/ "
           "(nc-v11, dev.tgz), http://statmt.org/wmt14/test-full.tgz")


def check(root: Path, src: str, tgt: str) -> str:
    """One line describing the prepared corpus; TranslationDataError naming what is missing otherwise."""
    try:
        manifest = load_manifest(root)
    except TranslationDataError as e:
        expected = [f"{s}.{lang}" for s in SPLITS for lang in (src, tgt)]
        missing = [name for name in expected if not (root / name).is_file()]
        raw = (f"raw files missing: {', '.join(missing)}; write them from the WMT'16 archives with `python "
               f"scripts/prepare_wmt.py --root {root} --archives <folder of the .tgz files>`" if missing else
               f"raw files present; run `python scripts/prepare_wmt.py --root {root}`")
        raise TranslationDataError(f"{e}\n  expected in {root}: {', '.join(expected)} (raw text, one sentence per "
                                   f"line; see `python scripts/prepare_wmt.py --help`)\n  {raw}") from None
    sizes = {s: open_split(root, s, manifest) for s in manifest["splits"]}
    return (f"{root}: {manifest['src_lang']}->{manifest['tgt_lang']}, BPE vocabulary {manifest['vocab_size']}, "
            + ", ".join(f"{s} {len(split)} pairs" for s, split in sizes.items()))



# ---------------------------------------------------------------- the raw archives


@dataclass(frozen=True)
class Member:
    """One file inside one archive."""

    archive: Path
    name: str

    def __str__(self) -> str:
        return f"{self.archive.name}:{self.name}"


def _names(archive: Path) -> list[str]:
    try:
        with tarfile.open(archive) as tar:
            return [m.name for m in tar if m.isfile()]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise TranslationDataError(f"{archive}: not a readable .tgz, or cut short ({e})") from None


def find_archives(folder: Path) -> list[Path]:
    """The standard archives present in `folder`; an error naming the missing ones (test-full.tgz is optional)."""
    if not folder.is_dir():
        raise TranslationDataError(f"--archives {folder}: no such folder")
    missing = [n for n in (*TRAIN_ARCHIVES, "dev.tgz") if not (folder / n).is_file()]
    if missing:
        raise TranslationDataError(f"{folder}: missing {', '.join(missing)} (the WMT'16 En-De archives, from "
                                   f"{SOURCES})")
    return [folder / n for n in (*TRAIN_ARCHIVES, *DEV_ARCHIVES) if (folder / n).is_file()]


def _pair_pattern(src: str, tgt: str) -> re.Pattern[str]:
    pair = "|".join(re.escape(p) for p in (f"{src}-{tgt}", f"{tgt}-{src}"))
    return re.compile(rf"(?P<stem>.+)\.(?:{pair})\.(?P<lang>{re.escape(src)}|{re.escape(tgt)})$")


def plan(archives: list[Path], src: str, tgt: str) -> dict[str, list[tuple[Member, Member, bool]]]:
    """Per split, the (source, target, is SGM) files to concatenate, read from the archives' listings."""
    listing = {a: _names(a) for a in archives}
    corpus = _pair_pattern(src, tgt)
    train = []
    for a in archives:
        sides: dict[str, dict[str, str]] = {}
        for name in sorted(listing[a]):
            m = corpus.match(Path(name).name)
            if m and not name.endswith(".sgm"):
                sides.setdefault(m["stem"], {})[m["lang"]] = name
        for stem, files in sorted(sides.items()):
            if set(files) != {src, tgt}:
                raise TranslationDataError(f"{a}: {stem} has only its .{''.join(files)} side")
            train.append((Member(a, files[src]), Member(a, files[tgt]), False))
    if not train:
        raise TranslationDataError(f"no training corpus (*.{src}-{tgt}.{src} or *.{tgt}-{src}.{src}) in "
                                   f"{', '.join(a.name for a in archives)}")

    def first(*candidates: tuple[str, str]) -> list[Member]:
        """The first archive (in order) holding both files of a candidate pair, tried in order."""
        for a in archives:
            names = {Path(n).name: n for n in listing[a]}
            for pair in candidates:
                if all(f in names for f in pair):
                    return [Member(a, names[f]) for f in pair]
        return []

    splits = {"train": train}
    for split, year in (("valid", 2013), ("test", 2014)):
        # Exact names: an archive holds every language pair's test set for a year (newstest2014-fren-src.en.sgm
        # next to newstest2014-deen-src.en.sgm), named for the pair either way round (2014's En-De and De-En
        # share newstest2014-deen-*); newstest2013 is multi-way parallel, one file per language.
        sgm_names = [(f"newstest{year}-{pair}-src.{src}.sgm", f"newstest{year}-{pair}-ref.{tgt}.sgm")
                     for pair in (f"{src}{tgt}", f"{tgt}{src}")] + [
                     (f"newstest{year}-src.{src}.sgm", f"newstest{year}-ref.{tgt}.sgm")]
        sgm = first(*sgm_names)
        plain = [] if sgm else first((f"newstest{year}.{src}", f"newstest{year}.{tgt}"))
        if not (sgm or plain):
            wanted = ", ".join(" + ".join(p) for p in sgm_names)
            raise TranslationDataError(f"newstest{year} ({split}): none of {wanted} in "
                                       f"{', '.join(a.name for a in archives)} (dev.tgz holds them)")
        files = sgm or plain
        splits[split] = [(files[0], files[1], bool(sgm))]
    return splits


def _lines(stream: IO[bytes], sgm: bool) -> Iterator[str]:
    """Text lines of a corpus file (split at \\n only), or the segments of an SGM file as sacrebleu reads them."""
    for raw in stream:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not sgm:
            yield line
        elif line.startswith("<seg "):  # sacrebleu's FakeSGMLDataset rule
            yield re.sub(r"\s+", " ", re.sub(r"<seg.*?>(.*)</seg>.*?", "\\1", line).strip())


def _write_side(members: list[tuple[Member, bool]], out: Path, bar: Any) -> list[int]:
    """Concatenate the files into `out`, counting lines on `bar`; returns each file's line count."""
    counts = []
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for member, sgm in members:
            with tarfile.open(member.archive) as tar:
                stream = tar.extractfile(member.name)
                n = 0
                for line in _lines(stream, sgm):
                    f.write(line.replace("\r", " ") + "\n")  # \n ends a line, for every reader
                    n += 1
                    if n % 10000 == 0:
                        bar.update(10000)
                bar.update(n % 10000)
            counts.append(n)
    return counts


def extract_raw(archives: list[Path], root: Path, src: str = "en", tgt: str = "de",
                progress: bool = True) -> dict[str, int]:
    """{train,valid,test}.{src,tgt} in `root` from the archives (splits already there are kept); returns the
    pairs per split written by this call."""
    from tqdm import tqdm

    jobs = plan(archives, src, tgt)
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    todo = [s for s in SPLITS if not all((root / f"{s}.{lang}").is_file() for lang in (src, tgt))]
    for split in todo:
        files = jobs[split]
        parts = {lang: root / f".{split}.{lang}.part" for lang in (src, tgt)}
        with tqdm(desc=f"{split}.{src} + {split}.{tgt} from the archives", unit="line", disable=not progress) as bar:
            src_counts = _write_side([(s, sgm) for s, _, sgm in files], parts[src], bar)
            tgt_counts = _write_side([(t, sgm) for _, t, sgm in files], parts[tgt], bar)
        for (s, t, _), ns, nt in zip(files, src_counts, tgt_counts):
            if ns != nt:
                for p in parts.values():
                    p.unlink()
                raise TranslationDataError(f"{s} has {ns} lines but {t} has {nt}: the archive's two sides do not "
                                           f"align (a damaged download?)")
        for lang, part in parts.items():
            os.replace(part, root / f"{split}.{lang}")
        written[split] = sum(src_counts)
    return written
