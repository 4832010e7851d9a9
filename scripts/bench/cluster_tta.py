"""Time to accuracy of every gradient exchange on an emulated cluster with slow links, start-up included.

    sudo .venv/bin/python -m scripts.bench.cluster_tta [--quick] [--seeds 3] [--out runs/cluster_tta/<time>]
    sudo .venv/bin/python -m scripts.bench.cluster_tta --resume runs/cluster_tta/<time>   # continue a stopped run
    .venv/bin/python -m scripts.bench.cluster_tta --from-runs runs/cluster_tta/<time>     # report only, no root
    sudo .venv/bin/python -m scripts.bench.cluster_tta --tune local --set comm.local_steps=4 [--tuning-seeds 0]

The cluster is scripts/netem's (`cluster.sh up 2 RATE`, `run.sh --nproc-per-node 2`, as scripts/bench/scaling.py
brings it up, under a prefix of its own): 2 network namespaces ("nodes") of 2 ranks each, 1 CPU thread per rank,
the links between nodes unshaped, 1 Gbit/s or 200 Mbit/s per direction. On it the TTA photo task of
scripts/bench/tta.py (configs/tta_recipe_cpu.yaml: ResNet-18, datasets/tta_photos, global batch 64, the multi-level
cache empty at each start) trains to the end of its schedule once per (seed, rate, kind), with `comm.kind` set to
each kind of KINDS. Each seed runs every rate and every kind before the next seed starts, the kinds' order rotating
from rate to rate and seed to seed, so that a drift in the machine's load falls on every kind alike.

Per run, and per (rate, kind) as medians over seeds with their range:
- the wall seconds from the launch of the run (scripts/netem/run.sh started: process start-up, rendezvous, the
  measured choices (every run measures its own: no choices cache), auto's calibration and trials, the cache
  fill) to each target, at TARGET_CONSECUTIVE
  evaluations in a row (trainer/tta_stats.py's reading, as scripts/bench/tta.py reads it), and the epochs to it;
  a kind that misses a target on a seed counts as infinitely slow there, so its median is a miss when it misses on
  half the seeds or more, and a miss is never another kind's win;
- the final and best top-1;
- bytes sent per node: from the communicator (rank 0's `comm/bytes_sent` and `comm/bytes_inter_node` of each logged
  step, standing for the steps since the previous logged one, times the ranks of a node) and from the namespaces'
  interface counters (the host side of each node's veth: what it receives is what the node sent), read before and
  after the run; the counters include rendezvous, evaluation and checksum traffic;
- auto's calibration and trial seconds where its metrics log them (`comm/...calibration_s`, `comm/...trial_s`),
  and the seconds from the launch to its first calibration record.

"Which kind when": per link rate, the kind with the least median time to WHICH_TARGET, and auto's median time to it
over the best per-step kind's (seed by seed beside it). Results go to
docs/results/cluster_tta.json (cluster_tta.quick.json with --quick) when every planned run has finished, or to
--results-dir when it is given; scripts/results_tables.py renders them into docs/benchmarks.md.

Tuning (`--tune KIND --set key=value ...`): one kind with config overrides on tuning seeds (below FIRST_SEED) at one
rate (`--rate`, default TUNING_RATE); each run is appended to TUNING_FILE with the machine and commit, and no fresh
seed is ever used to choose a setting.

Each finished run is saved at once as OUT/records/RATE_KIND_seedN.json; `--resume OUT` reuses them and runs
only the rest. The emulated nodes share this machine's disk, so they share one cache folder per run (a real
node fills its own). Needs root (network namespaces) and NVIDIA DALI; without them it exits with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from scripts.bench import common, tta
from scripts.bench.common import print_table
from scripts.bench.scaling import RATES
from trainer.tta_stats import TARGET_CONSECUTIVE, TARGETS, Run, epoch_records, read_run

BENCH = "cluster_tta"
KINDS: dict[str, list[str]] = {
    "dense": ["comm.kind=dense"],
    "dense16": ["comm.kind=dense", "comm.compression=fp16"],
    "topk": ["comm.kind=topk"],
    "hitopk": ["comm.kind=hitopk"],
    # rank and dense warm-up tuned on tuning seed 0 (docs/results/cluster_tta_tuning.json): the fastest to 70%
    "powersgd": ["comm.kind=powersgd", "comm.powersgd_rank=16", "comm.dense_warmup_steps=31"],
    # auto with an fp16 wire, as in scripts/bench/scaling.py: its dense16 is then the fixed dense16 row's exchange
    "auto": ["comm.kind=auto", "comm.compression=fp16"],
}
"""Each kind the bench trains with -> its config overrides, in the order of a seed's first rate."""
MULTI_STEP_KINDS: dict[str, list[str]] = {
    # local SGD, plain averaging, H tuned on tuning seed 0 (against DiLoCo's outer step, other H and SparseLoCo:
    # docs/results/cluster_tta_tuning.json). Its moving average folds once per round: the recipe's per-step decay
    # 0.95, compounded over the H steps of a round
    "local": ["comm.kind=local", "comm.local_steps=16", f"train.ema_decay={0.95 ** 16:.4f}"],
}
"""The multi-step kinds -> their overrides; they run after KINDS, on the same seeds and rates."""
PER_STEP_KINDS = ("dense", "dense16", "topk", "hitopk", "powersgd")
"""The kinds that exchange every step with a fixed plan: what auto is compared against."""
QUICK_KINDS = ("dense", "topk", "powersgd", "auto")  # and MULTI_STEP_KINDS
QUICK_RATES = ("1gbit",)
NODES, RANKS_PER_NODE = 2, 2
NETEM_ENV = {"NETEM_PREFIX": "dawnt", "NETEM_SUBNET": "10.213.2"}  # not scaling's or the default: ours to tear down
PORT = 29617
FIRST_SEED = tta.FRESH_SEEDS_FROM  # the tuning seeds are below it
FULL_SEEDS, QUICK_SEEDS = 3, 1
WHICH_TARGET = 0.7
RUN_ESTIMATE_S = {"unlimited": 450.0, "1gbit": 600.0, "200mbit": 1200.0}
"""A run's seconds before any run of the cell has finished (rough: the recipe's ~300 s on 2 ranks, 4 ranks on the
same cores, and dense's ~45 MB per step crossing the link); replaced by the medians of finished runs."""
TUNING_RATE = "1gbit"
TUNING_FILE = common.RESULTS_DIR / "cluster_tta_tuning.json"
"""Every tuning run of a kind's settings (a JSON list), as scripts/bench/tta.py keeps docs/results/tta_tuning.json."""
SETTINGS = ("config", "target_consecutive", "nodes", "ranks_per_node", "cpu")
"""What a saved run must share with this run to be reused by --resume: a full run spans sessions, and a session
may get another machine, whose runs belong in a result of their own."""


