"""The DAWNBench report (trainer/dawnbench_report.py, its command line scripts/dawnbench_report.py) on real run
folders: the ResNet recipe trained for real on the digits, one process."""

import csv
import json
import re
import shutil
from datetime import date
from pathlib import Path

import pytest
import torch

from recipes.resnet50 import main as train
from scripts.dawnbench_report import main  # the command line, for its one-line errors
from trainer.dawnbench import PUBLISHED
from trainer.dawnbench_report import hms, report
from tests.conftest import run_ranks
from tests.test_trainer import TINY, phases

pytestmark = pytest.mark.e2e  # the module's runs: two real trainings on gloo ranks

README_FIELDS = {"version": str, "author": str, "authorEmail": str, "framework": str, "codeURL": str, "model": str,
                 "hardware": str, "costPerHour": float, "timestamp": str, "misc": dict}


def _train_runs(rank: int, world: int, runs: list[list[str]]) -> None:
    for argv in runs:
        train(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> dict[str, Path]:
    """Two real runs: one meets its (easy) top-5 target at epoch 1 and trains on; one never meets top-1 = 100%."""
    root = tmp_path_factory.mktemp("runs")
    common = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", "train.max_steps_per_epoch=3",
              "log.tensorboard=false", *[a for a in TINY if not a.startswith("log.tensorboard")]]
    reached = [*common, f"log.dir={root / 'reached'}", "train.epochs=2", phases(2), "train.target_top1=0.0",
               "train.target_top5=0.05", "train.stop_at_target=false"]  # top-5 of 10 classes is >= 5% at once
    missed = [*common, f"log.dir={root / 'missed'}", "train.epochs=1", phases(1), "train.target_top1=1.0"]
    run_ranks(_train_runs, 1, root, [reached, missed], timeout=600)  # two runs, on a shared, loaded box
    return {"reached": root / "reached", "missed": root / "missed"}


def outputs(out: Path) -> tuple[dict, list[dict[str, str]], str]:
    """The entry JSON and TSV parsed as plain JSON and tab-separated CSV, and report.md."""
    (json_path,), (tsv_path,) = list(out.glob("*.json")), list(out.glob("*.tsv"))
    assert json_path.stem == tsv_path.stem  # DAWNBench: [author]_[model]_[hardware tag]_[framework].{json,tsv}
    with tsv_path.open(newline="") as f:
        reader = csv.DictReader(f, delimiter="\t")
        assert reader.fieldnames == ["epoch", "hours", "top1Accuracy", "top5Accuracy"]
        rows = list(reader)
    return json.loads(json_path.read_text()), rows, (out / "report.md").read_text()


def test_entry_json_has_every_dawnbench_field(runs, tmp_path):
    report(runs["reached"], tmp_path, author="Test Author", cost_per_hour=3.06)
    entry, _, _ = outputs(tmp_path)
    assert list(entry) == list(README_FIELDS)
    for key, kind in README_FIELDS.items():
        assert type(entry[key]) is kind, key
    assert entry["version"] == "v1.0" and entry["costPerHour"] == 3.06 and entry["model"] == "resnet18"
    assert date.fromisoformat(entry["timestamp"]) == date.today()
    assert list(tmp_path.glob("test-author_resnet18_1cpu_pytorch.json"))
    summary = json.loads((runs["reached"] / "summary.json").read_text())
    misc = entry["misc"]
    assert misc["targetReached"] and misc["timeToTargetSeconds"] == summary["time_to_target_s"]
    assert misc["epochsToTarget"] == 1 and misc["epochsRun"] == 2 and misc["worldSize"] == 1
    assert misc["finalTop5Accuracy"] == pytest.approx(100 * summary["final_top5"], abs=1e-4)
    assert "costNote" not in misc


def test_tsv_round_trips_to_the_run_history(runs, tmp_path):
    report(runs["reached"], tmp_path)
    _, rows, _ = outputs(tmp_path)
    history = json.loads((runs["reached"] / "summary.json").read_text())["history"]
    assert [int(r["epoch"]) for r in rows] == [h["epoch"] + 1 for h in history] == [1, 2]
    for r, h in zip(rows, history):  # TSV precision: hours 6 decimals, accuracies 4, in percent
        assert float(r["hours"]) == pytest.approx(h["time/elapsed_s"] / 3600, abs=1e-6)
        assert float(r["top1Accuracy"]) == pytest.approx(100 * h["eval/top1"], abs=1e-4)
        assert float(r["top5Accuracy"]) == pytest.approx(100 * h["eval/top5"], abs=1e-4)
    assert (runs["reached"] / "dawnbench.tsv").read_text() == next(tmp_path.glob("*.tsv")).read_text()


