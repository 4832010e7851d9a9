"""The shipped scripts/slurm/resnet50_dawnbench.sbatch on a real Slurm cluster of one node (tests/slurm_cluster.py):
munged, slurmctld and slurmd on this machine, jobs submitted with sbatch, signals sent by Slurm itself.

The same file that asks for 16 nodes x 8 GPUs runs here as 1 node x 2 CPU ranks: sbatch options on the command
line override its #SBATCH lines (--nodes, --gpus-per-node, --cpus-per-task, --time, --signal), variables
override its paths (DATA, CONFIG, RUN_DIR, LOCAL, GPUS, GRACE, MASTER_PORT, NOCACHE), and the words after the
script are the recipe's overrides: resnet18 on the 16 px digits, gloo, deterministic, 2 epochs of STEPS steps,
so that an interrupted and resumed job is compared bit for bit with one that ran through.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from tests.conftest import ROOT
from tests.slurm_cluster import Cluster, Unavailable, free_port, start, stop
from tests.test_trainer import TINY, phases
from trainer.checkpoint import latest_checkpoint

pytestmark = pytest.mark.cluster

SCRIPT = "scripts/slurm/resnet50_dawnbench.sbatch"
STEPS = 20  # per epoch; 2 epochs
GRACE_S = 30  # the ranks' grace after a stop signal: inside the --signal notice below
NOTICE_S = 50  # --signal=B:USR1@50 with --time=1: the notice 50 s before the one-minute limit
JOB_TIMEOUT_S = 240  # a guard against a hung job, not a speed requirement


def recipe_overrides() -> list[str]:
    return [*TINY, "log.tensorboard=false", "train.epochs=2", phases(2), f"train.max_steps_per_epoch={STEPS}",
            "train.deterministic=true", "train.target_top1=0", "comm.kind=dense",
            "train.preempt_check_every_steps=1"]  # the stop at the step the signal came in


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    folder = Path(tempfile.mkdtemp(prefix="dawnbench-slurm-"))  # short: munge's socket path has a length limit
    try:
        running = start(folder)  # stops what it started when it fails
    except BaseException as e:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, Unavailable):
            pytest.skip(f"no Slurm cluster here: {e}")
        raise
    try:
        yield running
    finally:
        stop(running)


class Job:
    """One submission of the shipped script: its id, folders and output."""

    def __init__(self, cluster: Cluster, tmp: Path, digits_root: Path, *options: str, **env: str) -> None:
        self.cluster, self.run_dir, self.output = cluster, tmp / "run", tmp / "slurm.out"
        variables = {"DATA": str(digits_root), "CONFIG": "configs/quickstart_cpu.yaml", "NOCACHE": "1", "GPUS": "2",
                     "RUN_DIR": str(self.run_dir), "LOCAL": str(tmp / "local"), "GRACE": str(GRACE_S),
                     "MASTER_PORT": str(free_port()), **env}
        sbatch_options = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}",
                          f"--output={self.output}", *options]
        self.id = cluster.sbatch(SCRIPT, sbatch_options, tuple(recipe_overrides()),
                                 env={**os.environ, **variables}, cwd=ROOT)

    def state(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        try:
            return self.cluster.wait_job(self.id, timeout=timeout)
        except TimeoutError as e:
            pytest.fail(f"{e}\n{self.text()[-4000:]}")

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = JOB_TIMEOUT_S) -> None:
        """Poll `check()` until true; fail with the job's output after `timeout` or when the job ended."""
        deadline = time.monotonic() + timeout
        while not check():
            state = self.state().get("JobState")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") or time.monotonic() > deadline:
                pytest.fail(f"job {self.id} ({state}): never {what}\n{self.text()[-4000:]}")
            time.sleep(0.2)

    def train_steps(self) -> list[int]:
        """The steps metrics.jsonl logged (every step: TINY's log.every_steps=1), in order, resumes included."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [r["step"] for r in map(json.loads, filter(None, lines)) if r.get("kind") == "step"]

    def rank_pids(self) -> list[int]:
        """This job's training ranks (torchrun's workers: LOCAL_RANK in their environment)."""
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"recipes.resnet50" in cmd and f"log.dir={self.run_dir}".encode() in cmd \
                        and b"LOCAL_RANK=" in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except (OSError, ValueError):
                pass
        return pids


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    state = found[0]
    assert state["trainer"]["step"] == 2 * STEPS, state["trainer"]["step"]
    return state["model"]


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    a, b = final_weights(reference), final_weights(run_dir)
    different = [name for name, value in a.items() if not torch.equal(value, b[name])]
    assert not different, f"weights differ from the uninterrupted job's: {different[:5]}"


def stop_checkpoint_and_resume(out: str) -> int:
    """The step of the stop's checkpoint, checked to be the one the requeued run resumed from."""
    stop = re.search(r"preempted: .* reached 2 rank\(s\); checkpoint of step (\d+) complete .*exiting with status 75",
                     out)
    assert stop, out[-4000:]
    step = int(stop.group(1))
    assert re.search(rf"resumed from \S+step-{step:08d} at epoch \d+, step {step}\b", out), out[-4000:]
    return step


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, digits_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The job that runs through: the reference of the interrupted ones."""
    job = Job(cluster, tmp_path_factory.mktemp("uninterrupted"), digits_root, "--time=10")
    job.wait()
    return job


def test_a_job_runs_through_and_writes_its_run_folder_and_dawnbench_report(uninterrupted):
    """Catches a script that starts torchrun with no ranks where Slurm gives no GPU count (GPUS unused), that
    passes the recipe's overrides where argparse drops them, or that ends without the DAWNBench report."""
    job = uninterrupted.state()
    out = uninterrupted.text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "0", out[-4000:]
    run = uninterrupted.run_dir
    for name in ("metrics.jsonl", "dawnbench.tsv", "summary.json", "config.yaml", "env.json", "checkpoints"):
        assert (run / name).exists(), f"{name} missing from {run}"
    assert json.loads((run / "summary.json").read_text())["epochs_run"] == 2
    assert (run / "dawnbench" / "report.md").exists() and list((run / "dawnbench").glob("*.json")), out[-4000:]
    assert uninterrupted.train_steps() == list(range(1, 2 * STEPS + 1))
    assert "world 2 = " in out and "requeue" not in out