# ---------------------------------------------------------------- the plan


def kinds_for(quick: bool) -> dict[str, list[str]]:
    """The kinds a run trains with, and their overrides."""
    every = {**KINDS, **MULTI_STEP_KINDS}
    return {k: v for k, v in every.items() if not quick or k in QUICK_KINDS or k in MULTI_STEP_KINDS}


def plan_runs(seeds: Sequence[int], rates: Sequence[str], kinds: Sequence[str]) -> list[tuple[int, str, str]]:
    """(seed, rate, kind) in running order: seed by seed, rate by rate, the kinds rotated by one place at each
    (rate, seed), so that no kind always runs first or after the same one."""
    out, turn = [], 0
    for seed in seeds:
        for rate in rates:
            k = turn % len(kinds)
            out += [(seed, rate, kind) for kind in [*kinds[k:], *kinds[:k]]]
            turn += 1
    return out


def run_name(seed: int, rate: str, kind: str) -> str:
    return f"{rate}_{kind}_seed{seed}"


def machine_name() -> str:
    """This machine as records name it: CPU model, cores and the instruction-set flags that change kernel choices
    (two sessions may get boxes of one model name with other sizes)."""
    m = common.machine()
    return f"{m['cpu']}, {m['cores']} cores ({', '.join(m['cpu_flags']) or 'no listed flags'})"


