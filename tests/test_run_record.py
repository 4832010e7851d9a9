"""env.json, the run record: every rank's host gathered over a real 2-rank gloo group, versions and packages as
installed, nvidia-smi's driver read when the command exists, earlier starts kept on a resume."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_ranks
from trainer.config import git_commit
from trainer.dist import DistConfig, Topology, setup_distributed
from trainer.run_record import describe_devices, read_run_record, write_run_record

pytestmark = pytest.mark.dist


def _write(rank: int, world: int, out: Path) -> str | None:
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    path = write_run_record(out, topo)
    return str(path) if path else None


def test_two_ranks_record_both_hosts_and_rank_zero_writes(tmp_path):
    paths = run_ranks(_write, 2, tmp_path, tmp_path / "run", timeout=600)
    assert paths == [str(tmp_path / "run" / "env.json"), None]
    record = json.loads((tmp_path / "run" / "env.json").read_text())
    hosts = record["hosts"]
    assert hosts["world_size"] == 2 and hosts["backend"] == "gloo"
    assert [r["rank"] for r in hosts["ranks"]] == [0, 1]
    assert {r["host"] for r in hosts["ranks"]} == {socket.gethostname()} and hosts["nodes"] == 1
    assert all(r["device"] == "cpu" for r in hosts["ranks"])
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["cuda"] == torch.version.cuda
    assert record["packages"]["torch"] == importlib.metadata.version("torch")
    assert record["packages"]["numpy"] == importlib.metadata.version("numpy")
    sha = record["git_commit"].removesuffix("+dirty")  # (HEAD may move meanwhile: others commit in this tree)
    assert re.fullmatch(r"[0-9a-f]{40}", sha) and git_commit() != "unknown" and record["command"]["argv"]
    assert subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT).returncode == 0
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    assert record["cpu"]["model"] == model and "fpu" in record["cpu"]["flags"]
    assert describe_devices(record).startswith(f"2 CPU processes on {model} on 1 host (gloo, torch ")


def test_the_driver_comes_from_nvidia_smi_and_is_null_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-smi anywhere
    write_run_record(tmp_path / "a", Topology())
    assert read_run_record(tmp_path / "a")["gpus"]["driver"] is None
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"  # prints what nvidia-smi prints for this query on a 2-GPU node
    smi.write_text("#!/bin/sh\necho '570.86.15, NVIDIA H200'\necho '570.86.15, NVIDIA H200'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    write_run_record(tmp_path / "b", Topology())
    gpus = read_run_record(tmp_path / "b")["gpus"]
    assert gpus["driver"] == "570.86.15" and gpus["nvidia_smi"] == ["NVIDIA H200", "NVIDIA H200"]
    assert "driver 570.86.15" in describe_devices(read_run_record(tmp_path / "b"))


def test_a_resume_keeps_the_earlier_starts_and_a_fresh_run_does_not(tmp_path):
    write_run_record(tmp_path, Topology())
    first = read_run_record(tmp_path)
    write_run_record(tmp_path, Topology(), fresh=False)
    write_run_record(tmp_path, Topology(), fresh=False)
    record = read_run_record(tmp_path)
    assert len(record["earlier_starts"]) == 2
    assert record["earlier_starts"][0] == {"time": first["time"], "world_size": 1, "hosts": [socket.gethostname()],
                                           "devices": [first["hosts"]["ranks"][0]["device_name"]]}
    write_run_record(tmp_path, Topology())
    assert read_run_record(tmp_path)["earlier_starts"] == []
    (tmp_path / "env.json").write_text("{torn")
    assert read_run_record(tmp_path) is None
    write_run_record(tmp_path, Topology(), fresh=False)  # an unreadable record is replaced, not fatal
    assert read_run_record(tmp_path)["earlier_starts"] == [] and not list(tmp_path.glob(".env.json.tmp"))
    assert os.access(tmp_path / "env.json", os.R_OK)
