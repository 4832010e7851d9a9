"""Time to accuracy: our recipe against the torchvision reference recipe, each tuned with as many runs, on fresh seeds.

    python -m scripts.bench.tta [--quick] [--seeds 6] [--first-seed 100] [--out runs/bench_tta]
    python -m scripts.bench.tta --tune baseline --set lr=0.05 --set lr-warmup-epochs=0 [--tuning-seeds 0]
    python -m scripts.bench.tta --tune recipe --set optim.lr=0.3 [--tuning-seeds 0]
    python -m scripts.bench.tta --tune recipe --ablation --set comm.kind=hitopk --tuning-seeds 0 1 2

The task (scripts/make_tta_photos.py, written to datasets/tta_photos if missing): 40 classes, two overlapping
regions of each of 20 real photographs (18 of scikit-image's, scikit-learn's 2), 2,000 training JPEGs of 300-500
px, 2,000 validation images stored as 55 px PNGs, so both sides evaluate the same decoded pixels at the same
resolution (shorter side 55 px, the identity resize, then a 48 px center crop). ResNet-18 from scratch, 2
processes (torchrun, gloo, 1 CPU thread each), global batch 64, one input worker per rank, the same
augmentation (random-resized crop, area 0.35-1, flips).

The targets: each of TARGETS top-1 on the validation split at TARGET_CONSECUTIVE evaluations in a row, the clock
read at the last of them, so one lucky epoch cannot cross it. Every run goes to the end of its schedule, so the
times to every target, and each side's final and best top-1, come from the same runs; HEADLINE are the targets
the verdict is about.

The sides, each with a frozen config per headline target (FROZEN; one file where the same config was best for
both), tuned on tuning seeds with the same number of runs (docs/results/tta_tuning.json holds every tuning run as
data, with the flags each one changed); a side with two configs runs both on every fresh seed, and each target is
read from the runs of the configs frozen for it:
  (a) baseline: scripts/tta_baseline.py --config configs/tta_baseline_cpu.yaml, the torchvision reference recipe
      (ImageFolder + DataLoader, PIL decodes every JPEG every epoch, one fixed image size, SGD + warm-up + cosine,
      DDP dense allreduce, fp32: the reference's --amp is CUDA-only), tuned with the reference's flags;
  (b) recipe: `recipes.resnet50 --config configs/tta_recipe_cpu_48px.yaml`, built on tta_recipe_cpu.yaml (DALI CPU
      mode behind the multi-level cache, empty at the start of each run so its fill is timed; progressive
      resizing; LARS; the weights' moving average;
      the communicator, precision, memory layout and convolutions measured at start-up: comm.kind, train.amp,
      train.channels_last, model.small_map_gemm all auto), tuned with its config keys; the seconds its measured
      choices take before its clock (none when this machine's cache has them) count in its time.

Evaluation (the statistics are trainer/tta_stats.py's): fresh seeds (FRESH_SEEDS_FROM on; the tuning seeds are
below it), the sides alternating which goes first from seed to seed so that drift in the machine's load falls on
both; per target and seed the paired ratio recipe time / baseline time where both sides reached it; reported per
target: the median of those ratios, a bootstrap 90% interval of it and their range (min to max), and the misses
of each side (a target one side misses is its miss, never the other side's win). The 1-minute load average is
recorded before and after every run. `--quick`: 2 fresh seeds; the full run: 6. The result file is per machine
(docs/results/tta-<machine>.json).

Timing, alike for both sides: each script's clock starts before its first epoch, once the process group, the
model and the dataset listing exist; data loading and decoding, input-pipeline start-up, the recipe's cache fill
and every evaluation of all 2,000 images are inside it. Imports, process-group set-up and teardown are not
(they are in the "process wall" column). No checkpoints on either side. The JPEGs are read once beforehand, so
both sides find them in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import yaml

from scripts.bench import common
from scripts.bench.common import print_table
from trainer.run_record import widest_flag
from trainer.tta_stats import (HEADLINE, SIDES, TARGET_CONSECUTIVE, TARGETS, Run, accuracy, compare, read_run,
                               seed_order)

ROOT = Path(__file__).resolve().parents[2]
SIDE_COLORS = {"baseline": "tab:blue", "recipe": "tab:orange"}
BASELINE = ("torchvision reference recipe (ImageFolder + DataLoader, fixed size, SGD + cosine, DDP dense), tuned on "
            "tuning seeds")
DATA = Path("datasets/tta_photos")  # written by scripts/make_tta_photos.py if missing
RECIPE_CONFIG = "configs/tta_recipe_cpu.yaml"  # the recipe on this task, which the frozen recipe configs build on
BASELINE_CONFIG = "configs/tta_baseline_cpu.yaml"
BASELINE_FROZEN_75 = "configs/tta_baseline_cpu_75.yaml"
RECIPE_FROZEN = "configs/tta_recipe_cpu_48px.yaml"
FROZEN: dict[str, dict[float, str]] = {"baseline": {0.7: BASELINE_CONFIG, 0.75: BASELINE_FROZEN_75},
                                       "recipe": {0.7: RECIPE_FROZEN, 0.75: RECIPE_FROZEN}}
"""Each side's frozen config per headline target, tuned for that target on tuning seeds; a side whose best config
was the same for every target lists one file throughout and runs once per seed."""
FRESH_SEEDS_FROM = 100  # seeds below are tuning seeds
QUICK_SEEDS, FULL_SEEDS = 2, 6
TUNING_FILE = common.RESULTS_DIR / "tta_tuning.json"
RAM_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None


# ---------------------------------------------------------------- the frozen configs

def config_for(side: str, target: float) -> str:
    """The side's config for `target`: the one frozen for the lowest headline target at or above it (the
    highest headline's above them all)."""
    frozen = FROZEN[side]
    at_or_above = [t for t in sorted(frozen) if t >= target - 1e-9]
    return frozen[at_or_above[0] if at_or_above else max(frozen)]


