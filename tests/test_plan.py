"""The planner's formulas on hand-computed cases, config parsing, the emulated-cluster model, and its errors."""

from __future__ import annotations

import json
import math

import pytest

from scripts import plan
from scripts.plan import (Exchange, Link, ModelSpec, PlanError, allgather_s, hierarchical_allreduce_s,
                          overlap_step_s, reduce_scatter_s, ring_allreduce_s)

LINK = Link(alpha_s=1e-3, bytes_per_s=100e6)  # 1 ms per ring step, 100 MB/s


# ---------------------------------------------------------------- collectives


def test_ring_allreduce_hand_computed():
    # 4 ranks, 100 MB: 2*3 steps of 1 ms + 2*3/4 * 100 MB / 100 MB/s = 0.006 + 1.5 s
    assert ring_allreduce_s(100e6, 4, LINK) == pytest.approx(1.506)
    # 2 ranks: 2 steps + 1x the buffer
    assert ring_allreduce_s(50e6, 2, LINK) == pytest.approx(0.002 + 0.5)
    assert ring_allreduce_s(100e6, 1, LINK) == 0.0


def test_reduce_scatter_and_allgather_hand_computed():
    # reduce-scatter of 80 MB over 4 ranks: 3 steps + 3/4 of the buffer
    assert reduce_scatter_s(80e6, 4, LINK) == pytest.approx(0.003 + 0.6)
    # allgather of 10 MB payloads over 4 ranks: 3 steps + 3 payloads through each link
    assert allgather_s(10e6, 4, LINK) == pytest.approx(0.003 + 0.3)
    # two groups sharing the link carry twice the bytes, same number of steps
    assert allgather_s(10e6, 4, LINK, sharing=2) == pytest.approx(0.003 + 0.6)
    assert reduce_scatter_s(80e6, 1, LINK) == 0.0 and allgather_s(10e6, 1, LINK) == 0.0


def test_reduce_scatter_plus_allgather_is_an_allreduce():
    n, p = 64e6, 8
    assert reduce_scatter_s(n, p, LINK) + allgather_s(n / p, p, LINK) == pytest.approx(ring_allreduce_s(n, p, LINK))


def test_hierarchical_allreduce_hand_computed():
    intra, inter = Link(0.0, 1e9), Link(0.0, 1e8)
    # 2 nodes x 4 GPUs, 100 MB: intra RS 3/4*0.1 s, inter 2*1/2*1 s, intra AG 3*25 MB / 1 GB/s = 0.075 s
    assert hierarchical_allreduce_s(100e6, 2, 4, intra, inter) == pytest.approx(0.075 + 1.0 + 0.075)
    # one node: no inter-node part
    assert hierarchical_allreduce_s(100e6, 1, 4, intra, inter) == pytest.approx(0.15)


def test_overlap_step_hand_computed():
    # forward 1 s, backward 2 s; two buckets ready at 25% and 100% of backward
    ready = [0.25, 1.0]
    assert overlap_step_s(1.0, 2.0, ready, [0.1, 0.1]) == pytest.approx(3.1)  # only the last chain shows
    # a long first chain: starts at 1.5 s, 3 s long, the second waits for it
    assert overlap_step_s(1.0, 2.0, ready, [3.0, 0.5]) == pytest.approx(1.5 + 3.0 + 0.5)
    # exchange work competing with compute, and a write-back tail
    assert overlap_step_s(1.0, 2.0, ready, [0.1, 0.1], cpu_s=0.4) == pytest.approx(3.4)
    assert overlap_step_s(1.0, 2.0, ready, [0.1, 0.1], tail_s=0.2) == pytest.approx(3.3)


