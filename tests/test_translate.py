"""Beam search, checkpoint averaging and the translate command, for real: a batched beam search checked
against a one-sentence-at-a-time reference, a Transformer trained by the recipe in one process, its
checkpoints averaged, raw text translated, and sacreBLEU of beam against greedy search."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from data import synthetic_translation as synth
from data.translation import BOS, EOS, PAD, prepare_corpus
from recipes.transformer import main
from recipes.transformer_model import Seq2SeqTransformer, TransformerConfig
from trainer.checkpoint import checkpoint_dirs, load_model_state
from trainer.decoding import Search, beam_search, greedy_decode
from trainer.export import ExportError, average_states, load_weights
from trainer.translate import resolve_device

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "transformer_quickstart_cpu.yaml"


def tiny_model(vocab: int = 30, seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(d_model=16, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, dropout=0.0)
    model = Seq2SeqTransformer(cfg, vocab).eval()
    with torch.no_grad():
        model.embed.weight[EOS] *= 3  # EOS likely after a few steps: hypotheses end at different lengths
    return model


def sources(vocab: int = 30, n: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (n,), generator=g)
    src = torch.full((n, int(lengths.max()) + 1), PAD)
    for row, length in enumerate(lengths.tolist()):
        src[row, :length] = torch.randint(4, vocab, (length,), generator=g)
        src[row, length] = EOS
    return src


@torch.no_grad()
def reference_beam(model: Seq2SeqTransformer, src: torch.Tensor, beam: int, len_penalty: float,
                   limit: int) -> list[int]:
    """Beam search on one unpadded sentence, hypotheses as Python lists, the whole prefix re-run each step."""
    live = [(0.0, [])]
    finished = []
    for step in range(limit):
        candidates = []
        for score, ids in live:
            lprobs = torch.log_softmax(model(src, torch.tensor([[BOS] + ids]))[0, -1].float(), -1)
            candidates += [(score + float(lp), ids, tok) for tok, lp in enumerate(lprobs.tolist())]
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:2 * beam]
        for score, ids, tok in candidates[:beam]:
            if tok == EOS or step + 1 == limit:
                finished.append((score / (step + 1) ** len_penalty, ids + ([] if tok == EOS else [tok])))
        if len(finished) >= beam or step + 1 == limit:
            break
        live = [(score, ids + [tok]) for score, ids, tok in candidates if tok != EOS][:beam]
    return max(finished, key=lambda f: f[0])[1]


@pytest.mark.parametrize("beam,len_penalty", [(2, 1.0), (4, 0.6)])
def test_batched_beam_search_equals_a_one_sentence_reference(beam, len_penalty):
    model, src = tiny_model(), sources()
    got = beam_search(model, src, beam=beam, len_penalty=len_penalty, max_len_a=1.0, max_len_b=3)
    for row in range(src.shape[0]):
        one = src[row:row + 1, :int((src[row] != PAD).sum())]
        limit = one.shape[1] + 3  # max_len_a x source tokens (EOS included) + max_len_b
        assert got[row] == reference_beam(model, one, beam, len_penalty, limit), row
        assert EOS not in got[row] and len(got[row]) <= limit
    assert len({len(ids) for ids in got}) > 2  # hypotheses ended at several lengths, some at the limit


def test_beam_one_is_greedy_search():
    model, src = tiny_model(), sources(n=20)
    greedy = greedy_decode(model, src)
    assert beam_search(model, src, beam=1) == greedy
    assert Search(beam=1).decode(model, src) == greedy
    assert Search(beam=4).decode(model, src) == beam_search(model, src, beam=4) != greedy
    with pytest.raises(ValueError, match="beam size must be >= 1, got 0"):
        beam_search(model, src, beam=0)


# ---------------------------------------------------------------- checkpoint averaging


def test_averaging_identical_states_gives_them_back_and_two_states_their_mean():
    a = tiny_model(seed=0).state_dict()
    b = tiny_model(seed=1).state_dict()
    a["steps"], b["steps"] = torch.tensor(7), torch.tensor(9)  # an integer buffer: kept, not averaged
    same = average_states([a, a, a])
    assert same.keys() == a.keys() and all(torch.equal(same[k], a[k]) for k in a)
    mean = average_states([a, b])
    for key in a:
        if key == "steps":
            assert int(mean[key]) == 7
        else:
            assert mean[key].dtype == a[key].dtype
            assert torch.allclose(mean[key], (a[key] + b[key]) / 2, rtol=0, atol=1e-7), key
    assert not torch.equal(mean["embed.weight"], a["embed.weight"])
    with pytest.raises(ExportError, match="hold different models"):
        average_states([a, tiny_model(vocab=31).state_dict()])


# ---------------------------------------------------------------- a trained run


def noun_phrase_corpus(root: Path, n_train: int = 2500, n_valid: int = 100) -> Path:
    """Pairs of two noun phrases of the quickstart's grammar ("the blue rivers and forty-seven birds" ->
    "die blauen Flüsse und siebenundvierzig Vögel": gender, case endings, plurals, compound numbers), prepared
    as the recipe reads them; short enough to be learnt in a minute on one CPU thread."""
    rng, seen, pairs = random.Random(0), set(), []
    while len(pairs) < n_train + n_valid:
        a, b = synth.noun_phrase(rng), synth.noun_phrase(rng)
        en, de = f"{a.en} and {b.en}", f"{a.de[0]} und {b.de[0]}"
        if en not in seen:
            seen.add(en)
            pairs.append((en, de))
    synth.write_raw(root, {"valid": pairs[:n_valid], "train": pairs[n_valid:]})
    prepare_corpus(root, "en", "de", vocab_size=200, splits=("train", "valid"), progress=False)
    return root


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The recipe in one process: 3 epochs, a checkpoint after each."""
    tmp = tmp_path_factory.mktemp("translate")
    corpus = noun_phrase_corpus(tmp / "corpus")
    run = tmp / "run"
    main(["--config", str(CONFIG), f"data.root={corpus}", f"log.dir={run}", "data.test_split=", "model.d_model=64",
          "model.heads=4", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=128",
          "data.max_tokens=300", "train.epochs=3", "train.eval_every_epochs=3", "schedule.warmup_epochs=0.3",
          "optim.lr=3.0e-3", "comm.kind=dense", "train.threads=1", "train.keep_checkpoints=3",
          "train.target_bleu=0", "log.progress=false", "log.tensorboard=false"])
    return run


