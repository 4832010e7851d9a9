"""A real single-node Slurm cluster on this machine, in a folder of its own: munged, slurmctld and slurmd.

    cluster = start(Path(tempfile.mkdtemp()))   # installs slurmctld, slurmd and munge with apt-get if missing
    cluster.sbatch("scripts/slurm/resnet50_dawnbench.sbatch", "--nodes=1", ...)
    stop(cluster)                               # every daemon and job gone, the folder removed

The node is this machine (its hostname, its cores); no cgroups (proctrack/linuxproc, task/none), no
accounting. Its own munge key, socket and ports: a Slurm or munge already running here is left alone.
Everything (config, state, spool, logs) lies in the folder; the clients find the config through
`cluster.env` (SLURM_CONF). Needs root: the daemons run as root and SlurmUser is root. `Unavailable` says in one
line why the cluster cannot start here (the tests skip with it).

For people: scripts/slurm/local_cluster.sh up|down (`make slurm-up`, `make slurm-down`) runs this module:

    python -m tests.slurm_cluster up|down [DIR]      (default DIR: /tmp/dawnbench-slurm)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
"""Debian/Ubuntu packages of the daemons and the clients (Slurm 22.05 on Debian 12)."""
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
DEFAULT_DIR = Path("/tmp/dawnbench-slurm")
UP_TIMEOUT_S = 60.0
REQUEUE_DELAY_S = 5
"""AuthInfo cred_expire: also how long a requeued job waits before it may start again (Slurm's default: 120 s)."""

CONFIG = """\
# A single-node test cluster written by tests/slurm_cluster.py (all paths inside {dir}).
ClusterName=dawnbench-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket,cred_expire={requeue_delay}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
# no cgroups: processes are tracked by their parent links, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the main scheduler every 2 s (default 60): a requeued job starts again within seconds
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class Unavailable(RuntimeError):
    """The cluster cannot start on this machine; the message is one line saying why."""


@dataclass
class Cluster:
    """A running cluster: its folder, config, node and the environment its clients need."""

    dir: Path
    node: str
    cpus: int
    version: str
    """Slurm's version, e.g. 22.05.8."""

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF: what sbatch, squeue, scontrol and scancel need."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster; stdout and stderr as text."""
        done = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()}")
        return done

    def sbatch(self, script: str | Path, options: list[str], script_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit `script` with sbatch `options` (they override its #SBATCH lines) and `script_args`, in `env`
        (default: this process's) and `cwd`; returns the job id."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script), *script_args],
                              env={**(env or os.environ), "SLURM_CONF": str(self.conf)}, cwd=cwd,
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StartTime, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\S+?)=(\S*)", out))

    def wait_job(self, job_id: int, done: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                              "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"),
                 timeout: float = 300) -> dict[str, str]:
        """Wait until the job's state is one of `done`; returns the job. A timeout cancels it and raises."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in done:
                return job
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout:.0f}s")
            time.sleep(0.5)

    def node_state(self) -> str:
        """The node's state as sinfo shows it (idle, allocated, down, ...); "" while slurmctld does not answer."""
        return self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False).stdout.strip()


# ------------------------------------------------------------------ install, start, stop

def why_unavailable() -> str | None:
    """One line saying why the cluster cannot start here without installing anything, or None."""
    if sys.platform != "linux":
        return "a Slurm test cluster needs Linux"
    if os.geteuid() != 0:
        return "a Slurm test cluster needs root (its daemons run as root): run make test-cluster as root"
    if not all(Path(d).exists() for d in DAEMONS) and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it (slurmctld, slurmd, munge)"
    return None


def install() -> None:
    """apt-get install the daemons and clients if any is missing, without starting the distribution's own services
    (a policy-rc.d that denies starts, for the install only). Raises Unavailable, in one line, on failure."""
    if all(Path(d).exists() for d in DAEMONS) and shutil.which("sbatch"):
        return
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")  # 101: action forbidden (invoke-rc.d, deb-systemd-invoke)
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:  # a stale package list: update once and retry
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {e}") from None
    finally:
        if ours:
            policy.unlink()
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["?"]
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {last[0]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path) -> Path:
    """The munge key and slurm.conf of a cluster in `folder` (created): this machine as its one node."""
    for sub in ("munge", "state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # munged refuses a socket in a folder others cannot reach
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = folder / "slurm.conf"
    conf.write_text(CONFIG.format(dir=folder, node=socket.gethostname().split(".")[0], cpus=os.cpu_count() or 1,
                                  ctld_port=free_port(), slurmd_port=free_port(), requeue_delay=REQUEUE_DELAY_S))
    return conf


def last_log_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if "error" in ln.lower()] \
        if path.exists() else []
    return lines[-1].strip() if lines else f"(nothing in {path})"