def test_the_time_limit_notice_checkpoints_requeues_and_the_job_ends_bitwise_equal(cluster, digits_root,
                                                                                     tmp_path, uninterrupted):
    """--signal=B:USR1@50 under --time=1: the notice reaches the batch shell, which stops the ranks; they write a
    checkpoint within their grace, the job requeues itself, resumes from that checkpoint and ends with the
    uninterrupted job's weights. Catches a USR1 passed on to torchrun (it dies of it, no checkpoint), a job left
    to be killed at its limit (TIMEOUT, not requeued) and a requeued run that starts over or drops its
    overrides. Slurm checks time limits every 30 s: the job starts with a long limit; once it trains, the ranks
    are paused (SIGSTOP) and the limit cut to one minute, so the notice comes at the next check while they are
    still mid-run; after the requeue the limit is raised again, so that the resumed run is not warned too."""
    job = Job(cluster, tmp_path, digits_root, "--time=10", f"--signal=B:USR1@{NOTICE_S}")
    job.wait_for("trained a step", lambda: len(job.train_steps()) >= 2)
    ranks = job.rank_pids()
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=1")
        job.wait_for("got the time-limit notice", lambda: "time limit near" in job.text(), timeout=45)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    job.wait_for("was requeued", lambda: int(job.state().get("Restarts", 0)) >= 1, timeout=GRACE_S + 30)
    cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    state = job.wait()
    out = job.text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, out[-4000:])
    assert "time limit near (SIGUSR1): the ranks checkpoint and stop" in out
    step = stop_checkpoint_and_resume(out)
    assert 2 <= step < 2 * STEPS
    assert_same_weights(job.run_dir, uninterrupted.run_dir)
    assert (job.run_dir / "dawnbench" / "report.md").exists()


def test_scancel_term_checkpoints_requeues_and_the_resumed_job_loses_no_step(cluster, digits_root, tmp_path,
                                                                             uninterrupted):
    """`scancel --signal=TERM JOB` (the job's steps; what a spot-reclaim hook sends): every rank finishes its step,
    they checkpoint it and stop, the batch script requeues the job and the resumed run continues with the next
    step: every step logged exactly once, and the weights bitwise the uninterrupted job's. Catches a script that
    exits 0 after such a stop without requeueing (the job looks COMPLETED half-trained), a node script that
    passes a second SIGTERM to torchrun, and a resume from an older checkpoint (steps trained twice)."""
    job = Job(cluster, tmp_path, digits_root, "--time=10")
    job.wait_for("trained 3 steps", lambda: len(job.train_steps()) >= 3)
    cluster.run("scancel", "--signal=TERM", str(job.id))
    state = job.wait()
    out = job.text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, out[-4000:])
    step = stop_checkpoint_and_resume(out)
    assert 3 <= step < 2 * STEPS
    assert job.train_steps() == list(range(1, 2 * STEPS + 1)), "a step lost or trained twice across the requeue"
    assert_same_weights(job.run_dir, uninterrupted.run_dir)


def test_a_read_only_checkpoint_folder_stops_the_job_at_start_with_one_error(cluster, digits_root, tmp_path):
    """The run's checkpoint folder on a read-only mount (root writes through file permissions, not through a
    read-only mount): the ranks stop before their first step, each with one line naming the folder, and the job
    fails instead of training for hours without a checkpoint. Catches a check of permission bits only (root
    passes them), a check deferred to the first checkpoint, a fresh run's archiving of the folder failing first
    (it is a mount point), and a traceback from every rank instead of one line."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        job = Job(cluster, tmp_path, digits_root, "--time=10", MAX_RESTARTS="0")
        state = job.wait()
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    out = job.text()
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", (state, out[-4000:])
    errors = re.findall(rf"checkpoint error: {re.escape(str(folder))} is not writable \(Read-only file system\)", out)
    assert 1 <= len(errors) <= 2, out[-4000:]  # one line per rank that got there before torchrun stopped the rest
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out
    assert job.train_steps() == [] and not (job.run_dir / "previous").exists()