def test_bucket_cost_dense_and_sparse_on_a_gpu_cluster():
    c = plan.Cluster(2, 4, inter=Link(0.0, 1e8), intra=Link(0.0, 1e9), selection=plan.Selection(0.0, 0.0))
    n = 10_000_000  # 40 MB of fp32
    assert plan.bucket_cost(n, Exchange("dense"), c) == pytest.approx(hierarchical_allreduce_s(40e6, 2, 4, c.intra,
                                                                                                c.inter))
    assert plan.bucket_cost(n, Exchange("dense fp16"), c) == pytest.approx(
        hierarchical_allreduce_s(20e6, 2, 4, c.intra, c.inter))
    # hitopk at 1%: shard 2.5 M, k 25,000 pairs of 8 bytes; the 4 local ranks share the NIC
    expected = (reduce_scatter_s(40e6, 4, c.intra) + allgather_s(8 * 25_000, 2, c.inter, sharing=4)
                + allgather_s(10e6, 4, c.intra))
    assert plan.bucket_cost(n, Exchange("hitopk", 0.01), c) == pytest.approx(expected)
    # flat topk: 100,000 pairs through one ring of all 8 ranks
    assert plan.bucket_cost(n, Exchange("topk", 0.01), c) == pytest.approx(allgather_s(800_000, 8, c.inter))
    # a bucket under dense_below goes dense
    assert plan.bucket_cost(1000, Exchange("hitopk", 0.01), c) == plan.bucket_cost(1000, Exchange("dense"), c)


def test_fit_link_recovers_alpha_and_bandwidth():
    link = Link(2e-3, 50e6)
    w = 4
    points = [[n, ring_allreduce_s(4 * n, w, link), 0.0] for n in (1e5, 1e6, 4e6)]
    fitted = plan.fit_link(points, 2 * (w - 1), 2 * (w - 1) / w * 4)
    assert fitted.alpha_s == pytest.approx(2e-3)
    assert fitted.bytes_per_s == pytest.approx(50e6)


# ---------------------------------------------------------------- the emulated cluster


def _synthetic_run(link: Link, cpu_per_element: float) -> dict:
    """A 4 x 1 run whose collectives follow `link` exactly and whose pieces cost cpu_per_element CPU s."""
    def points(wall, sizes=(1e5, 1e6)):
        return [[n, wall(n), cpu_per_element * n] for n in sizes]

    w = 4
    prim = {"allreduce": points(lambda n: ring_allreduce_s(4 * n, w, link)),
            "allreduce_fp16": points(lambda n: ring_allreduce_s(2 * n, w, link)),
            "allgather": points(lambda n: allgather_s(4 * n, w, link))}
    for name in ("dense_local", "fp16_cast", "sparse_local"):
        prim[name] = points(lambda n: 0.0)
    compute = {"step_s": 3.0, "fwd_s": 1.0, "bwd_s": 2.0, "cpu_s": 1.5, "fwd_cpu_s": 0.5, "bwd_cpu_s": 1.0}
    return {"nodes": 4, "ranks_per_node": 1, "rate": "1gbit", "primitives": prim,
            "models": {"m": {"buckets": [10_000_000], "bucket_ready": [1.0],
                             "exchanges": {"compute only": compute, "dense": {"step_s": 3.6, "cpu_s": 1.5}}}}}


def test_emulated_step_hand_computed():
    run = _synthetic_run(Link(0.0, 1e8), cpu_per_element=0.0)
    cluster = plan.EmulatedCluster.from_run(run, cores=2)
    spec = ModelSpec("m", [10_000_000], [1.0])
    compute = run["models"]["m"]["exchanges"]["compute only"]
    # dense: 1.5 x 40 MB / 100 MB/s = 0.6 s after backward ends (the only bucket is ready at its end)
    assert cluster.step_s(compute, spec, Exchange("dense")) == pytest.approx(3.6)
    # 1e-8 CPU s per element in each piece: a dense bucket costs 0.1 s gathering/writing back and 0.1 s in
    # the allreduce. The compute runs at 2 wall s per CPU s (3 s for 1.5 CPU s), so the write-back after
    # the chain takes 0.2 s: network bound 3.6 + 0.2; the CPU bound, 3 + (4 ranks / 2 cores) x 0.2 = 3.4
    busy = plan.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-8), cores=2)
    assert busy.step_s(compute, spec, Exchange("dense")) == pytest.approx(3.6 + 0.2)
    # ten times the CPU work: the CPU bound, 3 + 2 x 2.0 = 7.0, beats the network bound, 3.6 + 2.0
    busier = plan.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-7), cores=2)
    assert busier.step_s(compute, spec, Exchange("dense")) == pytest.approx(7.0)
    # on 4 cores the 4 ranks do not share: 3 + 2.0 = 5.0 < 5.6
    roomy = plan.EmulatedCluster.from_run(_synthetic_run(Link(0.0, 1e8), cpu_per_element=1e-7), cores=4)
    assert roomy.step_s(compute, spec, Exchange("dense")) == pytest.approx(5.6)
    # calibrated: the exchange measured at 1.0 CPU s per step instead of the pieces' 0.2: 3 + 2 x 1.0
    assert busy.step_s(compute, spec, Exchange("dense"), exchange_cpu_s=1.0) == pytest.approx(5.0)


