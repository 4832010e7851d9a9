"""Shared helpers for scripts/bench/*: arguments, timing, a readable table, the final JSON line.

Every benchmark prints a table and, as its very last line, one JSON object
``{"bench": NAME, "baseline": WHAT, ..., "ratio": X}`` with X measured against the baseline in the
same run (machines here are shared and noisy; only same-run ratios are comparable).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

DEFAULT_THREADS = 2  # the CPU box has two cores


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    parser = argparse.ArgumentParser(prog=f"scripts/bench/{name}.py", description=description)
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repeats (seconds, for CI)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"torch intra-op CPU threads (default {DEFAULT_THREADS})")
    parser.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
               ) -> argparse.Namespace:
    """Parses argv, applies --threads and prints where the numbers come from."""
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else platform.processor() or platform.machine())
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


def _cell(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


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
    """Prints the final one-line JSON object and returns it."""
    result = {"bench": bench, "baseline": baseline, **fields, "ratio": round(ratio, 3)}
    print(json.dumps(result))
    return result
