"""Translation data, model and evaluation for real: the synthetic grammar, sentencepiece BPE on files in
tmp_path, memory-mapped ids, token batching across ranks, greedy decoding and sacreBLEU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data.translation import (BOS, EOS, PAD, TranslationBatch, TranslationData, TranslationDataConfig,
                              TranslationDataError, collate, eval_batches, load_manifest, prepare_corpus, token_batches)
from data import synthetic_translation as synth
from recipes.transformer_model import Seq2SeqTransformer, TransformerConfig
from trainer.decoding import corpus_bleu, evaluate_bleu, greedy_decode
from trainer.translation import translation_loss
from trainer.dist import Topology
from trainer.optim import maybe_clip_gradients


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]  # small models: threads only add overhead


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small synthetic corpus, prepared once: 1,500 training pairs, BPE of 400 pieces."""
    return synth.prepare(tmp_path_factory.mktemp("synthetic"), n_train=1500, n_valid=60, n_test=80, vocab_size=400)


def write_pair(root: Path, split: str, src: list[str], tgt: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{split}.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (root / f"{split}.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")


# ---------------------------------------------------------------- the synthetic grammar


def test_grammar_numbers_dates_and_agreement():
    assert [synth.number_de(n) for n in (2, 17, 20, 21, 23, 99)] == [
        "zwei", "siebzehn", "zwanzig", "einundzwanzig", "dreiundzwanzig", "neunundneunzig"]
    assert [synth.ordinal_en(n) for n in (1, 3, 20, 21, 30)] == ["first", "third", "twentieth", "twenty-first",
                                                                   "thirtieth"]
    assert [synth.ordinal_de_dative(n) for n in (1, 3, 7, 12, 20, 31)] == [
        "ersten", "dritten", "siebten", "zwölften", "zwanzigsten", "einunddreißigsten"]
    pairs = synth.generate(3000, 0, 0, seed=1)["train"]
    german = " ".join(de for _, de in pairs)
    # case and gender on articles and adjectives, V2 after a fronted adverb, verb-final after dass/weil
    for phrase in ("den ", "dem ", "einen ", "keinen ", "im ", ", dass ", ", weil "):
        assert phrase in german
    fronted = [(en, de) for en, de in pairs if en.startswith("Today ")]
    assert fronted and all(de.split()[1] in {v.de[p] for v in synth.TRANSITIVE + synth.INTRANSITIVE
                                              + synth.DITRANSITIVE for p in range(6)}
                           | {m[3][p] for m in synth.MODALS for p in range(6)} for _, de in fronted)
    assert all(de.endswith((".", "?")) and de[0].isupper() for _, de in pairs)


def test_corpus_is_deterministic_and_held_out_sentences_never_appear_in_train():
    a = synth.generate(2000, 100, 200, seed=3)
    assert a == synth.generate(2000, 100, 200, seed=3)
    assert a != synth.generate(2000, 100, 200, seed=4)
    train = {en for en, _ in a["train"]}
    assert len(train) == 2000
    assert not train & {en for en, _ in a["test"]} and not train & {en for en, _ in a["valid"]}


# ---------------------------------------------------------------- BPE and memory-mapped ids


def test_bpe_round_trip_and_mmap_ids_give_back_the_raw_lines(corpus):
    data = TranslationData(TranslationDataConfig(root=str(corpus)))
    assert data.vocab_size <= 400 and load_manifest(corpus)["dtype"] == "uint16"
    for split in (data.train, data.valid, data.test):
        src_lines = (corpus / f"{split.name}.en").read_text(encoding="utf-8").splitlines()
        tgt_lines = (corpus / f"{split.name}.de").read_text(encoding="utf-8").splitlines()
        assert len(split) == len(src_lines)
        for i in range(0, len(split), 7):
            line = int(split.index[i, 4])
            assert data.decode(split.src(i).tolist()) == src_lines[line]
            assert data.decode(split.tgt(i).tolist()) == tgt_lines[line]
        assert split.references(np.array([2, 0])) == [tgt_lines[2], tgt_lines[0]]
    # umlauts, ß and punctuation survive encode -> decode (a text the BPE has never seen)
    text = "Am einunddreißigsten März öffnen die Männer, dass süße Äpfel überall sind?"
    assert data.sp.decode(data.sp.encode(text)) == text


def test_collate_adds_bos_eos_and_pads():
    split = type("S", (), {})()
    seqs = {0: (np.array([5, 6, 7]), np.array([8])), 1: (np.array([9]), np.array([10, 11]))}
    split.src = lambda i: seqs[i][0]
    split.tgt = lambda i: seqs[i][1]
    b = collate(split, np.array([0, 1]))
    assert b.src.tolist() == [[5, 6, 7, EOS], [9, EOS, PAD, PAD]]
    assert b.tgt_in.tolist() == [[BOS, 8, PAD], [BOS, 10, 11]]
    assert b.tgt_out.tolist() == [[8, EOS, PAD], [10, 11, EOS]]
    assert b.num_tokens == 5
    moved = b.to(torch.device("cpu"))
    assert moved.tokens == 5  # counted before the copy: on a GPU the count would be a host sync each step
    moved.tgt_out[0, 0] = PAD
    assert moved.num_tokens == 5 and TranslationBatch(b.src, b.tgt_in, moved.tgt_out).num_tokens == 4


# ---------------------------------------------------------------- token batching


@pytest.mark.parametrize("world", [1, 2, 3])
def test_token_batches_respect_max_tokens_and_use_every_pair_once_per_epoch(world):
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 60, 1001), rng.integers(1, 60, 1001)
    max_tokens = 300
    plans = [token_batches(src, tgt, max_tokens, world, seed=7, epoch=e) for e in range(3)]
    assert len({len(p) for p in plans}) == 1  # the same number of steps every epoch
    for plan in plans:
        assert all(len(step) == world for step in plan)
        seen = np.concatenate([b for step in plan for b in step])
        assert np.array_equal(np.sort(seen), np.arange(1001))  # every pair exactly once
        for step in plan:
            for b in step:
                assert len(b) * (max(src[b].max(), tgt[b].max()) + 1) <= max_tokens
    assert not np.array_equal(np.concatenate(plans[0][0]), np.concatenate(plans[1][0]))  # reshuffled per epoch
    assert token_batches(src, tgt, max_tokens, world, 7, 1)[3][0].tolist() == plans[1][3][0].tolist()


