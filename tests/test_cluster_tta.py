"""The emulated-cluster time-to-accuracy bench's pure parts: times from a run's metrics records, medians with misses,
--resume, the estimate, the tables. No processes, no namespaces."""

import json
import math
from pathlib import Path

import pytest

from scripts import results_tables
from scripts.bench import cluster_tta, common
from trainer.tta_stats import read_run

pytestmark = pytest.mark.unit

LAUNCH = 1000.0


def write_metrics(run_dir: Path, top1: list[float], wall: list[float], elapsed: list[float],
                  extra: list[dict] = ()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [*extra, *({"kind": "epoch", "step": 10 * (i + 1), "epoch": i, "eval/top1": a, "time/wall_clock": w,
                        "time/elapsed_s": e} for i, (a, w, e) in enumerate(zip(top1, wall, elapsed)))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_times_to_targets_count_from_the_launch_with_two_in_a_row(tmp_path):
    """Catches reading the trainer's clock (time/elapsed_s, which starts after rendezvous and imports) instead of the
    launch, and taking the first lucky evaluation instead of the second in a row."""
    top1 = [0.55, 0.62, 0.58, 0.66, 0.71, 0.74, 0.76]
    wall = [LAUNCH + 60 + 10 * i for i in range(7)]  # 60 s of start-up before the first epoch ends
    write_metrics(tmp_path, top1, wall, [10.0 * i for i in range(7)])
    run = read_run("recipe", 100, tmp_path, 200.0, 0.0, 0.0, "c.yaml")
    record = cluster_tta.make_record(run, LAUNCH, "1gbit", "dense", [], cluster_tta.metrics_records(tmp_path), {},
                                     [0.6, 0.7, 0.75, 0.8], 2)
    assert record["time_to_s"] == {"0.6": 100.0, "0.7": 110.0, "0.75": None, "0.8": None}
    assert record["epochs_to"] == {"0.6": 5, "0.7": 6, "0.75": None, "0.8": None}
    assert record["final_top1"] == 0.76 and record["best_top1"] == 0.76


def test_comm_bytes_stand_for_the_steps_since_the_last_logged_one():
    """Catches summing only the logged steps (20x too few bytes) or forgetting the node's second rank."""
    records = [{"kind": "step", "step": 20, "comm/bytes_sent": 10.0, "comm/bytes_inter_node": 4.0},
               {"kind": "step", "step": 40, "comm/bytes_sent": 1.0, "comm/bytes_inter_node": 0.5},
               {"kind": "epoch", "step": 50, "eval/top1": 0.5}]
    out = cluster_tta.comm_bytes(records, ranks_per_node=2)
    assert out["bytes_sent"] == 2 * (10.0 * 20 + 1.0 * 30) and out["bytes_inter_node"] == 2 * (4.0 * 20 + 0.5 * 30)
    assert out["steps"] == 50 and out["logged_steps"] == 2


def test_auto_seconds_read_what_its_metrics_log():
    """Catches taking the calibration time from the trainer's clock instead of the launch, or missing logged keys."""
    records = [{"kind": "step", "step": 1, "time/wall_clock": LAUNCH + 30, "comm/calibrated": 0.0},
               {"kind": "comm", "step": 7, "time/wall_clock": LAUNCH + 45.5, "comm/calib/dense_span_s": 0.3},
               {"kind": "step", "step": 20, "time/wall_clock": LAUNCH + 80, "comm/auto/trials_s": 12.0}]
    assert cluster_tta.auto_seconds(records, LAUNCH) == {"auto/trials_s": 12.0, "calibrated_after_s": 45.5}


def test_interface_counters_are_the_host_ends_and_their_difference(tmp_path):
    """Catches reading the node's sent bytes from the host end's tx (what the node received)."""
    for i, (rx, tx) in enumerate([(500, 70), (300, 90)]):
        stats = tmp_path / f"pfx-h{i}" / "statistics"
        stats.mkdir(parents=True)
        (stats / "rx_bytes").write_text(f"{rx}\n")
        (stats / "tx_bytes").write_text(f"{tx}\n")
    now = cluster_tta.interface_bytes("pfx", 2, tmp_path)
    assert now == {"node0": {"sent": 500, "received": 70}, "node1": {"sent": 300, "received": 90}}
    before = {"node0": {"sent": 100, "received": 10}, "node1": {"sent": 100, "received": 10}}
    assert cluster_tta.counter_delta(before, now) == {"node0": {"sent": 400, "received": 60},
                                                       "node1": {"sent": 200, "received": 80}}


def record(rate: str, kind: str, seed: int, t70: float | None, final: float = 0.8, process_s: float = 500.0) -> dict:
    return {"rate": rate, "kind": kind, "seed": seed, "time_to_s": {"0.7": t70},
            "epochs_to": {"0.7": None if t70 is None else 5}, "final_top1": final, "best_top1": final + 0.01,
            "process_s": process_s, "comm_bytes_per_node": {"bytes_sent": 2e6, "bytes_inter_node": 1e6},
            "interface_bytes": {"node0": {"sent": 1_000_000, "received": 0}, "node1": {"sent": 3_000_000, "received": 0}},
            "auto": {"calibrated_after_s": 40.0} if kind == "auto" else {}, "load_before": 1.0, "load_after": 2.0}


def test_a_kind_that_misses_is_a_miss_never_the_winner():
    """Catches the median over the reached seeds only: topk's one fast seed (300 s) would beat dense's 500 s although
    topk missed 70% on two of three seeds."""
    runs = [record("200mbit", "dense", s, t) for s, t in ((100, 500.0), (101, 520.0), (102, 480.0))]
    runs += [record("200mbit", "topk", 100, 300.0), record("200mbit", "topk", 101, None),
             record("200mbit", "topk", 102, None)]
    cells = cluster_tta.summarize(runs, [0.7])
    topk, dense = cells["200mbit"]["topk"]["targets"]["0.7"], cells["200mbit"]["dense"]["targets"]["0.7"]
    assert topk["median_s"] is None and topk["missed"] == [101, 102] and topk["range_s"] == [300.0, 300.0]
    assert dense["median_s"] == 500.0 and dense["range_s"] == [480.0, 520.0] and dense["vs_dense"] == 1.0
    assert cluster_tta.which_kind(cells)["200mbit"] == {"target": "0.7", "kind": "dense", "median_s": 500.0}
    # one miss in three: the median is the slower of the two reached times, not the mean of the reached ones
    runs[4] = record("200mbit", "topk", 101, 400.0)
    cells = cluster_tta.summarize(runs, [0.7])
    assert cells["200mbit"]["topk"]["targets"]["0.7"]["median_s"] == 400.0
    assert cells["200mbit"]["topk"]["targets"]["0.7"]["vs_dense"] == 0.8
    assert cluster_tta.which_kind(cells)["200mbit"]["kind"] == "topk"
    assert cluster_tta.headline_ratio(cells, ["200mbit"]) == 0.8


def test_auto_is_judged_against_the_fastest_per_step_kind_seed_by_seed():
    """Catches judging auto against a multi-step kind (local is faster here but is not a per-step kind), against
    dense instead of the fastest, pairing another seed's time, or a missed median read as a time."""
    runs = [record("1gbit", k, s, t) for k, times in (("dense", (300.0, 320.0, 310.0)), ("topk", (200.0, 260.0, 220.0)),
                                                     ("local", (150.0, 150.0, 150.0)), ("auto", (210.0, 250.0, None)))
            for s, t in zip((100, 101, 102), times)]
    out = cluster_tta.auto_vs_best(runs, cluster_tta.summarize(runs, [0.7]))
    # auto's median (250 s, its miss counted as infinitely slow) over top-k's (220 s); per seed where both reached
    assert out == {"1gbit": {"target": "0.7", "best": "topk", "ratio": round(250 / 220, 3),
                             "per_seed": {"100": 1.05, "101": round(250 / 260, 3)}}}
    runs[-2] = record("1gbit", "auto", 101, None)  # two misses in three: auto's median is a miss
    assert cluster_tta.auto_vs_best(runs, cluster_tta.summarize(runs, [0.7]))["1gbit"]["ratio"] is None


def test_per_cell_accuracy_bytes_and_autos_seconds_are_medians():
    """Catches mixing rates in one cell or summing the nodes' interface bytes instead of averaging per node."""
    runs = [record("1gbit", "auto", 100, 200.0, 0.70), record("1gbit", "auto", 101, 210.0, 0.74),
            record("1gbit", "auto", 102, 220.0, 0.72), record("200mbit", "auto", 100, 900.0, 0.1)]
    cell = cluster_tta.summarize(runs, [0.7])["1gbit"]["auto"]
    assert cell["final_top1"] == {"median": 0.72, "range": [0.70, 0.74]}
    assert cell["interface_mb_sent_per_node"] == 2.0 and cell["comm_mb_per_node"]["bytes_inter_node"] == 1.0
    assert cell["auto_s"] == {"calibrated_after_s": 40.0} and cell["targets"]["0.7"]["vs_dense"] is None


def test_kinds_interleave_within_a_seed_and_rotate():
    """Catches running one kind's seeds back to back (load drift would fall on one kind) or a fixed order."""
    plan = cluster_tta.plan_runs([100, 101], ["1gbit", "200mbit"], ["a", "b", "c"])
    assert [k for s, r, k in plan[:3]] == ["a", "b", "c"] and [k for s, r, k in plan[3:6]] == ["b", "c", "a"]
    assert [(s, r) for s, r, _ in plan[:6]] == [(100, "1gbit")] * 3 + [(100, "200mbit")] * 3
    assert len(set(plan)) == 12 and plan[6][0] == 101
    assert list(cluster_tta.kinds_for(False))[-1] == "local"  # the multi-step kind runs after the per-step ones
    assert list(cluster_tta.kinds_for(True)) == [*cluster_tta.QUICK_KINDS, "local"]
    assert cluster_tta.kinds_for(False)["dense16"] == ["comm.kind=dense", "comm.compression=fp16"]


def test_resume_reuses_finished_records_and_refuses_other_settings(tmp_path):
    """Catches rerunning finished runs on --resume, or reusing a run read with another target rule or on another
    machine."""
    settings = {"config": "c.yaml", "target_consecutive": 2, "nodes": 2, "ranks_per_node": 2}
    (tmp_path / "records").mkdir()
    done = {**record("1gbit", "dense", 100, 300.0), **settings}
    (tmp_path / "records" / "1gbit_dense_seed100.json").write_text(json.dumps(done))
    (tmp_path / "1gbit_topk_seed100").mkdir()  # started, never finished: no record
    records = cluster_tta.load_records(tmp_path, settings)
    plan = cluster_tta.plan_runs([100], ["1gbit"], ["dense", "topk"])
    assert [p for p in plan if p not in records] == [(100, "1gbit", "topk")]
    with pytest.raises(ValueError, match="target_consecutive: 2, now 3"):
        cluster_tta.load_records(tmp_path, {**settings, "target_consecutive": 3})
    # a session on another machine may not add to these runs, and no report mixes machines' runs
    (tmp_path / "records" / "1gbit_dense_seed100.json").write_text(json.dumps({**done, "cpu": "AMD EPYC"}))
    with pytest.raises(ValueError, match="cpu: 'AMD EPYC', now 'Intel Xeon'"):
        cluster_tta.load_records(tmp_path, {**settings, "cpu": "Intel Xeon"})
    other = {**record("1gbit", "topk", 100, 300.0), **settings, "cpu": "Intel Xeon"}
    (tmp_path / "records" / "1gbit_topk_seed100.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="several machines"):
        cluster_tta.load_records(tmp_path, settings)
    # a kind whose settings were frozen anew since the run: its record is not reused
    (tmp_path / "records" / "1gbit_topk_seed100.json").unlink()
    dense = {**done, "overrides": ["comm.kind=dense"]}
    (tmp_path / "records" / "1gbit_dense_seed100.json").write_text(json.dumps(dense))
    assert cluster_tta.load_records(tmp_path, settings, {"dense": ["comm.kind=dense"]})
    with pytest.raises(ValueError, match="overrides"):
        cluster_tta.load_records(tmp_path, settings, {"dense": ["comm.kind=dense", "comm.bucket_mb=5"]})


def test_the_estimate_uses_finished_runs_of_the_cell_then_the_rate_then_the_prior():
    """Catches an estimate that ignores finished runs (hours off at 200 Mbit/s) or borrows another rate's runs."""
    finished = [record("1gbit", "dense", 100, 1.0, process_s=s) for s in (700.0, 900.0, 800.0)]
    finished.append(record("1gbit", "topk", 100, 1.0, process_s=300.0))
    pending = [(101, "1gbit", "dense"), (101, "1gbit", "hitopk"), (101, "200mbit", "dense")]
    assert cluster_tta.estimate_s(pending, finished, {"1gbit": 1.0, "200mbit": 2000.0}) == 800.0 + 750.0 + 2000.0
    assert cluster_tta.estimate_s([], finished) == 0.0


def test_without_root_it_stops_with_one_line(monkeypatch, tmp_path):
    """Catches starting cluster.sh (or training) on a machine that cannot make namespaces."""
    monkeypatch.setattr(common, "record_run", lambda args: None)
    monkeypatch.setattr(common, "netem_skip_reason", lambda: "needs root (network namespaces and tc shaping)")
    monkeypatch.setattr(cluster_tta, "run_all", lambda *a: pytest.fail("ran without root"))
    with pytest.raises(SystemExit, match="^bench cluster_tta: needs root"):
        cluster_tta.main(["--quick", "--out", str(tmp_path / "out")])


def result() -> dict:
    runs = [record("200mbit", "dense", s, t) for s, t in ((100, 500.0), (101, 520.0))]
    runs += [record("200mbit", "topk", 100, 300.0), record("200mbit", "topk", 101, None)]
    runs += [record("1gbit", k, 100, t) for k, t in (("dense", 200.0), ("auto", 180.0))]
    cells = cluster_tta.summarize(runs, [0.7])
    return {"model": "resnet18", "layout": "2x2", "seeds": [100, 101], "runs_done": 6, "runs_planned": 8,
            "complete": False, "target_consecutive": 2, "targets": ["0.7"], "cells": cells,
            "which_kind": cluster_tta.which_kind(cells), "ratio": cluster_tta.headline_ratio(cells, ["200mbit"]),
            "auto_vs_best": cluster_tta.auto_vs_best(runs, cells),
            "runs": runs}


def test_the_tables_show_misses_and_the_kind_per_rate():
    """Catches a table that prints a missed median as a time, or a "which kind" row won by a kind that missed."""
    text = "\n".join(results_tables.cluster_tta(result()))
    assert "| 200mbit | topk | missed |" in text and "| 200mbit | dense | 510 (500-520) |" in text
    assert "| 200mbit | resnet18 | **dense** | 510 |" in text and "| 1gbit | resnet18 | **auto** | 180 |" in text
    assert "calibrated_after_s 40" in text and "6 of 8 runs" in text
    what, figure = results_tables.SUMMARY["cluster_tta"]
    assert figure(result()) == ("1.000; which kind: 200mbit dense, 1gbit auto; auto / fastest per-step kind: 1gbit "
                                "0.900 (partial: seeds 100, 101; 6 of 8 runs)")
    assert "| 1gbit | resnet18 | **auto** | 180 | 0.900 (dense; seed 100: 0.900) |" in text
    assert "| 200mbit | resnet18 | **dense** | 510 | - |" in text  # auto did not run there
    # a partial result of one seed says so: its ranges are one run's
    one = {**result(), "seeds": [100, 101, 102]}
    one["runs"] = [r for r in one["runs"] if r["seed"] == 100]
    assert "partial: seed 100 (101, 102 not yet run: no spread)" in figure(one)
    assert "median over seed 100 (101, 102 not yet run: no spread)" in "\n".join(results_tables.cluster_tta(one))


def test_no_results_file_renders_a_note_and_a_file_renders_the_table(tmp_path):
    """Catches --check failing (or a table appearing) before any run exists, and a file that does not render."""
    assert "No result file yet, so no table" in results_tables.render("cluster_tta", tmp_path)
    record_ = {"date": "2026-12-04T03:00:00+00:00", "machine": {"cpu": "CPU A", "cores": 2, "cpu_flags": []},
               "commit": "0123456789abcdef", "command": "python -m scripts.bench.cluster_tta",
               "load_avg_1min": {"start": 0.1, "end": 0.2}, "result": {**result(), "runs": []}}
    (tmp_path / "cluster_tta.json").write_text(json.dumps(record_))
    text = results_tables.render("cluster_tta", tmp_path)
    assert "docs/results/cluster_tta.json" in text and "Which kind when" in text
    assert not math.isnan(result()["ratio"])


def test_tuning_runs_tuning_seeds_with_the_kinds_overrides_and_appends_each_run(monkeypatch, tmp_path):
    """Catches a tuning run on a fresh seed, --set lost or placed before the kind's own overrides, and a history
    that is overwritten instead of appended to."""
    monkeypatch.setattr(common, "record_run", lambda args: None)
    monkeypatch.setattr(cluster_tta, "prepare_to_train", lambda: None)
    ran = []

    def fake_run_all(pending, kinds, out, targets, consecutive, finished):
        for seed, rate, kind in pending:
            ran.append((seed, rate, kind, kinds[kind]))
            finished.append({**record(rate, kind, seed, 300.0), "finished": "2026-12-04T00:00:00Z",
                             "run_dir": str(out / kind)})

    monkeypatch.setattr(cluster_tta, "run_all", fake_run_all)
    history = tmp_path / "tuning.json"
    history.write_text(json.dumps([{"earlier": True}]))
    monkeypatch.setattr(cluster_tta, "TUNING_FILE", history)
    cluster_tta.main(["--tune", "local", "--set", "comm.local_steps=4", "--tuning-seeds", "0", "1",
                      "--out", str(tmp_path / "out")])
    assert [(s, r, k) for s, r, k, _ in ran] == [(0, "1gbit", "local"), (1, "1gbit", "local")]
    assert ran[0][3] == [*cluster_tta.MULTI_STEP_KINDS["local"], "comm.local_steps=4"]
    saved = json.loads(history.read_text())
    assert saved[0] == {"earlier": True} and [e["seed"] for e in saved[1:]] == [0, 1]
    assert all(e["set"] == ["comm.local_steps=4"] and e["purpose"] == "tuning" and "run_dir" not in e
               for e in saved[1:])
    with pytest.raises(SystemExit):
        cluster_tta.parse(["--tune", "local", "--tuning-seeds", str(cluster_tta.FIRST_SEED)])
    with pytest.raises(SystemExit):
        cluster_tta.parse(["--set", "comm.local_steps=4"])


def test_the_tuning_table_lists_every_run_with_its_settings_misses_and_counts(tmp_path):
    """Catches a tuning table that hides a miss, drops a run's settings, or miscounts a kind's runs."""
    runs = [{**record("1gbit", "powersgd", 0, None), "set": ["comm.powersgd_rank=4"], "cpu": "AMD EPYC",
             "overrides": ["comm.kind=powersgd", "comm.powersgd_rank=4"], "date": "2026-12-04T15:00:00Z",
             "commit": "abcdef0123"},
            {**record("1gbit", "local", 0, 250.0), "set": [], "overrides": ["comm.kind=local"], "cpu": "AMD EPYC",
             "date": "2026-12-04T15:10:00Z", "commit": "abcdef0123"},
            {**record("1gbit", "local", 1, 260.0), "set": ["comm.local_steps=4"], "cpu": "AMD EPYC",
             "overrides": ["comm.kind=local", "train.ema_decay=0.66", "comm.local_steps=4"],
             "date": "2026-12-04T15:20:00Z", "commit": "abcdef0123+dirty"}]
    (tmp_path / "cluster_tta_tuning.json").write_text(json.dumps(runs))
    text = results_tables.render("cluster_tta_tuning", tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| AMD EPYC")]
    assert len(rows) == 3 and "| missed |" in rows[0] and "`comm.powersgd_rank=4`" in rows[0]
    assert "| 250 |" in rows[1] and "| none |" in rows[1]
    assert "`train.ema_decay=0.66`<br>`comm.local_steps=4`" in rows[2] and "`abcdef0+dirty`" in rows[2]
    assert "AMD EPYC, local: 2 runs; AMD EPYC, powersgd: 1 runs" in text
