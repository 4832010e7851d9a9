"""The Transformer recipe end to end on 2 real gloo ranks (hitopk, 2 nodes x 1 rank): metrics, TensorBoard,
BLEU before and after, checkpoints, and a killed-and-resumed run that ends where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from data import synthetic_translation as synth
from recipes.transformer import Config
from tests.conftest import run_ranks
from trainer.checkpoint import latest_checkpoint
from trainer.config import ConfigError, load_config, reference

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "transformer_quickstart_cpu.yaml"
TINY = ["model.d_model=32", "model.heads=2", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
        "data.max_tokens=400", "train.amp=off", "schedule.warmup_epochs=0.5", "comm.kind=hitopk", "comm.density=0.05",
        "comm.dense_below=0", "comm.dense_warmup_steps=5", "comm.selection=mstopk",
        "log.progress=false", "log.every_steps=5", "train.target_bleu=0"]


def test_shipped_configs_load_and_every_field_is_documented():
    wmt = load_config(Config, CONFIG.parent / "transformer_wmt16_en_de.yaml")
    assert (wmt.model.d_model, wmt.model.heads, wmt.model.ffn_dim, wmt.model.dropout) == (1024, 16, 4096, 0.3)
    assert wmt.optim.name == "adam" and wmt.optim.betas == (0.9, 0.98) and wmt.optim.lr == 1e-3
    assert wmt.schedule.decay == "inverse_sqrt"
    assert wmt.schedule.warmup_start_factor * wmt.optim.lr == pytest.approx(1e-7)  # fairseq's --warmup-init-lr
    assert wmt.comm.kind == "auto" and wmt.comm.min_density == 0.1
    assert wmt.data.max_tokens == 3584 and wmt.model.label_smoothing == 0.1
    quick = load_config(Config, CONFIG)
    assert quick.train.target_bleu == 60 and quick.dist.ranks_per_node == 1 and quick.comm.kind == "auto"
    assert [key for key, _, _, doc in reference(Config) if not doc] == []
    with pytest.raises(ConfigError, match=r"train\.target_blue: unknown key \(did you mean train\.target_bleu\?\)"):
        load_config(Config, CONFIG, ["train.target_blue=20"])
    with pytest.raises(ConfigError, match="model.d_model: must be a positive multiple of model.heads"):
        load_config(Config, CONFIG, ["model.d_model=130"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return synth.prepare(tmp_path_factory.mktemp("synthetic"), n_train=800, n_valid=40, n_test=40, vocab_size=300)


def _runs(rank: int, world: int, tmp: Path, runs: list[list[str]]) -> None:
    """Each run is a fresh process group (the recipe tears its group down at the end, as under torchrun)."""
    from recipes.transformer import main
    for i, args in enumerate(runs):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.FileStore(str(tmp / f"store{i}"), world), rank=rank,
                                    world_size=world)
        main(["--config", str(CONFIG), *args])


@pytest.mark.long
def test_two_rank_local_run_averages_adams_state_and_closes_its_rounds(corpus, tmp_path):
    """comm.kind local on the Transformer recipe (Adam): it trains, every round-end check of the replica guard
    passes (dist.check_every_steps 1: a synchronisation that left the weights unequal stops the run), and the
    epoch-end checkpoint holds no open round (a round that did not close with the epoch would). The averaging of
    Adam's moments is tests/test_comm_local.py's."""
    run = tmp_path / "local"
    args = [f"data.root={corpus}", *TINY, "train.epochs=2", "comm.kind=local", "comm.local_steps=3",
            "dist.check_every_steps=1", f"log.dir={run}"]
    run_ranks(_runs, 2, tmp_path, tmp_path, [args], timeout=240)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs_run"] == 2 and 0 <= summary["test_bleu"] <= 100
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert steps[-1]["loss/train"] < steps[0]["loss/train"]
    state, _ = latest_checkpoint(run)
    assert all(r["comm"]["round"] is not None and r["comm"]["round"]["mine"] is None for r in state["ranks"])
    moments = [state["optimizer"]["state"][i]["exp_avg_sq"] for i in sorted(state["optimizer"]["state"])]
    assert moments and all(torch.isfinite(m).all() for m in moments)


def test_two_rank_hitopk_run_logs_bleu_and_resumes_exactly(corpus, tmp_path):
    common = [f"data.root={corpus}", *TINY]
    full, cut = tmp_path / "full", tmp_path / "cut"
    runs = [[*common, "train.epochs=3", f"log.dir={full}"],
            [*common, "train.epochs=1", f"log.dir={cut}"],                   # "killed" after epoch 1 ...
            [*common, "train.epochs=3", f"log.dir={cut}", "--resume"]]       # ... and resumed to the end
    run_ranks(_runs, 2, tmp_path, tmp_path, runs, timeout=240)

    summary = json.loads((full / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs_run"] == 3 and summary["target_bleu"] == 0
    assert 0 <= summary["test_bleu_untrained"] <= 100 and 0 <= summary["test_bleu"] <= 100
    assert [h["epoch"] for h in summary["history"]] == [0, 1, 2]
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and all(r["time/tokens_per_s"] > 0 for r in steps)
    assert all(r["comm/density"] < 0.2 for r in steps if r["step"] > 5)  # sparse after the 5 dense steps
    assert steps[-1]["loss/train"] < steps[0]["loss/train"]
    assert {"loss/train", "schedule/lr"} <= steps[0].keys()
    assert [r["kind"] for r in records if r["kind"] == "test"] == ["test", "test"]  # untrained, then trained

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(full / "tensorboard")).Reload().Tags()["scalars"]
    for tag in ("loss/train", "time/tokens_per_s", "schedule/lr", "eval/bleu", "eval/test_bleu_untrained",
                "eval/test_bleu_trained"):
        assert tag in tags

    # the resumed run continued from the epoch-1 checkpoint and ends with the uninterrupted run's weights
    resumed = json.loads((cut / "summary.json").read_text())
    assert resumed["test_bleu_untrained"] is None and resumed["epochs_run"] == 3
    assert [h["eval/bleu"] for h in resumed["history"]] == [h["eval/bleu"] for h in summary["history"]]
    a, _ = latest_checkpoint(full)
    b, _ = latest_checkpoint(cut)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