def test_token_batches_errors():
    with pytest.raises(TranslationDataError, match="2 training pairs cannot give each of 3 ranks a batch"):
        token_batches(np.array([3, 4]), np.array([3, 4]), 100, 3, 0, 0)
    with pytest.raises(TranslationDataError, match="a pair of 11 tokens exceeds data.max_tokens 10"):
        token_batches(np.array([10]), np.array([2]), 10, 1, 0, 0)
    with pytest.raises(TranslationDataError, match="raise data.max_tokens"):
        token_batches(np.array([8, 8, 8]), np.array([1, 1, 1]), 10, 2, 0, 0)


def test_ranks_share_the_prepared_training_set_exactly_once(corpus):
    cfg = TranslationDataConfig(root=str(corpus), max_tokens=200)
    ranks = [TranslationData(cfg, rank=r, world=2, seed=5) for r in range(2)]
    steps = ranks[0].steps_per_epoch()
    assert steps == ranks[1].steps_per_epoch() > 0
    lines = []
    for r, data in enumerate(ranks):
        batches = list(data.train_batches(epoch=1))
        assert len(batches) == steps
        for b in batches:
            assert b.src.numel() <= 200 and b.tgt_in.numel() <= 200
            lines += [data.decode([t for t in row if t not in (PAD, EOS)]) for row in b.src.tolist()]
        resumed = list(data.train_batches(epoch=1, start_step=3))
        assert torch.equal(resumed[0].src, batches[3].src)  # a mid-epoch resume continues the same order
    assert sorted(lines) == sorted((corpus / "train.en").read_text(encoding="utf-8").splitlines())


def test_eval_batches_cover_the_split_once():
    lens = np.random.default_rng(1).integers(1, 40, 103)
    got = np.concatenate([b for r in range(3) for b in eval_batches(lens, 64, r, 3)])
    assert np.array_equal(np.sort(got), np.arange(103))
    assert all(len(b) * (lens[b].max() + 1) <= 64 or len(b) == 1 for b in eval_batches(lens, 64, 0, 3))
    assert sorted(np.concatenate(eval_batches(lens, 64, 0, 1, limit=10)).tolist()) == list(range(10))


# ---------------------------------------------------------------- bad corpus inputs


def test_mismatched_line_counts_are_an_error_naming_both_files(tmp_path):
    write_pair(tmp_path, "train", ["a b", "c d", "e f"], ["x", "y"])
    with pytest.raises(TranslationDataError, match=r"train\.en has 3 lines but .*train\.de has 2"):
        prepare_corpus(tmp_path, vocab_size=50, splits=("train",))
    assert not (tmp_path / "prepared").exists()  # checked before any work
    write_pair(tmp_path, "train", ["a b", "c d"], ["x", "y"])
    with pytest.raises(TranslationDataError, match=r"split 'valid' is missing .*valid\.en"):
        prepare_corpus(tmp_path, vocab_size=50, splits=("train", "valid"))


def test_empty_and_overlong_pairs_are_skipped_and_counted(tmp_path, capsys):
    src = ["the dog sees the cat", "", "a cat", "the man", " ".join(["word"] * 80), "a dog"] * 10
    tgt = ["der Hund sieht die Katze", "leer", "", "der Mann", "Wort", "ein Hund"] * 10
    src[3], tgt[3] = "the\rman", "der Mann\r"  # a stray carriage return splits no line
    write_pair(tmp_path, "train", src, tgt)
    write_pair(tmp_path, "valid", ["the dog"], ["der Hund"])
    manifest = prepare_corpus(tmp_path, vocab_size=60, splits=("train", "valid"), max_len=40)
    stats = manifest["splits"]["train"]
    assert (stats["lines"], stats["pairs"], stats["skipped_empty"], stats["skipped_long"]) == (60, 30, 20, 10)
    assert "train: skipped 20 pairs with an empty side and 10 longer than 40 tokens, of 60" in capsys.readouterr().out
    # at load time, data.max_len skips (and counts) more; the references stay aligned with their sources
    data = TranslationData(TranslationDataConfig(root=str(tmp_path), test_split="", max_len=4))
    assert data.train_size == 20 and data.stats() == {"data/skipped_pairs": 40.0}
    kept = [data.decode(data.train.src(int(p)).tolist()) for p in data.train_positions]
    assert set(kept) == {"the man", "a dog"}  # sentencepiece's normalization reads the stray \r as a space
    assert set(data.train.references(data.train_positions)) == {"der Mann", "ein Hund"}


