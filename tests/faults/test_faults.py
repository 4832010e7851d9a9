"""Faults, for real: a rank killed under torchrun, a torn checkpoint, a stopped rank, NaN gradients, a full disk.

Every test trains the ResNet recipe (resnet18 on 16 px digits) on 2 gloo ranks in deterministic mode, so a
resumed run is compared with an uninterrupted one bit for bit. The faults come from outside the recipe
(tests/faults/inject.py). Schedule: 2 epochs x 5 steps; checkpoints after steps 3, 6, 9 (mid-epoch) and at
the epoch ends (5, 10). A corrupted cache entry is covered in tests/test_cache.py.

A resumed run ends bitwise equal to the uninterrupted one: which test covers which (communicator, resume
path). A reference run serves every test of its configuration (module fixtures); the kill and the SIGTERM
strike one torchrun job in turn, each test asserting its part.

    communicator          resume path                                      test
    dense (torchrun)      torchrun restart after a SIGKILL, step-6 ckpt    here: test_a_rank_killed_mid_epoch_...
    dense (torchrun)      SIGTERM: step-7 ckpt, exit 75, torchrun restart  here: test_a_sigterm_to_one_rank_...
    dense (torchrun)      torn newest ckpt skipped, step 9, resume=true    here: test_a_torn_newest_checkpoint_...
    topk                  SIGTERM: step-5 ckpt, exit 75, resume=true       test_checkpoint: ..._resumes_on_2_ranks_...
    topk                  corrupted rank file: the epoch-end ckpt          test_checkpoint: ..._corrupted_rank_file_...
    topk, 2 -> 3 ranks    other world size (kept/dropped; not bitwise)     test_checkpoint: ..._resumes_on_3_ranks_...
    hitopk, torch.topk    epoch-end ckpt, --resume, fresh processes        test_comm: test_hitopk_run_resumes_bitwise
    none (1 process)      epoch-end ckpt, --resume to more epochs          test_trainer: test_resume_gives_the_same_...
    none, choices         measured choices from the ckpt, not the cache    test_choices: ..._keeps_the_checkpoints_...
    Transformer, hitopk   epoch-end ckpt, --resume, BLEU history           test_transformer_recipe: ..._resumes_exactly
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.conftest import ROOT, run_ranks
from tests.faults.inject import Fault, install
from tests.test_trainer import TINY, phases
from trainer.checkpoint import MODEL, CheckpointWriteError, checkpoint_dirs, latest_checkpoint, load_model_state

pytestmark = pytest.mark.e2e

LAUNCH_TIMEOUT_S = 400  # a guard against a hang of the launcher itself, not a speed requirement


def recipe_args(digits_root: Path, log_dir: Path, kind: str, *extra: str) -> list[str]:
    return ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", *TINY, "log.tensorboard=false",
            "train.epochs=2", phases(2), "train.max_steps_per_epoch=5", "train.checkpoint_every_steps=3",
            "train.keep_checkpoints=3", "train.deterministic=true", "train.target_top1=0", f"comm.kind={kind}",
            "comm.density=0.05", "comm.dense_below=1000", "train.preempt_check_every_steps=1",  # the signal's step
            f"log.dir={log_dir}", *extra]


def torchrun(args: list[str], restarts: int = 0, fault: str = "") -> subprocess.CompletedProcess:
    """2 ranks under torchrun (its own rendezvous store), stdout and stderr together."""
    env = {**os.environ, "FAULT": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={restarts}", "-m", "tests.faults.inject", *args]
    # A session of its own: on a hang, the launcher and its workers go together.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def final_state(run_dir: Path) -> dict:
    found = latest_checkpoint(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    return found[0]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["trainer"]["step"] == b["trainer"]["step"] == 10
    different = [name for name, value in a["model"].items() if not torch.equal(value, b["model"][name])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> Callable[[str], Path]:
    """The reference run per communicator, trained once per module without a fault."""
    runs: dict[str, Path] = {}

    def run(kind: str) -> Path:
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
            done = torchrun(recipe_args(digits_root, out, kind))
            assert done.returncode == 0, done.stdout[-4000:]
            runs[kind] = out
        return runs[kind]

    return run


# ---------------------------------------------------------------- elastic restart, preemption, torn checkpoints


@pytest.fixture(scope="module")
def killed_then_preempted(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> tuple[Path, str]:
    """One torchrun job, both restart paths (dense): rank 1 is SIGKILLed in step 8 (attempt 0), the restarted
    job resumes from the step-6 checkpoint and rank 1 gets a SIGTERM in its first step, step 7 (attempt 1);
    every rank finishes step 7, they write a checkpoint of it together and exit 75; attempt 2 resumes at step 7
    and finishes. Its folder and torchrun's output."""
    run = tmp_path_factory.mktemp("killed-then-preempted")
    done = torchrun(recipe_args(digits_root, run, "dense"), restarts=2, fault="kill:1:8,term:1:1:1")
    assert done.returncode == 0, done.stdout[-4000:]
    return run, done.stdout


