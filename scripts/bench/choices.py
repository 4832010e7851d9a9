"""Measured choices against pinned ones: an epoch of the time-to-accuracy recipe with its defaults against every
pinned combination of precision and communicator, interleaved.

The recipe: configs/tta_recipe_cpu.yaml on 2 ranks (torchrun), one epoch at one phase's image size (global batch
64, evaluation at 48 px as in the frozen config). Variants:
  auto, measuring   the defaults (train.amp, train.channels_last, model.small_map_gemm and comm.kind at auto),
                    with an empty measured-choices cache: the start-up measurement runs;
  auto, cached      the same, right after, served from the cache the run before wrote;
  pinned            train.amp in {off, bf16} x comm.kind in {dense, hitopk}, with the layout and convolutions the
                    config pinned before measured choices existed (NCHW, GEMM on tiny maps).
Every round runs every variant once (the pinned ones in a rotated order); the data cache is filled by a warm-up
run first, so no variant pays the JPEG decoding. Per variant: the median over rounds of the epoch's seconds
(training and evaluation, `time/epoch_s` in metrics.jsonl) and of the seconds the measured choices took before
the clock (env.json). ratio = auto's epoch (measuring) over the fastest pinned combination's epoch, the worst
size; the start-up seconds are reported beside it, and with them added (a one-epoch run pays them once; a run
of E epochs spreads them over E).

    python -m scripts.bench.choices [--quick] [--sizes 24 40] [--rounds 2]
    python -m scripts.bench.choices --from-runs OUT      # the result of an earlier run's folders, no training
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from scripts.bench import common
from scripts.bench.common import print_table
from trainer.run_record import read_run_record

ROOT = common.REPO
CONFIG = "configs/tta_recipe_cpu.yaml"
DATA = Path("datasets/tta_photos")  # written by scripts/make_tta_photos.py if missing
PINNED = [(amp, kind) for amp in ("off", "bf16") for kind in ("dense", "hitopk")]
BEFORE = ["train.channels_last=false", "model.small_map_gemm=true"]  # what the config pinned before
DIRECT = [(f"amp {amp}, direct convs, dense", [f"train.amp={amp}", "comm.kind=dense", "train.channels_last=false",
                                               "model.small_map_gemm=false"]) for amp in ("off", "bf16")]
"""Pinned with oneDNN's convolutions on tiny maps too: the combinations the measurement may keep."""


def run(out: Path, overrides: Sequence[str], size: int, data_cache: Path) -> dict[str, Any]:
    """One epoch on 2 ranks into `out`; its epoch seconds, start-up seconds and decision."""
    phase = f"schedule.phases=[{{start_epoch: 0, end_epoch: 1, image_size: {size}, batch_size: 64, val_image_size: 48}}]"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "recipes.resnet50", "--config", CONFIG, f"log.dir={out}", "train.epochs=1", phase,
           f"data.root={DATA}", f"data.cache.dir={data_cache / 'disk'}", f"data.cache.ram_dir={data_cache / 'ram'}",
           "train.target_top1=0", "log.progress=false", "log.tensorboard=false", *overrides]
    common.run_logged(cmd, out)
    return read(out)


def read(out: Path) -> dict[str, Any]:
    """A finished run's epoch seconds, start-up seconds, decision and accuracy."""
    epoch = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if '"time/epoch_s"' in line)
    choices = (read_run_record(out) or {}).get("choices") or {}
    said = [line for line in (out / "train.log").read_text().splitlines() if line.startswith("comm auto")]
    return {"epoch_s": float(epoch["time/epoch_s"]), "startup_s": float(choices.get("seconds", 0.0)),
            "choice": choices.get("choice"), "source": choices.get("source"), "top1": float(epoch["eval/top1"]),
            "comm_auto": said[-1] if said else None}