def load_records(out: Path, settings: Mapping[str, Any], kinds: Mapping[str, Sequence[str]] | None = None
                 ) -> dict[tuple[int, str, str], dict[str, Any]]:
    """The finished runs saved under out/records, by (seed, rate, kind). A record run with other `settings` (config,
    target rule, layout, machine), or with other overrides than its kind's in `kinds` (a setting frozen since),
    raises, as do records of several machines: their times would not compare."""
    done = {}
    for path in sorted((out / "records").glob("*.json")):
        record = json.loads(path.read_text())
        differ = {k: (record.get(k), v) for k, v in settings.items() if record.get(k) != v}
        if kinds is not None and record["kind"] in kinds and record.get("overrides") != list(kinds[record["kind"]]):
            differ["overrides"] = (record.get("overrides"), list(kinds[record["kind"]]))
        if differ:
            what = ", ".join(f"{k}: {a!r}, now {b!r}" for k, (a, b) in differ.items())
            old = " (written before records named their machine)" if "cpu" in differ and differ["cpu"][0] is None \
                else ""
            raise ValueError(f"{path}: run with other settings ({what}){old}; give a fresh --out")
        done[(record["seed"], record["rate"], record["kind"])] = record
    cpus = {r.get("cpu") for r in done.values()}
    if len(cpus) > 1:
        raise ValueError(f"{out}: runs from several machines ({', '.join(map(str, sorted(cpus, key=str)))}; None: "
                         "written before records named their machine): each machine's runs are a result of their own")
    return done


def estimate_s(pending: Iterable[tuple[int, str, str]], finished: Iterable[Mapping[str, Any]],
               default_s: Mapping[str, float] = RUN_ESTIMATE_S) -> float:
    """Seconds the pending runs will take: each the median wall time of the finished runs of its rate and kind, else
    of its rate, else `default_s` of its rate."""
    by_cell: dict[tuple[str, str], list[float]] = {}
    by_rate: dict[str, list[float]] = {}
    for r in finished:
        by_cell.setdefault((r["rate"], r["kind"]), []).append(r["process_s"])
        by_rate.setdefault(r["rate"], []).append(r["process_s"])
    total = 0.0
    for _, rate, kind in pending:
        seconds = by_cell.get((rate, kind)) or by_rate.get(rate)
        total += statistics.median(seconds) if seconds else default_s[rate]
    return total