@pytest.mark.long  # with its fixture's torchrun restarts, 15 s or more
def test_a_rank_killed_mid_epoch_restarts_and_ends_bitwise_equal(killed_then_preempted, uninterrupted):
    # dense; hitopk's residuals across a resume are checked by tests/test_comm.py's resume test
    run, out = killed_then_preempted
    assert "exitcode: -9" in out  # torchrun saw rank 1 die of the SIGKILL...
    # ...and the restarted job resumed inside epoch 1 from the newest checkpoint (step 6), on its own
    assert re.search(r"resumed from \S+step-00000006 at epoch 1, step 6", out), out[-4000:]
    assert_same_weights(final_state(uninterrupted("dense")), final_state(run))


@pytest.mark.long
def test_a_sigterm_to_one_rank_checkpoints_exits_75_and_the_restart_ends_equal(killed_then_preempted, uninterrupted):
    """The preemption notice in step 7 (between the step-6 checkpoint and the step-9 one) is checkpointed at
    step 7; the restart resumes there and ends with the uninterrupted run's weights and scores."""
    run, out = killed_then_preempted
    assert re.search(r"preempted: .*reached 1 rank\(s\); checkpoint of step 7 complete .* exiting with status 75",
                     out), out[-4000:]
    assert "exitcode: 75" in out  # what torchrun saw, and restarted on
    assert re.search(r"resumed from \S+step-00000007 at epoch 1, step 7", out), out[-4000:]
    assert_same_weights(final_state(uninterrupted("dense")), final_state(run))
    a, b = (json.loads((d / "summary.json").read_text()) for d in (uninterrupted("dense"), run))
    assert a["final"]["eval/top1"] == b["final"]["eval/top1"] and a["final"]["eval/loss"] == b["final"]["eval/loss"]


def test_a_torn_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, digits_root, uninterrupted):
    reference = final_state(uninterrupted("dense"))
    run = tmp_path / "torn"
    shutil.copytree(uninterrupted("dense"), run)
    newest = run / "checkpoints" / "step-00000010" / MODEL
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a write cut off half-way
    done = torchrun(recipe_args(digits_root, run, "dense", "train.resume=true"))
    assert done.returncode == 0, done.stdout[-4000:]
    assert re.search(r"skipping checkpoint: \S+step-00000010/model\.pt: truncated", done.stdout), done.stdout[-4000:]
    assert re.search(r"resumed from \S+step-00000009 at epoch 1, step 9", done.stdout)
    assert_same_weights(reference, final_state(run))  # step 10 trained again, to the same bits


