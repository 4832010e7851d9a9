"""Shared test helpers: real gloo ranks (trainer.testing.run_ranks) whose failures fail the test; the digits data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from trainer import testing

ROOT = Path(__file__).resolve().parent.parent


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = 120.0) -> list[Any]:
    """trainer.testing.run_ranks on gloo; a failing, hung or crashed rank fails the test with its traceback."""
    try:
        return testing.run_ranks(fn, world, tmp_path, *args, timeout=timeout)
    except testing.RanksFailed as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session", autouse=True)
def choices_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The measured-choices cache of this test session (trainer/choices.py reads $XDG_CACHE_HOME, and so do the
    ranks and runs the tests start): never the user's."""
    import os
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
