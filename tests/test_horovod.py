"""The Horovod backend for real: `horovodrun --gloo` with 4 processes (2 nodes x 2), every communicator.

Skipped where Horovod is not installed (`make horovod` builds it; CI does). How the backend is chosen (the
Horovod module only when asked for, unknown names, a missing Horovod) is checked everywhere.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod not installed (run `make horovod`)")
def test_communicators_on_horovod_match_the_reference():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(horovodrun), "--gloo", "-np", "4", "-H", "localhost:4", sys.executable,
                           str(ROOT / "tests" / "horovod_worker.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kind in ("dense", "topk", "hitopk"):
        assert sum(f": {kind} OK on horovod" in line for line in proc.stdout.splitlines()) == 4, proc.stdout[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod not installed (run `make horovod`)")
def test_recipe_runs_on_horovod_with_a_checkpoint(tmp_path, digits_root):
    """The whole recipe under horovodrun: broadcasts, hitopk, evaluation, every rank's checkpoint file."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["--config", "configs/quickstart_cpu.yaml", "dist.backend=horovod", f"data.root={digits_root}",
            "data.backend=torchvision", "data.workers=0", "model.arch=resnet18", "train.threads=1", "train.epochs=1",
            "schedule.phases=[{start_epoch: 0, end_epoch: 1, image_size: 16, batch_size: 16}]",
            "schedule.total_epochs=1", "train.max_steps_per_epoch=3", "comm.kind=hitopk", "comm.dense_below=1000", "log.progress=false",
            f"log.dir={tmp_path / 'run'}"]
    proc = subprocess.run([str(horovodrun), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
                           "recipes.resnet50", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from trainer.checkpoint import latest_checkpoint
    state, _ = latest_checkpoint(tmp_path / "run")
    assert state["trainer"]["step"] == 3 and len(state["ranks"]) == 2
    assert state["ranks"][1]["comm"]["residuals"]  # rank 1 wrote its error feedback into its own file


# ---------------------------------------------------------------- choosing the backend (runs everywhere)


def test_horovod_is_not_imported_unless_chosen():
    """An optional dependency: a gloo run (here one process) never imports the Horovod backend or Horovod."""
    code = ("import sys\nfrom trainer.dist import DistConfig, setup_distributed, teardown_distributed\n"
            "topo = setup_distributed(DistConfig(backend='gloo'))\nteardown_distributed()\n"
            "print(sorted(m for m in sys.modules if 'horovod' in m))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_an_unknown_backend_lists_the_valid_ones():
    from trainer.config import ConfigError
    from trainer.dist import DistConfig, resolve_backend, setup_distributed
    with pytest.raises(ConfigError,
                       match=r"^dist.backend: unknown backend 'mpi' \(valid: auto, gloo, nccl, horovod\)$"):
        setup_distributed(DistConfig(backend="mpi"))  # type: ignore[arg-type] - what a typo in code would do
    with pytest.raises(ConfigError, match=r"^dist.backend: horovod is not a torch.distributed backend \(auto, nccl or "
                                          r"gloo\)$"):
        resolve_backend("horovod")


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None, reason="Horovod is installed here")
def test_choosing_horovod_without_it_says_how_to_install_it():
    from trainer.config import ConfigError
    from trainer.dist import DistConfig, setup_distributed
    with pytest.raises(ConfigError, match=r"^dist.backend: horovod needs Horovod, which is not installed "
                                          r"\(run `make horovod`\)$"):
        setup_distributed(DistConfig(backend="horovod"))


# ---------------------------------------------------------------- GPUs under an emulated layout (a fake Horovod)


class FakeHorovod:
    """The part of horovod.torch that setup_horovod uses, for one rank of `world` on one machine."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world, self.initialized = rank, world, False
        fake = self

        class ProcessSet:
            def __init__(self, ranks: list[int] | None = None) -> None:
                self.ranks = ranks

            def included(self) -> bool:
                return self.ranks is None or fake._rank in self.ranks

            def size(self) -> int:
                return fake._world if self.ranks is None else len(self.ranks)

            def rank(self) -> int:
                return fake._rank if self.ranks is None else self.ranks.index(fake._rank)

        self.ProcessSet = ProcessSet
        self.global_process_set = ProcessSet()

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, process_sets: list | None = None) -> None:
        self.initialized = True

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def local_rank(self) -> int:
        return self._rank  # one machine: its local rank is its rank

    def local_size(self) -> int:
        return self._world


@pytest.mark.unit
def test_emulated_nodes_on_one_machine_put_every_rank_on_its_own_gpu(monkeypatch):
    """2 emulated nodes of 4 (dist.ranks_per_node=4) on one 8-GPU machine: the GPU follows the machine's local
    rank (hvd.local_rank()), so ranks 0-7 take GPUs 0-7; the node layout is the emulated one."""
    from trainer.dist import DistConfig
    from trainer.dist import horovod_backend

    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setenv("HOROVOD_SIZE", "8")  # what horovodrun -np 8 -H localhost:8 sets
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "8")
    topos = []
    for rank in range(8):
        monkeypatch.setattr(horovod_backend, "hvd", FakeHorovod(rank, 8))
        monkeypatch.setattr(horovod_backend, "_registered_sets", [])
        topos.append(horovod_backend.setup_horovod(DistConfig(backend="horovod", ranks_per_node=4)))
    assert [t.device for t in topos] == selected == [torch.device("cuda", r) for r in range(8)]
    assert [t.local_rank for t in topos] == [0, 1, 2, 3, 0, 1, 2, 3]  # the emulated nodes' layout
    assert all(t.ranks_per_node == 4 and t.world_size == 8 for t in topos)


@pytest.mark.unit
def test_horovod_sizes_that_disagree_with_the_launchers_variables_are_an_error(monkeypatch):
    """The node process sets are made from HOROVOD_SIZE before hvd.init: a launcher that did not set it (or set
    another) would get sets of the wrong ranks; hvd's sizes, read after init, catch it."""
    from trainer.config import ConfigError
    from trainer.dist import DistConfig
    from trainer.dist import horovod_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("HOROVOD_SIZE", raising=False)
    monkeypatch.delenv("HOROVOD_LOCAL_SIZE", raising=False)
    monkeypatch.setattr(horovod_backend, "hvd", FakeHorovod(0, 8))
    monkeypatch.setattr(horovod_backend, "_registered_sets", [])
    with pytest.raises(ConfigError, match=r"^dist\.backend: horovod: 8 ranks, 8 on this machine, but HOROVOD_SIZE / "
                                          r"HOROVOD_LOCAL_SIZE say 1 and 1: launch with horovodrun"):
        horovod_backend.setup_horovod(DistConfig(backend="horovod"))