# ---------------------------------------------------------------- a stopped (hung) rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
def test_a_stopped_rank_is_named_in_a_timeout_error(tmp_path, digits_root):
    """Rank 1 SIGSTOPs itself in step 3: rank 0 fails with an error naming it and the collective, and exits
    non-zero instead of hanging (under torchrun, the launcher then stops the job)."""
    port, procs = free_port(), []
    argv = recipe_args(digits_root, tmp_path / "run", "dense", "dist.timeout_s=10")
    for rank in range(2):
        env = {**os.environ, "FAULT": "stop:1:3", "OMP_NUM_THREADS": "1",
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(tmp_path / f"rank{rank}.log", "w") as log:  # a file, not a pipe: nobody reads rank 1's
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.faults.inject", *argv], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        procs[0].wait(LAUNCH_TIMEOUT_S)
        state = Path(f"/proc/{procs[1].pid}/status").read_text()
        assert re.search(r"State:\s+T", state), "rank 1 should be stopped, not gone"
    finally:
        for p in procs:
            p.kill()  # rank 1: what torchrun does to the rest of a failed job
            p.wait()
    out = (tmp_path / "rank0.log").read_text()
    assert procs[0].returncode not in (0, -signal.SIGKILL), out[-4000:]  # rank 0 exited on its own, failing
    assert re.search(r"CommTimeoutError: rank 0: allreduce of gradient bucket \d+ .*did not complete within 10s "
                     r"\(dist\.timeout_s\); rank 1 stopped answering", out), out[-4000:]


# ---------------------------------------------------------------- non-finite gradients


def _train_with_nan(rank: int, world: int, argv: list[str], expect_stop: bool) -> None:
    install(Fault("nan", rank=0, step=3))  # only rank 0's gradient: averaging must carry it to rank 1
    from recipes.resnet50 import main
    if not expect_stop:
        main(argv)
        return
    with pytest.raises(FloatingPointError, match=r"non-finite gradient at step 3 \(epoch 0, step 3 of the epoch"):
        main(argv)


def test_a_nan_gradient_is_skipped_and_counted_with_a_loss_scaler(tmp_path, digits_root):
    argv = recipe_args(digits_root, tmp_path / "run", "dense", "train.loss_scale=dynamic", "train.epochs=1",
                       phases(1))
    run_ranks(_train_with_nan, 2, tmp_path, argv, False, timeout=LAUNCH_TIMEOUT_S)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 5
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    assert [r["train/skipped_steps"] for r in steps] == [0, 0, 1, 1, 1]
    assert math.isfinite(steps[2]["loss/train"])  # the loss was fine; the gradient was not
    state = final_state(tmp_path / "run")
    assert state["trainer"]["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_a_nan_gradient_without_a_loss_scaler_stops_before_the_update(tmp_path, digits_root):
    argv = recipe_args(digits_root, tmp_path / "run", "hitopk", "train.loss_scale=off",
                       "train.checkpoint_every_steps=2")
    run_ranks(_train_with_nan, 2, tmp_path, argv, True, timeout=LAUNCH_TIMEOUT_S)
    newest = final_state(tmp_path / "run")  # the checkpoint after step 2 is the last one, and clean
    assert newest["trainer"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in newest["model"].values() if v.is_floating_point())


def test_a_loss_scaler_that_skips_every_step_stops_the_run(tmp_path, digits_root, monkeypatch):
    import recipes.resnet50 as recipe
    monkeypatch.setattr(recipe, "build_model", recipe.build_model)  # restored after the test
    install(Fault("nan", rank=0, step=2))
    argv = recipe_args(digits_root, tmp_path / "run", "dense", "train.loss_scale=dynamic", "train.epochs=1",
                       phases(1), "train.max_skipped_steps=1", "train.checkpoint_every_steps=0",
                       "train.deterministic=false")  # in this process: leave torch's global mode alone
    with pytest.raises(FloatingPointError, match=r"the loss scaler skipped 1 steps in a row, up to step 2: .*"
                                                 r"\(train\.max_skipped_steps\)"):
        recipe.main(argv)


# ---------------------------------------------------------------- a full disk


def _fill_the_disk(rank: int, world: int, argv: list[str]) -> None:
    from recipes.resnet50 import main
    expected = r"No space left on device.*previous checkpoints .* are intact" if rank == 0 else \
        r"1 rank\(s\) could not write their part of the checkpoint"
    with pytest.raises(CheckpointWriteError, match=expected):
        main(argv)


@pytest.mark.cluster  # mounts a tmpfs: root
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, digits_root):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    import torchvision
    params = sum(p.numel() for p in torchvision.models.resnet18(num_classes=10).parameters())
    disk = tmp_path / "disk"
    disk.mkdir()
    # Room for one checkpoint (weights + momentum, 4 bytes each) and the logs, not for a second one.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(1.5 * 8 * params)}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        argv = recipe_args(digits_root, disk, "dense", "train.checkpoint_every_steps=2", "train.epochs=1",
                           phases(1))
        run_ranks(_fill_the_disk, 2, tmp_path, argv, timeout=LAUNCH_TIMEOUT_S)
        left = sorted(p.name for p in (disk / "checkpoints").iterdir())
        assert left == ["step-00000002"]  # the failed checkpoint's folder and temporary files are gone
        assert [d.name for d in checkpoint_dirs(disk)] == ["step-00000002"]
        assert load_model_state(disk / "checkpoints" / "step-00000002")
    finally:
        subprocess.run(["umount", str(disk)], check=False)