# ---------------------------------------------------------------- reading a run


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl (a line still being written is skipped)."""
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def from_launch(run: Run, launched: float) -> Run:
    """`run` with each evaluation's seconds counted from the launch (wall clock `launched`) instead of the trainer's
    clock: start-up before the clock (processes, rendezvous, imports) included."""
    walls = [float(r["time/wall_clock"]) for r in epoch_records(Path(run.run_dir))]
    return replace(run, elapsed_s=[round(w - launched, 3) for w in walls])


def comm_bytes(records: Sequence[Mapping[str, Any]], ranks_per_node: int) -> dict[str, float]:
    """Bytes per node from the communicator: rank 0's bytes of each logged step stand for every step since the
    previous logged one (the last for the steps after it, up to the last epoch record's), times the node's ranks."""
    steps = sorted((int(r["step"]), r) for r in records if r.get("kind") == "step" and "comm/bytes_sent" in r)
    last = max([int(r["step"]) for r in records if r.get("kind") == "epoch" and "step" in r] + [0])
    out = {"bytes_sent": 0.0, "bytes_inter_node": 0.0}
    previous = 0
    for i, (step, r) in enumerate(steps):
        until = max(step, last) if i == len(steps) - 1 else step
        for key in out:
            out[key] += float(r.get(f"comm/{key}", 0.0)) * (until - previous)
        previous = until
    return {k: v * ranks_per_node for k, v in out.items()} | {"logged_steps": len(steps), "steps": max(previous, last)}


def auto_seconds(records: Sequence[Mapping[str, Any]], launched: float) -> dict[str, float]:
    """Auto's start-up as its metrics log it: every `comm/...calibration_s` and `comm/...trial(s)_s` value (the last
    of each), and `calibrated_after_s`: launch to the first record carrying its calibration ({} for other kinds)."""
    out: dict[str, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("comm/") and key.endswith(("calibration_s", "trial_s", "trials_s")):
                out[key.removeprefix("comm/")] = float(value)
    calibrated = [r["time/wall_clock"] for r in records if any(k.startswith("comm/calib/") for k in r)]
    if calibrated:
        out["calibrated_after_s"] = round(min(calibrated) - launched, 3)
    return out


def interface_bytes(prefix: str, nodes: int, sysfs: Path = Path("/sys/class/net")) -> dict[str, dict[str, int]]:
    """Each node's bytes sent and received so far, from the host end of its veth (`PREFIX-hI`, in this namespace):
    what the host end receives, the node sent."""
    out = {}
    for i in range(nodes):
        stats = sysfs / f"{prefix}-h{i}" / "statistics"
        out[f"node{i}"] = {"sent": int((stats / "rx_bytes").read_text()),
                           "received": int((stats / "tx_bytes").read_text())}
    return out


def counter_delta(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]
                  ) -> dict[str, dict[str, int]]:
    return {node: {k: after[node][k] - v for k, v in counts.items()} for node, counts in before.items()}


def make_record(run: Run, launched: float, rate: str, kind: str, overrides: Sequence[str],
                records: Sequence[Mapping[str, Any]], interfaces: Mapping[str, Any],
                targets: Sequence[float], consecutive: int, commit: str | None = None) -> dict[str, Any]:
    """One run's saved record: the run as tta_stats reads it (the trainer's clock, start-up choices included), the
    seconds from the launch to each evaluation, what it sent, and the code it ran (`commit`: the tree's at its
    launch; default the bench's start, which a long run may have moved on from)."""
    since = from_launch(run, launched)
    return {"rate": rate, "kind": kind, "seed": run.seed, "overrides": list(overrides), "config": run.config,
            "target_consecutive": consecutive, "nodes": NODES, "ranks_per_node": RANKS_PER_NODE,
            "cpu": machine_name(), **{k: v for k, v in asdict(run).items() if k not in ("side", "seed", "config")},
            "from_launch_s": since.elapsed_s,
            "time_to_s": {f"{t:g}": since.time_to(t, consecutive) for t in targets},
            "epochs_to": {f"{t:g}": since.epochs_to(t, consecutive) for t in targets},
            "final_top1": run.final_top1, "best_top1": run.best_top1,
            "comm_bytes_per_node": comm_bytes(records, RANKS_PER_NODE), "interface_bytes": dict(interfaces),
            "auto": auto_seconds(records, launched) if kind == "auto" else {},
            "commit": commit or common.start_commit(), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# ---------------------------------------------------------------- medians and spread


def _median(values: Sequence[float]) -> float | None:
    """The median, a missed seed counting as infinitely slow; None when that median is a miss."""
    m = statistics.median(values) if values else math.inf
    return None if math.isinf(m) else round(m, 1)


def summarize(records: Sequence[Mapping[str, Any]], targets: Sequence[float]) -> dict[str, dict[str, Any]]:
    """{rate: {kind: cell}}: per target the median seconds from the launch (a miss: infinitely slow), the range over
    the seeds that reached it, the seeds that missed, the median epochs; the final and best top-1 (median and
    range), the bytes per node, auto's seconds; and each time over dense's of the same rate (medians)."""
    cells: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["rate"], r["kind"]), []).append(r)
    for (rate, kind), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        per_target = {}
        for t in (f"{t:g}" for t in targets):
            times = [r["time_to_s"].get(t) for r in runs]
            reached = [x for x in times if x is not None]
            epochs = [r["epochs_to"][t] for r in runs if r["epochs_to"].get(t) is not None]
            per_target[t] = {"median_s": _median([math.inf if x is None else x for x in times]),
                             "range_s": [min(reached), max(reached)] if reached else None,
                             "missed": [r["seed"] for r, x in zip(runs, times) if x is None],
                             "median_epochs": statistics.median(epochs) if epochs else None}
        cells.setdefault(rate, {})[kind] = {
            "seeds": [r["seed"] for r in runs], "targets": per_target,
            **{f"{key}_top1": {"median": round(statistics.median(r[f"{key}_top1"] for r in runs), 4),
                               "range": [round(min(r[f"{key}_top1"] for r in runs), 4),
                                         round(max(r[f"{key}_top1"] for r in runs), 4)]} for key in ("final", "best")},
            "process_s": round(statistics.median(r["process_s"] for r in runs), 1),
            "comm_mb_per_node": {k: round(statistics.median(r["comm_bytes_per_node"][k] for r in runs) / 1e6, 1)
                                 for k in ("bytes_sent", "bytes_inter_node")},
            "interface_mb_sent_per_node": round(statistics.median(
                statistics.mean(n["sent"] for n in r["interface_bytes"].values()) for r in runs) / 1e6, 1)
            if all(r["interface_bytes"] for r in runs) else None,
            "auto_s": {k: round(statistics.median(r["auto"][k] for r in runs), 1)
                       for k in sorted(set.intersection(*(set(r["auto"]) for r in runs)))} if kind == "auto" else {}}
    for kinds in cells.values():
        dense = kinds.get("dense")
        for cell in kinds.values():
            for t, e in cell["targets"].items():
                base = dense["targets"][t]["median_s"] if dense else None
                e["vs_dense"] = None if base is None or e["median_s"] is None else round(e["median_s"] / base, 3)
    return cells


