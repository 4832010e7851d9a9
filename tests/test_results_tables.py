"""The README's and docs' results tables are generated from docs/results/*.json and match them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from scripts import results_tables
from scripts.results_tables import REPO, RESULTS_DIR, ResultsError, documents, main, regenerate, render

pytestmark = pytest.mark.unit


def test_committed_tables_match_their_result_files(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--check"])
    assert code == 0, capsys.readouterr().out


def test_every_result_file_is_shown() -> None:
    text = "".join(path.read_text() for path in documents())
    for path in RESULTS_DIR.glob("*.json"):
        record = json.loads(path.read_text())
        if ".quick" not in path.name and isinstance(record, dict) and "result" in record:  # a bench's result
            bench = results_tables.bench_of(path)
            assert f"<!-- results:{bench} -->" in text or bench in results_tables.SUMMARY, \
                f"{path.name} has no table in README.md or docs/"


def test_readme_has_the_summary_and_links_only_inside_the_repository() -> None:
    readme = (REPO / "README.md").read_text()
    assert "<!-- results:summary -->" in readme
    assert "../" not in readme and not re.search(r"issue\s*#?\d", readme, re.I)
    assert len(readme.splitlines()) <= 155
    # the first screen says what has run on GPUs, before any instructions
    first_screen = "\n".join(readme.splitlines()[:25])
    assert "| **GPUs** |" in first_screen and readme.index("| **GPUs** |") < readme.index("## Quickstart")


@pytest.fixture
def copy(tmp_path: Path) -> tuple[Path, Path]:
    """A results folder with the real optim and replica_guard files, and a page with their tables and the summary."""
    results = tmp_path / "results"
    results.mkdir()
    for bench in ("optim", "replica_guard"):
        shutil.copy(RESULTS_DIR / f"{bench}.json", results)
    page = tmp_path / "page.md"
    page.write_text("# Page\n\ntext\n\n<!-- results:optim -->\nold\n<!-- /results -->\n\nmiddle\n\n"
                    "<!-- results:replica_guard -->\n<!-- /results -->\n\n<!-- results:summary -->\n<!-- /results -->\nend\n")
    return results, page


def test_generate_then_check_is_clean_and_text_outside_markers_stays(copy: tuple[Path, Path]) -> None:
    results, page = copy
    assert main(["--results-dir", str(results), str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Page\n\ntext\n\n<!-- results:optim -->\n") and "\nmiddle\n" in text
    assert text.endswith("<!-- /results -->\nend\n") and "old" not in text
    assert main(["--check", "--results-dir", str(results), str(page)]) == 0
    record = json.loads((results / "optim.json").read_text())
    assert f"{record['result']['ratio']:.2f}x" in text and record["date"][:10] in text


def test_a_changed_number_in_a_result_file_is_detected(copy: tuple[Path, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    results, page = copy
    main(["--results-dir", str(results), str(page)])
    capsys.readouterr()
    path = results / "replica_guard.json"
    record = json.loads(path.read_text())
    record["result"]["share"] *= 2
    path.write_text(json.dumps(record))
    assert main(["--check", "--results-dir", str(results), str(page)]) == 1
    out = capsys.readouterr().out
    assert "results:replica_guard" in out and "results:summary" in out and "results:optim" not in out


def test_a_hand_edited_figure_in_a_page_is_detected(copy: tuple[Path, Path]) -> None:
    results, page = copy
    main(["--results-dir", str(results), str(page)])
    text = page.read_text()
    ratio = f"{json.loads((results / 'optim.json').read_text())['result']['ratio']:.2f}x"
    page.write_text(text.replace(ratio, "9.99x" if ratio != "9.99x" else "1.00x", 1))
    new, stale = regenerate(page.read_text(), results)
    assert stale == ["optim"] and new == text


def test_unknown_table_and_missing_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="results:nosuch: no such table"):
        render("nosuch", RESULTS_DIR)
    assert "No result file yet: `python -m scripts.bench.optim` writes" in render("optim", tmp_path)
    with pytest.raises(ResultsError, match="no result files"):
        render("summary", tmp_path)


def test_every_table_renders_from_the_committed_files() -> None:
    for path in RESULTS_DIR.glob("*.json"):
        bench = results_tables.bench_of(path)
        if ".quick" not in path.name and bench in results_tables.TABLES:
            assert f"docs/results/{path.name}" in render(bench)


def test_tta_accuracy_names_the_configs_frozen_for_each_target() -> None:
    def acc(base: float, recipe: float) -> dict:
        return {side: {"mean_final_top1": v, "mean_best_top1": v + 0.01}
                for side, v in (("baseline", base), ("recipe", recipe))}
    two = {"accuracy": {"0.7": acc(0.70, 0.75), "0.75": acc(0.78, 0.75)},
           "frozen": {"baseline": {"0.7": "b70.yaml", "0.75": "b75.yaml"}, "recipe": {"0.7": "r.yaml", "0.75": "r.yaml"}}}
    assert results_tables.tta_accuracy(two) == (
        "Final top-1, mean over the seeds of `b70.yaml` and `r.yaml` (frozen for 70%): baseline 70.0%, recipe 75.0% "
        "(best: 71.0% and 76.0%). Final top-1, mean over the seeds of `b75.yaml` and `r.yaml` (frozen for 75%): "
        "baseline 78.0%, recipe 75.0% (best: 79.0% and 76.0%).")
    one = {"accuracy": two["accuracy"] | {"0.75": acc(0.70, 0.75)},
           "frozen": {side: {"0.7": "x.yaml", "0.75": "x.yaml"} for side in ("baseline", "recipe")}}
    assert results_tables.tta_accuracy(one).count("Final top-1") == 1 and "frozen for 70% and 75%" in \
        results_tables.tta_accuracy(one)
    assert results_tables.tta_accuracy({"accuracy": acc(0.7, 0.8)}).startswith(  # a file of one config per side
        "Final top-1, mean over the seeds: baseline 70.0%, recipe 80.0%")
    assert "not recorded" in results_tables.tta_accuracy({})


def test_tta_headline_gives_the_range_misses_and_whether_the_choices_were_cached() -> None:
    target = {"ratio": 0.8, "seeds": [100, 101, 102], "seeds_in_median": 2, "range": [0.7, 0.9],
              "missed": {"baseline": [102], "recipe": []}}
    runs = [{"side": "recipe", "choices": {"source": "cache"}}, {"side": "baseline", "choices": {}}]
    r = {"headline": ["0.7"], "targets": {"0.7": target}, "runs": runs}
    assert results_tables.tta_headline(r) == ("0.800 at 70% (2 of 3 seeds; range 0.700-0.900; baseline missed 1); "
                                              "the recipe's measured choices read from this machine's cache")
    runs[0]["choices"]["source"] = "measured"
    assert "cache" not in results_tables.tta_headline(r)
    # the precision each side trained in: the recipe's measured choice (train.amp off is fp32)
    runs.append({"side": "recipe", "choices": {"source": "cache", "choice": {"amp": "bf16"}}})
    assert results_tables.tta_headline(r).endswith("; the recipe in bf16 (measured), the baseline in fp32")
    runs.append({"side": "recipe", "choices": {"source": "cache", "choice": {"amp": "off"}}})
    assert results_tables.tta_headline(r).endswith("; the recipe in bf16 or fp32 (measured), the baseline in fp32")


def test_a_per_machine_bench_renders_each_machines_file(tmp_path: Path) -> None:
    record = json.loads(next(RESULTS_DIR.glob("tta-*.json")).read_text())
    # two models, and one model name on two machines that differ in their widest vector extension
    for name, cpu, flags in (("tta-one", "CPU One", ["avx2"]), ("tta-two", "CPU Two", []),
                             ("tta-two-bf16", "CPU Two", ["avx2", "avx512f", "avx512_bf16"])):
        machine = {**record["machine"], "cpu": cpu, "cpu_flags": flags}
        (tmp_path / f"{name}.json").write_text(json.dumps({**record, "machine": machine}))
    text = render("tta", tmp_path)
    assert text.index("**CPU One") < text.index("docs/results/tta-one.json") < text.index("**CPU Two")
    assert "docs/results/tta-two.json" in text
    rows = [line for line in render("summary", tmp_path).splitlines() if "time to accuracy" in line]
    machines = {re.search(r"\[(tta-[a-z0-9-]+)\]", row)[1]: row.split(" | ")[-2] for row in rows}
    assert machines == {"tta-one": "CPU One (avx2), 2 cores, " + record["date"][:10],
                        "tta-two": "CPU Two, 2 cores, " + record["date"][:10],
                        "tta-two-bf16": "CPU Two (avx512_bf16), 2 cores, " + record["date"][:10]}


def test_tuning_runs_are_read_at_the_bench_target_from_their_curves(tmp_path: Path) -> None:
    from trainer.tta_stats import HEADLINE, TARGET_CONSECUTIVE
    TARGET_TOP1 = HEADLINE[0]

    def run(side: str, top1: list[float], overrides: list[str]) -> dict:
        return {"date": "2026-12-02T07:00:00Z", "commit": "0123456789ab", "side": side, "overrides": overrides,
                "seed": 0, "top1": top1,
                "elapsed_s": [10.0 * (i + 1) for i in range(len(top1))], "epochs_run": len(top1),
                "load_before": 0.5, "load_after": 2.1, "cpu": "CPU A"}

    high, low = TARGET_TOP1 + 0.01, TARGET_TOP1 - 0.01
    lucky = [low] * 3 + [high] + [low] * 3  # one evaluation above: not a crossing
    steady = [low] * 2 + [high] * TARGET_CONSECUTIVE + [low]
    phases = ("schedule.phases=[{start_epoch: 0, end_epoch: 2, image_size: 24}, "
              "{start_epoch: 2, end_epoch: 5, image_size: 40}]")
    (tmp_path / "tta_tuning.json").write_text(json.dumps([run("recipe", lucky, ["optim.lr=0.4"]),
                                                          run("baseline", steady, [phases])]))
    text = render("tta_tuning", tmp_path)
    lucky_row, steady_row = [line for line in text.splitlines() if line.startswith("| CPU A | 2026")]
    assert "missed" in lucky_row and "`optim.lr=0.4`" in lucky_row
    assert f"{10.0 * (2 + TARGET_CONSECUTIVE):.1f} (epoch {2 + TARGET_CONSECUTIVE})" in steady_row
    assert "phases 24 px ep. 0-2, 40 px ep. 2-5" in steady_row
    assert "`0123456`" in steady_row and "CPU A, baseline: 1 runs, 1 of them alone; CPU A, recipe: 1 runs, 1 of them alone" in text
    assert steady_row.startswith("| CPU A | 2026-12-02 07:00 |")
    assert "No tuning run yet" in render("tta_tuning", tmp_path / "empty")


def test_the_ablation_groups_the_recipes_runs_to_the_end_by_exchange_only(tmp_path: Path) -> None:
    def run(side: str, seed: int, overrides: list[str], final: float | None, purpose: str = "ablation") -> dict:
        out = {"side": side, "seed": seed, "overrides": overrides, "commit": "abcdef0123", "top1": [0.5, 0.7],
               "best_top1": 0.9, "cpu": "CPU A", "date": "2026-12-03T15:00:00Z", "epochs_run": 2,
               "elapsed_s": [1.0, 2.0], "load_before": 0.5, "load_after": 2.0, "purpose": purpose}
        return out if final is None else {**out, "final_top1": final}
    runs = [run("recipe", 0, ["comm.kind=dense"], 0.8), run("recipe", 1, ["comm.kind=dense"], 0.7),
            run("recipe", 0, [], 0.6), run("recipe", 0, ["comm.kind=hitopk"], 0.5),
            run("recipe", 2, ["comm.kind=dense", "optim.lr=0.1"], 0.99),  # changed more than the exchange
            run("recipe", 4, [], 0.98, purpose="tuning"),  # the config as it stands, run as a tuning run
            run("baseline", 0, [], 0.99), run("recipe", 3, ["comm.kind=dense"], None)]  # stopped at its target
    (tmp_path / "tta_tuning.json").write_text(json.dumps(runs))
    runs.append({**run("recipe", 0, ["comm.kind=dense"], 0.5), "cpu": "CPU B"})  # another machine: its own row
    # one model name, another vector extension: another machine
    runs.append({**run("recipe", 1, ["comm.kind=dense"], 0.4), "cpu_widest": "avx512_bf16"})
    (tmp_path / "tta_tuning.json").write_text(json.dumps(runs))
    rows = [line for line in render("tta_ablation", tmp_path).splitlines() if line.startswith("| CPU")]
    assert rows == ["| CPU A | `auto (the config)` | 0 | `abcdef0` | 60.00% (60.00-60.00) | 90.00% (90.00-90.00) |",
                    "| CPU A | `dense` | 0, 1 | `abcdef0` | 75.00% (70.00-80.00) | 90.00% (90.00-90.00) |",
                    "| CPU A | `hitopk` | 0 | `abcdef0` | 50.00% (50.00-50.00) | 90.00% (90.00-90.00) |",
                    "| CPU A (avx512_bf16) | `dense` | 1 | `abcdef0` | 40.00% (40.00-40.00) | 90.00% (90.00-90.00) |",
                    "| CPU B | `dense` | 0 | `abcdef0` | 50.00% (50.00-50.00) | 90.00% (90.00-90.00) |"]
    # the tuning table lists them all, and counts the ablation runs apart from the tuning runs
    text = render("tta_tuning", tmp_path)
    assert "recipe: 3 runs" in text and "baseline: 1 runs" in text and "and 6 ablation runs" in text
    assert "| CPU A (avx512_bf16) | 2026-12-03 15:00 |" in text


def test_a_result_made_of_training_runs_shows_the_runs_load_not_the_report_s() -> None:
    record = json.loads(next(RESULTS_DIR.glob("tta-*.json")).read_text())
    record["load_avg_1min"] = {"start": 0.1, "end": 0.1}  # a later --from-runs report on an idle box
    record["result"]["runs"] = [{**r, "load_before": b, "load_after": a}
                                for r, (b, a) in zip(record["result"]["runs"], [(1.5, 2.0), (2.5, 3.5)] * 6)]
    text = results_tables.provenance("tta", record)
    assert "from 1.5 to 3.5 at its runs' starts and ends" in text and "0.1" not in text


def test_the_gpu_check_table_shows_each_check_from_its_latest_run(tmp_path: Path) -> None:
    def run(number: int, rows: list[tuple[str, str, str]], note: str = "") -> dict:
        out = {"rows": [{"check": c, "result": r, "detail": f"run {number} | {c}", "group": g} for c, r, g in rows],
               "pass": 0, "fail": 0, "skip": 0, "machine": {"torch": "2.11", "gpus": ["NVIDIA H200"]}}
        return {"run": number, "date": "2026-12-04T17:00:00", "commit": "a" * 40 + "+dirty", "tree": "t",
                "command": "c", "output": out, **({"note": note} if note else {})}

    record = {"bench": "gpu_check", "device": "one GPU", "runs": [
        run(1, [("lars row", "FAIL", "lars"), ("adam a", "FAIL", "adam"), ("adam b", "PASS", "adam")]),
        run(2, [("adam a", "PASS", "adam")], note="only adam")]}
    (tmp_path / "gpu_check.json").write_text(json.dumps(record))
    text = render("gpu_check", tmp_path)
    assert "| lars row | **FAIL** | 1 | run 1 \\| lars row |" in text
    assert "| adam a | **PASS** | 2 |" in text and "adam b" not in text  # a check's rows come from one run
    assert text.index("lars row") < text.index("adam a")  # in the first run's order
    assert "Run 2: only adam" in text and "`aaaaaaa+dirty`: t" in text and "2.11" in text
    assert render("gpu_check", tmp_path / "none").startswith("_No GPU run yet")
