"""Real ranks on one machine, for tests, benchmarks and the GPU check (the package itself does not import this
module).

`run_ranks(fn, world, workdir, *args)` spawns `world` processes that meet through a FileStore in `workdir` (no
ports), runs `fn(rank, world, *args)` in every one and returns what each returned, by rank. A rank that raises,
hangs past the timeout or dies becomes one `RanksFailed` naming it, with its traceback.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.dist import teardown_distributed

POLL_S = 0.05


class RanksFailed(RuntimeError):
    """A rank raised, did not finish within the timeout, or exited with a non-zero status."""


def _rank_main(rank: int, world: int, store: str, backend: str, fn: Callable[..., Any], args: tuple,
               reports: Any) -> None:
    """One spawned rank: join the group, run fn, wait for every peer, report, leave."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # the ranks share the machine's cores; fn may ask for more
    try:
        device = None
        if backend == "nccl":  # one GPU per rank
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank, world_size=world,
                                device_id=device)
        result = fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()  # nobody tears the group down while a peer still talks to it (gloo aborts)
        reports.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        reports.put((rank, False, traceback.format_exc()))
    finally:
        teardown_distributed()  # also joins the heartbeat thread (an abort at exit otherwise)


def run_ranks(fn: Callable[..., Any], world: int, workdir: Path | str, *args: Any, timeout: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` spawned ranks (`backend` gloo, or nccl with rank r on GPU r) and
    return the ranks' return values, by rank (None for a rank that left with os._exit(0), as a test may after
    breaking its group on purpose). `fn` and `args` must pickle (fn at a module's top level).

    Raises RanksFailed naming the ranks that died without reporting, the first failing rank (with its traceback),
    the ranks that did not finish within `timeout` seconds (they are killed), or the ranks that exited with a
    non-zero status after their report.
    """
    ctx = mp.get_context("spawn")
    reports = ctx.SimpleQueue()
    store = str(Path(workdir) / "store")
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, backend, fn, args, reports))
             for r in range(world)]
    for p in procs:
        p.start()
    received: list[tuple[int, bool, Any]] = []
    deadline = time.monotonic() + timeout
    # Drain while waiting: a report larger than the pipe's buffer blocks its rank until it is read.
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not reports.empty():
            received.append(reports.get())
        time.sleep(POLL_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not reports.empty():
        received.append(reports.get())
    reported = {rank for rank, _, _ in received}
    died = [(r, p.exitcode) for r, p in enumerate(procs) if r not in reported and r not in hung and p.exitcode]
    failed = [(rank, tb) for rank, ok, tb in received if not ok]
    problems = []
    if died:  # first: a rank that died without a word is the likely cause of its peers' errors
        problems.append(f"ranks died before reporting (rank, exit status): {died}")
    if failed:
        rank, tb = failed[0]
        problems.append(f"rank {rank} failed:\n{tb}")
    if hung:
        problems.append(f"ranks {hung} did not finish within {timeout}s")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if r in reported and p.exitcode != 0]
    if bad and not problems:
        problems.append(f"ranks exited with non-zero status after reporting (rank, exit status): {bad}")
    if problems:
        raise RanksFailed("\n".join(problems))
    results = {rank: value for rank, ok, value in received}
    return [results.get(r) for r in range(world)]
