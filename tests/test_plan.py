"""The planner over the package's cost model (trainer/comm/planner.py, trainer/comm/emulated.py): recipe
configs (ResNet phases, the Transformer's real model), time to target and cost, auto's choice, the
emulated-cluster model, a run's own calibration, and its errors; its command line (scripts/plan.py, `main`).
The cost formulas themselves are tested in tests/test_cost.py."""

from __future__ import annotations

import json
import math

import pytest

from recipes.resnet50 import Config as ResNetConfig
from scripts import plan
from trainer.comm import emulated, planner
from trainer.comm.cost import DENSE, Choice, Link, allgather_s, describe, exposed_s, ring_allreduce_s
from trainer.comm.planner import ModelSpec, PlanError, Strategy
from trainer.config import load_config

pytestmark = pytest.mark.unit


def test_step_is_compute_plus_the_exposed_exchange():
    net = planner.gpu_network(2, 4, inter_gbit=1.0, intra_gbyte=100.0, efficiency=1.0)
    spec = ModelSpec("m", [10_000_000, 10_000_000], [0.5, 1.0])
    plan_ = [DENSE, DENSE]
    chain = net.chain_s(describe(10_000_000, DENSE, net.layout))
    # forward 1 s, backward 2 s: the first bucket is ready 1 s before backward ends, the second at its end
    expected = 3.0 + exposed_s([1.0, 0.0], [chain, chain])
    assert planner.step_seconds(1.0, 2.0, spec, plan_, net) == pytest.approx(expected)
    assert planner.step_seconds(1.0, 2.0, spec, plan_, planner.gpu_network(1, 1, 1.0, 100.0, 1.0)) == 3.0
    # a pinned kind leaves buckets under dense_below dense
    assert Strategy(Choice("hitopk", 0.01)).plan(ModelSpec("m", [100, 20_000]), 1.0, net) == [
        DENSE, Choice("hitopk", 0.01)]
    assert Strategy(Choice("dense16")).plan(ModelSpec("m", [100]), 1.0, net) == [Choice("dense16")]


# ---------------------------------------------------------------- the emulated cluster


def _synthetic_run(link: Link, cpu_per_element: float) -> dict:
    """A 4 x 1 run whose collectives follow `link` exactly and whose pieces cost cpu_per_element CPU s."""
    def points(wall, sizes=(1e5, 1e6)):
        return [[n, wall(n), cpu_per_element * n] for n in sizes]

    w = 4
    prim = {"world": points(lambda n: ring_allreduce_s(4 * n, w, link)),
            "world16": points(lambda n: ring_allreduce_s(2 * n, w, link)),
            "world_gather": points(lambda n: allgather_s(4 * n, w, link))}
    for name in ("dense_local", "fp16_cast", "sparse_local"):
        prim[name] = points(lambda n: 0.0)
    compute = {"step_s": 3.0, "fwd_s": 1.0, "bwd_s": 2.0, "cpu_s": 1.5, "fwd_cpu_s": 0.5, "bwd_cpu_s": 1.0}
    return {"nodes": 4, "ranks_per_node": 1, "rate": "1gbit", "primitives": prim,
            "models": {"m": {"buckets": [10_000_000], "bucket_ready": [1.0],
                             "exchanges": {"compute only": compute, "dense": {"step_s": 3.6, "cpu_s": 1.5},
                                           "dense16": {"step_s": 3.3, "cpu_s": 1.5}}}}}


def test_emulated_step_hand_computed():
    run = _synthetic_run(Link(0.0, 1e8), cpu_per_element=0.0)
    cluster = emulated.EmulatedCluster.from_run(run, cores=2)
    spec = ModelSpec("m", [10_000_000], [1.0])
    compute = run["models"]["m"]["exchanges"]["compute only"]
    dense = [DENSE]
    # dense: 1.5 x 40 MB / 100 MB/s = 0.6 s after backward ends (the only bucket is ready at its end)
    assert cluster.step_s(compute, spec, dense) == pytest.approx(3.6)
    # 1e-8 CPU s per element in each piece: a dense bucket costs 0.1 s gathering/writing back and 0.1 s in
    # the allreduce. The compute runs at 2 wall s per CPU s (3 s for 1.5 CPU s), so the write-back after
    # the chain takes 0.2 s: network bound 3.6 + 0.2; the CPU bound, 3 + (4 ranks / 2 cores) x 0.2 = 3.4
    busy = emulated.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-8), cores=2)
    assert busy.step_s(compute, spec, dense) == pytest.approx(3.6 + 0.2)
    # ten times the CPU work: the CPU bound, 3 + 2 x 2.0 = 7.0, beats the network bound, 3.6 + 2.0
    busier = emulated.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-7), cores=2)
    assert busier.step_s(compute, spec, dense) == pytest.approx(7.0)
    # on 4 cores the 4 ranks do not share: 3 + 2.0 = 5.0 < 5.6
    roomy = emulated.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-7), cores=4)
    assert roomy.step_s(compute, spec, dense) == pytest.approx(5.6)
    # calibrated: the exchange measured at 1.0 CPU s per step instead of the pieces' 0.2: 3 + 2 x 1.0
    assert busy.step_s(compute, spec, dense, exchange_cpu_s=1.0) == pytest.approx(5.0)


