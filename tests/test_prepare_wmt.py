"""WMT'16 En-De from miniature raw archives (the structure of the standard .tgz files: Europarl, Common Crawl, News
Commentary, dev.tgz with SGM test sets), prepared to raw text, BPE and ids, and read by a 1-epoch Transformer run."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from data import wmt
from scripts.prepare_wmt import main as prepare_main

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
NOUNS = [("house", "Haus"), ("dog", "Hund"), ("tree", "Baum"), ("car", "Auto"), ("book", "Buch"), ("city", "Stadt")]
ADJ = [("big", "große"), ("small", "kleine"), ("old", "alte"), ("new", "neue")]


def sentences(n: int, offset: int) -> tuple[list[str], list[str]]:
    en, de = [], []
    for i in range(offset, offset + n):
        (ne, nd), (ae, ad) = NOUNS[i % len(NOUNS)], ADJ[i // len(NOUNS) % len(ADJ)]
        en.append(f"The {ae} {ne} number {i} is here.")
        de.append(f"Die {ad} {nd} Nummer {i} ist hier.")
    return en, de


def add(tar: tarfile.TarFile, name: str, lines: list[str]) -> None:
    data = "".join(f"{line}\n" for line in lines).encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def sgm(lines: list[str], lang: str, kind: str) -> list[str]:
    return ([f'<{kind}set setid="newstest" srclang="any" trglang="{lang}">', '<doc sysid="ref" docid="d1">'] +
            [f'<seg id="{i + 1}">  {line}  </seg>' for i, line in enumerate(lines)] + ["</doc>", f"</{kind}set>"])


def make_archives(folder: Path, sizes: tuple[int, int, int] = (40, 40, 20)) -> dict[str, tuple[list[str], list[str]]]:
    """The four archives with their real member paths; returns the raw text each split should get."""
    folder.mkdir(parents=True, exist_ok=True)
    corpora, offset = [], 0
    members = [("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en"),
               ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
               ("training-parallel-nc-v11.tgz", "training-parallel-nc-v11/news-commentary-v11.de-en")]
    for (archive, stem), n in zip(members, sizes):
        en, de = sentences(n, offset)
        offset += n
        with tarfile.open(folder / archive, "w:gz") as tar:
            add(tar, f"{stem}.de", de)  # .de before .en, as in the real archives
            add(tar, f"{stem}.en", en)
            if "commoncrawl" in stem:  # other language pairs in the same archive are ignored
                add(tar, "commoncrawl.fr-en.fr", ["x"])
                add(tar, "commoncrawl.fr-en.en", ["y"])
        corpora.append((en, de))
    valid, test = sentences(10, 1000), sentences(12, 2000)
    with tarfile.open(folder / "dev.tgz", "w:gz") as tar:
        add(tar, "dev/newstest2013.en", valid[0])
        add(tar, "dev/newstest2013.de", valid[1])
        add(tar, "dev/newstest2013-src.en.sgm", sgm(valid[0], "en", "src"))
        add(tar, "dev/newstest2013-ref.de.sgm", sgm(valid[1], "de", "ref"))
        add(tar, "dev/newstest2014-deen-src.en.sgm", sgm(test[0], "en", "src"))
        add(tar, "dev/newstest2014-deen-ref.de.sgm", sgm(test[1], "de", "ref"))
        add(tar, "dev/newstest2014-deen-src.de.sgm", sgm(test[1], "de", "src"))
        for pair in ("csen", "fren"):  # every 2014 pair's English side is there too, as in the real dev.tgz
            add(tar, f"dev/newstest2014-{pair}-src.en.sgm", sgm(["decoy"], "en", "src"))
            add(tar, f"dev/newstest2014-{pair}-ref.en.sgm", sgm(["decoy"], "en", "ref"))
        add(tar, "dev/newstest2013-src.fr.sgm", sgm(["decoy"], "fr", "src"))
        add(tar, "dev/newstest2013-ref.en.sgm", sgm(["decoy"], "en", "ref"))
    train = ([s for en, _ in corpora for s in en], [s for _, de in corpora for s in de])
    return {"train": train, "valid": valid, "test": test}


def test_raw_archives_to_text_bpe_and_a_one_epoch_run(tmp_path, capsys):
    from recipes.transformer import main as train

    expected = make_archives(tmp_path / "archives")
    root = tmp_path / "wmt"
    prepare_main(["--root", str(root), "--archives", str(tmp_path / "archives"), "--vocab-size", "120",
                  "--no-progress"])
    for split, (en, de) in expected.items():  # the corpora back to back, in fairseq's order; SGM stripped
        assert (root / f"{split}.en").read_text().splitlines() == en
        assert (root / f"{split}.de").read_text().splitlines() == de
    assert "train 100 pairs" in capsys.readouterr().out.splitlines()[-1]
    out = tmp_path / "run"
    summary = train(["--config", str(ROOT / "configs" / "transformer_quickstart_cpu.yaml"), f"data.root={root}",
                     f"log.dir={out}", "train.epochs=1", "model.d_model=32", "model.heads=2",
                     "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64", "data.max_tokens=300",
                     "comm.kind=dense", "log.progress=false", "log.tensorboard=false", "train.target_bleu=0",
                     "train.threads=1", "log.every_steps=1"])
    assert summary["epochs_run"] == 1 and 0 <= summary["test_bleu"] <= 100
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["kind"] == "step"]


def test_a_split_already_written_is_kept_and_bad_archives_are_named(tmp_path):
    make_archives(tmp_path / "archives")
    root = tmp_path / "wmt"
    root.mkdir()
    (root / "valid.en").write_text("kept\n")
    (root / "valid.de").write_text("behalten\n")
    written = wmt.extract_raw(wmt.find_archives(tmp_path / "archives"), root, progress=False)
    assert sorted(written) == ["test", "train"] and written["train"] == 100
    assert (root / "valid.de").read_text() == "behalten\n" and not list(root.glob(".*.part"))

    (tmp_path / "archives" / "dev.tgz").unlink()
    with pytest.raises(SystemExit, match=r"missing dev\.tgz \(the WMT'16 En-De archives, from .*statmt"):
        prepare_main(["--root", str(tmp_path / "x"), "--archives", str(tmp_path / "archives")])
    make_archives(tmp_path / "archives")
    with tarfile.open(tmp_path / "archives" / "training-parallel-nc-v11.tgz", "w:gz") as tar:  # sides misaligned
        add(tar, "training-parallel-nc-v11/news-commentary-v11.de-en.de", ["eins", "zwei"])
        add(tar, "training-parallel-nc-v11/news-commentary-v11.de-en.en", ["one"])
    with pytest.raises(SystemExit, match=r"news-commentary-v11.de-en.en has 1 lines but .*\.de has 2"):
        prepare_main(["--root", str(tmp_path / "y"), "--archives", str(tmp_path / "archives"), "--no-progress"])
    assert not (tmp_path / "y" / "train.en").exists()
    (tmp_path / "archives" / "training-parallel-commoncrawl.tgz").write_bytes(b"not a tgz")
    with pytest.raises(SystemExit, match=r"training-parallel-commoncrawl.tgz: not a readable \.tgz"):
        prepare_main(["--root", str(tmp_path / "z"), "--archives", str(tmp_path / "archives"), "--no-progress"])
    with pytest.raises(SystemExit, match=r"raw files missing: .*--archives"):
        prepare_main(["--root", str(tmp_path / "z"), "--check"])
