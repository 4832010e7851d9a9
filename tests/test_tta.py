"""The time-to-accuracy bench: the two-in-a-row target, paired ratios and their bootstrap interval on constructed
inputs; a tiny variant of the task (4 classes from 2 photos); the baseline script on real gloo ranks; both sides'
validation pixels; the bench's run control; the frozen configs."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from data.cache import lowres_short_side
from data.tta_photos import VAL_SIDE, prepare, region_centres
from scripts import tta_baseline  # the baseline contender: a command line (parse_args, main) under test
from scripts.bench import tta  # the bench's command line (main) and its runner
from scripts.bench.common import machine, run_logged  # the machine a run records; the benches' run control
from tests.conftest import ROOT, run_ranks
from trainer import tta_plot
from trainer.run_record import widest_flag
from trainer.tta_plot import plot
from trainer.tta_stats import (Run, accuracy, bootstrap_interval, compare, first_reach, paired_ratio, reached_at,
                               read_curve, read_run, seed_order)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task's generator at a tiny size: 2 photos x 2 regions = 4 classes, 8 training and 12 validation images."""
    return prepare(tmp_path_factory.mktemp("tta_photos") / "data", train=8, val=12, regions=2, photo_limit=2)


# ---------------------------------------------------------------- the statistics

def test_target_needs_consecutive_evaluations():
    top1 = [0.5, 0.91, 0.88, 0.90, 0.95, 0.97]
    assert reached_at(top1, 0.9, 2) == 4  # the lucky 0.91 at index 1 is followed by 0.88: not yet
    assert reached_at(top1, 0.9, 1) == 1
    assert reached_at(top1, 0.9, 3) == 5
    assert reached_at(top1, 0.96, 2) is None and reached_at([], 0.9, 2) is None
    assert tta_baseline.reached_at is reached_at  # the baseline's own stop uses the same rule


def test_paired_ratio_needs_both_sides_to_reach_the_target():
    assert paired_ratio(30.0, 60.0) == 0.5
    assert paired_ratio(None, 60.0) is None and paired_ratio(30.0, None) is None and paired_ratio(None, None) is None


def test_bootstrap_interval_is_exact_on_small_samples():
    # Resamples of 3 values: the median is 1 with probability 7/27, 10 with 7/27: both beyond the 5% tails.
    assert bootstrap_interval([1.0, 2.0, 10.0]) == (1.0, 10.0)
    # Of 7 values: P(median <= 2nd smallest) = P(>= 4 of 7 draws among the 2 smallest) = 0.073 > 0.05, while
    # P(median <= smallest) = 0.005: the 5% quantile is the 2nd smallest, by symmetry the 95% one the 6th.
    assert bootstrap_interval([7.0, 1.0, 3.0, 5.0, 2.0, 6.0, 4.0]) == (2.0, 6.0)
    assert bootstrap_interval([0.4] * 6) == (0.4, 0.4)
    low, high = bootstrap_interval([0.3, 0.5, math.inf])  # a missed seed: the upper end is unbounded
    assert low == 0.3 and high == math.inf
    with pytest.raises(ValueError, match="no nan"):
        bootstrap_interval([0.5, math.nan])


def run(side: str, seed: int, tta_s: float | None, final: float = 0.95) -> Run:
    """A run whose curve reaches 0.9 twice in a row at `tta_s` seconds (never when None), ending at `final`."""
    t = tta_s or 100.0
    top1 = [0.5, 0.95, final] if tta_s is not None else [0.5, 0.6, min(final, 0.6)]
    return Run(side=side, seed=seed, process_s=t + 10, load_before=1.0, load_after=2.0, run_dir=f"/runs/{side}{seed}",
               top1=top1, elapsed_s=[t / 2, t * 0.75, t], config=tta.config_for(side, tta.HEADLINE[0]))


