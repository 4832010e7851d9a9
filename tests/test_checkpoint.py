"""Per-rank checkpoints for real: 2 gloo ranks of the ResNet recipe (resnet18, 16 px digits, deterministic),
stopped by a SIGTERM to one rank, resumed on 2 ranks (bitwise the uninterrupted run) and on 3 (it goes on,
saying what it dropped); a corrupted rank file makes every rank fall back to the previous checkpoint.

Schedule: 2 epochs x 3 steps at global batch 12 (6 per rank on 2 ranks, 4 on 3), checkpoints at the epoch
ends (steps 3 and 6); the SIGTERM reaches rank 1 during step 5, so the preemption checkpoint is step 5, inside
epoch 1.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import rejoin_group, run_ranks
from tests.faults.inject import Fault, install
from tests.test_trainer import TINY, phases
from trainer.checkpoint import (MANIFEST, MODEL, CheckpointFolderError, CheckpointWriter, CheckpointWriteError,
                                checkpoint_dirs,
                                collect_rank_records, latest_checkpoint, prune, rank_file, step_dir_name,
                                write_atomic, write_manifest, write_rank_files)
from trainer.comm import LocalCommunicator
from trainer.dist import DistConfig, setup_distributed
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.preemption import PREEMPTED_EXIT_CODE
from trainer.progress import ProgressLines
from trainer.task import Task
from trainer.train_config import Components, LoopConfig, TrainConfig

pytestmark = pytest.mark.e2e

TIMEOUT_S = 900  # a guard against a hang, not a speed requirement (2-core box shared by other runs)


def recipe_args(digits_root: Path, log_dir: Path, *extra: str) -> list[str]:
    return ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", *TINY, "log.tensorboard=false",
            "train.epochs=2", phases(2, batch=12), "train.max_steps_per_epoch=3", "train.deterministic=true",
            "train.target_top1=0", "comm.kind=topk", "comm.density=0.05", "comm.dense_below=1000",
            "train.preempt_check_every_steps=1",  # the signal's own step is checkpointed
            f"log.dir={log_dir}", *extra]


def _train(rank: int, world: int, workdir: Path, runs: list[tuple[list[str], str]]) -> list[dict]:
    """The recipe runs one after another on this rank, each with its fault planted (a planted fault stays for the
    rest of the process: faulted runs go last); per run, its exit status and the warnings it raised."""
    from recipes.resnet50 import main
    results = []
    for i, (argv, fault) in enumerate(runs):
        rejoin_group(rank, world, workdir / f"store{i}")
        if fault:
            install(Fault.parse(fault))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                main(argv)
                status = 0
            except SystemExit as e:
                status = e.code
        results.append({"status": status, "warnings": [str(w.message) for w in caught]})
    return results


def train(tmp_path: Path, world: int, runs: list[tuple[list[str], str]]) -> list[list[dict]]:
    """`runs` (argv, fault) in one spawn of `world` ranks (a spawn costs more than a short run); per run, each
    rank's exit status and warnings."""
    workdir = Path(tmp_path) / f"ranks-{len(list(Path(tmp_path).glob('ranks-*')))}"
    workdir.mkdir(parents=True)
    by_rank = run_ranks(_train, world, workdir, workdir, runs, timeout=TIMEOUT_S)
    return [list(ranks) for ranks in zip(*by_rank)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> dict[str, Path]:
    """The uninterrupted 2-rank run, and one whose rank 1 got a SIGTERM in step 5 (in the same ranks, after it)."""
    base = tmp_path_factory.mktemp("per-rank")
    straight, preempted = train(base, 2, [(recipe_args(digits_root, base / "straight"), ""),
                                          (recipe_args(digits_root, base / "preempted"), "term:1:5")])
    assert [r["status"] for r in straight] == [0, 0]
    assert [r["status"] for r in preempted] == [PREEMPTED_EXIT_CODE] * 2  # every rank: the restartable status
    return {"straight": base / "straight", "preempted": base / "preempted"}


def resumed_copy(runs: dict[str, Path], tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(runs["preempted"], run)
    return run


@pytest.fixture(scope="module")
def resumed_on_2(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                 digits_root: Path) -> dict[str, tuple[Path, list[dict]]]:
    """The preempted run resumed on 2 ranks from two copies, in one spawn of ranks: as it was (first, in fresh
    processes), and with rank 1's file of the newest checkpoint corrupted. Per copy: its folder and results."""
    base = tmp_path_factory.mktemp("resumed-on-2")
    intact, corrupt = resumed_copy(runs, base, "on2"), resumed_copy(runs, base, "corrupt")
    torn = corrupt / "checkpoints" / "step-00000005" / rank_file(1)
    data = bytearray(torn.read_bytes())
    data[len(data) // 2] ^= 0xFF
    torn.write_bytes(bytes(data))
    results = train(base, 2, [(recipe_args(digits_root, run, "train.resume=true"), "") for run in (intact, corrupt)])
    return {"on2": (intact, results[0]), "corrupt": (corrupt, results[1])}


@pytest.mark.long
def test_a_sigterm_to_one_rank_leaves_a_complete_per_rank_checkpoint(runs):
    newest = checkpoint_dirs(runs["preempted"])[0]
    assert newest.name == "step-00000005"  # the step rank 1 was in when the signal came, finished
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["step"] == 5
    assert set(manifest["files"]) == {MODEL, "shared.pt", rank_file(0), rank_file(1)}
    # the model part opens with plain torch.load, no code of ours (so do the others)
    weights = torch.load(newest / MODEL, weights_only=True)
    assert "fc.weight" in weights and weights["fc.weight"].shape[0] == 10
    for name in manifest["files"]:
        torch.load(newest / name, weights_only=True)
    state, _ = latest_checkpoint(runs["preempted"])
    assert state["trainer"]["epoch"] == 1 and state["trainer"]["step_in_epoch"] == 2
    assert state["trainer"]["samples_in_epoch"] == 24
    assert all(r["comm"]["residuals"] for r in state["ranks"])  # each rank's error feedback, in its own file
    assert not (runs["preempted"] / "summary.json").exists()


@pytest.mark.long
def test_the_preempted_run_resumes_on_2_ranks_bitwise_equal(runs, resumed_on_2):
    run, results = resumed_on_2["on2"]
    assert [r["status"] for r in results] == [0, 0]
    assert not any("written by" in w for r in results for w in r["warnings"])
    straight, _ = latest_checkpoint(runs["straight"])
    resumed, _ = latest_checkpoint(run)
    assert straight["trainer"]["step"] == resumed["trainer"]["step"] == 6
    different = [k for k, v in straight["model"].items() if not torch.equal(v, resumed["model"][k])]
    assert not different, different[:5]
    for r in (0, 1):  # the residuals went on from where they were, rank by rank
        for bucket, residual in straight["ranks"][r]["comm"]["residuals"].items():
            assert torch.equal(residual, resumed["ranks"][r]["comm"]["residuals"][bucket])
    a, b = (json.loads((d / "summary.json").read_text()) for d in (runs["straight"], run))
    assert a["final"]["eval/top1"] == b["final"]["eval/top1"] and a["steps"] == b["steps"] == 6


@pytest.mark.long
def test_the_preempted_run_resumes_on_3_ranks_with_a_warning(runs, tmp_path, digits_root):
    run = resumed_copy(runs, tmp_path, "on3")
    (results,) = train(tmp_path, 3, [(recipe_args(digits_root, run, "train.resume=true"), "")])
    assert [r["status"] for r in results] == [0, 0, 0]
    (warning,) = [w for w in results[0]["warnings"] if "written by" in w]
    assert "written by 2 ranks, on 3 ranks" in warning
    assert "dropped the communicator's per-rank state ['residuals']" in warning
    assert "rank 2 seeded random generators from train.seed, ranks 0-1 restored theirs" in warning
    assert "sample 24 of epoch 1 = step 2 at global batch 12" in warning
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["steps"] == 6 and summary["epochs_run"] == 2
    state, newest = latest_checkpoint(run)
    assert newest.name == "step-00000006" and len(state["ranks"]) == 3  # now a 3-rank checkpoint


@pytest.mark.long
def test_a_corrupted_rank_file_falls_back_to_the_previous_checkpoint(runs, resumed_on_2):
    run, results = resumed_on_2["corrupt"]
    assert [r["status"] for r in results] == [0, 0]
    assert any("skipping checkpoint" in w and "rank-00001.pt: checksum mismatch" in w for w in results[0]["warnings"])
    straight, _ = latest_checkpoint(runs["straight"])
    resumed, _ = latest_checkpoint(run)  # from step 3 (the epoch end), steps 4-6 trained again
    different = [k for k, v in straight["model"].items() if not torch.equal(v, resumed["model"][k])]
    assert not different, different[:5]


def test_without_a_terminal_progress_is_a_line_every_n_steps(capsys):
    lines = ProgressLines(total=10, initial=2, every=4)
    lines.set_postfix(epoch=1, loss="2.310")
    for _ in range(8):
        lines.update(1)
    captured = capsys.readouterr()
    out = captured.err.splitlines()  # the stream whose terminal check chose the lines (and tqdm draws on)
    assert captured.out == ""
    assert [line.split()[1] for line in out] == ["4/10", "8/10", "10/10"]  # every 4th step, and the last
    assert out[-1].startswith("step 10/10 (100%)") and out[-1].endswith("epoch=1 loss=2.310")
    assert "\r" not in "".join(out)  # nothing redrawn into a log file


class PlannedTask(Task):
    """A task whose steps per epoch are set from outside (as token batching sets them per world size)."""

    unit, targets = "tokens", {}

    def __init__(self, model: torch.nn.Module, steps: int) -> None:
        self.model, self.steps = model, steps

    def steps_per_epoch(self, phase: object) -> int:
        return self.steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ResidualComm(LocalCommunicator):
    """One process's communicator with error-feedback residuals over buckets of the given sizes."""

    def __init__(self, topo: object, bucket_sizes: list[int]) -> None:
        super().__init__(topo)
        self.buckets = [SimpleNamespace(numel=n) for n in bucket_sizes]
        self.residuals: dict[int, torch.Tensor] = {}  # none before the first step

    def state_dict(self) -> dict:
        return {"steps": self.steps, "residuals": {i: r.clone() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.residuals = state["steps"], dict(state.get("residuals", {}))


def one_process_trainer(tmp_path: Path, task_steps: int = 30, buckets: list[int] | None = None,
                        **train: object) -> Trainer:
    topo = setup_distributed(DistConfig())
    model = torch.nn.Linear(2, 2)
    comm = LocalCommunicator(topo) if buckets is None else ResidualComm(topo, buckets)
    return Trainer(LoopConfig(TrainConfig(epochs=2, **train), log=LogConfig(dir=str(tmp_path))), topo,
                   PlannedTask(model, task_steps), Components(model, torch.optim.SGD(model.parameters(), lr=0.1), comm))


def test_residuals_of_another_bucket_layout_are_dropped_with_a_warning(tmp_path):
    writer = one_process_trainer(tmp_path, buckets=[3, 2])
    writer.step, writer.comm.residuals = 4, {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([1.0, 2.0])}
    writer.checkpoint(background=False)
    same = one_process_trainer(tmp_path, buckets=[3, 2], resume=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert same.checkpointer.load_latest() is not None
    assert not [w for w in caught if "layout" in str(w.message)]
    assert torch.equal(same.comm.residuals[1], torch.tensor([1.0, 2.0]))  # the same layout: restored
    other = one_process_trainer(tmp_path, buckets=[4, 1], resume=True)
    with pytest.warns(UserWarning, match=r"on the same 1 ranks but another communicator layout \(buckets [0-9a-f]+ -> "
                                         r"[0-9a-f]+\).*dropped the communicator's per-rank state \['residuals'\]"):
        assert other.checkpointer.load_latest() is not None
    assert other.comm.residuals == {} and other.step == 4  # zero residuals, the rest restored


def test_a_resume_whose_epoch_has_other_steps_says_the_rest_is_replanned(tmp_path):
    trainer = one_process_trainer(tmp_path, task_steps=30)
    trainer.epoch = 1
    batch = trainer.schedule.phase(1).batch_size
    # the same steps per epoch (a global batch fixed in samples): the same samples, the same step
    kept = trainer.checkpointer.replan_position({"step_in_epoch": 20, "steps_per_epoch": 30, "samples_in_epoch": 20 * batch})
    assert trainer.step_in_epoch == 20 and kept == f"data position kept: sample {20 * batch} of epoch 1 = step 20 " \
                                                   f"at global batch {batch}"
    # batches planned per world size: 40 steps on the old ranks, 30 now; step 20 of 40 is step 15 of 30
    moved = trainer.checkpointer.replan_position({"step_in_epoch": 20, "steps_per_epoch": 40, "samples_in_epoch": 20 * batch})
    assert trainer.step_in_epoch == 15
    assert "re-planned for 1 ranks (30 steps instead of 40): it continues at step 15" in moved
    assert "some pairs may be trained twice and some skipped" in moved and "sample" not in moved


def _checkpoint_with_a_failing_writer(rank: int, world: int, tmp: str) -> str:
    trainer = one_process_trainer(Path(tmp))
    if rank == 1:
        def write(*args: object) -> None:
            raise RuntimeError("torch.save failed half-way")
        trainer.checkpointer.writer.write = write  # type: ignore[method-assign]
    try:
        trainer.checkpoint(background=False)
    except CheckpointWriteError as e:
        return str(e)
    return "no error"


def test_any_failure_of_one_ranks_checkpoint_write_stops_every_rank(tmp_path):
    # a RuntimeError on rank 1 (not a write error): rank 0 must not wait for it in the next collective
    messages = run_ranks(_checkpoint_with_a_failing_writer, 2, tmp_path, str(tmp_path / "run"), timeout=240)
    assert "RuntimeError: torch.save failed half-way; stopping" in messages[1]
    assert "1 rank(s) could not write their part of the checkpoint" in messages[0]
    assert not (tmp_path / "run" / "checkpoints" / "step-00000000").exists()  # the unfinished folder removed


class SignalledTask(PlannedTask):
    """A whole (tiny) task for `Trainer.fit` in one process; `signal_in` names the hook that sends this process
    a SIGUSR1 (evaluate: after the last step's preemption check), and `test` records what it finds."""

    def __init__(self, model: torch.nn.Module, signal_in: str) -> None:
        super().__init__(model, steps=2)
        self.signal_in, self.seen = signal_in, {}
        self.trainer: Trainer | None = None

    def train_batches(self, phase: object, epoch: int, start_step: int = 0):
        return iter([torch.ones(1, 2)] * (self.steps - start_step))

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.model(batch).sum(), 1

    def evaluate(self, phase: object) -> dict[str, float]:
        if self.signal_in == "evaluate":
            os.kill(os.getpid(), signal.SIGUSR1)
        return {}

    def test(self) -> dict[str, float]:
        if self.trainer is not None:  # the final test, after training
            self.seen = {"handler": signal.getsignal(signal.SIGUSR1), "watchdog": self.trainer.preemption.watchdog}
        return {}

    def target_reached(self, record: dict) -> bool:
        return False

    def describe(self, phase: object) -> str:
        return "tiny"

    def stats(self) -> dict[str, float]:
        return {}


def test_a_signal_after_the_last_check_leaves_no_grace_timer_past_training(tmp_path):
    topo = setup_distributed(DistConfig())
    model = torch.nn.Linear(2, 1)
    task = SignalledTask(model, signal_in="evaluate")
    trainer = Trainer(LoopConfig(TrainConfig(epochs=1, preempt_grace_s=600),
                                 log=LogConfig(dir=str(tmp_path), progress=False)), topo, task,
                      Components(model, torch.optim.SGD(model.parameters(), lr=0.1), LocalCommunicator(topo)))
    task.trainer = trainer
    before = signal.getsignal(signal.SIGUSR1)
    trainer.fit()
    assert trainer.preemption.signal == signal.SIGUSR1  # it came, after the last step's check
    assert task.seen["handler"] == before  # the final test runs under the previous handlers
    assert task.seen["watchdog"].finished.is_set()  # cancelled (set by cancel; else only after 600 s)


def test_a_forked_child_does_not_act_on_the_inherited_handler(tmp_path):
    trainer = one_process_trainer(tmp_path, preempt_grace_s=600)
    restore = trainer.preemption.install()
    try:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, as fork starts it
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0 if trainer.preemption.watchdog is None and trainer.preemption.signal is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # alive after SIGTERM, and no timer of its own
        assert trainer.preemption.signal is None
    finally:
        restore()


def _agree_on_a_signal(rank: int, world: int, tmp: str) -> tuple[bool, bool, int]:
    trainer = one_process_trainer(Path(tmp), preempt_grace_s=600)
    restore = trainer.preemption.install()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    armed_before = trainer.preemption.watchdog is not None
    agreed = trainer.preemption.agreed(trainer.step + 1)  # at the end of the first step: auto's first check
    armed = trainer.preemption.watchdog is not None
    trainer.preemption.cancel_watchdog()
    restore()
    return agreed, armed and not (rank == 0 and armed_before), trainer.preemption.ranks


def test_every_rank_has_the_grace_timer_once_the_ranks_agree_on_a_signal(tmp_path):
    results = run_ranks(_agree_on_a_signal, 2, tmp_path, str(tmp_path / "run"), timeout=240)
    assert results == [(True, True, 1), (True, True, 1)]  # rank 0 was not signalled, yet has its timer


def test_a_write_error_reads_without_an_errno_prefix_and_keeps_the_errno(tmp_path):
    with pytest.raises(CheckpointWriteError) as caught:
        write_atomic(tmp_path / "missing" / "model.pt", b"weights")
    assert str(caught.value).startswith(f"could not write checkpoint file {tmp_path / 'missing' / 'model.pt'}")
    assert "[Errno" not in str(caught.value) and caught.value.errno == errno.ENOENT


LEAVE_DURING_A_BACKGROUND_WRITE = """
import sys, torch
from trainer.checkpoint import CheckpointWriter
writer = CheckpointWriter(sys.argv[1], rank=0, world_size=2, wait_timeout_s=600)
# rank 0's thread writes its part (64 MB: the save is still in torch's C++ when the error leaves), then
# waits for rank 1's record, which never comes
writer.write_in_background(1, {"rank-00000.pt": {"x": torch.ones(16_000_000)}}, "token")
raise RuntimeError("the training thread failed")
"""


def test_a_process_leaving_on_an_error_does_not_wait_for_its_background_write(tmp_path):
    # a hang guard, not a timing: the writer would wait 600 s for rank 1; and the process leaves with its error,
    # not aborted (SIGABRT) by finalization catching the writer inside torch's save
    result = subprocess.run([sys.executable, "-c", LEAVE_DURING_A_BACKGROUND_WRITE, str(tmp_path / "checkpoints")],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=240)
    assert result.returncode == 1 and "the training thread failed" in result.stderr
    step = tmp_path / "checkpoints" / "step-00000001"
    assert not (step / MANIFEST).exists()
    # the thread finished rank 0's own part before the process left: its file and its record
    assert json.loads((step / "rank-00000.json").read_text())["token"] == "token"
    assert torch.load(step / "rank-00000.pt")["x"].numel() == 16_000_000


def test_prune_keeps_the_newest_complete_checkpoints_not_a_torn_one(tmp_path):
    for step in (1, 2, 3):
        ckpt_dir = tmp_path / step_dir_name(step)
        write_rank_files(ckpt_dir, {MODEL: {"w": torch.full((64,), float(step))}}, 0, "token")
        write_manifest(ckpt_dir, step, 1, collect_rank_records(ckpt_dir, 1, "token", timeout_s=10))
    torn = tmp_path / step_dir_name(3) / MODEL
    torn.write_bytes(torn.read_bytes()[:100])  # truncated after its manifest was written
    (tmp_path / step_dir_name(4)).mkdir()  # an attempt stopped before its manifest
    prune(tmp_path, keep=2)
    assert [d.name for d in sorted(tmp_path.iterdir())] == [step_dir_name(1), step_dir_name(2)]


def test_a_checkpoint_reads_the_communicators_state_once(tmp_path):
    trainer = one_process_trainer(tmp_path, buckets=[3])
    trainer.comm.residuals = {0: torch.tensor([1.0, 2.0, 3.0])}
    calls = []
    state_dict = trainer.comm.state_dict
    trainer.comm.state_dict = lambda: calls.append(1) or state_dict()  # type: ignore[method-assign]
    for background in (False, True):
        trainer.checkpoint(background=background)
        trainer.checkpointer.wait()
        trainer.step += 1
    assert len(calls) == 2  # once per checkpoint on rank 0: the rank file and the shared state share the copy
    state, _ = latest_checkpoint(tmp_path)
    assert torch.equal(state["ranks"][0]["comm"]["residuals"][0], torch.tensor([1.0, 2.0, 3.0]))
    assert state["comm_per_rank"] == ["residuals"] and state["comm_shared"] == {"steps": 0}


# ---------------------------------------------------------------- an unwritable checkpoint folder


@pytest.mark.unit
def test_an_unwritable_checkpoint_folder_is_refused_at_the_writers_setup_in_one_line(tmp_path, monkeypatch):
    """A read-only mount refuses the probe file (root included; permission bits would pass root): the writer's
    setup raises one line naming the folder, before any step. tests/test_slurm_real.py mounts a real one."""
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("trainer.checkpoint.tempfile.mkstemp", read_only)
    with pytest.raises(CheckpointFolderError) as e:
        CheckpointWriter(tmp_path / "checkpoints", rank=0, world_size=1)
    assert str(e.value) == (f"{tmp_path / 'checkpoints'} (its parent {tmp_path}) is not writable (Read-only file "
                            "system): no checkpoint could be saved; point log.dir at a writable folder")
    assert e.value.errno == errno.EROFS and "\n" not in str(e.value)


@pytest.mark.unit
def test_the_writable_check_creates_no_folder_and_leaves_no_probe(tmp_path):
    """A fresh run's folder is probed in its nearest existing parent and not created (a fresh run archives the
    outputs it finds, an empty checkpoints folder included); an existing one keeps no probe file."""
    CheckpointWriter(tmp_path / "run" / "checkpoints", rank=0, world_size=1)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "checkpoints").mkdir()
    CheckpointWriter(tmp_path / "checkpoints", rank=0, world_size=1)
    assert list((tmp_path / "checkpoints").iterdir()) == []