def test_compare_with_measurements_reports_each_cell():
    cal = {"version": 1, "density": 0.01, "dense_below": 16384, "bucket_mb": 25.0,
           "runs": [_synthetic_run(Link(0.0, 1e8), 0.0)]}
    rows = {r["exchange"]: r for r in emulated.compare_with_measurements(cal)}
    assert set(rows) == {"dense", "dense16"}  # the fixed exchanges, by the cost model's names
    assert rows["dense"]["error"] == pytest.approx(0.0) and rows["dense"]["exchange_cpu_s"] == 0.0
    assert rows["dense16"]["predicted_s"] == pytest.approx(3.3)  # half the bytes of dense on the same link


def test_a_calibration_with_the_older_names_loads_under_the_cost_models(tmp_path):
    run = _synthetic_run(Link(0.0, 1e8), 0.0)
    run["primitives"] = {{"world": "allreduce", "world16": "allreduce_fp16", "world_gather": "allgather"}.get(k, k): v
                         for k, v in run["primitives"].items()}
    run["models"]["m"]["exchanges"]["dense fp16"] = run["models"]["m"]["exchanges"].pop("dense16")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"version": 1, "density": 0.01, "dense_below": 16384, "runs": [run]}))
    rows = {r["exchange"]: r for r in emulated.compare_with_measurements(emulated.load_calibration(path))}
    assert rows["dense16"]["predicted_s"] == pytest.approx(3.3)


def test_calibration_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(PlanError, match="file not found.*scaling.py"):
        emulated.load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        emulated.load_calibration(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "comm"}))
    with pytest.raises(PlanError, match="not a scaling.py calibration"):
        emulated.load_calibration(other)
    with pytest.raises(PlanError, match="two sizes"):
        emulated.fit_cpu([[1.0, 1.0, 1.0]])


# ---------------------------------------------------------------- recipe config


def test_phases_from_the_dawnbench_config():
    cfg = load_config(ResNetConfig, "configs/resnet50_dawnbench.yaml", [])
    phases = planner.phases_from_config(cfg, world=128)
    assert [(p.image_size, p.epochs, p.batch_size) for p in phases] == [
        (96, 13, 32768), (128, 11, 32768), (224, 3, 32768), (288, 1, 16384)]  # the entry: 16k in the last epoch only
    assert phases[0].steps_per_epoch == 1_281_167 // 32768  # drop_last, as the loaders
    # 256 images per GPU at 96 px: (96/224)^2 / 1200 img/s each
    assert phases[0].compute_s == pytest.approx(256 * (96 / 224) ** 2 / 1200)
    assert phases[3].val_image_size == 288
    measured = planner.phases_from_config(cfg, world=128, compute_s_per_image={96: 0.2e-3})
    assert measured[0].compute_s == pytest.approx(256 * 0.2e-3)


def test_predict_run_counts_every_step_and_the_warmup():
    cfg = load_config(ResNetConfig, "configs/resnet50_dawnbench.yaml", [])
    net = planner.gpu_network(16, 8, inter_gbit=25.0, intra_gbyte=100.0, efficiency=0.95)
    spec = ModelSpec("resnet50", [6_500_000, 6_500_000, 6_500_000, 6_057_032])
    phases = planner.phases_from_config(cfg, net.layout.world)
    dense = planner.predict_run(phases, spec, Strategy(DENSE), net, price=10.0, eval_every=1)
    assert dense.train_s == pytest.approx(sum(p.epochs * p.steps_per_epoch * s
                                              for p, s in zip(phases, dense.step_s)))
    assert dense.cost_usd == pytest.approx(dense.total_s / 3600 * 16 * 10.0)
    hitopk = planner.predict_run(phases, spec, Strategy(Choice("hitopk", 0.01)), net, 10.0, warmup_steps=40)
    no_warmup = planner.predict_run(phases, spec, Strategy(Choice("hitopk", 0.01)), net, 10.0, warmup_steps=0)
    assert hitopk.train_s == pytest.approx(no_warmup.train_s + 40 * (dense.step_s[0] - no_warmup.step_s[0]))
    assert hitopk.total_s < dense.total_s  # 25 Gbit/s between 128 V100s: the sparse exchange wins