def side_configs(side: str) -> list[str]:
    """The side's distinct frozen configs, in the order of their targets: each runs once per fresh seed."""
    return list(dict.fromkeys(FROZEN[side][t] for t in sorted(FROZEN[side])))


def runs_for(runs: Sequence[Run], target: float) -> list[Run]:
    """The runs read at `target`: each side's runs of its config for that target."""
    return [r for r in runs if r.config == config_for(r.side, target)]


def run_label(side: str, config: str) -> str:
    """SIDE, or SIDE-CONFIGSTEM where the side runs several configs."""
    return side if len(side_configs(side)) == 1 else f"{side}-{Path(config).stem}"


def run_folder(side: str, config: str, seed: int) -> str:
    """A run's folder: its label and seed (SIDE_seedN, SIDE-CONFIGSTEM_seedN)."""
    return f"{run_label(side, config)}_seed{seed}"


# ---------------------------------------------------------------- one run

def torchrun(nproc: int) -> list[str]:
    # --standalone: a free local port per run, so concurrent benches and tests never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def baseline_cmd(config: str, run_dir: Path, seed: int, overrides: Sequence[str] = ()) -> list[str]:
    """Overrides are `option=value` with the script's option names (lr-warmup-epochs=0, channels-last=true)."""
    flags = []
    for item in overrides:
        key, value = item.split("=", 1)
        if value.lower() in ("true", "false"):  # BooleanOptionalAction options
            flags.append(f"--{key}" if value.lower() == "true" else f"--no-{key}")
        else:
            flags.append(f"--{key}={value}")
    return [*torchrun(2), str(ROOT / "scripts" / "tta_baseline.py"), "--config", config, f"--output-dir={run_dir}",
            f"--seed={seed}", "--no-stop-at-target", *flags]


