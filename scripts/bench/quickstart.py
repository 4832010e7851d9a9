"""The quickstarts as a user runs them, timed: `make quickstart`'s training (the ResNet recipe on the digits, 2 CPU
ranks) twice, first with an empty measured-choices cache, then served from it, and `make transformer-quickstart`'s
training once; what each reached and what its start-up measurement cost.

Per run: the process's wall seconds (torchrun start to exit), the trainer's clock (`elapsed_s`), time to the
target, the final scores, and the seconds the measured choices took before the clock (env.json) with their share
of the wall time. With --fresh-clone N, first `make quickstart` itself N times, each in a fresh clone of HEAD (its
venv set up from scratch; pip's download cache is this machine's) with an empty measured-choices cache. ratio =
the median over the fresh clones of (start-up seconds / `make quickstart` seconds) (with --fresh-clone), else the
measuring run's start-up seconds / its training wall seconds.

    python -m scripts.bench.quickstart [--quick] [--fresh-clone [N]]   (--quick: the ResNet runs only)
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from scripts.bench import common
from scripts.bench.common import print_table
from trainer.run_record import read_run_record

ROOT = common.REPO
RESNET = ("configs/quickstart_cpu.yaml", "recipes.resnet50", "datasets/digits",
          [sys.executable, "scripts/prepare_digits.py", "--out", "datasets/digits"])
TRANSFORMER = ("configs/transformer_quickstart_cpu.yaml", "recipes.transformer", "datasets/synthetic_en_de",
               [sys.executable, "scripts/prepare_synthetic_translation.py", "--out", "datasets/synthetic_en_de"])


def train(name: str, recipe: tuple, out: Path, cache: Path) -> dict[str, Any]:
    """One quickstart training into `out` (2 ranks), with the measured-choices cache `cache`."""
    config, module, _, _ = recipe
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", module,
           "--config", config, f"log.dir={out}", f"train.choices_cache={cache}", "log.progress=false"]
    wall = common.run_logged(cmd, out)
    summary = json.loads((out / "summary.json").read_text())
    choices = (read_run_record(out) or {}).get("choices") or {}
    startup = float(choices.get("seconds", 0.0))
    scores = {k: summary.get(k) for k in ("final_top1", "final_top5", "final_bleu", "test_bleu",
                                          "test_bleu_untrained") if summary.get(k) is not None}
    print(f"  {name}: {wall:.1f} s wall, clock {summary['elapsed_s']:.1f} s, start-up {startup:.1f} s "
          f"({choices.get('source')}: {choices.get('choice')}); {scores}", flush=True)
    return {"wall_s": round(wall, 1), "elapsed_s": round(summary["elapsed_s"], 1),
            "time_to_target_s": summary["time_to_target_s"], "epochs_run": summary["epochs_run"],
            "startup_s": round(startup, 2), "startup_share": round(startup / wall, 4),
            "choice": choices.get("choice"), "source": choices.get("source"), **scores}


def fresh_clone(out: Path) -> dict[str, Any]:
    """`make quickstart` in a fresh clone of HEAD under `out` (created), timed whole (venv, data, training,
    report), and its venv set-up (`make setup`, which `make quickstart` runs first) on its own. The clone's venv
    and data are removed once read (several GB each); its run folder and log stay."""
    out.mkdir(parents=True)
    clone = out / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    cache = out / "cache-fresh"
    start = time.perf_counter()
    with open(out / "make-quickstart.log", "w") as log:
        # `make quickstart` sets the venv up first; run as its own make call, the same step is timed alone
        done = subprocess.run(["make", "setup"], cwd=clone, stdout=log, stderr=subprocess.STDOUT)
        setup = time.perf_counter() - start
        if not done.returncode:
            done = subprocess.run(["make", "quickstart", f"ARGS=train.choices_cache={cache} log.progress=false"],
                                  cwd=clone, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"make quickstart in {clone} exited with status {done.returncode}; see "
                           f"{out / 'make-quickstart.log'}")
    run = clone / "runs" / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    startup = float(((read_run_record(run) or {}).get("choices") or {}).get("seconds", 0.0))
    for bulky in (".venv", "datasets"):
        shutil.rmtree(clone / bulky, ignore_errors=True)
    print(f"  make quickstart, fresh clone: {wall:.1f} s (of which make setup {setup:.1f} s), start-up "
          f"{startup:.1f} s ({startup / wall:.1%}); top-1 {summary.get('final_top1')}", flush=True)
    return {"wall_s": round(wall, 1), "setup_s": round(setup, 1), "elapsed_s": round(summary["elapsed_s"], 1),
            "time_to_target_s": summary["time_to_target_s"], "epochs_run": summary["epochs_run"],
            "startup_s": round(startup, 2), "startup_share": round(startup / wall, 4),
            "final_top1": summary.get("final_top1"), "final_top5": summary.get("final_top5")}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = common.bench_parser("quickstart", __doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/bench_quickstart/<time>)")
    parser.add_argument("--fresh-clone", type=int, nargs="?", const=1, default=0, metavar="N",
                        help="also time `make quickstart` N times (default 1), each in a fresh clone of HEAD "
                             "(each sets up its own venv)")
    args = parser.parse_args(argv)
    common.record_run(args)
    out = (args.out or ROOT / "runs" / "bench_quickstart" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    recipes = [RESNET] if args.quick else [RESNET, TRANSFORMER]
    for _, _, data, prepare in recipes:
        if not (ROOT / data).is_dir():
            subprocess.run(prepare, cwd=ROOT, check=True)
    machine = common.machine()
    print(f"# scripts/bench/quickstart.py: {machine['cpu']} ({', '.join(machine['cpu_flags'])}), 2 ranks; run "
          f"folders in {out}", flush=True)
    clones = [f"make quickstart, fresh clone{f' {i + 1}' if args.fresh_clone > 1 else ''}"
              for i in range(args.fresh_clone)]
    runs = {name: fresh_clone(out / f"fresh-{i}") for i, name in enumerate(clones)}
    runs |= {"resnet, measuring": train("resnet, measuring", RESNET, out / "resnet-measuring", out / "cache"),
            "resnet, cached": train("resnet, cached", RESNET, out / "resnet-cached", out / "cache")}
    if not args.quick:
        runs["transformer, measuring"] = train("transformer, measuring", TRANSFORMER, out / "transformer",
                                               out / "cache")
    print_table(["run", "wall s", "clock s", "start-up s", "start-up share", "scores"],
                [[name, r["wall_s"], r["elapsed_s"], r["startup_s"], r["startup_share"],
                  ", ".join(f"{k} {v:.4g}" for k, v in r.items() if k.startswith(("final_", "test_")))]
                 for name, r in runs.items()])
    measuring = runs["resnet, measuring"]
    shares = [runs[name]["startup_s"] / runs[name]["wall_s"] for name in clones]
    return common.emit_result(
        "quickstart", f"make quickstart on {len(clones)} fresh clone(s) (start-up share, median)" if clones else
        "the measuring quickstart's own wall time (start-up share)",
        statistics.median(shares) if shares else measuring["startup_s"] / measuring["wall_s"], runs=runs,
        fresh_clone_shares=[round(share, 4) for share in shares],
        training_startup_share=measuring["startup_share"],
        cached_startup_share=runs["resnet, cached"]["startup_share"])


if __name__ == "__main__":
    main()
