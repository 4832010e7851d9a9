"""The emulated cluster (scripts/netem): argument and environment errors everywhere; as root, two shaped
nodes whose gloo allreduce stays under the cap, and a `down` that leaves no namespace, veth, bridge,
qdisc or /etc/netns file behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the scripts' checks; the shaped cluster itself needs root (cluster)

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "netem" / "cluster.sh"
RUN = ROOT / "scripts" / "netem" / "run.sh"
PREFIX, SUBNET = "dawnt", "10.213.2"  # not the default cluster, nor the scaling benchmark's
ENV = {**os.environ, "NETEM_PREFIX": PREFIX, "NETEM_SUBNET": SUBNET}

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="needs root and iproute2 (ip, tc): network namespaces and tc shaping")


def sh(*args: str | Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], env=env or ENV, text=True, capture_output=True, timeout=timeout)


def stub_bin(tmp_path: Path, uid: int, tools: tuple[str, ...] = ()) -> Path:
    """A PATH directory with an `id` that reports `uid`, `ip`/`tc` that fail if called, and real `tools`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    for name in ("ip", "tc"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'called ip/tc before validating the arguments' >&2\nexit 99\n")
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


# ---------------------------------------------------------------- errors (any user)


def test_not_root_is_a_clear_error(tmp_path):
    env = {**ENV, "PATH": f"{stub_bin(tmp_path, 1000)}:{os.environ['PATH']}"}
    proc = sh(CLUSTER, "up", "2", "1gbit", env=env)
    assert proc.returncode == 1
    assert "must run as root" in proc.stderr


def test_missing_iproute2_is_a_clear_error(tmp_path):
    bin_dir = stub_bin(tmp_path, 0, tools=("tr",))
    for name in ("ip", "tc"):
        (bin_dir / name).unlink()
    proc = sh("/bin/bash", CLUSTER, "status", env={**ENV, "PATH": str(bin_dir)})
    assert proc.returncode == 1
    assert "ip and tc (package iproute2) are required and missing" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("up", "0", "1gbit"), "N must be an integer in 1..64, got '0'"),
    (("up", "2"), "RATE missing"),
    (("up", "2", "fast"), "RATE must look like 1gbit, 200mbit or 500kbit (or 'unlimited'), got 'fast'"),
    (("sideways",), "unknown command 'sideways'"),
    (("rate",), "rate: RATE missing"),
    (("rate", "fast"), "RATE must look like 1gbit, 200mbit or 500kbit (or 'unlimited'), got 'fast'"),
])
def test_bad_arguments_are_named_before_anything_is_made(tmp_path, args, message):
    env = {**ENV, "PATH": f"{stub_bin(tmp_path, 0)}:{os.environ['PATH']}"}
    proc = sh(CLUSTER, *args, env=env)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr
    assert "called ip/tc" not in proc.stderr


def test_bad_prefix_and_addresses():
    proc = sh(CLUSTER, "status", env={**ENV, "NETEM_PREFIX": "Bad-Name"})
    assert proc.returncode == 1 and "NETEM_PREFIX must be" in proc.stderr
    proc = sh(CLUSTER, "status", env={**ENV, "NETEM_SUBNET": "8.8.8"})
    assert proc.returncode == 1 and "NETEM_SUBNET must be the first three octets of a private /24" in proc.stderr
    assert sh(CLUSTER, "addr", "1").stdout.strip() == f"{SUBNET}.2"


def test_run_without_a_command_is_a_clear_error():
    proc = sh(RUN, "--nproc-per-node", "2")
    assert proc.returncode == 1 and "nothing to run" in proc.stderr


# ---------------------------------------------------------------- root: a real emulated cluster

WORKER = """
import json, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.ones(2**20)  # 4 MiB of fp32
dist.all_reduce(t)  # warm-up: connections, allocations
times = []
for _ in range(3):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t)
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    json.dump({"seconds": sorted(times)[1], "bytes": t.numel() * 4, "value": t[0].item()}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def leftovers() -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    found = [line for text in (netns, links, qdiscs) for line in text.splitlines() if f"{PREFIX}-" in line]
    return found + [str(p) for p in Path("/etc/netns").glob(f"{PREFIX}-*")]


@pytest.mark.cluster
@needs_root
def test_two_shaped_nodes_cap_gloo_and_down_leaves_nothing(tmp_path):
    rate_bytes = 200e6 / 8
    worker, out = tmp_path / "allreduce.py", tmp_path / "out.json"
    worker.write_text(WORKER)
    try:
        first = sh(CLUSTER, "up", "2", "200mbit")
        assert first.returncode == 0, first.stderr
        again = sh(CLUSTER, "up", "2", "200mbit")  # idempotent: same nodes, same shaping
        assert again.returncode == 0 and again.stdout == first.stdout
        status = sh(CLUSTER, "status").stdout
        assert f"{SUBNET}.1/24" in status and f"{SUBNET}.2/24" in status
        assert status.count("200Mbit") == 4  # each node: uplink and downlink
        proc = sh(RUN, "--nproc-per-node", "1", "--port", "29531", worker, out, timeout=90)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["value"] == 2.0 ** 4  # ones, summed over 2 ranks by each of the 4 allreduces
        # a 2-rank ring allreduce sends the whole buffer once over each node's link
        throughput = result["bytes"] / result["seconds"]
        assert throughput <= 1.05 * rate_bytes, f"{throughput * 8 / 1e6:.0f} Mbit/s through a 200 Mbit/s cap"
        assert throughput >= 0.5 * rate_bytes, f"only {throughput * 8 / 1e6:.0f} Mbit/s of a 200 Mbit/s link"
    finally:
        down = sh(CLUSTER, "down")
    assert down.returncode == 0, down.stderr
    assert leftovers() == []


def test_scaling_bench_skips_with_a_reason_when_not_root(monkeypatch, capsys):
    from scripts.bench import scaling

    monkeypatch.setattr(scaling.os, "geteuid", lambda: 1000)
    result = scaling.main(["--quick"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == result
    assert result["bench"] == "scaling" and "needs root" in result["skipped"] and result["ratio"] is None