def test_unprepared_or_changed_corpus_says_how_to_prepare(tmp_path):
    with pytest.raises(TranslationDataError, match="corpus folder not found; prepare it with"):
        TranslationData(TranslationDataConfig(root=str(tmp_path / "nothing")))
    write_pair(tmp_path, "train", ["the dog"] * 4, ["der Hund"] * 4)
    write_pair(tmp_path, "valid", ["the dog"], ["der Hund"])
    with pytest.raises(TranslationDataError, match=r"no prepared corpus \(expected .*manifest.json\)"):
        TranslationData(TranslationDataConfig(root=str(tmp_path)))
    prepare_corpus(tmp_path, vocab_size=30, splits=("train", "valid"), progress=False)
    with pytest.raises(TranslationDataError, match="split 'test' was not prepared"):
        TranslationData(TranslationDataConfig(root=str(tmp_path)))
    write_pair(tmp_path, "valid", ["the dog", "a cat"], ["der Hund", "eine Katze"])
    with pytest.raises(TranslationDataError, match="changed since they were prepared"):
        TranslationData(TranslationDataConfig(root=str(tmp_path), test_split=""))


# ---------------------------------------------------------------- model, decoding, BLEU


def test_sacrebleu_on_known_strings():
    assert corpus_bleu(["Der Hund sieht die Katze."], ["Der Hund sieht die Katze."]) == pytest.approx(100.0)
    # all n-gram precisions 1, hypothesis 4 of 5 reference tokens: BLEU = brevity penalty = exp(1 - 5/4)
    assert corpus_bleu(["a b c d"], ["a b c d e"]) == pytest.approx(100 * np.exp(1 - 5 / 4), abs=1e-3)
    assert corpus_bleu(["x y z w"], ["a b c d"]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        corpus_bleu(["a", "b"], ["a"])


def tiny_model(vocab: int = 40, seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, dropout=0.0)
    return Seq2SeqTransformer(cfg, vocab).eval()


def test_greedy_decode_matches_step_by_step_reference():
    model = tiny_model()
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD], [11, EOS, PAD, PAD, PAD]])
    # EOS made likely after a few steps so some rows finish early and leave the batch
    with torch.no_grad():
        model.embed.weight[EOS] *= 3
    got = greedy_decode(model, src, max_len_a=1.0, max_len_b=3)
    for row in range(3):  # one sentence at a time, full recompute, no batch shrinking
        one = src[row:row + 1, :int((src[row] != PAD).sum())]
        ys, want = torch.tensor([[BOS]]), []
        for _ in range(int(one.shape[1] + 3)):
            nxt = int(model(one, ys)[0, -1].argmax())
            if nxt == EOS:
                break
            want.append(nxt)
            ys = torch.cat([ys, torch.tensor([[nxt]])], dim=1)
        assert got[row] == want
        assert EOS not in got[row] and len(got[row]) <= one.shape[1] + 3


def test_loss_is_label_smoothed_mean_over_target_tokens(corpus):
    data = TranslationData(TranslationDataConfig(root=str(corpus), max_tokens=300))
    batch = next(data.train_batches(0))
    model = tiny_model(data.vocab_size)
    loss, n = translation_loss(model, batch, label_smoothing=0.0)
    logits = model(batch.src, batch.tgt_in)
    mask = batch.tgt_out != PAD
    want = torch.nn.functional.cross_entropy(logits[mask], batch.tgt_out[mask])
    assert n == int(mask.sum()) and loss.item() == pytest.approx(want.item(), rel=1e-5)
    smoothed, _ = translation_loss(model, batch, label_smoothing=0.1)
    assert smoothed.item() != pytest.approx(loss.item())


def test_untrained_model_scores_near_zero_bleu(corpus):
    data = TranslationData(TranslationDataConfig(root=str(corpus)))
    bleu, hyps = evaluate_bleu(tiny_model(data.vocab_size), data, data.test, Topology(), max_tokens=500)
    assert len(hyps) == len(data.test) and bleu < 5.0


def test_gradient_clipping_runs_before_each_update():
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
    maybe_clip_gradients(optimizer, max_norm=0.5)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    optimizer.step()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm.item() == pytest.approx(0.5, rel=1e-4)
    unclipped = torch.optim.Adam(model.parameters(), lr=0.0)
    maybe_clip_gradients(unclipped, max_norm=0.0)  # 0 = off
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    unclipped.step()
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())