def recipe_cmd(config: str, run_dir: Path, disk: Path, ram: Path, seed: int, overrides: Sequence[str] = ()
               ) -> list[str]:
    """The recipe on 2 local ranks (`recipe_args`)."""
    return [*torchrun(2), *recipe_args(config, run_dir, disk, ram, seed, overrides)]


def recipe_args(config: str, run_dir: Path, disk: Path, ram: Path, seed: int, overrides: Sequence[str] = ()
                ) -> list[str]:
    """The recipe's module and arguments, for any launcher: on fresh, empty cache folders (L1/L3 on disk, the L2
    file in RAM), so filling them is timed; the trainer's own stop at its target off, so every run goes to the
    end."""
    return ["-m", "recipes.resnet50", "--config", config, f"log.dir={run_dir}",
            f"data.cache.dir={disk}", f"data.cache.ram_dir={ram}", f"train.seed={seed}",
            "train.stop_at_target=false", "log.progress=false", *overrides]


def recipe_precision() -> tuple[str, list[str]]:
    """How the recipe's precision is set, in words, and the overrides that set it: measured at start-up on
    this machine (train.amp: auto in the frozen config; each run's choice is in its env.json and run.json), no
    flag decides it. The baseline trains in fp32."""
    return "measured at start-up (train.amp: auto; each run's choice in its env.json)", []


def times_text(r: Run, targets: Sequence[float], consecutive: int) -> str:
    """'70%: 95.1 s, 75%: missed' for a run."""
    times = {t: r.time_to(t, consecutive) for t in targets}
    return ", ".join(f"{100 * t:g}%: " + ("missed" if s is None else f"{s:.1f} s") for t, s in times.items())


def run_side(side: str, config: str, seed: int, out: Path, targets: Sequence[float], consecutive: int,
             overrides: Sequence[str], recipe_overrides: Sequence[str], folder: str | None = None) -> Run:
    """One run of `side` with `config` on `seed` into out/`folder` (default SIDE_seedSEED; it must not exist
    yet), to the end."""
    run_dir = (out / (folder or f"{side}_seed{seed}")).resolve()
    if run_dir.exists():
        raise FileExistsError(f"{run_dir}: exists; give a fresh --out (run folders are never reused)")
    load_before = os.getloadavg()[0]
    if side == "baseline":
        seconds = common.run_logged(baseline_cmd(config, run_dir, seed, overrides), run_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="tta-cache-") as disk, \
                tempfile.TemporaryDirectory(prefix="tta-l2-", dir=RAM_DIR) as ram:
            seconds = common.run_logged(recipe_cmd(config, run_dir, Path(disk), Path(ram), seed,
                                        [*recipe_overrides, *overrides]), run_dir)
    r = read_run(side, seed, run_dir, seconds, load_before, os.getloadavg()[0], config)
    print(f"  {side} ({config}) seed {seed}: {times_text(r, targets, consecutive)}; final top-1 "
          f"{100 * r.final_top1:.2f}%, best {100 * r.best_top1:.2f}% in {len(r.top1)} epochs, process "
          f"{r.process_s:.1f} s, load {load_before:.1f} -> {r.load_after:.1f}", flush=True)
    (run_dir / "run.json").write_text(json.dumps({**asdict(r), "target_consecutive": consecutive}, indent=1) + "\n")
    return r


def load_runs(out: Path) -> tuple[list[Run], int]:
    """The finished runs under `out` (each run folder's run.json, written when the run ended), with the rule
    they were read by; only fresh seeds with every frozen config of both sides finished."""
    docs = [json.loads(p.read_text()) for p in sorted(out.glob("*_seed*/run.json"))]
    if not docs:
        raise FileNotFoundError(f"{out}: no finished run (no */run.json)")
    rules = {d.pop("target_consecutive") for d in docs}
    if len(rules) != 1:
        raise ValueError(f"{out}: runs read with different rules (evaluations in a row: {sorted(rules)})")
    runs = [Run(**d) for d in docs if d["seed"] >= FRESH_SEEDS_FROM]  # a tuning run is never evaluated
    done: dict[int, set[tuple[str, str]]] = {}
    for r in runs:
        done.setdefault(r.seed, set()).add((r.side, r.config))
    planned = {(side, config) for side in SIDES for config in side_configs(side)}
    runs = [r for r in runs if done[r.seed] == planned]
    runs.sort(key=lambda r: (Path(r.run_dir) / "run.json").stat().st_mtime)  # running order
    (consecutive,) = rules
    return runs, consecutive


