"""The run record: `log.dir/env.json`, written at the start of every run, says what the run ran on.

    time, command (argv, executable, working folder), git_commit
    python, platform, cpu (model, logical cores, flags)
    versions: torch, CUDA, cuDNN, NCCL (those torch was built with and loads), DALI, Horovod
    gpus: this node's devices as torch sees them (name, compute capability, memory), and nvidia-smi's driver
          version and GPU names where nvidia-smi exists (null otherwise)
    hosts: every rank's host name, local rank and device (gathered once, at the start), world size, nodes
    launcher: the torchrun / Slurm / NCCL environment variables of rank 0
    packages: the installed versions of the packages that change results or speed
    choices: the measured choices this start trains with (trainer/choices.py), added once decided

Each value that cannot be read here is null, never a guess. A resumed run rewrites the record and keeps a
short form of each earlier start (time, world size, hosts, devices) under `earlier_starts`, so a run that
moved between clusters says so. scripts/dawnbench_report.py reads the devices from it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.config import git_commit
from trainer.dist import Topology

RECORD = "env.json"
PACKAGES = ("torch", "torchvision", "triton", "nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110",
            "horovod", "numpy", "pillow", "PyYAML", "tensorboard", "sentencepiece", "sacrebleu", "fsspec",
            "onnx", "onnxruntime", "scipy")
ENV_PREFIXES = ("TORCHELASTIC_", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_RESTART_COUNT",
                "SLURM_GPUS", "CUDA_VISIBLE_DEVICES", "NCCL_", "OMP_NUM_THREADS", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "MASTER_ADDR")


def cpu_info() -> dict[str, Any]:
    """Model name, logical cores and the flag list of /proc/cpuinfo (the model from `platform` elsewhere)."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = value.split()
                break
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine(), "logical_cores": os.cpu_count(),
            "flags": flags}


KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The instruction-set flags that change which kernels run (a model name such as "AMD EPYC" can cover machines with
and without AVX-512)."""


def kernel_flags() -> list[str]:
    """This CPU's `KERNEL_FLAGS`, in that order."""
    flags = set(cpu_info()["flags"] or [])
    return [f for f in KERNEL_FLAGS if f in flags]


def widest_flag(flags: Sequence[str]) -> str:
    """The widest vector extension among a CPU's `flags` ('' for none): what tells apart machines that one model
    name covers."""
    return next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(cpu_info()["model"])


def versions() -> dict[str, Any]:
    """torch and the GPU libraries it was built with and loads; DALI and Horovod when installed."""
    def safe(fn: Any) -> Any:
        try:
            return fn()
        except Exception:  # a CPU build, or a library that cannot load here: not recorded, not fatal
            return None

    nccl = safe(torch.cuda.nccl.version) if torch.version.cuda else None
    dali = next((v for v in (package_version(p) for p in PACKAGES if p.startswith("nvidia-dali")) if v), None)
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": safe(torch.backends.cudnn.version) if torch.backends.cudnn.is_available() else None,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "dali": dali, "horovod": package_version("horovod")}


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> dict[str, Any]:
    """This node's GPUs as torch sees them, and nvidia-smi's driver and names (null where it is absent)."""
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                            "memory_gib": round(p.total_memory / 2**30, 1)})
    driver = smi = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            rows = [[c.strip() for c in line.split(",", 1)] for line in out.splitlines() if line.strip()]
            driver, smi = (rows[0][0] if rows else None), [r[-1] for r in rows]
        except (OSError, subprocess.SubprocessError):
            pass
    return {"torch_devices": devices, "driver": driver, "nvidia_smi": smi}


def this_rank(topo: Topology) -> dict[str, Any]:
    device = str(topo.device)
    return {"rank": topo.rank, "host": socket.gethostname(), "local_rank": topo.local_rank, "device": device,
            "device_name": device_name(topo.device)}


def collect(topo: Topology, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The record on rank 0, given every rank's `this_rank`."""
    hosts = sorted({r["host"] for r in ranks})
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": {"argv": sys.argv, "executable": sys.executable, "cwd": os.getcwd()},
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_info(),
        "versions": versions(),
        "gpus": gpus(),
        "hosts": {"world_size": topo.world_size, "nodes": len(hosts), "names": hosts, "backend": topo.backend,
                  "ranks": ranks},
        "launcher": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "packages": {p: v for p in PACKAGES if (v := package_version(p))},
    }


def short_form(record: dict[str, Any]) -> dict[str, Any]:
    hosts = record.get("hosts", {})
    return {"time": record.get("time"), "world_size": hosts.get("world_size"), "hosts": hosts.get("names"),
            "devices": sorted({r.get("device_name") for r in hosts.get("ranks", [])} - {None})}


def write_run_record(log_dir: Path, topo: Topology, fresh: bool = True) -> Path | None:
    """Every rank gives its host and device (one gather); rank 0 writes log_dir/env.json and returns its path.
    A resumed run (`fresh` False) keeps the earlier starts' short forms."""
    ranks = topo.world.gather_object(this_rank(topo))
    if not topo.is_main:
        return None
    record = collect(topo, ranks or [this_rank(topo)])
    path = Path(log_dir) / RECORD
    earlier: list[dict[str, Any]] = []
    if not fresh and path.is_file():
        try:
            previous = json.loads(path.read_text())
            earlier = [*previous.get("earlier_starts", []), short_form(previous)]
        except (ValueError, AttributeError):
            pass  # an unreadable record is replaced
    record["earlier_starts"] = earlier
    _write(path, record)
    return path


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def add_to_run_record(log_dir: Path, key: str, value: Any) -> None:
    """Set `key` in log_dir/env.json (rank 0, after `write_run_record`), e.g. the measured choices; a missing or
    unreadable record is started anew with only this key."""
    path = Path(log_dir) / RECORD
    record = read_run_record(log_dir) or {}
    record[key] = value
    _write(path, record)


def read_run_record(log_dir: Path) -> dict[str, Any] | None:
    """log_dir/env.json, or None where it is missing or unreadable (a run from before the record existed)."""
    try:
        record = json.loads((Path(log_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe_devices(record: dict[str, Any]) -> str | None:
    """One line for a report: ranks × device model on how many hosts, driver and versions; None if unknown."""
    hosts = record.get("hosts") or {}
    ranks = hosts.get("ranks") or []
    if not ranks:
        return None
    counts: dict[tuple[bool, str], int] = {}
    for r in ranks:
        key = (str(r.get("device", "")).startswith("cuda"), r.get("device_name") or "unknown device")
        counts[key] = counts.get(key, 0) + 1
    devices = ", ".join(f"{n} × {name} GPU{'s' * (n != 1)}" if on_gpu else
                        f"{n} CPU process{'es' * (n != 1)} on {name}" for (on_gpu, name), n in counts.items())
    v = record.get("versions") or {}
    gpu = record.get("gpus") or {}
    extra = [hosts.get("backend") if hosts.get("backend") not in (None, "none") else None,
             f"driver {gpu['driver']}" if gpu.get("driver") else None,
             f"CUDA {v['cuda']}" if v.get("cuda") and any(str(r.get("device", "")).startswith("cuda")
                                                         for r in ranks) else None,
             f"torch {v['torch']}" if v.get("torch") else None]
    nodes = hosts.get("nodes") or len({r.get("host") for r in ranks})
    return f"{devices} on {nodes} host{'s' * (nodes != 1)} ({', '.join(e for e in extra if e)})"
