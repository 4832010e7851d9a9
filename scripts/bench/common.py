"""Shared helpers for scripts/bench/*: arguments, timing, a readable table, the final JSON line.

Every benchmark prints a table and, as its very last line, one JSON object
``{"bench": NAME, "baseline": WHAT, ..., "ratio": X}`` with X measured against the baseline in the
same run (machines here are shared and noisy; only same-run ratios are comparable). The same object, with
the date, the machine, the commit and the command added, is written to ``docs/results/NAME.json``
(``NAME.quick.json`` for ``--quick``), the files the README's and docs' tables are generated from.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from trainer.config import git_commit
from trainer.run_record import cpu_info, device_name, kernel_flags

DEFAULT_THREADS = 2  # the CPU box has two cores
REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "docs" / "results"
_run: dict[str, Any] = {}  # what parse_args saw: where and under which name emit_result writes


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    parser = argparse.ArgumentParser(prog=f"scripts/bench/{name}.py", description=description)
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repeats (seconds, for CI)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"torch intra-op CPU threads (default {DEFAULT_THREADS})")
    parser.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda")
    add_results_option(parser)
    return parser


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """--results-dir: where emit_result writes the result file ('' writes none)."""
    parser.add_argument("--results-dir", default=str(RESULTS_DIR),
                        help="write the result JSON here as BENCH.json (BENCH.quick.json with --quick); '' = don't")


def record_run(args: argparse.Namespace) -> None:
    """Remember the parsed arguments of this run for emit_result (parse_args calls it; benches with their own
    argument handling call it themselves)."""
    _run.update(results_dir=getattr(args, "results_dir", ""), quick=bool(getattr(args, "quick", False)),
                threads=getattr(args, "threads", None), device=str(getattr(args, "device", "cpu")),
                load_at_start=os.getloadavg(), commit=commit())  # the code the run starts with


def machine() -> dict[str, Any]:
    """The CPU model, cores, the instruction-set flags that change kernel choices, the GPU (if any) and torch."""
    info: dict[str, Any] = {"cpu": cpu_info()["model"], "cores": os.cpu_count(), "cpu_flags": kernel_flags(),
                            "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def commit() -> str:
    """HEAD's hash, with '+dirty' when tracked files differ from it ('unknown' outside a git checkout)."""
    return git_commit()


def start_commit() -> str:
    """The commit the run started at (recorded by `record_run`; now, for a run that did not call it)."""
    return _run.get("commit") or commit()


def write_result(result: Mapping[str, Any], folder: str | None = None) -> Path | None:
    """Write `result` with its provenance (date, machine, the commit the run started at, command, load) to
    `folder` (default: the results folder of the run's --results-dir)."""
    folder = _run.get("results_dir", str(RESULTS_DIR)) if folder is None else folder
    if not folder:
        return None
    name = f"{result['bench']}{'.quick' if _run.get('quick') else ''}.json"
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "commit": start_commit(),
              "command": shlex.join([Path(sys.executable).name, "-m", _module_name(), *sys.argv[1:]]),
              "threads": _run.get("threads"), "device": _run.get("device"), "quick": _run.get("quick", False),
              "load_avg_1min": {"start": _run.get("load_at_start", (None,))[0], "end": os.getloadavg()[0]},
              "result": dict(result)}
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    return path


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else sys.argv[0]


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
               ) -> argparse.Namespace:
    """Parses argv, applies --threads and prints where the numbers come from."""
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    record_run(args)
    device = torch.device(args.device)
    where = device_name(device)
    print(f"# {parser.prog}: {where}, {args.threads} CPU threads, torch {torch.__version__}, "
          f"{'quick' if args.quick else 'full'} size; median of repeats, warm-up excluded")
    return args


def median_ms(fns: Mapping[str, Callable[[], Any]], repeats: int,
              device: torch.device | str = "cpu", warmup: int = 1) -> dict[str, float]:
    """Median wall time in ms of each fn over `repeats` calls, after `warmup` calls each.

    The calls are interleaved (a, b, c, a, b, c, ...) so that load from other processes on a shared
    machine falls on every contender alike.
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def twin_resnets(arch: str, switch: Callable[[torch.nn.Module], Any]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two torchvision `arch` models (10 classes) with the same weights, the second after `switch` (a kernel
    path that changes what its layers run, not their parameters): a stock baseline and its contender."""
    import torchvision  # only the model benches need it

    torch.manual_seed(0)
    stock = getattr(torchvision.models, arch)(num_classes=10)
    switched = getattr(torchvision.models, arch)(num_classes=10)
    switched.load_state_dict(stock.state_dict())
    switch(switched)
    return stock, switched