def test_one_run_gives_its_time_to_every_target():
    r = Run(side="recipe", seed=100, process_s=60.0, load_before=0.0, load_after=0.0, run_dir="/r",
            top1=[0.55, 0.62, 0.58, 0.66, 0.71, 0.74, 0.72], elapsed_s=[10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
    assert r.time_to(0.6, 2) == 50.0  # 0.62 then 0.58: not yet; 0.66, 0.71 in a row
    assert r.time_to(0.6, 1) == 20.0 and r.time_to(0.7, 2) == 60.0 and r.time_to(0.75, 2) is None
    assert r.epochs_to(0.7, 2) == 6 and r.epochs_to(0.75, 1) is None
    assert r.final_top1 == 0.72 and r.best_top1 == 0.74


def test_compare_pairs_runs_by_seed_not_by_rank():
    # Medians of the sides would give 50 / 120 = 0.417; the paired ratios are 0.4, 0.5, 0.15 -> 0.4.
    runs = [run("baseline", 100, 100.0), run("recipe", 100, 40.0), run("recipe", 101, 60.0),
            run("baseline", 101, 120.0), run("baseline", 102, 300.0), run("recipe", 102, 45.0)]
    result = compare(runs, 0.9, 2)
    assert result["seeds"] == [100, 101, 102] and result["ratios"] == [0.4, 0.5, 0.15]
    assert result["ratio"] == 0.4 and result["missed"] == {"baseline": [], "recipe": []}
    assert result["range"] == [0.15, 0.5]
    low, high = result["interval"]
    assert low <= 0.4 <= high and low >= 0.15 and high <= 0.5


def test_compare_takes_the_median_of_an_even_number_of_seeds_over_the_seeds_both_reached():
    times = {100: (100.0, 30.0), 101: (100.0, 50.0), 102: (100.0, 70.0), 103: (100.0, 90.0), 104: (100.0, 10.0),
             105: (100.0, 40.0)}
    runs = [run(side, seed, t) for seed, (b, r) in times.items() for side, t in (("baseline", b), ("recipe", r))]
    runs += [run("baseline", 106, None), run("recipe", 106, None)]
    result = compare(runs, 0.9, 2)
    # ratios 0.1 0.3 0.4 0.5 0.7 0.9: the mean of the middle two, not either of them
    assert result["ratio"] == 0.45 and result["seeds_in_median"] == 6
    assert result["ratios"][-1] is None and result["missed"] == {"baseline": [106], "recipe": [106]}


def test_a_seed_the_baseline_misses_is_its_miss_not_the_recipes_win():
    runs = [run("baseline", 100, None), run("recipe", 100, 10.0), run("baseline", 101, 100.0),
            run("recipe", 101, 80.0), run("baseline", 102, 100.0), run("recipe", 102, 90.0)]
    result = compare(runs, 0.9, 2)
    assert result["ratios"] == [None, 0.8, 0.9] and result["ratio"] == 0.85  # not the median of (0, 0.8, 0.9)
    assert result["missed"] == {"baseline": [100], "recipe": []} and result["seeds_in_median"] == 2
    runs[1] = run("recipe", 100, None)  # and the other way round: a recipe miss is not left unreported
    result = compare(runs, 0.9, 2)
    assert result["missed"] == {"baseline": [100], "recipe": [100]} and result["ratio"] == 0.85
    nobody = compare([run("baseline", 100, None), run("recipe", 100, 50.0)], 0.9, 2)
    assert nobody["ratio"] is None and nobody["interval"] == [None, None] and nobody["range"] == [None, None]


def test_accuracy_gives_each_sides_final_and_best_top1():
    runs = [run("baseline", 100, 100.0, final=0.8), run("recipe", 100, 40.0, final=0.9),
            run("baseline", 101, 100.0, final=0.7), run("recipe", 101, 40.0, final=0.92)]
    acc = accuracy(runs)
    assert acc["baseline"]["final_top1"] == [0.8, 0.7] and acc["baseline"]["mean_final_top1"] == 0.75
    assert acc["recipe"]["best_top1"] == [0.95, 0.95] and acc["recipe"]["mean_final_top1"] == 0.91


def test_each_machine_gets_its_own_results_file():
    name = tta.result_name
    assert name({"cpu": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}) == \
        "tta-intel-xeon-processor-avx512bf16"
    assert name({"cpu": "AMD EPYC", "cpu_flags": ["avx2"]}) == "tta-amd-epyc-avx2"
    assert name({"cpu": "AMD EPYC 9654 96-Core", "cpu_flags": ["avx2", "avx512f"]}) == "tta-amd-epyc-9654-96-core-avx512f"
    assert name({"cpu": "Apple M2", "cpu_flags": []}) == "tta-apple-m2"


def test_compare_refuses_two_runs_of_one_side_and_seed():
    with pytest.raises(ValueError, match="two baseline runs of seed 100"):
        compare([run("baseline", 100, 50.0), run("baseline", 100, 60.0), run("recipe", 100, 20.0)], 0.9, 2)


def test_compare_needs_both_sides_of_every_seed():
    with pytest.raises(ValueError, match=r"incomplete: \[101\]"):
        compare([run("baseline", 100, 1.0), run("recipe", 100, 1.0), run("baseline", 101, 1.0)], 0.9, 2)


def test_sides_alternate_from_seed_to_seed():
    assert seed_order(100, 3) == [(100, "baseline"), (100, "recipe"), (101, "recipe"), (101, "baseline"),
                            (102, "baseline"), (102, "recipe")]


@pytest.mark.parametrize("argv, message", [
    (["--first-seed", "2"], "--first-seed must be >= 100"),
    (["--tune", "baseline", "--tuning-seeds", "100"], "--tuning-seeds must be in 0..99"),
    (["--tune", "recipe", "--set", "optim.lr"], "--set takes KEY=VALUE"),
    (["--tune", "baseline", "--ablation"], "--ablation goes with --tune recipe"),
    (["--tune", "recipe", "--ablation", "--set", "optim.lr=0.1"], "at most one --set comm.kind=KIND"),
    (["--tune", "recipe", "--config", "configs/none.yaml"], "--config configs/none.yaml: goes with --tune"),
])
def test_tuning_and_fresh_seeds_never_overlap(argv, message, capsys):
    with pytest.raises(SystemExit):
        tta.main([*argv, "--results-dir", ""])
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the task

def test_task_images(photos):
    classes = sorted(p.name for p in (photos / "train").iterdir())
    assert classes == ["000_astronaut_30", "001_astronaut_70", "002_brick_30", "003_brick_70"]
    assert region_centres(2) == [(0.3, 0.5), (0.7, 0.5)]
    train = sorted((photos / "train").rglob("*.JPEG"))
    val = sorted((photos / "val").rglob("*.png"))
    assert len(train) == 8 and len(val) == 12
    for path in train:
        with Image.open(path) as img:
            assert img.format == "JPEG" and 300 <= min(img.size) and max(img.size) <= 500
    for path in val:
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size == (VAL_SIDE, VAL_SIDE) and img.mode == "RGB"


KNOBS = {"off": (["train.ema_decay=0", "train.eval_flip=false"], ["--no-model-ema"]),
         "on": (["train.ema_decay=0.9", "train.eval_flip=true", "schedule.final_lr=0.01"],
                ["--model-ema", "--model-ema-steps=1", "--lr-min=0.001"])}


@pytest.mark.parametrize("config", tta.side_configs("recipe"))
@pytest.mark.parametrize("knobs", sorted(KNOBS))
def test_both_sides_evaluate_the_same_pixels(photos, tmp_path, knobs, config):
    """The recipe's validation batches (DALI, through the cache, at each frozen config's sizes) equal the
    baseline's (PIL + torchvision transforms) image by image, with the evaluation and schedule knobs off and on
    (the recipe's test-time flip then also scores the mirror of these same pixels)."""
    pytest.importorskip("nvidia.dali")
    from data.dali_loader import DaliImageData
    from recipes.resnet50 import Config
    from trainer.config import load_config

    # the frozen config as the bench runs it (its sizes, normalization, layout, dtype, cache levels), with the
    # bench's own folders
    recipe_knobs, baseline_knobs = KNOBS[knobs]
    recipe = load_config(Config, str(ROOT / config),
                         [f"data.root={photos}", f"data.cache.dir={tmp_path / 'cache'}", "data.cache.ram=false",
                          *recipe_knobs])
    # one evaluation size in every phase; validation reads the PNGs' own pixels: decoded as they are, or from
    # low-res copies made at the PNGs' own size (PIL's resize to the same size returns them unchanged); the
    # comparison below is what holds either way
    assert len({p.val_image_size for p in recipe.schedule.phases}) == 1
    assert recipe.schedule.phases[0].val_image_size > recipe.data.cache.lowres_max_image_size or \
        lowres_short_side(recipe.data.cache, recipe.data.val_resize_ratio) == VAL_SIDE
    val_size = recipe.schedule.phases[-1].val_image_size
    data = DaliImageData(recipe.data, rank=0, world_size=1, seed=0)
    from_copies = val_size <= recipe.data.cache.lowres_max_image_size
    assert data.fetch_for("val", val_size) == ("lowres" if from_copies else "encoded")
    batches = list(data.val_loader(val_size, 5))
    dali, dali_labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    args = tta_baseline.parse_args(["--config", tta.BASELINE_CONFIG, f"--data-path={photos}", "--workers=0",
                                    *baseline_knobs])
    assert bool(recipe.train.eval_flip) == args.model_ema == (knobs == "on")  # the knobs did apply
    _, val_loader, classes = tta_baseline.load_data(args, rank=0, world=1)
    base, base_labels = torch.cat([b[0] for b in val_loader]), torch.cat([b[1] for b in val_loader])
    assert classes == 4 and dali.shape == base.shape == (12, 3, val_size, val_size)
    assert torch.equal(dali_labels, base_labels)
    assert (dali - base).abs().max() < 1e-5  # float rounding of the normalization only


# ---------------------------------------------------------------- the baseline script

def _baseline_runs(rank: int, world: int, runs: list[list[str]]) -> None:
    for argv in runs:
        tta_baseline.main(argv)


@pytest.fixture(scope="module")
def baseline_runs(tmp_path_factory: pytest.TempPathFactory, photos: Path) -> dict[str, Path]:
    """The baseline on 2 gloo ranks with the frozen config at 16 px: one that meets an easy target twice in a row
    and stops, one that misses 100% (evaluating the EMA of its weights)."""
    root = tmp_path_factory.mktemp("tta_baseline")
    common = ["--config", tta.BASELINE_CONFIG, f"--data-path={photos}", "--workers=0", "--batch-size=2",
              "--train-crop-size=16", "--val-resize-size=18", "--val-crop-size=16", "--norm-weight-decay=0",
              "--label-smoothing=0.1"]
    stopped = [*common, f"--output-dir={root / 'stopped'}", "--epochs=4", "--target-top1=1e-9",
               "--target-consecutive=2"]
    missed = [*common, f"--output-dir={root / 'missed'}", "--epochs=2", "--target-top1=1.0", "--model-ema",
              "--model-ema-steps=1"]
    (root / "group").mkdir()
    run_ranks(_baseline_runs, 2, root / "group", [stopped, missed], timeout=600.0)
    return {"stopped": root / "stopped", "missed": root / "missed"}


@pytest.mark.e2e
def test_baseline_stops_at_the_second_evaluation_at_the_target(baseline_runs):
    records = [json.loads(line) for line in (baseline_runs["stopped"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]  # --epochs 4, stopped after two evaluations at the target
    summary = json.loads((baseline_runs["stopped"] / "summary.json").read_text())
    assert summary["epochs_run"] == 2 and summary["world_size"] == 2 and summary["target_consecutive"] == 2
    assert summary["time_to_target_s"] == records[1]["time/elapsed_s"] > records[0]["time/elapsed_s"]
    assert records[0]["eval/images"] == 12  # each validation image once across the 2 ranks
    args = json.loads((baseline_runs["stopped"] / "args.json").read_text())
    frozen = yaml.safe_load((ROOT / tta.BASELINE_CONFIG).read_text())  # lr and layout from the file, the rest from argv
    assert args["lr"] == str(frozen["lr"]) and args["channels_last"] == str(frozen["channels-last"])
    assert args["norm_weight_decay"] == "0.0" and args["epochs"] == "4"


@pytest.mark.e2e
def test_bench_reads_baseline_run_folders(baseline_runs):
    got = read_run("baseline", 0, baseline_runs["stopped"], 5.0, 1.0, 1.0)
    assert got.epochs_to(1e-9, 2) == 2 and len(got.top1) == 2
    missed = read_run("baseline", 1, baseline_runs["missed"], 5.0, 1.0, 1.0)
    assert len(missed.top1) == 2 and missed.time_to(1.0, 2) is None


def test_the_baselines_ema_is_the_references_average():
    """--model-ema: decay 1 - (1 - d) x world x batch x steps / epochs (the reference's adjustment), the first
    update copying the weights, BatchNorm's statistics averaged too."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    args = tta_baseline.parse_args(["--model-ema", "--model-ema-decay=0.999", "--model-ema-steps=2", "--epochs=8",
                                    "--batch-size=4"])
    ema = tta_baseline.build_ema(model, args, world=2)
    decay = 1 - (1 - 0.999) * 2 * 4 * 2 / 8
    first = [p.detach().clone() for p in model.parameters()]
    ema.update_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.fill_(2.0)
    ema.update_parameters(model)
    for got, w0, w1 in zip(ema.module.parameters(), first, model.parameters()):
        assert torch.allclose(got, decay * w0 + (1 - decay) * w1)
    assert torch.allclose(ema.module[1].running_mean, torch.tensor([(1 - decay) * 2.0]))  # use_buffers: averaged
    with pytest.raises(SystemExit):
        tta_baseline.parse_args(["--model-ema-decay=1.0"])


@pytest.mark.parametrize("warming_up", [False, True])
def test_the_baselines_ema_updates_every_n_steps_and_copies_the_weights_during_warm_up(warming_up):
    """The reference's cadence (`i % model_ema_steps == 0`: steps 0 and 2 of 3) and, during the lr warm-up, its
    reset after each update: the average is then the weights of the last updating step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    args = tta_baseline.parse_args(["--model-ema", "--model-ema-decay=0.9", "--model-ema-steps=2", "--epochs=1",
                                    "--batch-size=1"])
    ema = tta_baseline.build_ema(model, args, world=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = [(torch.randn(2, 4), torch.tensor([0, 2])) for _ in range(3)]
    tta_baseline.train_one_epoch(model, torch.nn.CrossEntropyLoss(), opt, loader, torch.contiguous_format, ema,
                                 args.model_ema_steps, warming_up)
    assert int(ema.n_averaged) == (0 if warming_up else 2)
    same = all(torch.equal(a, b) for a, b in zip(ema.module.parameters(), model.parameters()))
    assert same == warming_up  # the last step (index 2) updated it: a copy when warming up, an average if not


def _evaluated(rank: int, world: int, argv: list[str]) -> tuple[list[bool], bool]:
    """The baseline in a rank of its own: for each evaluation whether it scored the moving average, and whether
    the last evaluation's weights differ from the trained model's."""
    from torch.optim.swa_utils import AveragedModel

    seen: list[tuple[bool, list[torch.Tensor]]] = []
    trained: list[torch.nn.Module] = []
    evaluate, build_ema = tta_baseline.evaluate, tta_baseline.build_ema

    def spy(model, loader, memory_format):
        seen.append((isinstance(model, AveragedModel), [p.detach().clone() for p in model.parameters()]))
        return evaluate(model, loader, memory_format)

    tta_baseline.evaluate = spy
    tta_baseline.build_ema = lambda model, *a: trained.append(model) or build_ema(model, *a)
    tta_baseline.main(argv)
    weights = [p.detach() for p in trained[0].parameters()]
    return [is_average for is_average, _ in seen], any(not torch.equal(a, b) for a, b in zip(seen[-1][1], weights))


@pytest.mark.dist
@pytest.mark.parametrize("model_ema", [False, True])
def test_the_baseline_evaluates_the_average_with_model_ema(photos, tmp_path, model_ema):
    """With --model-ema every evaluation scores the moving average, never the trained weights; without it, the
    trained weights."""
    argv = ["--config", tta.BASELINE_CONFIG, f"--data-path={photos}", "--workers=0", "--batch-size=2",
            "--train-crop-size=16", "--val-resize-size=18", "--val-crop-size=16", "--epochs=2",
            f"--output-dir={tmp_path / 'run'}", "--model-ema-steps=1", "--model-ema-decay=0.9",
            "--model-ema" if model_ema else "--no-model-ema"]
    (tmp_path / "group").mkdir()
    [(averages, differs)] = run_ranks(_evaluated, 1, tmp_path / "group", argv, timeout=300.0)
    assert averages == [model_ema, model_ema]  # one evaluation per epoch
    assert differs == model_ema  # the last evaluation scored the average (it lags the trained weights) or them


def test_norm_weight_decay_splits_batchnorm_parameters():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2))
    args = tta_baseline.parse_args(["--norm-weight-decay=0", "--wd=0.01"])
    rest, norm = tta_baseline.param_groups(model, args)
    assert norm["weight_decay"] == 0.0 and rest["weight_decay"] == 0.01
    assert {id(p) for p in norm["params"]} == {id(model[1].weight), id(model[1].bias)} and len(rest["params"]) == 4
    assert len(tta_baseline.param_groups(model, tta_baseline.parse_args([]))) == 1


def test_baseline_config_file(tmp_path, capsys):
    args = tta_baseline.parse_args(["--config", tta.BASELINE_CONFIG, "--lr=0.3"])
    assert args.lr == 0.3 and args.data_path == Path("datasets/tta_photos") and args.batch_size == 32
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 0.1\nwarmup: 2\n")
    with pytest.raises(SystemExit):
        tta_baseline.parse_args(["--config", str(bad)])
    assert "unknown option(s) warmup" in capsys.readouterr().err
    # base: the other file's options first, this file's over them, the command line over both
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text("base: ../parent.yaml\nlr: 0.2\n")
    (tmp_path / "parent.yaml").write_text("lr: 0.1\nepochs: 3\nbase: grand.yaml\n")
    (tmp_path / "grand.yaml").write_text("epochs: 5\nbatch-size: 7\n")
    args = tta_baseline.parse_args(["--config", str(tmp_path / "sub" / "child.yaml"), "--batch-size=9"])
    assert (args.lr, args.epochs, args.batch_size) == (0.2, 3, 9)
    (tmp_path / "grand.yaml").write_text("base: sub/child.yaml\n")
    with pytest.raises(SystemExit):
        tta_baseline.parse_args(["--config", str(tmp_path / "sub" / "child.yaml")])
    assert "base files form a cycle" in capsys.readouterr().err


# ---------------------------------------------------------------- the plot (trainer/tta_plot.py) on real run folders

def test_first_reach():
    assert first_reach([1.0, 2.0, 3.0], [0.5, 0.98, 0.99], 0.98) == 2.0
    assert first_reach([1.0, 2.0], [0.5, 0.9], 0.98) is None
    assert first_reach([1.0], [0.5], None) is None


def history(run_dir: Path) -> tuple[list[float], list[float]]:
    """(elapsed seconds, top-1) of the run's evaluated epochs, as its summary.json records them."""
    records = json.loads((run_dir / "summary.json").read_text())["history"]
    return [h["time/elapsed_s"] for h in records], [h["eval/top1"] for h in records]


@pytest.mark.e2e
def test_plot_draws_recorded_runs_of_both_sides(baseline_runs, tmp_path, monkeypatch):
    """What the figure holds, read back from its axes against the runs' summary.json: each run's curve (seconds,
    top-1 in %) in its colour and with its legend label, a star at its first evaluation at the target, and the
    target line. The target is the stopped run's lowest top-1: that run is at it from its first evaluation on
    (two evaluations: the star must mark the first), exactly at it in one of them."""
    figures = []
    monkeypatch.setattr(tta_plot.plt, "close", figures.append)  # plot() closes its figure: keep it to read back
    runs = {"baseline": baseline_runs["stopped"], "baseline, missed": baseline_runs["missed"]}
    curves = {label: history(run) for label, run in runs.items()}
    target = min(curves["baseline"][1])
    assert 0 < target and len(curves["baseline"][0]) == 2  # it stopped at its second evaluation at >= 1e-9
    assert max(max(seconds) for seconds, _ in curves.values()) < 300  # seconds on the x axis
    plot(list(runs.values()), tmp_path / "tta.png", target=target, labels=list(runs), colors=["tab:blue"] * 2)
    monkeypatch.undo()
    (fig,) = figures
    tta_plot.plt.close(fig)  # its artists stay readable
    assert (tmp_path / "tta.png").is_file()
    (ax,) = fig.axes
    assert ax.get_xlabel() == "wall-clock time (s)" and ax.get_ylabel() == "validation top1 accuracy (%)"
    lines = {line.get_label(): line for line in ax.get_lines()}
    stars = [(float(line.get_xdata()[0]), float(line.get_ydata()[0])) for line in ax.get_lines()
             if line.get_marker() == "*"]
    reached, legend = 0, []
    for label, (seconds, top1) in curves.items():
        reach = next(((s, a) for s, a in zip(seconds, top1) if a >= target), None)
        legend.append(label + (f" (target at {reach[0]:.3g} s)" if reach else " (target not reached)"))
        assert legend[-1] in lines, (legend[-1], list(lines))
        curve = lines[legend[-1]]
        assert list(curve.get_xdata()) == seconds
        assert list(curve.get_ydata()) == pytest.approx([100 * a for a in top1])
        assert matplotlib.colors.same_color(curve.get_color(), "tab:blue")
        if reach:
            reached += 1
            assert (reach[0], pytest.approx(100 * reach[1])) in stars, (label, stars)
    assert reached >= 1 and len(stars) == reached
    legend.append(f"target {100 * target:g}%")
    assert list(lines[legend[-1]].get_ydata()) == pytest.approx([100 * target] * 2)
    assert [text.get_text() for text in ax.get_legend().get_texts()] == legend


@pytest.mark.e2e
def test_plotted_points_are_the_runs_evaluations(baseline_runs):
    """Each curve is its run's evaluated epochs, as the run's summary.json records them (both sides)."""
    for side in ("stopped", "missed"):
        assert len(history(baseline_runs[side])[0]) >= 1
        assert read_curve(baseline_runs[side], "top1") == history(baseline_runs[side]), side


@pytest.mark.e2e
def test_plot_cli_on_run_folders(baseline_runs, tmp_path):
    """The command line draws what plot() draws with the same runs, labels, metric and target, pixel for pixel
    (the drawing itself is checked above); labels other than the folder names, so that dropped ones show."""
    out = tmp_path / "cli.png"
    done = subprocess.run([sys.executable, "scripts/plot_tta.py", str(baseline_runs["stopped"]),
                           str(baseline_runs["missed"]), "--labels", "run A", "run B", "--metric", "top5",
                           "--target", "0.5", "--colors", "tab:green", "tab:red", "--out", str(out)],
                          cwd=ROOT, check=True, capture_output=True, text=True)
    assert done.stdout.strip() == str(out)
    same = plot([baseline_runs["stopped"], baseline_runs["missed"]], tmp_path / "api.png", metric="top5",
                target=0.5, labels=["run A", "run B"], colors=["tab:green", "tab:red"])
    other = plot([baseline_runs["stopped"], baseline_runs["missed"]], tmp_path / "other.png", metric="top5",
                 target=0.5, labels=["run A", "run C"], colors=["tab:green", "tab:red"])
    drawn, expected = matplotlib.image.imread(out), matplotlib.image.imread(same)
    assert drawn.shape == expected.shape and np.array_equal(drawn, expected)
    assert not np.array_equal(expected, matplotlib.image.imread(other))  # one legend word shows in the pixels


@pytest.mark.e2e
def test_plot_needs_one_label_and_colour_per_run(baseline_runs, tmp_path):
    with pytest.raises(ValueError, match=r"--labels: 1 given for 2 run\(s\)"):
        plot([baseline_runs["stopped"], baseline_runs["missed"]], tmp_path / "x.png", labels=["only one"])
    with pytest.raises(ValueError, match=r"--colors: 3 given for 2 run\(s\)"):
        plot([baseline_runs["stopped"], baseline_runs["missed"]], tmp_path / "x.png",
             colors=["red", "red", "blue"])


# ---------------------------------------------------------------- running a side

FAKE_TRAINER = """
import json, subprocess, sys, time
from pathlib import Path
# A worker in a session of its own, as torchrun starts them: ending the run must end it too.
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
(Path(sys.argv[1]) / "worker.pid").write_text(str(worker.pid))
log = open(Path(sys.argv[1]) / "metrics.jsonl", "a", buffering=1)
for epoch, top1 in enumerate([0.5, 0.95, 0.8, 0.95, 0.96] + [0.97] * 10000):
    log.write(json.dumps({"kind": "epoch", "epoch": epoch, "eval/top1": top1, "time/elapsed_s": epoch + 1.0}) + "\\n")
    time.sleep(0.2)
"""


@pytest.mark.e2e
def test_launch_runs_to_the_end_and_an_interrupted_one_leaves_nothing_running(tmp_path):
    finished = tmp_path / "finished"
    script = FAKE_TRAINER.replace("[0.97] * 10000", "[0.97] * 2").replace("time.sleep(600)", "time.sleep(0)")
    run_logged([sys.executable, "-c", script, str(finished)], finished)
    got = read_run("recipe", 0, finished, 1.0, 1.0, 1.0)
    assert len(got.top1) == 7 and got.time_to(0.9, 2) == 5.0 and got.time_to(0.965, 2) == 7.0  # to the end
    run_dir = tmp_path / "run"
    with pytest.raises(subprocess.TimeoutExpired):  # would write records for ~30 min
        run_logged([sys.executable, "-c", FAKE_TRAINER, str(run_dir)], run_dir, timeout_s=3.0)
    worker = int((run_dir / "worker.pid").read_text())
    for _ in range(100):  # SIGKILLed; gone once its parent (now init) has reaped it
        if not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"worker {worker} of the ended run is still running")


@pytest.mark.e2e
def test_a_failed_launch_shows_the_command_status_and_log_tail(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('rank 0: out of memory'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3; last lines of .*train.log:\nrank 0: out of mem"):
        run_logged(cmd, tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no evaluated epoch; the recipe run failed"):
        read_run("recipe", 0, tmp_path / "run", 1.0, 1.0, 1.0)


def test_tuning_history_is_data(tmp_path):
    path = tmp_path / "tuning.json"
    tta.append_tuning([run("baseline", 0, 50.0)], "baseline", ["lr=0.1"], [0.6, 0.9], 2, "fp32", path)
    measuring = run("recipe", 1, None)
    measuring.choices_s = 9.64  # its choices measured first, inside its time
    tta.append_tuning([measuring], "recipe", ["optim.lr=0.1"], [0.6, 0.9], 2, "bf16", path)
    tta.append_tuning([run("recipe", 2, 40.0)], "recipe", ["comm.kind=dense"], [0.9], 2, "bf16", path,
                      purpose="ablation")
    history = json.loads(path.read_text())
    assert [h["purpose"] for h in history] == ["tuning", "tuning", "ablation"]
    history = history[:2]
    assert [(h["seed"], h["time_to_s"], h["overrides"]) for h in history] == [
        (0, {"0.6": 50.0, "0.9": 50.0}, ["lr=0.1"]), (1, {"0.6": 100.0, "0.9": None}, ["optim.lr=0.1"])]
    # the config file the overrides applied to, as it was, and the precision each side trained in
    assert history[0]["config"]["file"] == tta.config_for("baseline", tta.HEADLINE[0])
    assert history[0]["precision"] == "fp32"
    assert history[1]["config"] == tta.config_record(tta.config_for("recipe", tta.HEADLINE[0]))
    assert history[1]["precision"] == "bf16"
    # the machine: its model name and widest vector extension (one model name covers machines that differ in it)
    assert {h["cpu_widest"] for h in history} == {widest_flag(machine()["cpu_flags"])}
    assert [h["choices_s"] for h in history] == [0.0, 9.6]


def test_widest_flag_names_the_widest_vector_extension():
    assert widest_flag(["avx2", "avx512f", "avx512_bf16"]) == "avx512_bf16" and widest_flag(["sse2"]) == ""
    assert widest_flag(["avx2", "avx512f", "avx512_bf16", "amx_bf16"]) == "amx_bf16"
    assert widest_flag(["avx512f", "avx2"]) == "avx512f" and widest_flag(["avx2"]) == "avx2"


# ---------------------------------------------------------------- the frozen configs

def test_frozen_configs_compare_like_with_like():
    from recipes.resnet50 import Config
    from trainer.config import load_config

    pairs = [(load_config(Config, str(ROOT / r)), tta_baseline.parse_args(["--config", str(ROOT / b)]))
             for r in tta.side_configs("recipe") for b in tta.side_configs("baseline")]
    assert len(pairs) == len(tta.side_configs("recipe")) * len(tta.side_configs("baseline")) >= 1
    for cfg, base in pairs:
        assert cfg.data.root == str(base.data_path) == str(tta.DATA) and cfg.model.arch == base.model
        assert {p.batch_size for p in cfg.schedule.phases} == {2 * base.batch_size}  # 2 ranks
        assert cfg.data.min_scale == base.min_scale and cfg.data.hflip == (base.hflip_prob == 0.5)
        assert cfg.data.workers == base.workers
        # Validation: the same size at every phase, the same resize, the PNGs' own pixels.
        assert {p.val_image_size for p in cfg.schedule.phases} == {base.val_crop_size}
        assert round(base.val_crop_size * cfg.data.val_resize_ratio) == base.val_resize_size == VAL_SIDE
        assert cfg.data.cache.lowres_max_image_size < base.val_crop_size or \
            lowres_short_side(cfg.data.cache, cfg.data.val_resize_ratio) == VAL_SIDE  # the PNGs' own size
        assert not 0 < cfg.data.rect_val_from_size <= base.val_crop_size  # square crops, as the baseline's
        assert cfg.schedule.phases[-1].end_epoch == cfg.train.epochs


def assert_loaded_as(raw: dict, loaded: object, where: str) -> None:
    """Every value of a recipe YAML mapping equals the loaded config's (sections and phase tables recursively)."""
    for key, value in raw.items():
        got = getattr(loaded, key)
        if isinstance(value, dict):
            assert_loaded_as(value, got, f"{where}{key}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            assert len(got) == len(value), f"{where}{key}"
            for i, (item, loaded_item) in enumerate(zip(value, got)):
                assert_loaded_as(item, loaded_item, f"{where}{key}[{i}].")
        else:
            assert got == value, f"{where}{key}: {got!r} != {value!r}"


def test_result_line_carries_both_configs(tmp_path, monkeypatch, capsys):
    """The bench's result line records each frozen config file as it stands, and what it records is what that
    side runs with: every baseline option as scripts/tta_baseline.py parses the file, every recipe key as the
    recipe's config loader resolves it."""
    from recipes.resnet50 import Config
    from scripts.bench import common
    from trainer.config import load_config

    monkeypatch.setitem(common._run, "results_dir", "")  # no result file
    runs = []
    for side, seconds, config in [("baseline", 50.0, c) for c in tta.side_configs("baseline")] + [
            ("recipe", 20.0, c) for c in tta.side_configs("recipe")]:
        r = run(side, 100, seconds)
        r.config, r.run_dir = config, str(tmp_path / tta.run_folder(side, config, 100))
        Path(r.run_dir).mkdir()
        (Path(r.run_dir) / "metrics.jsonl").write_text(json.dumps(
            {"kind": "epoch", "epoch": 0, "eval/top1": 0.95, "time/elapsed_s": seconds}) + "\n")
        runs.append(r)
    line = tta.finish(runs, tmp_path, [0.9], 2, "fp32", 1)
    capsys.readouterr()
    assert json.loads(json.dumps(line, allow_nan=False)) == line  # as printed and written: plain JSON
    # the asked target and the headline ones, read from the same runs; the verdict is the first headline's
    assert set(line["targets"]) == {"0.9", *(f"{t:g}" for t in tta.HEADLINE)}
    assert line["targets"]["0.9"]["ratio"] == 0.4 and line["ratio"] == line["targets"][f"{tta.HEADLINE[0]:g}"]["ratio"]
    assert line["accuracy"][f"{tta.HEADLINE[0]:g}"]["recipe"]["final_top1"] == [0.95]
    assert line["bench"].startswith("tta-")
    assert line["frozen"] == {side: {f"{t:g}": tta.config_for(side, t) for t in tta.HEADLINE} for side in tta.SIDES}
    files = {c["file"]: dict(c) for c in line["config_files"]}
    assert sorted(files) == sorted({*tta.side_configs("baseline"), *tta.side_configs("recipe")})
    baseline = files[tta.BASELINE_CONFIG]
    assert baseline.pop("file") == tta.BASELINE_CONFIG
    assert baseline.keys() == yaml.safe_load((ROOT / tta.BASELINE_CONFIG).read_text()).keys()
    args = tta_baseline.parse_args(["--config", str(ROOT / tta.BASELINE_CONFIG)])
    for key, value in baseline.items():
        parsed = getattr(args, key.replace("-", "_"))
        assert parsed == (Path(value) if isinstance(parsed, Path) else value), key
    for path in tta.side_configs("recipe"):
        recipe = files[path]
        assert recipe.pop("file") == path and recipe.keys() == yaml.safe_load((ROOT / path).read_text()).keys()
        assert_loaded_as({k: v for k, v in recipe.items() if k != "base"}, load_config(Config, str(ROOT / path)), "")


def test_each_target_reads_each_sides_config_for_it(tmp_path, monkeypatch):
    """A side with a config per headline target runs each on every seed; a target is read from the runs of the
    config frozen for the lowest headline target at or above it, and a seed is complete only with all of them."""
    from dataclasses import asdict

    monkeypatch.setitem(tta.FROZEN, "baseline", {0.7: "configs/b70.yaml", 0.75: "configs/b75.yaml"})
    monkeypatch.setitem(tta.FROZEN, "recipe", {t: tta.RECIPE_CONFIG for t in tta.HEADLINE})  # one for both
    assert tta.side_configs("baseline") == ["configs/b70.yaml", "configs/b75.yaml"]
    assert [tta.config_for("baseline", t) for t in (0.6, 0.7, 0.72, 0.75, 0.8)] == [
        "configs/b70.yaml", "configs/b70.yaml", "configs/b75.yaml", "configs/b75.yaml", "configs/b75.yaml"]
    assert tta.side_configs("recipe") == [tta.RECIPE_CONFIG]
    assert tta.run_folder("baseline", "configs/b75.yaml", 100) == "baseline-b75_seed100"
    assert tta.run_folder("recipe", tta.RECIPE_CONFIG, 100) == "recipe_seed100"
    # seed 100: the 70% config reaches 0.9 at 40 s, the 75% one at 80 s; seed 101 lacks the 75% config's run
    runs = []
    for side, seed, seconds, config in (("baseline", 100, 40.0, "configs/b70.yaml"),
                                        ("baseline", 100, 80.0, "configs/b75.yaml"),
                                        ("recipe", 100, 20.0, tta.RECIPE_CONFIG),
                                        ("baseline", 101, 40.0, "configs/b70.yaml"),
                                        ("recipe", 101, 20.0, tta.RECIPE_CONFIG)):
        r = run(side, seed, seconds)
        r.config, r.run_dir = config, str(tmp_path / tta.run_folder(side, config, seed))
        Path(r.run_dir).mkdir()
        (Path(r.run_dir) / "run.json").write_text(json.dumps({**asdict(r), "target_consecutive": 2}))
        runs.append(r)
    assert [compare(tta.runs_for(runs[:3], t), 0.9, 2)["ratios"] for t in (0.7, 0.75)] == [[0.5], [0.25]]
    loaded, _ = tta.load_runs(tmp_path)
    assert sorted((r.seed, r.config) for r in loaded) == sorted((100, r.config) for r in runs[:3])


def test_result_of_finished_runs_keeps_complete_seeds_only(tmp_path, monkeypatch):
    from dataclasses import asdict

    for side in tta.SIDES:  # one config per side
        monkeypatch.setitem(tta.FROZEN, side, {t: tta.config_for(side, tta.HEADLINE[0]) for t in tta.HEADLINE})

    # a complete fresh seed, an incomplete one, and a complete tuning seed (never part of a result)
    for r in (run("baseline", 100, 50.0), run("recipe", 100, 20.0), run("recipe", 101, 30.0),
              run("baseline", 0, 50.0), run("recipe", 0, 10.0)):
        (tmp_path / f"{r.side}_seed{r.seed}").mkdir()
        r.run_dir = str(tmp_path / f"{r.side}_seed{r.seed}")
        (Path(r.run_dir) / "run.json").write_text(json.dumps({**asdict(r), "target_consecutive": 2}))
    runs, consecutive = tta.load_runs(tmp_path)
    assert sorted((r.side, r.seed) for r in runs) == [("baseline", 100), ("recipe", 100)]
    assert consecutive == 2 and compare(runs, 0.9, consecutive)["ratios"] == [0.4]
    doc = json.loads((tmp_path / "recipe_seed101" / "run.json").read_text())
    (tmp_path / "recipe_seed101" / "run.json").write_text(json.dumps({**doc, "target_consecutive": 1}))
    with pytest.raises(ValueError, match="runs read with different rules"):
        tta.load_runs(tmp_path)


@pytest.mark.e2e
def test_the_documented_command_starts_from_the_repository_root():
    out = subprocess.run([sys.executable, "-m", "scripts.bench.tta", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--quick" in out.stdout, out.stderr