def start(folder: Path) -> Cluster:
    """Install if needed, configure in `folder` and start munged, slurmctld and slurmd; wait until the node is
    idle. Raises Unavailable (one line) where that cannot happen; what started is stopped again first."""
    reason = why_unavailable()
    if reason:
        raise Unavailable(reason)
    install()
    conf = write_config(folder)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    node = socket.gethostname().split(".")[0]
    munge = folder / "munge"
    steps = [("munged", ["/usr/sbin/munged", "--force", f"--socket={munge}/munge.socket",
                         f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                         f"--seed-file={munge}/munged.seed", f"--log-file={folder}/log/munged.log"]),
             ("slurmctld", ["/usr/sbin/slurmctld", "-i"]),  # -i: no state from a previous life
             ("slurmd", ["/usr/sbin/slurmd"])]
    version = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True).stdout.split()[-1]
    cluster = Cluster(folder, node, os.cpu_count() or 1, version)
    try:
        for name, cmd in steps:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                log = folder / "log" / f"{name}.log"
                raise Unavailable(f"{name} did not start: {(done.stderr.strip() or last_log_line(log))[-300:]}")
        deadline = time.monotonic() + UP_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            state = cluster.node_state()
            if state == "idle":
                return cluster
            time.sleep(0.5)
        raise Unavailable(f"the node {node} is '{state or 'unknown'}', not idle, {UP_TIMEOUT_S:.0f}s after "
                          f"the start: {last_log_line(folder / 'log' / 'slurmd.log')[-200:]}")
    except BaseException:
        stop(cluster, remove=False)
        raise


def _pids(folder: Path, names: tuple[str, ...] = ("slurmd", "slurmctld", "munged")) -> list[int]:
    """The live daemons of the cluster in `folder`, from their pid files."""
    files = {"slurmd": folder / "slurmd.pid", "slurmctld": folder / "slurmctld.pid",
             "munged": folder / "munge" / "munged.pid"}
    pids = []
    for name in names:
        try:
            pids.append(int(files[name].read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def _job_processes(folder: Path) -> list[int]:
    """slurmstepd processes of this cluster: their environment (slurmd's) names its config; another cluster's
    are left alone."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() != "slurmstepd":
                continue
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"SLURM_CONF={folder}/".encode() in environ:
            found.append(int(proc.name))
    return found


def stop(cluster: Cluster | Path, remove: bool = True) -> None:
    """Cancel every job, stop slurmctld and slurmd, then munged (SIGKILL after 20 s each), and remove the
    folder."""
    folder = cluster.dir if isinstance(cluster, Cluster) else Path(cluster)
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    quiet = {"env": env, "capture_output": True, "timeout": 30}
    if _pids(folder, ("slurmctld",)) and shutil.which("scancel"):
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], **quiet)  # type: ignore[arg-type]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], text=True, **quiet)  # type: ignore[arg-type]
            if jobs.returncode != 0 or not jobs.stdout.strip():
                break
            time.sleep(0.5)
        subprocess.run(["scontrol", "shutdown"], **quiet)  # type: ignore[arg-type]  # slurmctld and slurmd
    for names in (("slurmd", "slurmctld"), ("munged",)):  # munged last: the others talk to it until they end
        for pid in _pids(folder, names) if names == ("munged",) else []:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _pids(folder, names) and time.monotonic() < deadline:
            time.sleep(0.1)
    for pid in _pids(folder) + _job_processes(folder):
        os.kill(pid, signal.SIGKILL)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """`up [DIR]`: start a cluster in DIR and print the line that points the Slurm commands at it; `down [DIR]`:
    stop it and remove DIR."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("up", "down"):
        raise SystemExit("usage: python -m tests.slurm_cluster up|down [DIR]")
    folder = Path(args[1] if len(args) > 1 else DEFAULT_DIR).resolve()
    if args[0] == "down":
        stop(folder)
        print(f"stopped; {folder} removed")
        return
    if (folder / "slurm.conf").exists() and _pids(folder):
        raise SystemExit(f"a cluster is already up in {folder} (stop it: scripts/slurm/local_cluster.sh down)")
    try:
        cluster = start(folder)
    except Unavailable as e:
        raise SystemExit(f"local Slurm cluster: {e}") from None
    print(f"Slurm {cluster.version}: node {cluster.node} ({cluster.cpus} CPUs) idle; its files in {folder}\n"
          f"export SLURM_CONF={cluster.conf}")


if __name__ == "__main__":
    main()