# ---------------------------------------------------------------- the comparison

def report(runs: Sequence[Run], targets: dict[str, dict[str, Any]], consecutive: int) -> None:
    """The per-seed table (seconds to each target, from the comparison, each side with its config for that
    target; every run's final top-1) and a verdict line per target."""
    rows = []
    for i, seed in enumerate(next(iter(targets.values()))["seeds"]):
        mine = [r for r in runs if r.seed == seed]
        cells = ["-" if (s := res[f"{side}_s"][i]) is None else str(s) for res in targets.values() for side in SIDES]
        rows.append([seed, mine[0].side, *cells, " / ".join(f"{100 * r.final_top1:.1f}" for r in mine)])
    print_table(["seed", "first", *[f"{100 * float(t):g}% {side[0]}" for t in targets for side in SIDES],
                 "final top-1 (running order)"], rows)
    for t, res in targets.items():
        missed = "; ".join(f"{side} missed seeds {res['missed'][side]}" for side in SIDES if res["missed"][side])
        print(f"time to {100 * float(t):g}% top-1 ({consecutive} in a row), recipe / baseline, median of "
              f"{res['seeds_in_median']} seed(s) both reached: {res['ratio']}; bootstrap 90% interval "
              f"{res['interval']}; range {res['range']}" + (f"; {missed}" if missed else ""))


def config_record(path: str) -> dict[str, Any]:
    """A config file as it is in the repository, with its name."""
    return {"file": path, **yaml.safe_load((ROOT / path).read_text())}


def configs() -> dict[str, Any]:
    """Which config each side runs for each headline target, and every one of those files as it is."""
    return {"frozen": {side: {f"{t:g}": path for t, path in sorted(FROZEN[side].items())} for side in SIDES},
            "config_files": [config_record(path) for side in SIDES for path in side_configs(side)]}


def warm_page_cache(root: Path) -> int:
    """Read every file of the dataset once, so that neither side pays for cold disk reads (bytes read)."""
    return sum(len(p.read_bytes()) for p in root.rglob("*") if p.is_file())


def append_tuning(records: Sequence[Run], side: str, overrides: Sequence[str], targets: Sequence[float],
                  consecutive: int, precision: str, path: Path = TUNING_FILE, commit: str | None = None,
                  config: str | None = None, purpose: str = "tuning") -> Path:
    """Append tuning runs to the tuning history (a JSON list), with the date, machine, commit, the side's config
    file as it was (the overrides apply on top of it), the recipe's precision, each run's curve, its time to
    every target, its measured choices and the seconds measuring them took inside its time. `commit`: the one
    the runs ran at (default: now; the history file itself is a tracked file, so a second append would read as
    +dirty); `config`: the file the overrides applied to (default: the side's config for the first headline
    target); `purpose`: "tuning", or "ablation" for runs that only vary the exchange (counted apart from the
    tuning runs)."""
    history = json.loads(path.read_text()) if path.is_file() else []
    config_doc = config_record(config or config_for(side, HEADLINE[0]))
    machine = common.machine()
    for r in records:
        history.append({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "commit": commit or common.commit(), "choices": r.choices.get("choice"),
                        "choices_s": round(r.choices_s, 1),
                        "cpu": machine["cpu"], "cpu_widest": widest_flag(machine["cpu_flags"]),
                        "side": side, "purpose": purpose,
                        "overrides": list(overrides), "seed": r.seed,
                        "target_consecutive": consecutive,
                        "time_to_s": {f"{t:g}": r.time_to(t, consecutive) for t in targets},
                        "final_top1": round(r.final_top1, 4), "best_top1": round(r.best_top1, 4),
                        "epochs_run": len(r.top1), "top1": [round(x, 4) for x in r.top1],
                        "elapsed_s": [round(x, 1) for x in r.elapsed_s],
                        "load_before": r.load_before, "load_after": r.load_after, "config": config_doc,
                        "precision": precision if side == "recipe" else "fp32"})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history, indent=1) + "\n")
    return path