def test_recommend_prefers_the_densest_within_slack():
    def pred(kind, density, total):
        return planner.Prediction(Strategy(Choice(kind, density) if kind != "auto" else None), [], total, 0.0, 0.0)

    preds = [pred("dense", 1.0, 200.0), pred("hitopk", 0.001, 100.0), pred("hitopk", 0.01, 102.0),
             pred("hitopk", 0.05, 110.0), pred("auto", 1.0, 90.0)]
    assert planner.recommend(preds).strategy == Strategy(Choice("hitopk", 0.01))  # a fixed kind: auto is shown apart


# ---------------------------------------------------------------- bad input


def test_bad_config_key_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--calibration", "", "comm.densty=0.01"])
    assert e.value.code == 2
    assert "comm.densty: unknown key (did you mean comm.density?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0"], "--nodes: must be >= 1"),
    (["--inter-gbit", "-1"], "--inter-gbit: must be > 0"),
    (["--densities", "0.01,2"], "each density must be in (0, 1]"),
    (["--densities", "a,b"], "expected numbers separated by commas"),
    (["--compute-ms", "96"], "expected IMAGE_PX=MS_PER_IMAGE"),
    (["--gpus-per-node", "7"], "batch_size 32768 is not divisible by the world size 112"),
    (["--config", "configs/nope.yaml"], "config file not found"),
    (["--calibration", "runs/none/calibration.json"], "file not found"),
])
def test_bad_input_gets_one_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(argv if "--calibration" in argv else ["--calibration", "", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_prints_the_paper_setting_next_to_the_published_times(capsys):
    out = plan.main(["--calibration", ""])
    text = capsys.readouterr().out
    assert "2:31" in text and "2:38" in text and "Recommendation:" in text
    assert out["recommended"].startswith("hitopk ")  # 25 Gbit/s between 128 V100s: the hierarchical exchange wins
    assert math.isfinite(out["recommended_s"]) and out["recommended_s"] < out["dense_s"]
    # auto's choice per phase among the config's densities (0.01 only), no slower than all dense
    assert out["auto_s"] < out["dense_s"] and "comm.kind auto would choose" in text
    assert {c for phase in out["auto_plan"] for c in phase} <= {"dense", "dense16", "topk 0.01", "hitopk 0.01"}


def _auto_run(folder, link_bytes_per_s: float, densities: tuple[float, ...] = ()) -> None:
    """A run folder whose metrics.jsonl holds an auto communicator's calibration (2 nodes x 2 ranks)."""
    calib = {"nodes": 2.0, "ranks_per_node": 2.0, "min_density": 0.01, "dense_below": 16384.0, "local_competes": 0.0,
             "net_scale": 1.0, "select_per_element_s": 1e-8, "select_fixed_s": 1e-4, "cast_per_element_s": 1e-10,
             **{f"density/{i}": d for i, d in enumerate(densities)}}
    for name in ("world", "world16", "world_gather", "inter"):
        calib[f"link/{name}/alpha_s"], calib[f"link/{name}/bytes_per_s"] = 1e-4, link_bytes_per_s
    calib["link/intra/alpha_s"], calib["link/intra/bytes_per_s"] = 1e-5, 10e9
    for i, (n, ready) in enumerate([(6_000_000, 0.0), (20_000, 0.01), (6_000_000, 0.05)]):
        calib[f"bucket/{i}/elements"], calib[f"bucket/{i}/ready_before_end_s"] = float(n), ready
    folder.mkdir()
    lines = [{"kind": "step", "step": 1, "loss/train": 1.0},
             {"kind": "comm", "step": 10, **{f"comm/calib/{k}": v for k, v in calib.items()}}]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")


def test_from_run_replans_a_runs_own_calibration_at_other_bandwidths(tmp_path, capsys):
    _auto_run(tmp_path / "run", 1e9 / 8)  # measured at 1 Gbit/s
    out = plan.main(["--from-run", str(tmp_path / "run"), "--rate-factors", "0.2,100"])
    at = {(p["layout"], p["rate_factor"]): p for p in out["plans"]}
    slow, fast = at[("2x2", 0.2)], at[("2x2", 100.0)]
    assert any(c.startswith(("topk", "hitopk")) for c in slow["plan"]) and slow["exposed_ms"] < slow["dense_exposed_ms"]
    assert fast["plan"][0].startswith("dense") and fast["plan"][2].startswith("dense")  # the 6 M buckets
    assert all(float(c.split()[1]) >= 0.01 for p in out["plans"] for c in p["plan"] if " " in c)  # the safe bound
    assert "8x2" in {p["layout"] for p in out["plans"]}
    assert "auto's choice" in capsys.readouterr().out


def test_from_run_plans_with_the_runs_own_densities(tmp_path):
    _auto_run(tmp_path / "run", 1e9 / 8, densities=(0.1,))
    out = plan.main(["--from-run", str(tmp_path / "run"), "--rate-factors", "0.2"])
    sparse = [c for p in out["plans"] for c in p["plan"] if c.startswith(("topk", "hitopk"))]
    assert sparse and all(float(c.split()[1]) == 0.1 for c in sparse), sparse


def test_from_run_without_a_calibration_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1}) + "\n")
    with pytest.raises(SystemExit):
        plan.main(["--from-run", str(tmp_path / "run")])
    assert "no comm/calib" in capsys.readouterr().err