def which_kind(cells: Mapping[str, Mapping[str, Any]], target: float = WHICH_TARGET) -> dict[str, dict[str, Any]]:
    """Per rate, the kind with the least median time to `target` (None where no kind's median is a time: a miss
    never wins) and that time."""
    out = {}
    for rate, kinds in cells.items():
        times = {k: c["targets"][f"{target:g}"]["median_s"] for k, c in kinds.items()
                 if f"{target:g}" in c["targets"]}
        reached = {k: s for k, s in times.items() if s is not None}
        best = min(reached, key=reached.get) if reached else None
        out[rate] = {"target": f"{target:g}", "kind": best, "median_s": reached.get(best) if best else None}
    return out


def fastest_per_step(cells: Mapping[str, Mapping[str, Any]], target: float = WHICH_TARGET
                     ) -> dict[str, dict[str, Any]]:
    """which_kind among PER_STEP_KINDS only."""
    return which_kind({rate: {k: c for k, c in kinds.items() if k in PER_STEP_KINDS} for rate, kinds in cells.items()},
                      target)


def auto_vs_best(records: Sequence[Mapping[str, Any]], cells: Mapping[str, Mapping[str, Any]],
                 target: float = WHICH_TARGET) -> dict[str, dict[str, Any]]:
    """Per rate where auto ran and a per-step kind (PER_STEP_KINDS) reached `target`: auto's median time to it over
    the fastest per-step kind's (None where auto's median is a miss), and that ratio seed by seed over the seeds
    both reached."""
    t, out = f"{target:g}", {}
    for rate, best in fastest_per_step(cells, target).items():
        if best["kind"] is None or "auto" not in cells[rate]:
            continue
        auto = cells[rate]["auto"]["targets"].get(t, {}).get("median_s")
        time_to = {(r["seed"], r["kind"]): r["time_to_s"].get(t) for r in records if r["rate"] == rate}
        per_seed = {str(seed): round(s / time_to[seed, best["kind"]], 3) for (seed, kind), s in sorted(time_to.items())
                    if kind == "auto" and s is not None and time_to.get((seed, best["kind"])) is not None}
        out[rate] = {"target": t, "best": best["kind"],
                     "ratio": None if auto is None else round(auto / best["median_s"], 3), "per_seed": per_seed}
    return out


def headline_ratio(cells: Mapping[str, Mapping[str, Any]], rates: Sequence[str]) -> float | None:
    """At the slowest rate run: the best per-step kind's median time to WHICH_TARGET over dense's."""
    rate = next((r for r in reversed(RATES) if r in cells and r in rates), None)
    if rate is None or "dense" not in cells[rate]:
        return None
    best = fastest_per_step({rate: cells[rate]})[rate]["median_s"]
    dense = cells[rate]["dense"]["targets"][f"{WHICH_TARGET:g}"]["median_s"]
    return None if best is None or dense is None else round(best / dense, 3)