# ---------------------------------------------------------------- entry point

def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="scripts/bench/tta.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} fresh seeds instead of {FULL_SEEDS}")
    parser.add_argument("--seeds", type=int, default=0,
                        help=f"fresh seeds (default {FULL_SEEDS}; --quick: {QUICK_SEEDS})")
    parser.add_argument("--first-seed", type=int, default=FRESH_SEEDS_FROM, help="the first fresh seed")
    parser.add_argument("--targets", type=float, nargs="+", default=list(TARGETS),
                        help=f"top-1 targets (default {' '.join(f'{t:g}' for t in TARGETS)})")
    parser.add_argument("--consecutive", type=int, default=TARGET_CONSECUTIVE,
                        help=f"evaluations in a row at or above the target (default {TARGET_CONSECUTIVE})")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/bench_tta/<time>)")
    parser.add_argument("--tune", choices=SIDES, help="tuning: run one side with --set overrides on tuning seeds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="--tune: an override (baseline: option=value; recipe: dotted.config.key=value)")
    parser.add_argument("--tuning-seeds", type=int, nargs="+", default=[0], help="--tune: the seeds (< 100)")
    parser.add_argument("--ablation", action="store_true",
                        help="--tune recipe: the runs are the exchange's ablation (--set comm.kind=KIND or none), "
                             "recorded apart from the tuning runs")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"--tune: the config the overrides apply to (default: the side's for "
                             f"{100 * HEADLINE[0]:g}%%)")
    parser.add_argument("--from-runs", type=Path, metavar="OUT",
                        help="no training: the result of the finished runs in an earlier run's --out folder")
    common.add_results_option(parser)
    args = parser.parse_args(argv)
    common.record_run(args)
    seeds = args.seeds or (QUICK_SEEDS if args.quick else FULL_SEEDS)
    if seeds < 1 or not all(0 < t <= 1 for t in args.targets) or args.consecutive < 1:
        parser.error("--seeds and --consecutive must be >= 1 and --targets in (0, 1]")
    if args.tune is None and args.first_seed < FRESH_SEEDS_FROM:
        parser.error(f"--first-seed must be >= {FRESH_SEEDS_FROM}: lower seeds are tuning seeds")
    if args.tune is not None and any(not 0 <= s < FRESH_SEEDS_FROM for s in args.tuning_seeds):
        parser.error(f"--tuning-seeds must be in 0..{FRESH_SEEDS_FROM - 1}: higher seeds are the fresh ones")
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE")
    if args.ablation and (args.tune != "recipe" or any(not s.startswith("comm.kind=") for s in args.set)
                          or len(args.set) > 1):
        parser.error("--ablation goes with --tune recipe and at most one --set comm.kind=KIND")
    if args.config is not None and (args.tune is None or not (ROOT / args.config).is_file()):
        parser.error(f"--config {args.config}: goes with --tune and names a file under {ROOT}")
    from data import dali_available

    if not dali_available():
        reason = "needs NVIDIA DALI for the recipe side (pip install -r requirements.txt)"
        print(f"bench tta: skipped: {reason}")
        result = {"bench": result_name(common.machine()), "baseline": BASELINE, "skipped": reason, "ratio": None}
        print(json.dumps(result))
        return result
    from data.tta_photos import prepare

    root = prepare(ROOT / DATA)
    out = args.out or Path("runs/bench_tta") / time.strftime("%Y%m%d-%H%M%S")
    precision, precision_overrides = recipe_precision()
    machine = common.machine()
    print(f"# scripts/bench/tta.py: {machine['cpu']}, {machine['cores']} cores, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"{DATA}: ResNet-18, 2 processes x 1 CPU thread, runs to the end; targets "
          f"{', '.join(f'{100 * t:g}%' for t in args.targets)} top-1 at {args.consecutive} evaluations in a row; "
          f"recipe precision: {precision}; "
          f"{warm_page_cache(root) / 1e6:.0f} MB read once beforehand (page cache warm for both)", flush=True)
    if args.from_runs is not None:  # the seeds whose both runs finished, e.g. of a run stopped early
        runs, consecutive = load_runs(args.from_runs)
        return finish(runs, args.from_runs, args.targets, consecutive, precision, seeds)
    if args.tune is not None:
        config = args.config or config_for(args.tune, HEADLINE[0])
        runs = [run_side(args.tune, config, seed, out, args.targets, args.consecutive, args.set, precision_overrides)
                for seed in args.tuning_seeds]
        path = append_tuning(runs, args.tune, args.set, args.targets, args.consecutive, precision,
                             commit=common.start_commit(), config=config,
                             purpose="ablation" if args.ablation else "tuning")
        line = {"bench": "tta-tuning", "side": args.tune, "config": config, "overrides": args.set,
                "seeds": args.tuning_seeds,
                "time_to_s": [{f"{t:g}": r.time_to(t, args.consecutive) for t in args.targets} for r in runs],
                "final_top1": [r.final_top1 for r in runs], "history": str(path)}
        print(json.dumps(line))
        return line
    runs = [run_side(side, config, seed, out, args.targets, args.consecutive, (), precision_overrides,
                     run_folder(side, config, seed))
            for seed, side in seed_order(args.first_seed, seeds) for config in side_configs(side)]
    return finish(runs, out, args.targets, args.consecutive, precision, seeds)