@pytest.mark.unit
def test_hms_is_dawnbench_time_rounded_to_the_second():
    assert hms(0) == "0:00:00" and hms(151) == "0:02:31" and hms(1086) == "0:18:06"
    assert hms(59.4) == "0:00:59" and hms(59.6) == "0:01:00"  # rounded, not cut: 59.6 s is a minute
    assert hms(3599.7) == "1:00:00" and hms(25 * 3600 + 61) == "25:01:01"  # carries; hours do not wrap at a day


def test_report_places_the_run_beside_published_entries(runs, tmp_path):
    report(runs["reached"], tmp_path, cost_per_hour=3.06)
    entry, _, md = outputs(tmp_path)
    for p in PUBLISHED:  # each row carries its own entry's figures: the time read back is the published one
        row = next(line for line in md.splitlines() if line.startswith(f"| {p.name} |"))
        _, time_cell, _, hardware, cost, links = (cell.strip() for cell in row.strip("|").split(" | "))
        h, m, sec = (int(x) for x in re.fullmatch(r"(\d+):(\d\d):(\d\d)", time_cell).groups())
        assert m < 60 and sec < 60 and 3600 * h + 60 * m + sec == p.time_s, (p.name, time_cell)
        assert hardware == p.hardware and cost == ("—" if p.cost_usd is None else f"${p.cost_usd:.2f}")
        assert links == ", ".join(f"[{i + 1}]({url})" for i, url in enumerate(p.sources))
    assert "(https://arxiv.org/abs/2010.10458)" in md  # the paper's own result stands among them
    tta = entry["misc"]["timeToTargetSeconds"]
    mine = next(line for line in md.splitlines() if line.startswith("| **This run (reached)** |"))
    assert f"{hms(tta)} ({tta:.1f} s, epoch 1)" in mine and f"${tta / 3600 * 3.06:.2f}" in mine
    assert "5% top-5" in mine and "1 CPU process on " in mine and "(gloo, torch" in mine  # as env.json says


def test_a_run_that_never_reached_its_target_is_labelled_so(runs, tmp_path):
    report(runs["missed"], tmp_path)
    entry, rows, md = outputs(tmp_path)
    assert len(rows) == 1
    misc = entry["misc"]
    assert not misc["targetReached"] and misc["timeToTargetSeconds"] is None and misc["epochsToTarget"] is None
    assert entry["costPerHour"] == 0.0 and "placeholder" in misc["costNote"]
    mine = next(line for line in md.splitlines() if line.startswith("| **This run (missed)** |"))
    assert "target not reached (best top-1" in mine and "— (target not reached)" in mine
    assert "100% top-1" in mine and "s, epoch" not in mine


def test_rows_of_an_earlier_attempt_in_the_same_folder_are_left_out(runs, tmp_path):
    """dawnbench.tsv is appended to: a rerun into the same log.dir leaves the earlier attempt's rows on top."""
    run = shutil.copytree(runs["reached"], tmp_path / "run")
    earlier = (runs["missed"] / "dawnbench.tsv").read_text().splitlines(keepends=True)[1:]
    logged = (run / "dawnbench.tsv").read_text().splitlines(keepends=True)
    (run / "dawnbench.tsv").write_text(logged[0] + "".join(earlier) + "".join(logged[1:]))
    report(run, tmp_path / "out")
    _, rows, _ = outputs(tmp_path / "out")
    assert len(rows) == 2 and next((tmp_path / "out").glob("*.tsv")).read_text() == "".join(logged)


def test_hardware_auto_describes_this_machine(runs, tmp_path):
    report(runs["reached"], tmp_path, hardware="auto")
    entry, _, _ = outputs(tmp_path)
    kind = "GPU" if torch.cuda.is_available() else "CPU process on"
    assert entry["hardware"].startswith("1 ") and kind in entry["hardware"]


