"""Shared test helpers: real multi-process gloo groups that meet through a FileStore (no ports)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.dist import teardown_distributed  # noqa: E402


def _worker(rank: int, world: int, store_path: str, fn: Callable, args: tuple, errors: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()  # nobody tears gloo down while a peer still talks to it (SIGABRT in gloo's thread)
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        errors.put((rank, traceback.format_exc()))
    finally:
        teardown_distributed()  # also joins the heartbeat thread (an abort at exit otherwise)


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = 120.0) -> None:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; fail with the first failing rank's traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "store"), fn, args, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        pytest.fail(f"rank {rank} failed:\n{tb}")
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout}s")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"ranks exited with non-zero status: {bad}"


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real digits dataset, written once per test session at 16 px (small, fast)."""
    from scripts.prepare_digits import prepare
    return prepare(tmp_path_factory.mktemp("data") / "digits", size=16)