def test_from_run_on_one_node_refuses_to_extrapolate(tmp_path, capsys):
    _auto_run(tmp_path / "run", 1e9 / 8)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"comm/calib/nodes": 2.0', '"comm/calib/nodes": 1.0'))
    with pytest.raises(SystemExit) as e:
        plan.main(["--from-run", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no inter-node link was measured" in err and ">= 2 nodes" in err and len(err.strip().splitlines()) == 1


def test_transformer_config_plans_the_configs_own_model(capsys):
    out = plan.main(["--calibration", "", "--config", "configs/transformer_wmt16_en_de.yaml"])
    text = capsys.readouterr().out
    # Transformer-big of the config (d 1024, ffn 4096, 6+6 layers, shared 32k vocabulary), counted by hand:
    # embedding V d; encoder layer 4d^2+4d (attention) + 2df+f+d (feed-forward) + 4d (2 norms); decoder layer
    # twice the attention and 3 norms; the two final norms
    d, f, v = 1024, 4096, 32000
    params = v * d + 6 * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d) \
        + 6 * (8 * d * d + 8 * d + 2 * d * f + f + d + 6 * d) + 4 * d
    assert f"{params:,} parameters" in text
    steps = {s["exchange"]: s for s in out["steps"]}
    assert set(steps) == {"dense", "dense16", "topk 0.1", "hitopk 0.1", "auto"}  # never below min_density 0.1
    assert all(c in ("dense", "dense16", "topk 0.1", "hitopk 0.1") for c in steps["auto"]["plan"])


def test_transformer_plan_recommends_by_what_each_exchange_costs():
    """On one GPU nothing is exchanged: every exchange costs the compute alone, and plain dense is recommended.
    On a slow link (0.1 Gbit/s between 16 nodes) the exposed exchange is its bytes: fp16 halves dense's, and at
    the config's min_density 0.1 the (value, index) pairs gathered from 16 nodes (hitopk) or 128 GPUs (topk)
    outweigh dense's: dense16 < dense < hitopk < topk, dense16 recommended, auto no slower than it."""
    common = ["--calibration", "", "--config", "configs/transformer_wmt16_en_de.yaml", "--step-ms", "100"]
    one = plan.main([*common, "--nodes", "1", "--gpus-per-node", "1"])
    assert {s["exchange"]: s["step_ms"] for s in one["steps"]} == dict.fromkeys(
        ["dense", "dense16", "topk 0.1", "hitopk 0.1", "auto"], 100.0)
    assert one["recommended"] == "dense"
    slow = plan.main([*common, "--inter-gbit", "0.1"])
    exposed = {s["exchange"]: s["step_ms"] - 100.0 for s in slow["steps"]}
    assert exposed["dense16"] == pytest.approx(exposed["dense"] / 2, rel=0.01)
    assert exposed["dense16"] < exposed["dense"] < exposed["hitopk 0.1"] < exposed["topk 0.1"]
    assert slow["recommended"] == "dense16" and exposed["auto"] <= exposed["dense16"] * 1.0001


def test_model_transformer_uses_the_transformer_recipe():
    out = plan.main(["--calibration", "", "--model", "transformer", "--step-ms", "100"])
    assert out["compute_ms"] == 100.0 and out["steps"][0]["step_ms"] > 100.0
    base = plan.main(["--calibration", "", "--model", "transformer", "model.d_model=512", "model.heads=8",
                      "model.ffn_dim=2048"])
    assert len(base["steps"][0]["plan"]) < len(out["steps"][0]["plan"])  # fewer 25 MB buckets


def test_model_of_the_other_recipe_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--calibration", "", "--model", "transformer", "--config", "configs/resnet50_dawnbench.yaml"])
    assert "is a ResNet recipe config" in capsys.readouterr().err
