"""Measured choices against pinned ones: the time-to-accuracy recipe with its defaults against pinned combinations of
precision, convolutions and communicator, interleaved.

Two modes, both on configs/tta_recipe_cpu.yaml on 2 ranks (torchrun), the data cache filled by a warm-up run first
(no variant pays the JPEG decoding):
  run (default)   the whole recipe: its 10 epochs and phase table (24, 32, 40 px), run to the end (no target
                  stop), so the start-up measurement works with the recipe's own budget and the communicator's
                  own measurement is spread over the run as in a real one. Per variant: the training clock (the
                  epochs' seconds, evaluations included) and the start-up seconds before it.
  --screen        one epoch per image size (`--sizes`) of every pinned combination: cheap, to see which pinned
                  combinations can be the fastest; the run mode takes those within SCREEN_BOUND of the best at
                  every size from the screen's results file when it ran on this machine (CPU model and flags),
                  with the combinations it did not screen (or `--pinned`).
Variants: `auto, measuring` (the defaults: train.amp, train.channels_last, model.small_map_gemm, comm.kind at
auto; an empty measured-choices cache), `auto, cached` (the same right after, served from the cache the run before
wrote), and pinned combinations: train.amp in {off, bf16} x comm.kind in {dense, hitopk} x NCHW with the GEMM
convolutions on tiny maps (the config's settings before measured choices existed) or oneDNN's ("direct convs").
Every round runs every variant once, the pinned ones in a rotated order. Per variant: the median over rounds.
ratio = auto's training clock (measuring run) over the fastest pinned variant's, the start-up reported beside it.

    python -m scripts.bench.choices [--quick] [--rounds 3] [--pinned NAME ...]
    python -m scripts.bench.choices --screen [--sizes 24 40] [--rounds 1]
    python -m scripts.bench.choices [--screen] --from-runs OUT   # the result of earlier run folders, no training
"""

from __future__ import annotations

import itertools
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
from trainer.tta_stats import epoch_records

ROOT = common.REPO
CONFIG = "configs/tta_recipe_cpu.yaml"
DATA = Path("datasets/tta_photos")  # written by scripts/make_tta_photos.py if missing
GEMM = ["train.channels_last=false", "model.small_map_gemm=true"]  # what the config pinned before
DIRECT = ["train.channels_last=false", "model.small_map_gemm=false"]
PINNED = {(f"amp {amp}, {kind}" if convs is GEMM else f"amp {amp}, direct convs, {kind}"):
          [f"train.amp={amp}", f"comm.kind={kind}", *convs]
          for convs in (GEMM, DIRECT) for amp in ("off", "bf16") for kind in ("dense", "hitopk")}
"""Every pinned combination, by name."""
AUTO = ("auto, measuring", "auto, cached")
SCREEN_BOUND = 1.3
"""The run mode's pinned variants by default: those whose screened epoch is within this factor of the fastest
pinned epoch at every screened size."""