# ---------------------------------------------------------------- running


def launch(seed: int, rate: str, kind: str, overrides: Sequence[str], out: Path, targets: Sequence[float],
           consecutive: int, timeout_s: float) -> dict[str, Any]:
    """One run on the cluster (already up at `rate`) to the end; its record, saved to out/records."""
    name = run_name(seed, rate, kind)
    run_dir = (out / name).resolve()
    if run_dir.exists():  # a run that did not finish: keep its log for a look, start afresh
        run_dir.rename(run_dir.with_name(f"{name}.unfinished-{time.strftime('%Y%m%d-%H%M%S')}"))
    load_before = os.getloadavg()[0]
    before = interface_bytes(NETEM_ENV["NETEM_PREFIX"], NODES)
    with tempfile.TemporaryDirectory(prefix="cluster-tta-cache-") as disk, \
            tempfile.TemporaryDirectory(prefix="cluster-tta-l2-", dir=tta.RAM_DIR) as ram:
        # no measured-choices cache: every run measures its own at start-up, as on a fresh cluster (a run that
        # found the machine's cache filled by an earlier one would skip what the earlier one paid for)
        args = tta.recipe_args(tta.RECIPE_CONFIG, run_dir, Path(disk), Path(ram), seed,
                               [f"dist.ranks_per_node={RANKS_PER_NODE}", "train.choices_cache=none", *overrides])
        cmd = [str(common.REPO / "scripts" / "netem" / "run.sh"), "--nproc-per-node", str(RANKS_PER_NODE),
               "--port", str(PORT), "--threads", "1", *args]
        launched, commit = time.time(), common.commit()  # the tree this run's processes import
        seconds = common.run_logged(cmd, run_dir, timeout_s, env={**NETEM_ENV, "PY": sys.executable})
    interfaces = counter_delta(before, interface_bytes(NETEM_ENV["NETEM_PREFIX"], NODES))
    run = read_run("recipe", seed, run_dir, seconds, load_before, os.getloadavg()[0], tta.RECIPE_CONFIG)
    record = make_record(run, launched, rate, kind, overrides, metrics_records(run_dir), interfaces, targets,
                         consecutive, commit)
    path = out / "records" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"  {name}: " + ", ".join(f"{100 * float(t):g}% " + ("missed" if s is None else f"{s:.0f} s")
                                    for t, s in record["time_to_s"].items())
          + f"; final top-1 {100 * run.final_top1:.1f}%, process {seconds:.0f} s, "
          f"sent/node {statistics.mean(n['sent'] for n in interfaces.values()) / 1e6:.0f} MB", flush=True)
    return record


def run_all(pending: Sequence[tuple[int, str, str]], kinds: Mapping[str, list[str]], out: Path,
            targets: Sequence[float], consecutive: int, finished: list[dict[str, Any]]) -> None:
    """Run the pending runs in order, the cluster reshaped when the rate changes and always torn down."""
    up = None
    try:
        for i, (seed, rate, kind) in enumerate(pending, 1):
            if up != rate:
                common.netem("cluster.sh", "up", str(NODES), rate, env=NETEM_ENV, bench=BENCH, quiet=True)
                up = rate
            left = estimate_s(pending[i - 1:], finished)
            print(f"[{i}/{len(pending)}] seed {seed}, links {rate}, {kind} (about {left / 3600:.1f} h left)",
                  flush=True)
            timeout = max(1800.0, 4 * estimate_s([(seed, rate, kind)], finished))  # a hung rendezvous ends
            finished.append(launch(seed, rate, kind, kinds[kind], out, targets, consecutive, timeout))
    finally:
        if up is not None:
            common.netem("cluster.sh", "down", env=NETEM_ENV, bench=BENCH, quiet=True)