def test_hardware_and_environment_from_the_run_record(runs, tmp_path):
    """env.json, written by the run itself, names the device, versions and hosts; report.md shows them."""
    record = json.loads((runs["reached"] / "env.json").read_text())
    report(runs["reached"], tmp_path)
    entry, _, md = outputs(tmp_path)
    cpu = record["cpu"]["model"]
    assert entry["hardware"] == f"1 CPU process on {cpu} on 1 host (gloo, torch {torch.__version__})"
    env = entry["misc"]["environment"]
    assert env["hosts"] == record["hosts"]["names"] and env["versions"]["torch"] == torch.__version__
    assert env["driver"] is None and env["cpu"] == cpu and env["worldSize"] == 1
    assert "## Environment (`env.json`)" in md and f"- devices: 1 CPU process on {cpu}" in md
    assert "device not recorded" not in entry["hardware"]


def test_hardware_from_the_run_config_and_from_the_command_line(runs, tmp_path):
    run = shutil.copytree(runs["reached"], tmp_path / "run")
    (run / "env.json").unlink()  # a run folder from before the run record: the config's backend says what it can
    report(run, tmp_path / "gloo")
    assert "Not recorded: the run folder has no env.json" in outputs(tmp_path / "gloo")[2]
    assert outputs(tmp_path / "gloo")[0]["hardware"] == "1 CPU process (gloo)"
    report(run, tmp_path / "given", hardware="16 p3.16xlarge (AWS)")
    assert list((tmp_path / "given").glob("unknown_resnet18_16-p3.16xlarge-aws_pytorch.json"))
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("backend: gloo", "backend: auto"))
    report(run, tmp_path / "auto")
    assert "device not recorded in the run folder (no env.json" in outputs(tmp_path / "auto")[0]["hardware"]
    if not torch.cuda.is_available():
        (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("backend: auto", "backend: nccl"))
        with pytest.raises(ValueError, match="--hardware auto: dist.backend: nccl needs CUDA"):
            report(run, tmp_path / "nccl", hardware="auto")


def _break(run: Path, name: str, text: str | None) -> None:
    if text is None:
        (run / name).unlink()
    else:
        (run / name).write_text(text)


@pytest.mark.parametrize("name, text, message", [
    ("summary.json", None, r"summary.json: not found \(the run did not finish"),
    ("summary.json", "{not json", r"summary.json: not valid JSON"),
    ("summary.json", '{"steps": 3}', r"summary.json: missing epochs_run, elapsed_s, .*history"),
    ("config.yaml", "a: [", r"config.yaml: not valid YAML"),
    ("dawnbench.tsv", "epoch hours top1 top5\n", r"dawnbench.tsv: header must be 'epoch\\thours"),
    ("dawnbench.tsv", "epoch\thours\ttop1Accuracy\ttop5Accuracy\n1\t0.1\t0.5\n",
     r"dawnbench.tsv:2: expected 'epoch<TAB>hours<TAB>top1<TAB>top5'"),
    ("dawnbench.tsv", "epoch\thours\ttop1Accuracy\ttop5Accuracy\n1\t0.1\t50.0\t90.0\n",
     r"dawnbench.tsv: no row '1 .*' for epoch 1 of summary.json"),
])
def test_a_broken_run_folder_gets_a_one_line_error(runs, tmp_path, name, text, message):
    run = shutil.copytree(runs["reached"], tmp_path / "run")
    _break(run, name, text)
    with pytest.raises(SystemExit) as e:
        main([str(run), "--out", str(tmp_path / "out")])
    assert str(e.value).startswith("dawnbench_report: ") and "\n" not in str(e.value)
    assert re.search(message, str(e.value))
    assert not (tmp_path / "out").exists()  # nothing written from a run folder that failed its checks


def test_other_errors_name_the_problem(runs, tmp_path):
    with pytest.raises(ValueError, match="no such run folder"):
        report(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="--cost-per-hour: must be a finite number >= 0"):
        report(runs["reached"], tmp_path, cost_per_hour=-1.0)
    run = shutil.copytree(runs["reached"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "history": []}))
    with pytest.raises(ValueError, match="no evaluated epochs"):
        report(run, tmp_path / "out")
    (run / "summary.json").write_text(json.dumps({**summary, "history": summary["history"][:1]}))
    with pytest.raises(ValueError, match=r"its last row \(epoch 2\) is not the last evaluation .* \(epoch 1\)"):
        report(run, tmp_path / "out")
