"""The time-to-accuracy bench: the baseline script on real gloo ranks, run folders of both sides read alike, the
verdict (a ratio only when both sides reached the target), and the plot on recorded run folders."""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from PIL import Image

from recipes.resnet50 import main as train_recipe
from scripts import tta_baseline
from scripts.bench.tta import Run, compare, emit, launch, read_run, report
from scripts.plot_tta import first_reach, plot, read_curve
from tests.conftest import ROOT, run_ranks
from tests.test_trainer import TINY, phases


def _baseline_runs(rank: int, world: int, runs: list[list[str]]) -> None:
    for argv in runs:
        tta_baseline.main(argv)


def _recipe_rank(rank: int, world: int, argv: list[str]) -> None:
    train_recipe(argv)


@pytest.fixture(scope="module")
def tiny_digits(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> Path:
    """4 training and 2 validation images per class of the real 16 px digits (3 of class 0: an odd count), 2 steps an
    epoch at batch 16."""
    root = tmp_path_factory.mktemp("tiny_digits")
    for split, n in (("train", 4), ("val", 2)):
        for folder in sorted((digits_root / split).iterdir()):
            (root / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:n + (split == "val" and folder.name == "0")]:
                (root / split / folder.name / image.name).symlink_to(image)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_digits: Path) -> dict[str, Path]:
    """Real run folders: the baseline on 2 gloo ranks (one stopped at an easy target, one that misses 100%) and the
    recipe on 1 rank."""
    root = tmp_path_factory.mktemp("tta")
    common = [f"--data-path={tiny_digits}", "--model=resnet18", "--workers=0", "--batch-size=8", "--train-crop-size=16",
              "--val-resize-size=18", "--val-crop-size=16", "--no-channels-last", "--lr=0.05"]
    stopped = [*common, f"--output-dir={root / 'baseline'}", "--epochs=3", "--target-top1=1e-9"]  # met after epoch 1
    missed = [*common, f"--output-dir={root / 'missed'}", "--epochs=2", "--target-top1=1.0"]
    (root / "baseline_group").mkdir()
    run_ranks(_baseline_runs, 2, root / "baseline_group", [stopped, missed])
    recipe = ["--config", "configs/quickstart_cpu.yaml", f"data.root={tiny_digits}", f"log.dir={root / 'recipe'}",
              "train.epochs=2", phases(2), "train.target_top1=1e-9", "train.stop_at_target=false",
              "train.checkpoint_every_epochs=0", "data.cache.dir=", *[a for a in TINY if not a.startswith("log.tensor")],
              "log.tensorboard=false"]
    (root / "recipe_group").mkdir()
    run_ranks(_recipe_rank, 1, root / "recipe_group", recipe)
    return {"baseline": root / "baseline", "missed": root / "missed", "recipe": root / "recipe"}


