"""The Slurm launchers run as Slurm would run them, with stand-ins for srun, scancel, scontrol and torchrun (real
bash, real signals): the time-limit notice reaches torchrun as one SIGTERM, never SIGUSR1, the job is requeued
after the ranks stopped, and a requeued job resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from data import synthetic_translation as synth

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
# srun: one node; the step's task in a process group of its own, as slurmstepd starts it (its options dropped)
FAKE_SRUN = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
setsid "$@" &
echo $! > "$FAKE_LOG/step.pgid"
trap '' TERM
while kill -0 $! 2>/dev/null; do wait $!; status=$?; done
exit $status
"""
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$FAKE_LOG/scontrol"\n[ "$1" = show ] && echo node0\nexit 0\n'
# scancel --signal=SIG JOB: the signal to every process of the job step (here: the task's process group)
FAKE_SCANCEL = '#!/bin/bash\necho "$@" >> "$FAKE_LOG/scancel"\nkill -"${1#--signal=}" -- -"$(cat "$FAKE_LOG/step.pgid")"\n'
# torchrun's part as the ranks play it: SIGTERM -> "checkpoint" for a second (a second SIGTERM meanwhile is
# recorded: it would cut real torchrun's wait for the ranks short) and exit 75; SIGUSR1 kills it, as it kills
# real torchrun
FAKE_TORCHRUN = """#!/bin/bash
echo "$@" > "$FAKE_LOG/torchrun.args"
term() { echo checkpoint >> "$FAKE_LOG/stopped"; stopping=1; }
trap term TERM
touch "$FAKE_LOG/started"
stopping=""
for i in $(seq 600); do
  sleep 0.1
  [ -n "$stopping" ] && [ $((stopping++)) -ge 10 ] && exit 75
  [ -e "$FAKE_LOG/finish" ] && exit 0
done
exit 1
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.prepare(tmp_path_factory.mktemp("wmt"), n_train=200, n_valid=10, n_test=10, vocab_size=120)


def stand_ins(tmp: Path) -> dict[str, str]:
    bin_dir, log = tmp / "bin", tmp / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL),
                       ("torchrun", FAKE_TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
            "TORCHRUN": str(bin_dir / "torchrun"), "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "node0", "SLURM_NODEID": "0", "SLURM_GPUS_PER_NODE": "2", "NOCOPY": "1",
            "LOCAL": str(tmp / "local")}


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_time_limit_notice_checkpoints_stops_and_requeues(corpus, tmp_path):
    env = {**stand_ins(tmp_path), "DATA": str(corpus), "RUN_DIR": str(tmp_path / "run")}
    log = tmp_path / "log"
    proc = subprocess.Popen(["bash", "scripts/slurm/transformer_wmt.sbatch", "train.epochs=2"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(log / "started", proc)
    args = (log / "torchrun.args").read_text().split()
    assert args[:2] == ["--node_rank", "0"] and "--max-restarts" in args and args[args.index("--max-restarts") + 1] == "3"
    assert f"log.dir={tmp_path / 'run'}" in args and args[-1] == "train.epochs=2" and "--resume" not in args
    # the ranks' grace inside the 120 s notice, and torchrun waits for them longer than that
    assert "train.preempt_grace_s=100" in args and args[args.index("--shutdown-timeout") + 1] == "110"
    assert not any(a.startswith("train.preempt_check_every_steps") for a in args)  # auto: fitted to the grace
    assert (tmp_path / "run").is_dir()  # the run folder is made before the ranks start
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` sends the batch shell
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert (log / "scancel").read_text().split() == ["--signal=TERM", "4242"]  # to the step, not the batch shell
    assert (log / "stopped").read_text() == "checkpoint\n"  # torchrun got one SIGTERM (and would pass it on)
    assert "requeue 4242" in (log / "scontrol").read_text().splitlines()
    assert "torchrun ended with status 75 after SIGTERM" in out


def test_a_requeued_job_resumes_and_a_finished_one_is_not_requeued(corpus, tmp_path):
    env = {**stand_ins(tmp_path), "DATA": str(corpus), "RUN_DIR": str(tmp_path / "run"), "SLURM_RESTART_COUNT": "1"}
    log = tmp_path / "log"
    (log / "finish").touch()  # the ranks finish on their own
    result = subprocess.run(["bash", "scripts/slurm/transformer_wmt.sbatch"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    args = (log / "torchrun.args").read_text().split()
    # before every key=value: argparse takes no positional words after an option that follows some
    assert "--resume" in args and args.index("--resume") < min(i for i, a in enumerate(args) if "=" in a)
    assert "requeue" not in (log / "scontrol").read_text()


@pytest.mark.parametrize("gpus, slurm_gpus, nproc", [("", "a100:8", "8"), ("2", "0", "2")])
def test_the_ranks_per_node_come_from_gpus_or_the_jobs_gpu_count(corpus, tmp_path, gpus, slurm_gpus, nproc):
    """--gpus-per-node=a100:8 gives SLURM_GPUS_PER_NODE=a100:8 (8 ranks); GPUS=2 wins over a CPU job's 0."""
    env = {**stand_ins(tmp_path), "DATA": str(corpus), "RUN_DIR": str(tmp_path / "run"), "GPUS": gpus,
           "SLURM_GPUS_PER_NODE": slurm_gpus}
    (tmp_path / "log" / "finish").touch()
    result = subprocess.run(["bash", "scripts/slurm/transformer_wmt.sbatch"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    args = (tmp_path / "log" / "torchrun.args").read_text().split()
    assert args[args.index("--nproc_per_node") + 1] == nproc


def test_a_missing_corpus_stops_the_job_before_any_rank_starts(tmp_path):
    env = {**stand_ins(tmp_path), "DATA": str(tmp_path / "nowhere"), "RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(["bash", "scripts/slurm/transformer_wmt.sbatch"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "prepare_wmt.py" in result.stderr
    assert not (tmp_path / "log" / "started").exists()


@pytest.mark.parametrize("script", ["resnet50_dawnbench.sbatch", "transformer_wmt.sbatch", "node.sh"])
def test_the_scripts_parse_and_ask_for_restarts_and_requeue(script):
    path = ROOT / "scripts" / "slurm" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    if script.endswith(".sbatch"):
        assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@120" in text and "--max-restarts" in text
        assert 'mkdir -p "$RUN_DIR"' in text and "$LOCAL" in text