def train(out: Path, overrides: Sequence[str], data_cache: Path, extra: Sequence[str]) -> dict[str, Any]:
    """One run on 2 ranks into `out`; what `read` reads from it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "recipes.resnet50", "--config", CONFIG, f"log.dir={out}", f"data.root={DATA}",
           f"data.cache.dir={data_cache / 'disk'}", f"data.cache.ram_dir={data_cache / 'ram'}",
           "train.target_top1=0", "log.progress=false", "log.tensorboard=false", *extra, *overrides]
    common.run_logged(cmd, out)
    return read(out)


def one_epoch(size: int) -> list[str]:
    return ["train.epochs=1", f"schedule.phases=[{{start_epoch: 0, end_epoch: 1, image_size: {size}, batch_size: 64, "
                              f"val_image_size: 48}}]"]


def read(out: Path) -> dict[str, Any]:
    """A finished run's training clock (its epochs' seconds), start-up seconds, decision, accuracy and commit."""
    epochs = epoch_records(out)  # the recipe evaluates every epoch
    record = read_run_record(out) or {}
    choices = record.get("choices") or {}
    said = [line for line in (out / "train.log").read_text().splitlines() if line.startswith("comm auto")]
    return {"clock_s": sum(e["time/epoch_s"] for e in epochs), "epochs_s": [e["time/epoch_s"] for e in epochs],
            "startup_s": float(choices.get("seconds", 0.0)), "choice": choices.get("choice"),
            "source": choices.get("source"), "top1": float(epochs[-1]["eval/top1"]),
            "comm_auto": said[-1] if said else None, "commit": record.get("git_commit")}


def variants(round_index: int, cache: Path, pinned: Sequence[str]) -> list[tuple[str, list[str]]]:
    k = round_index % max(1, len(pinned))
    # a pinned hitopk still measures comm.selection: not from, nor into, the user's cache
    order = [(name, [*PINNED[name], "train.choices_cache=none"]) for name in [*pinned[k:], *pinned[:k]]]
    auto = [(name, [f"train.choices_cache={cache}"]) for name in AUTO]
    return order[:2] + auto + order[2:] if round_index % 2 else auto + order


def within_bound(cells: dict[str, Any]) -> list[str]:
    """The pinned variants the screen cannot rule out: within SCREEN_BOUND of the fastest pinned epoch at every
    size of screen cells, or not screened at all."""
    return [name for name in PINNED if all(name not in cell["variants"] or
                                           cell["variants"][name]["epoch_ratio"] <= SCREEN_BOUND
                                           for cell in cells.values())]


def screened(path: Path) -> list[str]:
    """The pinned variants a screen's results file keeps; every pinned variant when the screen ran on another
    machine (another CPU model or instruction-set flags: the ranking changes with them)."""
    record = json.loads(path.read_text())
    here = common.machine()
    if (record["machine"]["cpu"], record["machine"]["cpu_flags"]) != (here["cpu"], here["cpu_flags"]):
        print(f"# {path} was screened on {record['machine']['cpu']} {record['machine']['cpu_flags']}, not this "
              "machine: every pinned combination runs", flush=True)
        return list(PINNED)
    return within_bound(record["result"]["cells"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = common.bench_parser("choices", __doc__.splitlines()[0])
    parser.add_argument("--screen", action="store_true", help="one epoch per size of every pinned combination")
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 40], help="--screen: image sizes (default 24 40)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default: 3, --screen 1; --quick: 1)")
    parser.add_argument("--pinned", nargs="+", choices=sorted(PINNED), default=None,
                        help="run mode: the pinned variants (default: those the screen's results file keeps)")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/bench_choices/<time>)")
    parser.add_argument("--from-runs", type=Path, metavar="OUT", help="no training: the result of OUT's run folders")
    args = parser.parse_args(argv)
    common.record_run(args)
    rounds = args.rounds or (1 if args.quick or args.screen else 3)
    if args.from_runs:
        return finish_screen(screen_from_runs(args.from_runs.resolve()), rounds) if args.screen else \
            finish(summarize(runs_from(args.from_runs.resolve())), rounds)
    screen_file = Path(args.results_dir or common.RESULTS_DIR) / "choices_screen.json"
    pinned = list(PINNED) if args.screen else args.pinned or (screened(screen_file) if screen_file.exists()
                                                               else list(PINNED))
    out = (args.out or ROOT / "runs" / "bench_choices" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if not (ROOT / DATA / "train").is_dir():
        subprocess.run([sys.executable, "scripts/make_tta_photos.py", "--out", str(DATA)], cwd=ROOT, check=True)
    machine = common.machine()
    what = f"one epoch at {args.sizes} px" if args.screen else "the whole recipe"
    print(f"# scripts/bench/choices.py: {machine['cpu']} ({', '.join(machine['cpu_flags'])}), 2 ranks; {what}, "
          f"{rounds} round(s); pinned {pinned}; run folders in {out}", flush=True)
    extra = one_epoch(args.sizes[0]) if args.quick and not args.screen else []
    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="choices-data-") as data_cache:
        data_cache = Path(data_cache)
        train(out / "warm-up", PINNED["amp off, dense"], data_cache, one_epoch(args.sizes[0]))  # fills the cache
        for size in args.sizes if args.screen else [None]:
            runs: dict[str, list[dict[str, Any]]] = {}
            for r in range(rounds):
                cache = out / f"choices-cache-{size or 'run'}-{r}"  # empty: the measuring run fills it
                for name, overrides in variants(r, cache, pinned):
                    result = train(out / folder_name(size, r, name), overrides, data_cache,
                                   one_epoch(size) if size else extra)
                    runs.setdefault(name, []).append(result)
                    print(f"  {f'{size} px ' if size else ''}round {r}: {name}: clock {result['clock_s']:.1f} s + "
                          f"start-up {result['startup_s']:.1f} s; {result['choice']}", flush=True)
            if size is None:
                return finish(summarize(runs), rounds, pinned=pinned)
            cells[str(size)] = summarize(runs)
    return finish_screen(cells, rounds)


def folder_name(size: int | None, round_index: int, name: str) -> str:
    return f"{f'{size}px-' if size else ''}r{round_index}-{name.replace(', ', '-').replace(' ', '_')}"


def runs_from(out: Path, size: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """An earlier run's results per variant, from its folders under `out`."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in itertools.count():
        found = [name for name in [*AUTO, *PINNED] if (out / folder_name(size, r, name)).is_dir()]
        if not found:
            break
        for name in found:
            runs.setdefault(name, []).append(read(out / folder_name(size, r, name)))
    if not runs:
        raise FileNotFoundError(f"{out}: no run folders ({'SIZEpx-' if size else ''}rROUND-VARIANT)")
    return runs