def test_baseline_logs_every_epoch_and_stops_at_the_target(runs):
    records = [json.loads(line) for line in (runs["baseline"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0]  # --epochs 3, stopped after the first evaluation at the target
    summary = json.loads((runs["baseline"] / "summary.json").read_text())
    assert summary["epochs_run"] == 1 and summary["world_size"] == 2
    assert summary["time_to_target_s"] == records[0]["time/elapsed_s"] > 0
    assert records[0]["eval/images"] == 21  # each validation image once across the 2 ranks: no padding to 22


def test_baseline_that_misses_runs_its_schedule(runs):
    summary = json.loads((runs["missed"] / "summary.json").read_text())
    assert summary["time_to_target_s"] is None and summary["epochs_run"] == 2 and len(summary["history"]) == 2


def test_both_sides_run_folders_read_alike(runs):
    base = read_run("baseline", 0, runs["baseline"], process_s=5.0)
    assert base.reached and base.epochs_to_target == 1 and base.epochs_run == 1
    recipe = read_run("recipe", 0, runs["recipe"], process_s=6.0)
    assert recipe.reached and recipe.epochs_to_target == 1 and recipe.epochs_run == 2  # trained on past the target
    missed = read_run("baseline", 1, runs["missed"], process_s=5.0)
    assert not missed.reached and missed.time_to_target_s is None and missed.epochs_to_target is None


def test_missing_summary_names_the_run_and_its_log(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"summary.json: not found; the recipe run failed \(its log is "):
        read_run("recipe", 0, tmp_path, process_s=1.0)


def run(side: str, seed: int, tta: float | None, final: float = 0.985) -> Run:
    return Run(side=side, seed=seed, reached=tta is not None, time_to_target_s=tta,
               epochs_to_target=4 if tta is not None else None, final_top1=final, best_top1=final, epochs_run=6,
               process_s=(tta or 100.0) + 10, run_dir=f"/runs/{side}{seed}")


def test_ratio_is_the_median_recipe_time_over_the_median_baseline_time(capsys):
    runs = [run("baseline", 0, 100.0), run("recipe", 0, 40.0), run("baseline", 1, 120.0), run("recipe", 1, 50.0),
            run("baseline", 2, 300.0), run("recipe", 2, 45.0)]
    result = compare(runs)
    assert result["baseline_s"] == 120.0 and result["recipe_s"] == 45.0 and result["ratio"] == 0.375
    assert result["baseline_reached"] == result["recipe_reached"] == "3/3"
    report(runs, 0.98)
    emit(result, target_top1=0.98)
    out = capsys.readouterr().out.splitlines()
    assert "45.0 s / 120.0 s = 0.375" in "\n".join(out)
    last = json.loads(out[-1])  # the very last line is the JSON object, ratio last
    assert last["bench"] == "tta" and list(last)[-1] == "ratio" and last["ratio"] == 0.375


def test_a_side_that_missed_the_target_gets_no_ratio(capsys):
    runs = [run("baseline", 0, None, final=0.975), run("recipe", 0, 40.0)]
    result = compare(runs)
    assert result["ratio"] is None and result["baseline_s"] is None and result["baseline_reached"] == "0/1"
    assert result["recipe_s"] == 40.0 and result["baseline_final_top1"] == 0.975
    report(runs, 0.98)
    emit(result)
    out = capsys.readouterr().out
    assert "not reached" in out and "no ratio: baseline did not reach 98% top-1 in every run" in out
    assert json.loads(out.splitlines()[-1])["ratio"] is None


def test_compare_needs_both_sides():
    with pytest.raises(ValueError, match="no recipe runs to compare"):
        compare([run("baseline", 0, 10.0)])


def test_a_failed_launch_shows_the_command_status_and_log_tail(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('rank 0: out of memory'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3; last lines of .*train.log:\nrank 0: out of mem"):
        launch(cmd, tmp_path / "run")


def test_first_reach():
    assert first_reach([1.0, 2.0, 3.0], [0.5, 0.98, 0.99], 0.98) == 2.0
    assert first_reach([1.0, 2.0], [0.5, 0.9], 0.98) is None
    assert first_reach([1.0], [0.5], None) is None


def test_plot_draws_recorded_runs_of_both_sides(runs, tmp_path):
    png = plot([runs["baseline"], runs["recipe"], runs["missed"]], tmp_path / "tta.png", target=0.98,
               labels=["baseline", "recipe", "baseline, missed"], colors=["tab:blue", "tab:orange", "tab:blue"])
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (840, 540)  # 7 x 4.5 inches at 120 dpi


def test_plotted_points_are_the_runs_evaluations(runs):
    """Each curve is its run's evaluated epochs, as the run's summary.json records them (both sides)."""
    for side in ("baseline", "recipe", "missed"):
        history = json.loads((runs[side] / "summary.json").read_text())["history"]
        assert len(history) >= 1
        assert read_curve(runs[side], "top1") == ([h["time/elapsed_s"] for h in history],
                                                  [h["eval/top1"] for h in history]), side


def test_plot_cli_on_run_folders(runs, tmp_path):
    out = tmp_path / "cli.png"
    done = subprocess.run([sys.executable, "scripts/plot_tta.py", str(runs["baseline"]), str(runs["recipe"]),
                           "--labels", "baseline", "recipe", "--out", str(out)], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == str(out)
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size == (840, 540)  # 7 x 4.5 inches at 120 dpi
        png.load()  # the whole image decodes


def test_plot_needs_one_label_and_colour_per_run(runs, tmp_path):
    with pytest.raises(ValueError, match=r"--labels: 1 given for 2 run\(s\)"):
        plot([runs["baseline"], runs["recipe"]], tmp_path / "x.png", labels=["only one"])
    with pytest.raises(ValueError, match=r"--colors: 3 given for 2 run\(s\)"):
        plot([runs["baseline"], runs["recipe"]], tmp_path / "x.png", colors=["red", "red", "blue"])


def test_recipe_config_matches_the_bench():
    from recipes.resnet50 import Config
    from scripts.bench.tta import BASELINE_ARGS, DATA, RECIPE_CONFIG, TARGET_TOP1
    from trainer.config import load_config

    cfg = load_config(Config, RECIPE_CONFIG)
    assert cfg.schedule.phases[-1].end_epoch == cfg.train.epochs and cfg.train.target_top1 == TARGET_TOP1
    baseline = dict(zip(BASELINE_ARGS[::2], BASELINE_ARGS[1::2]))
    # Same data, model, global batch (2 ranks) and augmentation; the baseline's fixed size is the recipe's last.
    assert cfg.data.root == baseline["--data-path"] == str(DATA) and cfg.model.arch == baseline["--model"]
    assert {p.batch_size for p in cfg.schedule.phases} == {2 * int(baseline["--batch-size"])}
    assert cfg.data.min_scale == float(baseline["--min-scale"]) and cfg.data.hflip == (baseline["--hflip-prob"] == "0.5")
    assert cfg.schedule.phases[-1].image_size == int(baseline["--train-crop-size"])
    assert int(baseline["--epochs"]) >= cfg.train.epochs and cfg.data.cache.lowres_max_image_size >= 64