def result_name(machine: dict[str, Any]) -> str:
    """tta-<cpu model>-<widest vector flag>: one results file per machine (the ranking changes with it)."""
    words = "".join(c if c.isalnum() else " " for c in machine["cpu"].replace("(R)", "").replace("(TM)", ""))
    widest = widest_flag(machine["cpu_flags"]).replace("_", "")
    return "tta-" + "-".join([*words.lower().split(), *([widest] if widest else [])])


def finish(runs: Sequence[Run], out: Path, targets: Sequence[float], consecutive: int, precision: str,
           planned: int) -> dict[str, Any]:
    """Plot, table, the result file and the last-line JSON of finished runs: per target the comparison (each
    side's runs of its config for that target), per headline target each side's final and best top-1, and the
    headline targets' ratios."""
    from trainer.tta_plot import plot

    png = plot([Path(r.run_dir) for r in runs], out / "tta.png", "top1", min(HEADLINE),
               [f"{run_label(r.side, r.config)} (seed {r.seed})" for r in runs],
               [SIDE_COLORS[r.side] for r in runs])
    by_target = {f"{t:g}": compare(runs_for(runs, t), t, consecutive) for t in sorted(set(targets) | set(HEADLINE))}
    report(runs, by_target, consecutive)
    seeds = by_target[f"{HEADLINE[0]:g}"]["seeds"]
    line = {"bench": result_name(common.machine()), "baseline": BASELINE, "dataset": str(DATA), "model": "resnet18",
            "target_consecutive": consecutive, "headline": [f"{t:g}" for t in HEADLINE],
            "recipe_precision": precision, "seeds_planned": planned, "complete": len(seeds) >= planned,
            **configs(), "runs": [asdict(r) for r in runs], "plot": str(png), "targets": by_target,
            "accuracy": {f"{t:g}": accuracy(runs_for(runs, t)) for t in HEADLINE},
            "ratio": by_target[f"{HEADLINE[0]:g}"]["ratio"]}
    path = common.write_result(line)
    if path is not None:
        print(f"# result written to {path}")
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