def test_translate_scores_beam_against_greedy_and_translates_text(trained_run, tmp_path, capsys):
    scores = main(["translate", str(trained_run), "--beam", "4", "--output", str(tmp_path / "beam.de")])
    out = capsys.readouterr()
    assert f"valid split, 100 sentences, sacreBLEU: greedy {scores['greedy']:.2f}, beam 4 {scores['beam']:.2f}" \
        in out.out
    assert scores["greedy"] > 20  # the model learnt enough for the comparison to mean something
    assert scores["beam"] >= scores["greedy"]
    beam_hyps = (tmp_path / "beam.de").read_text(encoding="utf-8").splitlines()
    assert len(beam_hyps) == 100

    # raw text in, one line out per line in (an empty line gives an empty line); same as the split's decode
    lines = (trained_run.parent / "corpus" / "valid.en").read_text(encoding="utf-8").splitlines()[:5]
    (tmp_path / "in.en").write_text("\n".join([lines[0], "", *lines[1:]]) + "\n", encoding="utf-8")
    assert main(["translate", str(trained_run), "--beam", "4", "--input", str(tmp_path / "in.en"),
                 "--output", str(tmp_path / "out.de"), "--device", "cpu"]) == {}
    got = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    assert got == [beam_hyps[0], "", *beam_hyps[1:5]]


def test_averaged_checkpoints_are_the_mean_and_translate_with_them(trained_run):
    dirs = checkpoint_dirs(trained_run)
    assert len(dirs) == 3
    newest, older = load_model_state(dirs[0]), load_model_state(dirs[1])
    averaged, used = load_weights(trained_run, average_last=2)
    assert used == dirs[:2]
    for key, tensor in newest.items():
        assert torch.allclose(averaged[key], (tensor.double() + older[key].double()).div(2).float(), rtol=0,
                              atol=1e-7), key
    assert not torch.equal(averaged["embed.weight"], newest["embed.weight"])
    step = int(dirs[1].name.split("-")[1])
    at_step, used = load_weights(trained_run, step=step, average_last=2)
    assert used == dirs[1:3]
    scores = main(["translate", str(trained_run), "--beam", "2", "--average-last", "3", "--limit", "20"])
    assert 0 <= scores["greedy"] <= 100 and not math.isnan(scores["beam"])


def test_translate_errors_are_one_clear_line(trained_run, tmp_path):
    with pytest.raises(ExportError, match="5 checkpoints asked for, 3 there up to step"):
        main(["translate", str(trained_run), "--average-last", "5"])
    with pytest.raises(ExportError, match="no checkpoint of step 1 "):
        main(["translate", str(trained_run), "--step", "1"])
    with pytest.raises(ExportError, match="--beam must be >= 1, got 0"):
        main(["translate", str(trained_run), "--beam", "0"])
    with pytest.raises(ExportError, match="--split nope: the run's corpus has train, valid"):
        main(["translate", str(trained_run), "--split", "nope"])
    with pytest.raises(FileNotFoundError, match="--input .*missing.en: no such file"):
        main(["translate", str(trained_run), "--input", str(tmp_path / "missing.en")])
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    with pytest.raises(ExportError, match="no complete checkpoint in"):
        main(["translate", str(empty)])
    with pytest.raises(ExportError, match="no such folder"):
        main(["translate", str(tmp_path / "nowhere")])


def test_the_device_option_names_a_device_or_is_one_clear_line(tmp_path):
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ExportError, match="--device gpu0: not a torch device"):
        main(["translate", str(tmp_path / "nowhere"), "--device", "gpu0"])  # checked before the run is read
    if not torch.cuda.is_available():
        with pytest.raises(ExportError, match="--device cuda: no CUDA device here"):
            main(["translate", str(tmp_path / "nowhere"), "--device", "cuda"])
    else:
        with pytest.raises(ExportError, match="--device cuda:999: this machine has"):
            main(["translate", str(tmp_path / "nowhere"), "--device", "cuda:999"])
