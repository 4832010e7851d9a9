"""Shared test helpers: real gloo ranks (trainer.testing.run_ranks) whose failures fail the test; the digits data;
the test tiers.

Every test belongs to one tier, its closest tier marker (a test's own marker overrides its module's
`pytestmark`): unit (no processes: milliseconds to seconds), dist (real gloo process groups), e2e (training
runs, torchrun launches, faults), long (tests of the other tiers that take 15 s or more each on 2 cores:
repeated recipe runs, timeouts waited out, the GPU check's dry run), cluster (needs root: network namespaces,
tmpfs mounts, a Slurm daemon), gpu (needs CUDA). `--tier unit,dist` runs those tiers (`make test-fast`: unit;
`make test`: unit, dist, e2e; `make test-long`: long; `make test-cluster`: cluster; CI runs all but gpu); a
test without a tier stops the collection, naming it."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from trainer import testing

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "dist", "e2e", "long", "cluster", "gpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", default="", help=f"run only these tiers, comma-separated ({', '.join(TIERS)}); a "
                                                "test's tier is its closest tier marker")
    parser.addoption("--no-skips", action="store_true", help="a skipped test fails the run (CI's cluster tier: "
                                                             "as root every one of them must run)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """--no-skips: any skip turns a passing run into a failing one, listed by -rs."""
    if not session.config.getoption("--no-skips") or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        print(f"\n--no-skips: {len(skipped)} test(s) skipped; they must run here", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def tier_of(item: pytest.Item) -> str | None:
    """The test's closest tier marker: its own, else its class's, else its module's."""
    return next((mark.name for mark in item.iter_markers() if mark.name in TIERS), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if tier_of(item) is None]
    if untiered:
        raise pytest.UsageError(f"{len(untiered)} test(s) without a tier marker ({', '.join(TIERS)}): "
                                + ", ".join(untiered[:5]) + (" ..." if len(untiered) > 5 else ""))
    wanted = [t for t in config.getoption("--tier").split(",") if t]
    unknown = sorted(set(wanted) - set(TIERS))
    if unknown:
        raise pytest.UsageError(f"--tier: unknown tier(s) {unknown}; the tiers are {', '.join(TIERS)}")
    if wanted:
        keep = [item for item in items if tier_of(item) in wanted]
        config.hook.pytest_deselected(items=[item for item in items if tier_of(item) not in wanted])
        items[:] = keep


def as_from_file(state: Any) -> Any:
    """`state` saved with torch.save and read back weights-only, as a checkpoint file gives it: no tensor
    shared with the live object."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = 120.0) -> list[Any]:
    """trainer.testing.run_ranks on gloo; a failing, hung or crashed rank fails the test with its traceback."""
    try:
        return testing.run_ranks(fn, world, tmp_path, *args, timeout=timeout)
    except testing.RanksFailed as e:
        pytest.fail(str(e))


def rejoin_group(rank: int, world: int, store: Path) -> None:
    """Join a gloo group through a fresh FileStore at `store` unless this rank is in one: a recipe run tears its
    group down at its end (as under torchrun), so the next run in the same ranks meets anew."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(str(store), world), rank=rank, world_size=world)


PROCESS_STARTERS = re.compile(r"(python[\d.]*|torchrun|horovodrun|make|bash|sh|env)")
"""Programs that start Python (or a shell that may): what a unit test must not run."""


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise, kept: a unit test that starts a Python process (a multiprocessing child, a
    script, torchrun, a recipe, a shell) fails, saying to mark it dist or e2e. Short tools (git, uname) may run.
    Module- and session-scoped fixtures are set up before this guard: a test that uses one that starts
    processes is marked by hand."""
    if tier_of(request.node) != "unit":
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{request.node.nodeid} is in the unit tier but starts a Python process: mark it dist "
                           "(process groups) or e2e (runs, scripts, launches)")
    popen_init = subprocess.Popen.__init__

    def checked_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        words = os.fsdecode(program).split() if kwargs.get("shell") or isinstance(args, str) else [os.fsdecode(program)]
        if words and (PROCESS_STARTERS.fullmatch(os.path.basename(words[0])) or words[0] == sys.executable):
            refuse()
        popen_init(self, args, *rest, **kwargs)
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)


@pytest.fixture(scope="session", autouse=True)
def choices_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The measured-choices cache of this test session (trainer/choices.py reads $XDG_CACHE_HOME, and so do the
    ranks and runs the tests start): never the user's."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield Path(os.environ["XDG_CACHE_HOME"])
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real digits dataset, written once per test session at 16 px (small, fast)."""
    from data.digits import prepare
    return prepare(tmp_path_factory.mktemp("data") / "digits", size=16)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test: on a shared 2-core box, small models run many times slower on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