def test_compare_with_measurements_reports_each_cell():
    cal = {"version": 1, "density": 0.01, "dense_below": 16384, "bucket_mb": 25.0,
           "runs": [_synthetic_run(Link(0.0, 1e8), 0.0)]}
    rows = plan.compare_with_measurements(cal)
    assert len(rows) == 1 and rows[0]["exchange"] == "dense"
    assert rows[0]["error"] == pytest.approx(0.0) and rows[0]["exchange_cpu_s"] == 0.0


def test_calibration_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(PlanError, match="file not found.*scaling.py"):
        plan.load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        plan.load_calibration(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "comm"}))
    with pytest.raises(PlanError, match="not a scaling.py calibration"):
        plan.load_calibration(other)
    with pytest.raises(PlanError, match="two sizes"):
        plan.fit_cpu([[1.0, 1.0, 1.0]])


# ---------------------------------------------------------------- recipe config


def test_phases_from_the_dawnbench_config():
    cfg = plan.load_recipe_config("configs/resnet50_dawnbench.yaml", [])
    phases = plan.phases_from_config(cfg, world=128)
    assert [(p.image_size, p.epochs, p.batch_size) for p in phases] == [
        (96, 13, 32768), (128, 11, 32768), (224, 3, 32768), (288, 1, 16384)]  # the entry: 16k in the last epoch only
    assert phases[0].steps_per_epoch == 1_281_167 // 32768  # drop_last, as the loaders
    # 256 images per GPU at 96 px: (96/224)^2 / 1200 img/s each
    assert phases[0].compute_s == pytest.approx(256 * (96 / 224) ** 2 / 1200)
    assert phases[3].val_image_size == 288
    measured = plan.phases_from_config(cfg, world=128, compute_s_per_image={96: 0.2e-3})
    assert measured[0].compute_s == pytest.approx(256 * 0.2e-3)


def test_predict_run_counts_every_step_and_the_warmup():
    cfg = plan.load_recipe_config("configs/resnet50_dawnbench.yaml", [])
    c = plan.Cluster(16, 8, inter=Link(50e-6, 25e9 / 8 * 0.95), intra=Link(10e-6, 100e9),
                     selection=plan.Selection(200e-6, 4.4e-12), price_per_node_hour=10.0)
    spec = ModelSpec("resnet50", [6_500_000, 6_500_000, 6_500_000, 6_057_032])
    phases = plan.phases_from_config(cfg, c.world)
    dense = plan.predict_run(phases, spec, Exchange("dense"), c, eval_every=1)
    assert dense.train_s == pytest.approx(sum(p.epochs * p.steps_per_epoch * s
                                              for p, s in zip(phases, dense.step_s)))
    assert dense.cost_usd == pytest.approx(dense.total_s / 3600 * 16 * 10.0)
    hitopk = plan.predict_run(phases, spec, Exchange("hitopk", 0.01), c, warmup_steps=40)
    no_warmup = plan.predict_run(phases, spec, Exchange("hitopk", 0.01), c, warmup_steps=0)
    assert hitopk.train_s == pytest.approx(no_warmup.train_s + 40 * (dense.step_s[0] - no_warmup.step_s[0]))
    assert hitopk.total_s < dense.total_s  # 25 Gbit/s between 128 V100s: the sparse exchange wins


def test_recommend_prefers_the_densest_within_slack():
    def pred(kind, density, total):
        return plan.Prediction(Exchange(kind, density), [], total, 0.0, 0.0)

    preds = [pred("dense", 0.01, 200.0), pred("hitopk", 0.001, 100.0), pred("hitopk", 0.01, 102.0),
             pred("hitopk", 0.05, 110.0)]
    assert plan.recommend(preds).exchange == Exchange("hitopk", 0.01)


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
             {"kind": "step", "step": 10, **{f"comm/calib/{k}": v for k, v in calib.items()}}]
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


def test_transformer_model_spec_builds_without_the_bench():
    spec = plan.model_spec("transformer", 25.0)
    assert spec.params > 40_000_000 and len(spec.buckets) > 1