def screen_from_runs(out: Path) -> dict[str, Any]:
    sizes = sorted({int(p.name.split("px-")[0]) for p in out.glob("*px-r*")})
    return {str(size): summarize(runs_from(out, size)) for size in sizes}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per variant, and auto's ratios over the fastest pinned variant: its clock, and its clock with the
    start-up; cached over measuring (clock and start-up)."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        clock = statistics.median(r["clock_s"] for r in results)
        startup = statistics.median(r["startup_s"] for r in results)
        out[name] = {"clock_s": round(clock, 2), "startup_s": round(startup, 2), "total_s": round(clock + startup, 2),
                     "clocks_s": [round(r["clock_s"], 2) for r in results],
                     "epochs_s": [[round(e, 2) for e in r["epochs_s"]] for r in results],
                     "choice": results[-1]["choice"], "choices": [r["choice"] for r in results],
                     "plans": [r["comm_auto"] for r in results], "sources": [r["source"] for r in results],
                     "top1": [r["top1"] for r in results],
                     "commits": sorted({r["commit"] for r in results if r.get("commit")})}
    best_name = min((n for n in out if n not in AUTO), key=lambda n: out[n]["clock_s"])
    best = out[best_name]["clock_s"]
    for v in out.values():
        v["epoch_ratio"] = round(v["clock_s"] / best, 3)
        v["vs_best_pinned"] = round(v["total_s"] / best, 3)
    cell = {"variants": out, "best_pinned": best_name}
    if all(name in out for name in AUTO):
        cell.update(auto_over_best_pinned=out[AUTO[0]]["clock_s"] / best,
                    auto_with_startup_over_best_pinned=out[AUTO[0]]["total_s"] / best,
                    cached_over_measuring=out[AUTO[1]]["total_s"] / out[AUTO[0]]["total_s"])
    return cell


def finish(cell: dict[str, Any], rounds: int, pinned: Sequence[str] = ()) -> dict[str, Any]:
    rows = [[name, v["clock_s"], v["startup_s"], v["epoch_ratio"], v["vs_best_pinned"], v["top1"], v["choice"]]
            for name, v in cell["variants"].items()]
    print_table(["variant", "clock s", "start-up s", "clock / best pinned", "with start-up", "top-1", "choice"], rows)
    return common.emit_result(
        "choices", "the fastest pinned combination of precision, convolutions and communicator (screened), the "
        "whole TTA recipe, interleaved", cell["auto_over_best_pinned"], rounds=rounds, cell=cell,
        pinned=list(pinned or (n for n in cell["variants"] if n not in AUTO)),
        with_startup=round(cell["auto_with_startup_over_best_pinned"], 3),
        cached_over_measuring=round(cell["cached_over_measuring"], 3))


def finish_screen(cells: dict[str, Any], rounds: int) -> dict[str, Any]:
    rows = [[f"{size} px", name, v["clock_s"], v["startup_s"], v["epoch_ratio"], v["choice"]]
            for size, cell in cells.items() for name, v in cell["variants"].items()]
    print_table(["size", "variant", "epoch s", "start-up s", "epoch / best pinned", "choice"], rows)
    worst = max(cell.get("auto_over_best_pinned", float("nan")) for cell in cells.values())
    return common.emit_result(
        "choices_screen", "the fastest pinned combination's epoch at each size", worst, sizes=[int(s) for s in cells],
        rounds=rounds, cells=cells, bound=SCREEN_BOUND, kept=within_bound(cells))


if __name__ == "__main__":
    main()