def real_image_batches(count: int, batch: int, size: int, quick: bool = False, seed: int = 0
                       ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """`count` training batches of real photos, and the number of classes: the ImageNet-like folder's JPEGs
    (generated if missing, as the data benches do) decoded by torchvision with a random-resized crop to
    `size` px, flip and normalization, in a fixed order from `seed`."""
    from torchvision import datasets, transforms  # only the benches that train on photos need them

    from data.imagenet_like import prepare
    root = prepare(Path(f"datasets/imagenet_like{'_quick' if quick else ''}"), train=1000 if quick else 3000,
                   val=64)
    torch.manual_seed(seed)
    folder = datasets.ImageFolder(str(root / "train"), transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(seed))[:count * batch].tolist()
    batches = []
    for b in range(count):
        samples = [folder[i] for i in order[b * batch:(b + 1) * batch]]
        batches.append((torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])))
    return batches, len(folder.classes)


@contextlib.contextmanager
def cpu_burners(count: int) -> Iterator[None]:
    """`count` child processes that spin on the CPU while the block runs: a load that the bench itself makes,
    so a "loaded" figure can be reproduced on a quiet machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _cell(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each worker in a session of its own, so a process group does
    not hold them), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process has just exited
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def end_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (no process outside its tree)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_logged(cmd: Sequence[str], out: Path, timeout_s: float | None = None,
               env: Mapping[str, str] | None = None) -> float:
    """Run `cmd` from the repository root to its end, its output in out/train.log (`out` is created, and must not
    exist); its wall seconds. `env`: variables set on top of this process's environment. A non-zero exit raises,
    with the command, its status and the log's last lines. A run that outlives `timeout_s`, or a bench
    interrupted meanwhile, ends the run's whole process tree (torchrun's workers included) before raising:
    nothing is left running to load the next measurement."""
    out.mkdir(parents=True, exist_ok=False)
    start = time.perf_counter()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen(list(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env} if env else None)
        try:
            proc.wait(timeout=timeout_s)
        except BaseException:  # the timeout, Ctrl-C
            end_tree(proc.pid)
            proc.wait()
            raise
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "".join((out / "train.log").read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(cmd)}\nexited with status {proc.returncode}; last lines of "
                           f"{out / 'train.log'}:\n{tail}")
    return seconds


def netem_skip_reason() -> str | None:
    """Why this machine cannot run the emulated cluster of scripts/netem (None when it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces and tc shaping); run it with sudo"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc (apt-get install iproute2)"
    return None


def netem(script: str, *args: str, env: Mapping[str, str], bench: str, quiet: bool = False) -> None:
    """Run scripts/netem/SCRIPT with the cluster variables `env` (NETEM_PREFIX, NETEM_SUBNET: each bench's own
    cluster, so tearing it down touches no other); show its last lines and exit naming `bench` if it fails.

    quiet: print nothing on success (cluster.sh's status table); otherwise only the worker's progress
    lines (indented), as they come - torchrun's own warnings and c10d's exit-barrier noise stay out."""
    import collections

    tail: collections.deque[str] = collections.deque(maxlen=60)
    with subprocess.Popen([str(REPO / "scripts" / "netem" / script), *args], env={**os.environ, **env}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not quiet and line.startswith("  "):
                print(line, end="", flush=True)
    if proc.returncode:
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"bench {bench}: scripts/netem/{script} {' '.join(args)} failed with status {proc.returncode}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints rows under headers in aligned columns (floats: 3 significant digits, no exponent)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "-+-".join("-" * w for w in widths)
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line)
    for row in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def emit_result(bench: str, baseline: str, ratio: float, **fields: Any) -> dict[str, Any]:
    """Prints the final one-line JSON object, writes it to the results folder (with its provenance) and
    returns it."""
    result = {"bench": bench, "baseline": baseline, **fields, "ratio": round(ratio, 3)}
    path = write_result(result)
    if path is not None:
        print(f"# result written to {path}")
    print(json.dumps(result))
    return result