def report(records: Sequence[Mapping[str, Any]], planned: Sequence[tuple[int, str, str]], targets: Sequence[float],
           consecutive: int, results_dir: str | None) -> dict[str, Any]:
    """The table, the result file (when every planned run finished, or to an explicit --results-dir) and the
    last-line JSON."""
    keys = {(s, r, k) for s, r, k in planned}
    mine = [r for r in records if (r["seed"], r["rate"], r["kind"]) in keys]
    cells = summarize(mine, targets)
    rows = [[rate, kind, *[("missed" if e["median_s"] is None else e["median_s"]) for e in c["targets"].values()],
             f"{100 * c['final_top1']['median']:.1f}", c["comm_mb_per_node"]["bytes_inter_node"],
             c["interface_mb_sent_per_node"] if c["interface_mb_sent_per_node"] is not None else "-"]
            for rate, kinds in cells.items() for kind, c in kinds.items()]
    print_table(["links", "kind", *[f"s to {100 * t:g}%" for t in targets], "final top-1 %", "comm inter-node MB/node",
                 "interface MB sent/node"], rows)
    rates = list(dict.fromkeys(r for _, r, _ in planned))
    line = {"bench": BENCH, "baseline": "dense", "config": tta.RECIPE_CONFIG, "dataset": str(tta.DATA),
            "model": "resnet18", "layout": f"{NODES}x{RANKS_PER_NODE}", "rates": rates,
            "kinds": list(dict.fromkeys(k for _, _, k in planned)), "targets": [f"{t:g}" for t in targets],
            "target_consecutive": consecutive, "seeds": sorted({s for s, _, _ in planned}),
            "runs_planned": len(keys), "runs_done": len(mine), "complete": len(mine) == len(keys),
            "cells": cells, "which_kind": which_kind(cells), "auto_vs_best": auto_vs_best(mine, cells),
            "runs": list(mine),
            "ratio": headline_ratio(cells, rates)}
    folder = results_dir if results_dir is not None else (str(common.RESULTS_DIR) if line["complete"] else "")
    path = common.write_result(line, folder)
    if path is not None:
        print(f"# result written to {path}")
    else:
        print(f"# {len(mine)} of {len(keys)} runs finished: no result file (--resume OUT continues; --results-dir "
              "writes one anyway)")
    print(json.dumps({k: v for k, v in line.items() if k != "runs"}))
    return line


def prepare_to_train() -> None:
    """Exit in one line without root (netem) or DALI; else the dataset prepared and in the page cache."""
    from data import dali_available

    reason = common.netem_skip_reason() or (None if dali_available() else "needs NVIDIA DALI for the recipe "
                                            "(pip install -r requirements.txt)")
    if reason:
        raise SystemExit(f"bench {BENCH}: {reason}")
    from data.tta_photos import prepare

    tta.warm_page_cache(prepare(common.REPO / tta.DATA))