def variants(round_index: int, cache: Path) -> list[tuple[str, list[str]]]:
    pinned = [(f"amp {amp}, {kind}", [f"train.amp={amp}", f"comm.kind={kind}", *BEFORE]) for amp, kind in PINNED]
    pinned += DIRECT
    k = round_index % len(pinned)
    auto = [("auto, measuring", [f"train.choices_cache={cache}"]), ("auto, cached", [f"train.choices_cache={cache}"])]
    order = pinned[k:] + pinned[:k]
    return order[:2] + auto + order[2:] if round_index % 2 else auto + order


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = common.bench_parser("choices", __doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="image sizes (default 24 40; --quick: 24)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per size (default 2; --quick: 1)")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/bench_choices/<time>)")
    parser.add_argument("--from-runs", type=Path, metavar="OUT", help="no training: the result of OUT's run folders")
    args = parser.parse_args(argv)
    common.record_run(args)
    sizes = args.sizes or ([24] if args.quick else [24, 40])
    rounds = args.rounds or (1 if args.quick else 2)
    if args.from_runs:
        return finish(from_runs(args.from_runs.resolve()), rounds)
    out = (args.out or ROOT / "runs" / "bench_choices" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if not (ROOT / DATA / "train").is_dir():
        subprocess.run([sys.executable, "scripts/make_tta_photos.py", "--out", str(DATA)], cwd=ROOT, check=True)
    machine = common.machine()
    print(f"# scripts/bench/choices.py: {machine['cpu']} ({', '.join(machine['cpu_flags'])}), 2 ranks; sizes "
          f"{sizes}, {rounds} round(s) each; run folders in {out}", flush=True)
    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="choices-data-") as data_cache:
        data_cache = Path(data_cache)
        run(out / "warm-up", ["train.amp=off", "comm.kind=dense", *BEFORE], sizes[0], data_cache)  # fills the cache
        for size in sizes:
            runs: dict[str, list[dict[str, Any]]] = {}
            for r in range(rounds):
                cache = out / f"choices-cache-{size}-{r}"  # empty: the measuring run fills it for the cached one
                for name, overrides in variants(r, cache):
                    folder = out / folder_name(size, r, name)
                    result = run(folder, overrides, size, data_cache)
                    runs.setdefault(name, []).append(result)
                    print(f"  {size} px round {r}: {name}: epoch {result['epoch_s']:.1f} s + start-up "
                          f"{result['startup_s']:.1f} s; {result['choice']}", flush=True)
            cells[str(size)] = summarize(runs)
    return finish(cells, rounds)


def folder_name(size: int, round_index: int, name: str) -> str:
    return f"{size}px-r{round_index}-{name.replace(', ', '-').replace(' ', '_')}"


def from_runs(out: Path) -> dict[str, Any]:
    """The cells of an earlier run's folders under `out` (each folder's metrics.jsonl and env.json)."""
    names = ["auto, measuring", "auto, cached", *(f"amp {amp}, {kind}" for amp, kind in PINNED),
             *(name for name, _ in DIRECT)]
    cells: dict[str, Any] = {}
    for size in sorted({int(p.name.split("px-")[0]) for p in out.glob("*px-r*")}):
        runs: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            for folder in sorted(out.glob(f"{size}px-r*-{folder_name(size, 0, name).split('-r0-')[1]}")):
                runs.setdefault(name, []).append(read(folder))
        cells[str(size)] = summarize(runs)
    if not cells:
        raise FileNotFoundError(f"{out}: no run folders (SIZEpx-rR-VARIANT)")
    return cells


def finish(cells: dict[str, Any], rounds: int) -> dict[str, Any]:
    rows = [[f"{size} px", name, v["epoch_s"], v["startup_s"], v["epoch_ratio"], v["vs_best_pinned"], v["choice"]]
            for size, cell in cells.items() for name, v in cell["variants"].items()]
    print_table(["size", "variant", "epoch s", "start-up s", "epoch / best pinned", "with start-up", "choice"],
                rows)
    worst = max(cell["auto_over_best_pinned"] for cell in cells.values())
    return common.emit_result(
        "choices", "the fastest pinned combination of precision (fp32, bf16) and communicator (dense, hitopk), "
        "NCHW with GEMM convolutions on tiny maps, the same epoch, interleaved", worst, sizes=[int(s) for s in cells],
        rounds=rounds, cells=cells,
        with_startup=round(max(cell["auto_with_startup_over_best_pinned"] for cell in cells.values()), 3),
        cached_over_measuring=round(max(cell["cached_over_measuring"] for cell in cells.values()), 3))


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per variant, and auto's ratios over the fastest pinned epoch: its epoch, and its epoch with the
    start-up; cached over measuring (epoch + start-up)."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        epoch = statistics.median(r["epoch_s"] for r in results)
        startup = statistics.median(r["startup_s"] for r in results)
        out[name] = {"epoch_s": round(epoch, 2), "startup_s": round(startup, 2), "total_s": round(epoch + startup, 2),
                     "epochs_s": [r["epoch_s"] for r in results], "choice": results[-1]["choice"],
                     "choices": [r["choice"] for r in results], "plans": [r["comm_auto"] for r in results],
                     "sources": [r["source"] for r in results], "top1": [r["top1"] for r in results]}
    best_name = min((n for n in out if not n.startswith("auto")), key=lambda n: out[n]["epoch_s"])
    best = out[best_name]["epoch_s"]
    for v in out.values():
        v["epoch_ratio"] = round(v["epoch_s"] / best, 3)
        v["vs_best_pinned"] = round(v["total_s"] / best, 3)
    return {"variants": out, "best_pinned": best_name,
            "auto_over_best_pinned": out["auto, measuring"]["epoch_s"] / best,
            "auto_with_startup_over_best_pinned": out["auto, measuring"]["total_s"] / best,
            "cached_over_measuring": out["auto, cached"]["total_s"] / out["auto, measuring"]["total_s"]}


if __name__ == "__main__":
    main()