def append_tuning(records: Sequence[Mapping[str, Any]], overrides: Sequence[str], path: Path | None = None) -> Path:
    """Append tuning runs' records (with the --set overrides, the date and the machine) to the tuning history
    (default TUNING_FILE)."""
    path = path or TUNING_FILE
    history = json.loads(path.read_text()) if path.is_file() else []
    for r in records:
        history.append({"date": r["finished"], "machine": common.machine(), "purpose": "tuning", "set": list(overrides),
                        **{k: v for k, v in r.items() if k != "run_dir"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history, indent=1) + "\n")
    return path


def tune(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--tune: the kind with its bench overrides and then --set's, on each tuning seed at --rate; every run
    appended to TUNING_FILE."""
    overrides = [*kinds_for(False)[args.tune], *args.set]
    out = args.out or Path("runs/cluster_tta") / f"tune-{args.tune}-{time.strftime('%Y%m%d-%H%M%S')}"
    prepare_to_train()
    records: list[dict[str, Any]] = []
    run_all([(seed, args.rate, args.tune) for seed in args.tuning_seeds], {args.tune: overrides}, out, args.targets,
            args.consecutive, records)
    print(f"# {len(records)} tuning run(s) of {args.tune} {' '.join(args.set)} appended to "
          f"{append_tuning(records, args.set)}")
    return records


# ---------------------------------------------------------------- entry point


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench/cluster_tta.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"links {', '.join(QUICK_RATES)} only, kinds {', '.join(QUICK_KINDS)}, {QUICK_SEEDS} seed")
    parser.add_argument("--seeds", type=int, default=0,
                        help=f"fresh seeds (default {FULL_SEEDS}; --quick {QUICK_SEEDS})")
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED, help=f"the first seed (>= {FIRST_SEED})")
    parser.add_argument("--targets", type=float, nargs="+", default=list(TARGETS),
                        help=f"top-1 targets (default {' '.join(f'{t:g}' for t in TARGETS)})")
    parser.add_argument("--consecutive", type=int, default=TARGET_CONSECUTIVE,
                        help=f"evaluations in a row at or above a target (default {TARGET_CONSECUTIVE})")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/cluster_tta/<time>)")
    parser.add_argument("--resume", type=Path, metavar="OUT", help="continue OUT: reuse its finished runs")
    parser.add_argument("--from-runs", type=Path, metavar="OUT", help="no training: report OUT's finished runs")
    parser.add_argument("--results-dir", default=None,
                        help="write the result file here even if runs are missing ('' = never; default: "
                             "docs/results once every planned run has finished)")
    parser.add_argument("--tune", choices=list(kinds_for(False)), help="tuning: one kind on tuning seeds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="--tune: a config override on top of the kind's (repeatable)")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[0], help=f"--tune: seeds (< {FIRST_SEED})")
    parser.add_argument("--rate", choices=RATES, default=TUNING_RATE, help=f"--tune: the links (default {TUNING_RATE})")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (QUICK_SEEDS if args.quick else FULL_SEEDS)
    if args.tune is not None and any(not 0 <= s < FIRST_SEED for s in args.tuning_seeds):
        parser.error(f"--tuning-seeds must be in 0..{FIRST_SEED - 1}: higher seeds are the fresh ones")
    if args.tune is None and args.set:
        parser.error("--set needs --tune")
    if args.seeds < 1 or args.consecutive < 1 or not all(0 < t <= 1 for t in args.targets):
        parser.error("--seeds and --consecutive must be >= 1 and --targets in (0, 1]")
    if args.first_seed < FIRST_SEED:
        parser.error(f"--first-seed must be >= {FIRST_SEED}: lower seeds are tuning seeds")
    if sum(x is not None for x in (args.out, args.resume, args.from_runs)) > 1:
        parser.error("give one of --out, --resume and --from-runs")
    if WHICH_TARGET not in args.targets:
        parser.error(f"--targets must include {WHICH_TARGET:g} (the \"which kind when\" target)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    common.record_run(args)
    if args.tune is not None:
        tune(args)
        return {}
    kinds = kinds_for(args.quick)
    planned = plan_runs(range(args.first_seed, args.first_seed + args.seeds), QUICK_RATES if args.quick else RATES,
                        list(kinds))
    out = args.resume or args.from_runs or args.out or Path("runs/cluster_tta") / time.strftime("%Y%m%d-%H%M%S")
    settings = {"config": tta.RECIPE_CONFIG, "target_consecutive": args.consecutive, "nodes": NODES,
                "ranks_per_node": RANKS_PER_NODE, **({} if args.from_runs else {"cpu": machine_name()})}
    done = load_records(out, settings, None if args.from_runs else kinds) if (args.resume or args.from_runs) \
        else {}
    finished = [done[p] for p in planned if p in done]
    pending = [p for p in planned if p not in done]
    print(f"# {BENCH}: {len(planned)} runs planned ({args.seeds} seed(s) x {len(set(r for _, r, _ in planned))} "
          f"rate(s) x {len(kinds)} kinds), {len(finished)} finished in {out}, {len(pending)} to run: about "
          f"{estimate_s(pending, done.values()) / 3600:.1f} h", flush=True)
    if pending and args.from_runs is None:
        prepare_to_train()
        run_all(pending, kinds, out, args.targets, args.consecutive, finished)
    if not finished:
        raise SystemExit(f"bench {BENCH}: {out}: no finished run to report")
    return report(finished, planned, args.targets, args.consecutive, args.results_dir)


if __name__ == "__main__":
    main()
