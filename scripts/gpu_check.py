"""Checks every GPU path of the repository on a CUDA machine, unattended, and ends in one table.

    scripts/gpu_check.sh [--device auto|cuda|cpu] [--only NAME ...] [--budget-s 450] [--timeout-s S]

Each check runs in its own subprocess (`python -m scripts.gpu_check --run-one NAME`) under a timeout and
gives rows (check, result, detail) with result PASS, FAIL or SKIP. SKIP says why a path could not run: no
CUDA, an optional package absent (DALI, torchvision, Triton), or one GPU where the path needs two. FAIL is
a wrong result, an exception, a crash or a timeout; the other checks still run. The table goes to stdout,
ending in one JSON line: {"bench": "gpu_check", "rows": [...], "pass": n, "fail": n, "skip": n,
"machine": {...}}; what the checks print goes to stderr. The exit status is 1 if any row failed; 2, after one
line naming them, when this Python lacks torch or a package the repository imports (the preflight looks).

With `--device cpu`, or `auto` where torch sees no CUDA, it is a dry run of the same checks on the CPU
paths at tiny sizes (seconds each). On one H200 the whole run must end within 8 minutes: `--budget-s`
bounds it, and a check that cannot start in the time left is a FAIL. A new GPU path adds its check here.

The checks (names for --only): preflight (versions, compute capability against torch's arch list), mstopk
(Triton MSTopK against torch.topk and the reference at the communicator's sizes, from a worker thread on a
side stream, host syncs), communicators (dense / topk / hitopk / auto over NCCL on the GPUs present), lars
(FusedLARS against its per-tensor reference on ResNet-50's 161 tensors, and the kernels one step launches), adam
(build_adam's TritonAdam against torch's fused Adam and AdamW, likewise), train-resnet50 and train-transformer
(the trainer's own step on synthetic data: throughput, memory, host syncs), dali (DALI's mixed decoding), recipe
(recipes.resnet50 through fit and a resume), compile (train.compile and train.cuda_graphs on the GPU path's step
against eager: last, as its compilation may take what is left of the budget).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import itertools
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ("PASS", "FAIL", "SKIP")


@dataclass
class Row:
    check: str
    result: str
    """PASS, FAIL or SKIP."""
    detail: str
    values: dict[str, Any] = field(default_factory=dict)
    """The row's measurements, for the JSON line (images/s, recall, milliseconds...)."""


class Skip(Exception):
    """Raised by a check that cannot run here; the message says why."""


@dataclass
class Check:
    name: str
    fn: Callable[[Any], list[Row]]
    timeout_s: float
    """Seconds the check's subprocess may run on a GPU (a CPU dry run gets the same)."""
    requires: tuple[str, ...] = ()
    """Optional modules the check needs on every device."""
    requires_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Optional modules it needs on one device only, e.g. {"cuda": ("triton",)}."""
    hidden: bool = False
    """Run only when named with --only."""
    light: bool = False
    """The check imports no torch: its function gets the device's name, not a torch.device."""


CHECKS: dict[str, Check] = {}
MACHINE: dict[str, Any] = {}
"""Facts about the machine, filled by the preflight check and carried to the JSON line."""


def check(name: str, timeout_s: float, requires: tuple[str, ...] = (),
          requires_on: dict[str, tuple[str, ...]] | None = None, hidden: bool = False,
          light: bool = False) -> Callable[[Callable[[Any], list[Row]]], Callable[[Any], list[Row]]]:
    def register(fn: Callable[[Any], list[Row]]) -> Callable[[Any], list[Row]]:
        CHECKS[name] = Check(name, fn, timeout_s, requires, requires_on or {}, hidden, light)
        return fn
    return register


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def missing_module(name: str) -> str | None:
    """Why `name` cannot be imported when it (or a package above it) is not installed; None when it imports.

    An import that fails for another reason (a broken install, a missing shared library) raises: that
    is a FAIL of the check, not a SKIP."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        absent = err.name or ""
        if absent and (name == absent or name.startswith(absent + ".")):
            return f"{name} is not installed in this Python ({err})"
        raise
    return None


def require_device(device: Any) -> None:
    import torch

    if device.type == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")


# ---------------------------------------------------------------- shared helpers (run inside a check)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 1) -> float:
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def count_host_syncs(device: Any):
    """Counts the host syncs of the body with torch.cuda.set_sync_debug_mode("warn") (CUDA only; the list
    stays empty on the CPU). Yields the list of the syncs' sites, complete after the body: each names the
    innermost frame of this repository on the stack and the frame that synchronised (`sync_site`)."""
    import warnings

    import torch

    sites: list[str] = []
    if device.type != "cuda":
        yield sites
        return

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):  # the message's filename alone names a torch file, not the caller
            sites.append(sync_site(traceback.extract_stack()[:-1], filename, lineno))

    sync(device)
    with warnings.catch_warnings(record=True):  # torch 2.11 reports one sync at the switch itself: not the body's
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():  # also sees the comm thread's warnings: showwarning is process-wide
        warnings.simplefilter("always")
        warnings.showwarning = note
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)


def sync_site(stack: list[traceback.FrameSummary], filename: str, lineno: int) -> str:
    """'ours.py:12 function > package/file.py:34': the innermost frame of `stack` inside this repository, then the
    frame the warning names (its last two path parts: torch has many __init__.py)."""
    where = "/".join(Path(filename).parts[-2:]) + f":{lineno}"
    ours = [f for f in stack if Path(f.filename).resolve().is_relative_to(ROOT) and "site-packages" not in f.filename]
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name} > {where}" if ours else where


def kernel_launches(fn: Callable[[], Any], device: Any) -> int | None:
    """CUDA kernels that one call of `fn` launches, from torch.profiler's device events (copies and memsets not
    counted), after a first call that compiles; None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    fn()
    sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def resnet50_weights(device: Any, steps: int) -> tuple[list[Any], list[list[Any]], int]:
    """ResNet-50's parameter shapes (a narrow copy off CUDA) as float32 weights and `steps` gradients each, on
    `device`, drawn on the CPU from seed 0; and the number of elements."""
    import torch

    shapes = resnet50_shapes() if device.type == "cuda" else resnet50_shapes(width=8, num_classes=10)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).to(device) * (0.05 if len(s) > 1 else 1.0) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * 0.01).to(device) for s in shapes] for _ in range(steps)]
    return start, grads, sum(int(torch.Size(s).numel()) for s in shapes)


def max_relative_difference(a: list[Any], b: list[Any]) -> float:
    """The largest difference between matching tensors, relative to each tensor's largest value in `a`."""
    return max(((x - y).abs().max() / x.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b) if x.numel())


def all_close(ours: list[Any], reference: list[Any], rtol: float = 1e-6, atol: float = 1e-8) -> bool:
    """Every element of `ours` within atol + rtol x |reference| (torch.testing.assert_close's rule)."""
    import torch

    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(ours, reference))


def beyond_spread(ours: list[Any], reference: list[Any], other: list[Any], rtol: float = 1e-6,
                  atol: float = 1e-8) -> int:
    """Elements of `ours` farther from `reference` than both atol + rtol x |reference| and `other`, a second
    implementation of the same reference, is at that element: where two torch paths disagree, ours may too, by
    as much and no more."""
    import torch

    return sum(int(((x - y).abs() > torch.maximum(atol + rtol * y.abs(), (z - y).abs())).sum())
               for x, y, z in zip(ours, reference, other))


def outside(ours: list[Any], reference: list[Any], rtol: float = 1e-6, atol: float = 1e-8) -> str:
    """How `all_close` fails: the elements outside its bound, and the worst one's |difference| and |reference|."""
    import torch

    count, worst = 0, (0.0, 0.0, 0.0)
    for x, y in zip(ours, reference):
        excess = (x - y).abs() / (atol + rtol * y.abs())
        count += int((excess > 1).sum())
        i = int(excess.argmax()) if excess.numel() else 0
        if excess.numel() and float(excess.reshape(-1)[i]) > worst[0]:
            worst = (float(excess.reshape(-1)[i]), float((x - y).abs().reshape(-1)[i]), float(y.abs().reshape(-1)[i]))
    return f"{count:,} element(s) outside, the worst |diff| {worst[1]:.1e} at |ref| {worst[2]:.1e}"


def resnet50_shapes(width: int = 64, num_classes: int = 1000) -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50 in registration order (161 tensors, 25,557,032
    elements at width 64); `width` scales every stage's channels (the CPU dry run's smaller copy)."""
    shapes: list[tuple[int, ...]] = [(width, 3, 7, 7), (width,), (width,)]
    in_ch = width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        planes = width * 2 ** stage
        for block in range(blocks):
            shapes += [(planes, in_ch, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, in_ch, 1, 1), (planes * 4,), (planes * 4,)]
            in_ch = planes * 4
    return shapes + [(num_classes, in_ch), (num_classes,)]


def parameters_module(shapes: list[tuple[int, ...]], device: Any) -> Any:
    """A module whose parameters have `shapes` (no forward: the communicator check makes the loss)."""
    import torch
    from torch import nn

    module = nn.Module()
    module.weights = nn.ParameterList([nn.Parameter(torch.zeros(s, device=device)) for s in shapes])
    return module


@contextlib.contextmanager
def one_rank_world(device: Any):
    """A 1-rank process group (NCCL on CUDA, gloo on the CPU) and its Topology with `world` set, so the
    communicators run their real collectives. build_communicator returns the no-op LocalCommunicator for
    one process, so the caller constructs the communicator classes itself."""
    import datetime

    import torch.distributed as dist

    from trainer.dist import Topology, TorchGroup

    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0,
                                world_size=1, device_id=device if cuda else None)
        try:
            topo = Topology(rank=0, world_size=1, local_rank=0, ranks_per_node=1, device=device,
                            backend="nccl" if cuda else "gloo")
            topo.world = TorchGroup(None, 0, datetime.timedelta(seconds=120))
            yield topo
        finally:
            dist.destroy_process_group()


def one_rank_communicator(kind: str, model: Any, topo: Any, bucket_mb: float, density: float,
                          dense_below: int = 16384) -> Any:
    """`kind` over a 1-rank world: dense; topk (this rank's own top-k, allgathered among 1); hitopk (the one
    rank is a node of its own: dense reduce-scatter and allgather, nothing selected)."""
    from trainer.comm import CommConfig
    from trainer.comm.dense import DenseAllreduce
    from trainer.comm.sparse import TopKCommunicator

    if kind == "dense":
        return DenseAllreduce(model, topo, bucket_mb)
    intra, inter = (None, topo.world) if kind == "topk" else (topo.world, None)
    cfg = CommConfig(kind=kind, bucket_mb=bucket_mb, density=density, dense_below=dense_below)
    return TopKCommunicator(cfg, model, topo, intra=intra, inter=inter)


# ---------------------------------------------------------------- preflight


def _driver_version() -> str:
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return next((w for w in first.split() if w.count(".") >= 1 and w.replace(".", "").isdigit()), first)
    except (OSError, IndexError):
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


REPOSITORY_MODULES = ("trainer.loop", "trainer.classification", "trainer.translation", "trainer.testing",
                      "trainer.devices", "recipes.transformer_model", "kernels.testing")
"""The repository's modules the checks import (the DALI check's aside): the preflight imports them, so that a
package they need and this Python lacks stops the run in one line instead of failing every check."""


def missing_packages(modules: Iterable[str]) -> list[str]:
    """The packages not installed in this Python that importing `modules` runs into, sorted (an import stops at
    the first one it misses, so one per module at most)."""
    absent = set()
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            absent.add(err.name or name)
    return sorted(absent)


@check("preflight", timeout_s=90)
def check_preflight(device: Any) -> list[Row]:
    """Versions of everything the GPU paths use; each GPU's compute capability against torch's arch list
    (trainer.devices, the test the recipes make before they start), and a kernel run on it. A package the
    repository imports and this Python lacks is one FAIL row, its names in MACHINE["missing"]."""
    import torch

    cuda = torch.cuda.is_available()
    MACHINE["device"] = device.type  # before any import of ours: the parent's --device auto is resolved from it
    missing = missing_packages(REPOSITORY_MODULES)
    if missing:
        MACHINE["missing"] = missing
        return [Row("preflight versions", "FAIL", f"not installed in this Python: {', '.join(missing)} (the "
                                                  "repository imports them)")]

    from trainer.devices import arch_supported, cuda_problem

    nccl = "absent"
    with contextlib.suppress(Exception):  # a tuple (major, minor, patch); an int in older torch
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda or "none", "cudnn": str(torch.backends.cudnn.version() or "none"),
                "nccl": nccl, "driver": _driver_version() if cuda else "none",
                "triton": _package_version("triton"), "torchvision": _package_version("torchvision"),
                "dali": _package_version("nvidia-dali-cuda130") if _package_version("nvidia-dali-cuda130") != "absent"
                else _package_version("nvidia-dali-cuda120"), "onnxruntime": _package_version("onnxruntime")}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    MACHINE.update(versions, cuda_available=cuda, gpus=gpus, arch_list=torch.cuda.get_arch_list() if cuda else [])
    rows = [Row("preflight versions", "PASS", ", ".join(f"{k} {v}" for k, v in versions.items()), versions)]
    if device.type != "cuda" or not cuda:
        reason = cuda_problem() if not cuda else "--device cpu (dry run)"
        return rows + [Row("compute capability", "SKIP", reason or "no CUDA device")]
    arch_list = torch.cuda.get_arch_list()
    for i, name in enumerate(gpus):
        cap = torch.cuda.get_device_capability(i)
        supported = arch_supported(cap, arch_list)
        MACHINE.setdefault("capability", []).append(f"sm_{cap[0]}{cap[1]}")
        ran = supported and float((torch.ones(1024, device=f"cuda:{i}") * 2).sum()) == 2048.0
        detail = (f"GPU {i} {name}: sm_{cap[0]}{cap[1]}, torch arch list {' '.join(arch_list)}: "
                  + (f"supported; a kernel ran {'correctly' if ran else 'WRONG'}" if supported
                     else "missing (no sm_ binary, no older compute_ PTX): torch cannot run kernels on this GPU"))
        rows.append(Row("compute capability", verdict(supported and ran), detail,
                        {"gpu": i, "capability": f"sm_{cap[0]}{cap[1]}"}))
    return rows


# ---------------------------------------------------------------- kernels


@check("mstopk", timeout_s=150, requires_on={"cuda": ("triton",)})
def check_mstopk(device: Any) -> list[Row]:
    """kernels.mstopk (Triton on CUDA) at the communicator's sizes against torch.topk and mstopk_reference:
    exactly k distinct indices, recall, time; the same call from a worker thread on a side CUDA stream, as
    the communicator makes it; the host syncs of one call; the guards."""
    import torch

    from kernels import mstopk, mstopk_reference
    from kernels.testing import gradient_like

    require_device(device)
    gpu = device.type == "cuda"
    # ResNet-50's 25.6 M gradient elements sharded over a node's 8 ranks (3.2 M, k = 1%), and all of them at 0.1%
    sizes = [(3_200_000, 32_000), (25_600_000, 25_600)] if gpu else [(100_000, 1_000), (400_000, 400)]
    repeats = 5 if gpu else 2
    rows = []
    for seed, (n, k) in enumerate(sizes):
        x = gradient_like(n, seed, device)
        values, indices = mstopk(x, k)
        exact_k = (indices.numel() == k and indices.unique().numel() == k
                   and bool(torch.equal(values, x[indices])))
        expected = torch.topk(x.abs(), k).indices
        recall = torch.isin(indices, expected).sum().item() / k
        same = torch.isin(indices, mstopk_reference(x, k)[1]).sum().item() / k
        ms = median_ms(lambda: mstopk(x, k), device, repeats)
        topk_ms = median_ms(lambda: torch.topk(x.abs(), k), device, repeats)
        ok = exact_k and recall >= 0.99 and same >= 0.999
        rows.append(Row(f"mstopk n={n / 1e6:g}M k={k:,}", verdict(ok),
                        f"exactly k distinct {exact_k}; recall vs torch.topk {recall:.4f} (>= 0.99), same as "
                        f"mstopk_reference {same:.4f} (>= 0.999); {ms:.2f} ms vs torch.topk {topk_ms:.2f} ms",
                        {"n": n, "k": k, "recall": recall, "same_as_reference": same, "ms": ms,
                         "topk_ms": topk_ms}))
    rows.append(_mstopk_side_stream(device, *sizes[-1], mstopk))
    rows.append(_mstopk_host_syncs(device, *sizes[-1], mstopk))
    rows.append(_mstopk_guards(device, mstopk, mstopk_reference))
    return rows


def _mstopk_side_stream(device: Any, n: int, k: int, mstopk: Callable) -> Row:
    """As ExchangeCommunicator calls it: on its worker thread, on a side stream that waits for an event
    recorded after the kernels producing the input. The input is produced behind a 50 ms GPU sleep, so a
    missing wait would read it before it is written."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from kernels.testing import gradient_like

    x = gradient_like(n, 7, device)
    expected = mstopk(x, k)
    gpu = device.type == "cuda"
    side = torch.cuda.Stream(device) if gpu else None

    def on_worker(t: Any, ready: Any) -> tuple:
        if not gpu:
            return mstopk(t, k), None
        torch.cuda.set_device(device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            out = mstopk(t, k)
            done = torch.cuda.Event()
            done.record()
        return out, done

    with ThreadPoolExecutor(max_workers=1) as pool:
        ready = None
        if gpu:
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU cycles on the default stream before x is produced
        produced = x * 1.0
        if gpu:
            ready = torch.cuda.Event()
            ready.record()
            produced.record_stream(side)
        (values, indices), done = pool.submit(on_worker, produced, ready).result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
    same = bool(torch.equal(values, expected[0]) and torch.equal(indices, expected[1]))
    where = "a worker thread on a side CUDA stream, input produced behind a GPU sleep" if gpu else "a worker thread"
    return Row("mstopk worker thread", verdict(same),
               f"n={n:,} k={k:,} from {where}: result {'equal to' if same else 'DIFFERS from'} the main thread's")


def _mstopk_host_syncs(device: Any, n: int, k: int, mstopk: Callable) -> Row:
    if device.type != "cuda":
        return Row("mstopk host syncs", "SKIP", "torch.cuda.set_sync_debug_mode counts CUDA syncs only")
    from kernels.testing import gradient_like

    x = gradient_like(n, 8, device)
    mstopk(x, k)  # compiled and warm
    with count_host_syncs(device) as syncs:
        mstopk(x, k)
    where = sorted(set(syncs))
    # kernels/mstopk_device.py's algorithm keeps the search and the selection on the device: any sync fails
    return Row("mstopk host syncs", verdict(not syncs), f"one call, n={n:,} k={k:,}: {len(syncs)} host sync(s) "
               f"(torch.cuda.set_sync_debug_mode; 0 expected){' at ' + ', '.join(where) if where else ''}",
               {"host_syncs": len(syncs)})


def _mstopk_guards(device: Any, mstopk: Callable, reference: Callable) -> Row:
    import torch

    from kernels.testing import gradient_like

    x = gradient_like(100_000, 1, device)
    cases = {"all zero": (torch.zeros(50_000, device=device), 100),
             "ties at max": (torch.tensor([1.0, -5.0, 0.5, 5.0, 5.0], device=device), 2),
             "fallback": (x, 60_000), "float16": (x.half(), 1_000), "bfloat16": (x.bfloat16(), 1_000)}
    failed = [name for name, (t, k) in cases.items()
              if not all(torch.equal(a, b) for a, b in zip(mstopk(t, k), reference(t, k)))]
    try:  # the CPU path raises; the CUDA path may instead return k NaN values at indices 0..k-1 (no host sync)
        values, indices = mstopk(torch.tensor([1.0, float("nan"), 2.0], device=device), 2)
        if device.type != "cuda" or not (bool(values.isnan().all()) and indices.tolist() == [0, 1]):
            failed.append(f"NaN input gave {values.tolist()} at {indices.tolist()}")
    except ValueError as err:
        if "NaN or inf" not in str(err):
            failed.append(f"NaN message: {err}")
    detail = f"{', '.join(cases)}, NaN input: " + ("as documented" if not failed else f"wrong: {', '.join(failed)}")
    return Row("mstopk guards", verdict(not failed), detail)


# ---------------------------------------------------------------- communicators


def _comm_step(model: Any, comm: Any, grads: list, delay: bool = False) -> list:
    """loss = sum(p * g) makes every gradient exactly g; backward launches the buckets from the hooks."""
    import torch

    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    if delay:  # the gradients and the buckets' buffers are produced behind ~50 ms of GPU sleep
        torch.cuda._sleep(100_000_000)
    loss.backward()
    comm.finish()
    return [p.grad.clone() for p in params]


def poison_free_memory(device: Any, like: list) -> None:
    """Fill with NaN the freed blocks the caching allocator will hand back next, then free them again: twice
    tensors shaped as `like` (it best-fits, so they take the blocks that same-sized tensors freed: the
    gradients, the buckets' copies) and a flat one of their total (a bucket's buffer)."""
    import torch

    total = sum(t.numel() for t in like)
    pieces = [torch.full_like(t, float("nan")) for _ in range(2) for t in like]
    pieces.append(torch.full((total,), float("nan"), dtype=like[0].dtype, device=device))
    sync(device)
    del pieces


def _flat(tensors: list) -> Any:
    import torch

    return torch.cat([t.reshape(-1) for t in tensors])


def _mass_conserved(comm: Any, model: Any, grads: list, world: int) -> bool | None:
    """After a sparse step: world x averaged + every rank's residuals == the sum of every rank's gradients
    (error feedback loses nothing). None when nothing was selected (no residuals)."""
    import torch
    import torch.distributed as dist

    residuals = getattr(comm, "residuals", None)
    if not residuals:  # the same on every rank: residuals exist where the configuration selects
        return None
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    local = comm.local_size
    shard_rank = comm.intra.rank if comm.intra is not None else 0
    sent, incoming, left = [], [], []
    for b in comm.buckets:
        sent.append(_flat([p.grad for p in b.params]) * world)
        incoming.append(_flat([grads[index_of[id(p)]] for p in b.params]))
        full = torch.zeros(-(-b.numel // local) * local, device=comm.topo.device)
        if b.index in residuals:
            shard = full.numel() // local
            full[shard_rank * shard:(shard_rank + 1) * shard] = residuals[b.index]
        left.append(full[:b.numel])
    incoming, left = _flat(incoming), _flat(left)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(incoming)
        dist.all_reduce(left)
    return bool(torch.allclose(_flat(sent) + left, incoming, rtol=1e-4, atol=1e-3))


def _auto_steps(model: Any, topo: Any, bucket_mb: float, grads: list) -> dict:
    """`comm.kind: auto` through calibration (its reductions over ranks on the device, CUDA-event timing), the
    trial of its plan and one drift check (rank 0's broadcast decisions): calibrated, finite, the plan and the
    calibrated links."""
    import torch

    from trainer.comm import AutoCommunicator, CommConfig

    cfg = CommConfig(kind="auto", bucket_mb=bucket_mb, calibration_steps=3, trial_steps=3, redecide_every=3)
    comm = AutoCommunicator(cfg, model, topo)
    averaged = []
    # calibration, then as many trial windows as plans it tries (measured, so not known ahead), then a drift check
    for _ in range(100):
        averaged = _comm_step(model, comm, grads)
        if comm.calibrated:
            break
    for _ in range(cfg.redecide_every):
        averaged = _comm_step(model, comm, grads)
    comm.detach()
    world = comm.net.links["world"] if comm.net is not None else None
    return {"calibrated": comm.calibrated, "finite": bool(torch.isfinite(_flat(averaged)).all()),
            "plan": sorted({c.label for c in comm.plan}),
            "link": f"{world.bytes_per_s * 8 / 1e9:.2f} Gbit/s, {world.alpha_s * 1e6:.0f} us" if world else "none"}


def _comm_rank(rank: int, world: int, device_type: str) -> dict | None:
    """One rank of the communicator check, in the process group trainer.testing.run_ranks joined (or, on a 1-GPU
    machine, the only rank, in this process). Rank 0 returns the report."""
    import statistics

    import torch

    from trainer.comm import CommConfig, build_communicator
    from trainer.dist import DistConfig, setup_distributed

    gpu = device_type == "cuda"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    # 4+ ranks: 2 emulated nodes, so hitopk is hierarchical; fewer: one rank per node (hitopk = topk)
    per_node = world // 2 if world >= 4 and world % 2 == 0 else 1
    shapes = resnet50_shapes() if gpu else resnet50_shapes(width=8, num_classes=10)
    bucket_mb = 25.0 if gpu else 0.5
    gen = torch.Generator().manual_seed(rank)
    integer = [torch.randint(-8, 9, s, generator=gen).float().to(device) for s in shapes]
    real = [torch.randn(s, generator=gen).to(device) for s in shapes]
    model = parameters_module(shapes, device)

    def build(kind: str, density: float, topo: Any) -> Any:
        if world == 1:
            return one_rank_communicator(kind, model, topo, bucket_mb, density)
        return build_communicator(CommConfig(kind=kind, bucket_mb=bucket_mb, density=density), model, topo)

    with contextlib.ExitStack() as stack:
        if world == 1:
            topo = stack.enter_context(one_rank_world(device))
        else:
            topo = setup_distributed(DistConfig(ranks_per_node=per_node, timeout_s=120))
        out: dict[str, dict] = {}
        dense = None
        for kind in ("dense", "topk", "hitopk"):
            comm = build(kind, 1.0, topo)
            got = _comm_step(model, comm, integer)
            comm.detach()
            dense = dense or got
            exact = all(torch.equal(a, b) for a, b in zip(got, dense))
            comm = build(kind, 0.01, topo)
            averaged = _comm_step(model, comm, real)
            conserved = _mass_conserved(comm, model, real, world)
            finite = bool(torch.isfinite(_flat(averaged)).all())
            times = []
            for _ in range(5 if gpu else 2):
                sync(device)
                start = time.perf_counter()
                _comm_step(model, comm, real)
                sync(device)
                times.append(time.perf_counter() - start)
            comm.detach()
            delayed_same = None
            if gpu:  # the same first step, its gradients produced behind a GPU sleep: bitwise the same
                first = build(kind, 0.01, topo)
                plain = _comm_step(model, first, real)
                first.detach()
                model.zero_grad(set_to_none=True)
                # Poison what the caching allocator hands back next: freed blocks that still held the first
                # step's buffers would let a missing stream wait pass with the right numbers.
                poison_free_memory(device, plain)
                second = build(kind, 0.01, topo)
                late = _comm_step(model, second, real, delay=True)
                second.detach()
                delayed_same = all(torch.equal(a, b) for a, b in zip(plain, late))
            out[kind] = {"exact": exact, "conserved": conserved, "finite": finite, "delayed_same": delayed_same,
                         "ms": statistics.median(times) * 1e3, "buckets": len(comm.buckets)}
        auto = _auto_steps(model, topo, bucket_mb, real)
    if rank != 0:
        return None
    return {"ok": out, "auto": auto, "layout": f"{world // per_node} node(s) x {per_node} rank(s)",
            "elements": sum(int(torch.Size(s).numel()) for s in shapes)}


@check("communicators", timeout_s=180)
def check_communicators(device: Any) -> list[Row]:
    """dense / topk / hitopk with one rank per GPU (NCCL; 2 gloo ranks on the CPU dry run) on ResNet-50's
    tensors: density 1.0 equals dense bitwise, density 0.01 conserves the gradient mass (error feedback),
    a step whose gradients come behind a GPU sleep is bitwise the same, time per step. With one GPU the
    1-rank world runs and the multi-rank paths are a SKIP row."""
    import torch

    from trainer.testing import run_ranks

    require_device(device)
    gpu = device.type == "cuda"
    world = torch.cuda.device_count() if gpu else 2
    if world == 1:
        report = _comm_rank(0, 1, device.type)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = run_ranks(_comm_rank, world, tmp, device.type, timeout=150,
                               backend="nccl" if gpu else "gloo")[0]
    backend = (f"NCCL, {world} GPU(s)" if gpu else f"gloo, {world} CPU ranks") + f", {report['layout']}"
    rows = []
    for kind, r in report["ok"].items():
        ok = r["exact"] and r["conserved"] is not False and r["finite"] and r["delayed_same"] is not False
        conserved = "n/a (nothing selected)" if r["conserved"] is None else r["conserved"]
        delayed = "n/a (no CUDA streams)" if r["delayed_same"] is None else r["delayed_same"]
        rows.append(Row(f"comm {kind}", verdict(ok),
                        f"{backend}, {report['elements'] / 1e6:.1f} M elements in {r['buckets']} buckets: density "
                        f"1.0 == dense bitwise {r['exact']}; density 0.01 mass conserved {conserved}; gradients "
                        f"behind a GPU sleep give the same result {delayed}; {r['ms']:.1f} ms/step",
                        {"world": world, "ms": r["ms"]}))
    auto = report["auto"]
    rows.append(Row("comm auto", verdict(auto["calibrated"] and auto["finite"]),
                    f"{backend}: calibrated {auto['calibrated']} (world link {auto['link']}), one drift check, "
                    f"finite {auto['finite']}, plan {', '.join(auto['plan'])}", {"world": world}))
    if gpu and world < 2:
        rows.append(Row("comm multi-rank", "SKIP",
                        f"needs >= 2 GPUs ({world} present): allreduce, allgather and reduce-scatter between "
                        "ranks, the sparse exchange between nodes and hitopk's hierarchy did not run (the rows "
                        "above are a 1-rank world)"))
    return rows


# ---------------------------------------------------------------- FusedLARS


@check("determinism", timeout_s=90)
def check_determinism(device: Any) -> list[Row]:
    """Sparse sums and the replica guard: every node must apply bitwise the same update."""
    import torch
    from torch import nn

    from kernels.testing import gradient_like
    from trainer.comm.sparse import scatter_payloads
    from trainer.dist import weights_checksum

    require_device(device)
    gen = torch.Generator().manual_seed(0)
    parts, k, size = 16, 200_000 if device.type == "cuda" else 20_000, 50_000
    rows = []
    for part in range(parts):  # each payload: distinct indices (as MSTopK returns), colliding across payloads
        idx = torch.randperm(size, generator=gen)[:min(k, size)].sort().values
        vals = gradient_like(idx.numel(), seed=1 + part)
        rows.append(torch.cat([vals, idx.to(torch.int32).view(torch.float32)]))
    payloads = torch.cat(rows).to(device)
    results = [scatter_payloads(payloads, parts, size) for _ in range(5)]
    same = all(torch.equal(results[0], r) for r in results[1:])
    flat = payloads.view(parts, 2, -1)
    one_call = []
    for _ in range(5):  # one index_add_ over every payload at once: its order of additions may vary
        out = torch.zeros(size, device=device)
        out.index_add_(0, flat[:, 1].contiguous().view(torch.int32).reshape(-1).long(), flat[:, 0].reshape(-1))
        one_call.append(out)
    distinct = len({bytes(o.cpu().numpy().tobytes()) for o in one_call})
    out = [Row("sparse sums deterministic", verdict(same),
               f"{parts} payloads x {flat.shape[2]:,} pairs into {size:,}: 5 runs bitwise equal {same} "
               f"(one index_add_ over all payloads: {distinct} distinct result(s) in 5 runs)")]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 10)).to(device)
    before = weights_checksum(model)
    with torch.no_grad():
        w = model[1].weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0, device=device))
    after = weights_checksum(model)
    ok = bool(before != after) and before.device == w.device
    out.append(Row("replica checksum", verdict(ok), f"on {before.device}: one ulp changes the checksum {ok}"))
    return out


@check("lars", timeout_s=120)
def check_lars(device: Any) -> list[Row]:
    """FusedLARS against its per-tensor reference (kernels.lars.LARSReference) on ResNet-50's 161 tensors
    (float32, the trainer's two groups): 5 steps for each of nesterov x trust_clip and a trust-ratio range, max
    relative difference; time per step of both; on CUDA, the kernels one step launches (FAIL above 8: the
    Triton path takes 3 per LARS group and 1 for the excluded one, torch's foreach path hundreds)."""
    import torch

    from kernels import FusedLARS
    from kernels.lars import LARSReference

    require_device(device)
    options = [dict(nesterov=n, trust_clip=c) for n in (False, True) for c in (False, True)]
    options.append(dict(nesterov=False, trust_clip=False, min_trust_ratio=0.02, max_trust_ratio=0.05))
    gpu = device.type == "cuda"
    steps, repeats = (5, 5) if gpu else (3, 2)
    start, grads, n = resnet50_weights(device, steps)
    worst, close, times, launches, why = 0.0, True, {}, None, ""
    for i, option in enumerate(options):
        finals = []
        for name, make in (("loop", LARSReference), ("fused", FusedLARS)):
            weights = [torch.nn.Parameter(p.clone()) for p in start]
            opt = make([{"params": [w for w in weights if w.ndim > 1], "weight_decay": 5e-5},
                        {"params": [w for w in weights if w.ndim <= 1], "weight_decay": 0.0, "lars_exclude": True}],
                       lr=2.0, momentum=0.9, trust_coefficient=0.001, **option)
            for g in grads:
                for w, gw in zip(weights, g):
                    w.grad = gw
                opt.step()
            finals.append([w.detach().clone() for w in weights])
            if i == 0:
                times[name] = median_ms(opt.step, device, repeats)
                if name == "fused":
                    launches = kernel_launches(opt.step, device)
        worst = max(worst, max_relative_difference(*finals))
        if close and not all_close(finals[1], finals[0]):
            close, why = False, f" ({option}: {outside(finals[1], finals[0])})"
    counted = "not counted off CUDA" if launches is None else f"{launches} CUDA kernels per step (limit 8)"
    return [Row("FusedLARS", verdict(worst <= 1e-5 and close and (launches is None or launches <= 8)),
                f"{len(start)} tensors ({n / 1e6:.1f} M, float32), {steps} steps x nesterov x trust_clip and a "
                f"trust-ratio range: max relative difference from the per-tensor reference {worst:.1e} (limit "
                f"1e-5), {'' if close else 'NOT '}within rtol 1e-6, atol 1e-8{why}; step {times['fused']:.2f} ms vs "
                f"loop {times['loop']:.2f} ms ({times['loop'] / times['fused']:.1f}x); {counted}",
                {"max_rel_diff": worst, "all_close": close, "ms": times["fused"], "loop_ms": times["loop"],
                 "kernels": launches})]


@check("adam", timeout_s=120)
def check_adam(device: Any) -> list[Row]:
    """kernels.build_adam (TritonAdam on CUDA where Triton imports) against torch.optim.Adam / AdamW with
    fused=True on ResNet-50's 161 tensors: 5 steps with weight decay, max relative difference (limit 1e-5) and,
    element by element, within rtol 1e-6, atol 1e-8 of torch's fused result or no farther from it than torch's
    single-tensor result is there (`beyond_spread`); time per step and, on CUDA, the kernels one step launches
    (FAIL above 4: the Triton path takes 2 per group)."""
    import torch

    from kernels import build_adam

    require_device(device)
    gpu = device.type == "cuda"
    steps, repeats = (5, 5) if gpu else (3, 2)
    start, grads, n = resnet50_weights(device, steps)
    rows = []
    for name, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        finals, times, launches, kinds = [], {}, {}, {}
        for label, make in (("torch", lambda w: cls(w, lr=1e-3, weight_decay=0.01, fused=True)),
                            ("ours", lambda w: build_adam(w, name=name, lr=1e-3, weight_decay=0.01)),
                            ("single", lambda w: cls(w, lr=1e-3, weight_decay=0.01, foreach=False))):
            weights = [torch.nn.Parameter(p.clone()) for p in start]
            opt = make(weights)
            kinds[label] = type(opt).__name__
            for g in grads:
                for w, gw in zip(weights, g):
                    w.grad = gw
                opt.step()
            finals.append([w.detach().clone() for w in weights])
            times[label] = median_ms(opt.step, device, repeats)
            launches[label] = kernel_launches(opt.step, device)
        worst = max_relative_difference(*finals[:2])
        close = all_close(finals[1], finals[0])
        why = "" if close else f" ({outside(finals[1], finals[0])})"
        # torch's single-tensor path: its scalars combine as Python floats, as the Triton kernel's do
        single = max_relative_difference(finals[2], finals[1])
        single_close = all_close(finals[1], finals[2])
        # torch's two paths from each other: at an element where they differ beyond rtol 1e-6, ours may differ from
        # the fused one by as much as the single-tensor one does, and no more
        between = max_relative_difference(finals[2], finals[0])
        torch_close = all_close(finals[0], finals[2])
        between_why = "within" if torch_close else f"NOT within: {outside(finals[0], finals[2])}"
        beyond = beyond_spread(finals[1], finals[0], finals[2])
        ours = launches["ours"]
        launched = not gpu or (kinds["ours"] == "TritonAdam" and ours is not None and ours <= 4)
        ok = worst <= 1e-5 and beyond == 0 and launched
        counted = ("kernels not counted off CUDA" if ours is None
                   else f"{ours} CUDA kernels per step vs torch fused {launches['torch']} (limit 4)")
        rows.append(Row(f"{kinds['ours']} ({name})", verdict(ok),
                        f"{len(start)} tensors ({n / 1e6:.1f} M, float32), {steps} steps: max relative difference "
                        f"from torch's fused {cls.__name__} {worst:.1e} (limit 1e-5), {'' if close else 'NOT '}"
                        f"within rtol 1e-6, atol 1e-8{why}; from torch's single-tensor {cls.__name__} {single:.1e}, "
                        f"{'' if single_close else 'NOT '}within; torch fused from single-tensor {between:.1e}, "
                        f"{between_why}; {beyond:,} element(s) beyond both rtol 1e-6 and torch's own difference "
                        f"there (0 allowed); step {times['ours']:.2f} ms vs "
                        f"{times['torch']:.2f} ms; {counted}",
                        {"max_rel_diff": worst, "all_close": close, "ms": times["ours"], "torch_ms": times["torch"],
                         "kernels": ours, "torch_kernels": launches["torch"], "single_max_rel_diff": single,
                         "single_all_close": single_close, "torch_fused_vs_single": between,
                         "torch_all_close": torch_close, "beyond_torch_spread": beyond}))
    return rows


# ---------------------------------------------------------------- training steps on synthetic data


def _train_steps(trainer: Any, batches: Any, device: Any, warmup: int, timed: int, units: Callable) -> dict:
    """Warm-up steps, then `timed` steps timed end to end, then one step under the sync counter."""
    import torch

    skipped = trainer.skipped_steps
    for _ in range(warmup):
        trainer.train_step(next(batches))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start, seen = time.perf_counter(), 0
    for _ in range(timed):
        batch = next(batches)
        loss, _, _ = trainer.train_step(batch)
        seen += units(batch)
    sync(device)
    seconds = time.perf_counter() - start
    with count_host_syncs(device) as syncs:
        loss, _, _ = trainer.train_step(next(batches))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"per_s": seen / seconds, "peak_gib": peak, "syncs": len(syncs), "loss": float(loss),
            "skipped": trainer.skipped_steps - skipped, "steps": warmup + timed + 1,
            "sync_sites": sorted(set(syncs))}


def _trainer(train_cfg: Any, topo: Any, model: Any, task: Any, optimizer: Any, comm: Any, log_dir: str) -> Any:
    from trainer.loop import Trainer
    from trainer.metrics import LogConfig
    from trainer.train_config import Components, LoopConfig

    return Trainer(LoopConfig(train_cfg, log=LogConfig(dir=log_dir, tensorboard=False, progress=False)), topo, task,
                   Components(model, optimizer, comm))


def _step_detail(r: dict, unit: str, gpu: bool) -> str:
    memory = f", peak {r['peak_gib']:.1f} GiB" if gpu else ""
    syncs = (f", {r['syncs']} host sync(s)/step" + (f" ({', '.join(r['sync_sites'])})" if r["sync_sites"] else "")
             if gpu else "")
    return (f"{r['per_s']:,.0f} {unit}/s{memory}{syncs}, {r['skipped']} of {r['steps']} steps skipped by the loss "
            f"scaler, loss {r['loss']:.3f}")


@check("train-resnet50", timeout_s=240, requires=("torchvision",))
def check_train_resnet50(device: Any) -> list[Row]:
    """The trainer's own step (Trainer.train_step) on data.backend=synthetic: ResNet-50, AMP fp16 with the
    dynamic loss scaler, channels-last, FusedLARS, the topk communicator over a 1-rank world (MSTopK on its
    side stream), at each DAWNBench phase's per-GPU size: images/s, peak memory, host syncs per step,
    skipped steps. The CPU dry run: ResNet-18 at batch 4, 32 and 40 px, fp32 with the scaler."""
    import torch
    import torchvision

    from data import DataConfig, build_image_data
    from trainer.classification import ClassificationTask, ClassificationTrainConfig
    from trainer.optim import OptimConfig, build_optimizer
    from trainer.schedules import Phase

    require_device(device)
    gpu = device.type == "cuda"
    if gpu:
        torch.backends.cudnn.benchmark = True
    sizes = [(256, 96), (256, 128), (128, 224), (128, 288)] if gpu else [(4, 32), (4, 40)]
    arch = "resnet50" if gpu else "resnet18"
    phases = [Phase(start_epoch=i, end_epoch=i + 1, image_size=px, batch_size=batch)
              for i, (batch, px) in enumerate(sizes)]
    data = build_image_data(DataConfig(backend="synthetic"), 0, 1, seed=0, device=device)
    model = getattr(torchvision.models, arch)(num_classes=data.num_classes, zero_init_residual=True).to(device)
    model = model.to(memory_format=torch.channels_last)
    # a modest rate: BatchNorm and biases take it as plain SGD, and the labels are random
    optim_cfg = OptimConfig(name="lars", lr=0.1, momentum=0.9, weight_decay=5e-5, trust_coefficient=0.001,
                            trust_clip=True)
    optimizer = build_optimizer(model, optim_cfg)
    train_cfg = ClassificationTrainConfig(epochs=len(phases), amp="fp16" if gpu else "off", loss_scale="dynamic",
                                          channels_last=True)
    rows = []
    with one_rank_world(device) as topo, tempfile.TemporaryDirectory() as log_dir:
        comm = one_rank_communicator("topk", model, topo, bucket_mb=25.0, density=0.01)
        task = ClassificationTask(model, data, topo, phases, train_cfg, 0.1)
        trainer = _trainer(train_cfg, topo, model, task, optimizer, comm, log_dir)
        for phase in phases:
            batches = task.train_batches(phase, 0)
            r = _train_steps(trainer, batches, device, warmup=3 if gpu else 0, timed=10 if gpu else 1,
                             units=lambda b: len(b[1]))
            batches.close()
            ok = math.isfinite(r["loss"]) and r["skipped"] < r["steps"]
            rows.append(Row(f"train {arch} {phase.batch_size} @ {phase.image_size} px", verdict(ok),
                            _step_detail(r, "images", gpu) + f"; {'fp16' if gpu else 'fp32'}, channels-last, "
                            "FusedLARS, topk over 1 rank",
                            {k: r[k] for k in ("per_s", "peak_gib", "syncs", "skipped", "loss")}))
        comm.detach()
        sync_free = Phase(start_epoch=0, end_epoch=1, image_size=224, batch_size=256) if gpu else phases[-1]
        rows += _sync_free_rows(device, model, data, topo, sync_free, optim_cfg, arch, log_dir)
    return rows


THROUGHPUT_FLOOR = 5000.0
"""Images/s of ResNet-50's training step at 224 px that one H100/H200-class GPU must reach (compute only,
synthetic data): the product's target for this class of GPU, not yet reached by a measured run here."""
FLOOR_GPUS = ("H100", "H200", "H800", "GH200")


def throughput_floor(gpu_name: str, image_size: int) -> float | None:
    """The floor for `gpu_name` at `image_size` px (scaled by pixels from 224), or None for a GPU outside the
    H100/H200 class, whose floor nobody has measured."""
    if not any(tag in gpu_name for tag in FLOOR_GPUS):
        return None
    return THROUGHPUT_FLOOR * (224 / image_size) ** 2


def _sync_free_rows(device: Any, model: Any, data: Any, topo: Any, phase: Any, optim_cfg: Any, arch: str,
                    log_dir: str) -> list[Row]:
    """The step as the cluster configs run it where bf16 is native: bf16 autocast, no loss scaler, the non-finite
    check on the device (train.nonfinite_check=device), the dense exchange. Two rows: FAIL on any host sync in the
    step or a non-finite loss; and, on an H100/H200-class GPU, FAIL below the throughput floor (other GPUs: SKIP).
    The CPU dry run: fp32, syncs not counted, no floor."""
    import torch

    from trainer.classification import ClassificationTask, ClassificationTrainConfig
    from trainer.optim import build_optimizer

    gpu = device.type == "cuda"
    bf16 = gpu and torch.cuda.is_bf16_supported()
    name = f"train {arch} {phase.batch_size} @ {phase.image_size} px"
    if gpu and not bf16:
        return [Row(f"{name} sync-free", "SKIP", "this GPU has no native bf16: fp16 needs the loss scaler, whose "
                    "inf check is a host sync")]
    cfg = ClassificationTrainConfig(epochs=1, amp="bf16" if bf16 else "off", loss_scale="off",
                                    nonfinite_check="device", channels_last=True)
    comm = one_rank_communicator("dense", model, topo, bucket_mb=25.0, density=1.0)
    task = ClassificationTask(model, data, topo, [phase], cfg, 0.1)
    trainer = _trainer(cfg, topo, model, task, build_optimizer(model, optim_cfg), comm, log_dir)
    batches = task.train_batches(phase, 0)
    r = _train_steps(trainer, batches, device, warmup=3 if gpu else 0, timed=10 if gpu else 1,
                     units=lambda b: len(b[1]))
    batches.close()
    comm.detach()
    ok = math.isfinite(r["loss"]) and r["syncs"] == 0
    rows = [Row(f"{name} sync-free", verdict(ok),
                _step_detail(r, "images", gpu) + f"; {'bf16' if bf16 else 'fp32'}, no loss scaler, non-finite "
                "check on the device, FusedLARS, dense exchange", {k: r[k] for k in ("per_s", "syncs", "loss")})]
    floor = throughput_floor(torch.cuda.get_device_name(device), phase.image_size) if gpu else None
    if floor is None:
        rows.append(Row(f"{name} throughput floor", "SKIP", "no floor for this GPU (set for the H100/H200 class)"
                        if gpu else "no floor on the CPU"))
    else:
        rows.append(Row(f"{name} throughput floor", verdict(r["per_s"] >= floor),
                        f"{r['per_s']:,.0f} images/s against a floor of {floor:,.0f} (compute only, synthetic data)",
                        {"per_s": r["per_s"], "floor": floor}))
    return rows


class _TokenTask:
    """The translation loss on prepared token batches (the Trainer needs only `loss`)."""

    unit = "tokens"

    def __init__(self, model: Any, label_smoothing: float) -> None:
        self.model, self.label_smoothing = model, label_smoothing

    def loss(self, batch: Any) -> tuple:
        from trainer.translation import translation_loss

        return translation_loss(self.model, batch, self.label_smoothing)


# torchvision: trainer.translation imports data.translation, and the data package imports its torchvision backend
@check("train-transformer", timeout_s=150, requires=("torchvision",))
def check_train_transformer(device: Any) -> list[Row]:
    """The trainer's step on the Transformer-base of recipes/transformer.py (6+6 layers, d_model 512, a 32k
    shared vocabulary) with AMP fp16 and the loss scaler, fused Adam (kernels.build_adam) and the topk
    communicator over a 1-rank world, on random token batches of the recipe's 3,584 tokens per GPU:
    tokens/s, peak memory, host syncs per step. The CPU dry run: a 1+1-layer model, d_model 64."""
    import torch

    from data.translation import BOS, EOS, TranslationBatch
    from recipes.transformer_model import TransformerConfig, build_transformer
    from trainer.train_config import TrainConfig
    from trainer.optim import OptimConfig, build_optimizer

    require_device(device)
    gpu = device.type == "cuda"
    if gpu:
        cfg, vocab, sentences, length = TransformerConfig(), 32000, 112, 32  # 112 x 32 = 3,584 target tokens
    else:
        cfg = TransformerConfig(d_model=64, heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=128)
        vocab, sentences, length = 1000, 8, 16
    torch.manual_seed(0)
    model = build_transformer(cfg, vocab).to(device)
    optim_cfg = OptimConfig(name="adam", lr=1e-4, betas=(0.9, 0.98), weight_decay=0.0)
    optimizer = build_optimizer(model, optim_cfg)
    fused = bool(optimizer.defaults.get("fused"))
    gen = torch.Generator().manual_seed(1)

    def batch() -> Any:
        src = torch.randint(4, vocab, (sentences, length), generator=gen)
        tgt = torch.randint(4, vocab, (sentences, length - 1), generator=gen)
        src[:, -1] = EOS
        bos, eos = torch.full((sentences, 1), BOS), torch.full((sentences, 1), EOS)
        return TranslationBatch(src, torch.cat([bos, tgt], 1), torch.cat([tgt, eos], 1)).to(device)

    pool = [batch() for _ in range(4)]  # made before the clock starts, on the device

    train_cfg = TrainConfig(epochs=1, amp="fp16" if gpu else "off", loss_scale="dynamic")
    with one_rank_world(device) as topo, tempfile.TemporaryDirectory() as log_dir:
        comm = one_rank_communicator("topk", model, topo, bucket_mb=25.0, density=0.01)
        trainer = _trainer(train_cfg, topo, model, _TokenTask(model, cfg.label_smoothing), optimizer, comm, log_dir)
        r = _train_steps(trainer, itertools.cycle(pool), device, warmup=3 if gpu else 0, timed=10 if gpu else 2,
                         units=lambda b: sentences * length)
        comm.detach()
    ok = math.isfinite(r["loss"]) and r["skipped"] < r["steps"] and (fused or not gpu)
    name = "base" if gpu else "tiny"
    return [Row(f"train transformer-{name} {sentences * length:,} tokens", verdict(ok),
                _step_detail(r, "tokens", gpu) + f"; {'fp16' if gpu else 'fp32'}, "
                f"{'fused' if fused else 'NOT fused'} Adam, topk over 1 rank",
                {k: r[k] for k in ("per_s", "peak_gib", "syncs", "skipped", "loss")} | {"fused_adam": fused})]


# ---------------------------------------------------------------- input pipeline


def _batches_per_s(loader: Any, epochs: int = 2) -> tuple[list, float]:
    """All batches of the last epoch, and its images/s (the first epoch warms up)."""
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        batches = [(images.float().cpu(), labels) for images, labels in loader]
        seconds = time.perf_counter() - start
    return batches, sum(len(labels) for _, labels in batches) / seconds


@check("dali", timeout_s=150, requires=("nvidia.dali",), requires_on={"cpu": ("torchvision",)})
def check_dali(device: Any) -> list[Row]:
    """DALI `mixed` (nvJPEG) decoding against DALI's CPU decoding on the same files, and each pipeline's
    images/s. The CPU dry run compares DALI's CPU pipeline with the torchvision backend (the same
    deterministic validation transform) on fewer, smaller batches."""
    import torch

    from data import CacheConfig, DataConfig, build_image_data
    from scripts.make_imagenet_like import prepare

    require_device(device)
    gpu = device.type == "cuda"
    # at least one validation image per class (10): check_dataset wants the same classes in train/ and val/
    train, val, batch, px = (512, 128, 128, 224) if gpu else (20, 10, 10, 64)
    with tempfile.TemporaryDirectory() as tmp:
        root = prepare(Path(tmp) / "images", train=train, val=val)
        cfg = DataConfig(root=str(root), backend="dali", workers=2, dtype="float32",
                         cache=CacheConfig(ram=False, dir=""))
        other_cfg = cfg if gpu else DataConfig(root=str(root), backend="torchvision", workers=0)
        cpu, other = (build_image_data(c, 0, 1, 0, d) for c, d in ((cfg, torch.device("cpu")), (other_cfg, device)))
        name = "DALI mixed (GPU)" if gpu else "torchvision"
        val_cpu, val_other = (torch.cat([im.float().cpu() for im, _ in d.val_loader(px, batch)]) for d in (cpu, other))
        diff = (val_cpu - val_other).abs()
        # 1 grey level = 0.017 here. nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a few
        # levels; PIL and DALI CPU (both libjpeg-turbo, the same resize sizes and crop window) by about one
        limits = (0.02, 1.0) if gpu else (0.01, 0.1)
        ok = diff.mean().item() < limits[0] and diff.max().item() < limits[1]
        rows = [Row("DALI mixed decode", verdict(ok),
                    f"{name} vs DALI CPU, {val} JPEGs (300-500 px) resized+center-cropped to {px}: mean |diff| "
                    f"{diff.mean().item():.4f}, max {diff.max().item():.3f} (normalized units; limits {limits})")]
        for label, source in (("DALI CPU", cpu), (name, other)):
            batches, rate = _batches_per_s(source.train_loader(px, batch))
            ok = all(im.shape == (batch, 3, px, px) and torch.isfinite(im).all() for im, _ in batches)
            rows.append(Row(f"data {label}", verdict(ok), f"train {px} px, batch {batch}, {train} JPEGs: {rate:,.0f} "
                            f"images/s (epoch 2)", {"per_s": rate}))
            source.close()
    return rows


# ---------------------------------------------------------------- the recipe through fit and a resume


def _recipe_run(argv: list[str], run_dir: Path, resume: bool = False) -> dict:
    """recipes.resnet50 in this process (one rank); its summary."""
    from recipes.resnet50 import main

    return main([*argv, f"log.dir={run_dir}", *(["train.resume=true"] if resume else [])])


def _final_weights(run_dir: Path) -> dict:
    import torch

    from trainer.checkpoint import MODEL, checkpoint_dirs

    return torch.load(checkpoint_dirs(run_dir)[0] / MODEL, weights_only=True)


@check("recipe", timeout_s=240, requires=("torchvision",))
def check_recipe(device: Any) -> list[Row]:
    """`python -m recipes.resnet50` on data.backend=synthetic through `fit`: 2 epochs of 4 steps, an evaluation
    and a background checkpoint after each; then the run again from its first epoch's checkpoint (the newest
    removed), which must end where the uninterrupted run ended. Twice: bf16 autocast (the weights compared
    within a tolerance: cuDNN's kernels need not be deterministic), then train.deterministic=true (bitwise).
    GPU: ResNet-50, 256 images at 224 px, configs/resnet50_1node.yaml; the CPU dry run: ResNet-18 at 16 px in
    fp32, configs/quickstart_cpu.yaml."""
    import shutil

    import torch

    from trainer.checkpoint import checkpoint_dirs

    require_device(device)
    gpu = device.type == "cuda"
    bf16 = gpu and torch.cuda.is_bf16_supported()
    size, batch = (224, 256) if gpu else (16, 16)
    argv = ["--config", "configs/resnet50_1node.yaml" if gpu else "configs/quickstart_cpu.yaml",
            "data.backend=synthetic", "data.root=unused", "train.epochs=2", "train.max_steps_per_epoch=4",
            f"schedule.phases=[{{start_epoch: 0, end_epoch: 2, image_size: {size}, batch_size: {batch}}}]",
            "schedule.warmup_epochs=0", "train.target_top1=0", "train.target_top5=0", "train.checkpoint_every_epochs=1",
            "train.checkpoint_in_background=true", "train.keep_checkpoints=3", "log.progress=false",
            "log.tensorboard=false", "train.choices_cache=none", "train.channels_last=true" if gpu else
            "train.channels_last=false", "model.small_map_gemm=false", "comm.kind=dense"]
    if not gpu:
        argv.append("model.arch=resnet18")
    rows = []
    for mode in ("bf16", "deterministic"):
        extra = ([f"train.amp={'bf16' if bf16 else 'off'}", "train.loss_scale=off"] if mode == "bf16" else
                 ["train.deterministic=true", "train.amp=off"])
        with tempfile.TemporaryDirectory() as tmp:
            straight, resumed = Path(tmp) / "straight", Path(tmp) / "resumed"
            summary = _recipe_run([*argv, *extra], straight)
            shutil.copytree(straight, resumed)
            shutil.rmtree(checkpoint_dirs(resumed)[0])  # back to the first epoch's checkpoint
            (resumed / "metrics.jsonl").unlink()  # so that it shows which epochs the second run trained
            again = _recipe_run([*argv, *extra], resumed, resume=True)
            trained = [json.loads(line)["epoch"] for line in (resumed / "metrics.jsonl").read_text().splitlines()
                       if json.loads(line)["kind"] == "epoch"]
            a, b = _final_weights(straight), _final_weights(resumed)
            diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
        finite = all(math.isfinite(x["history"][-1]["eval/loss"]) for x in (summary, again))
        same_end = summary["steps"] == again["steps"] == 8 and trained == [1]  # the resume trained epoch 1 only
        ok = finite and same_end and (diff == 0.0 if mode == "deterministic" else diff < 1e-2)
        what = "bitwise" if mode == "deterministic" else "within 1e-2"
        rows.append(Row(f"recipe {mode} fit + resume", verdict(ok),
                        f"2 epochs x 4 steps at {batch} @ {size} px, evaluated and checkpointed in the background "
                        f"each epoch, resumed from epoch 1: final weights {what} of the uninterrupted run's (max "
                        f"difference {diff:.3g}); {'bf16' if bf16 else 'fp32'}" if mode == "bf16" else
                        f"2 epochs x 4 steps, deterministic kernels, resumed from epoch 1: max weight difference "
                        f"{diff:.3g} (0 expected)", {"max_weight_diff": diff, "resumed_epochs": trained}))
    return rows


# ---------------------------------------------------------------- the harness's own check


@check("compile", timeout_s=300, requires=("torchvision",))
def check_compile(device: Any) -> list[Row]:
    """torch.compile's modes as train.compile and train.cuda_graphs select them (trainer/compiling.apply_compile),
    on the GPU path's step: ResNet-50 at 256 x 224 px, bf16 where native, no loss scaler, the non-finite check on
    the device, FusedLARS, the dense exchange over 1 rank; eager, then inductor's default mode, then reduce-overhead
    (forward and backward replayed as CUDA graphs), each from the same weights and optimizer state. Per mode:
    images/s and the ratio to eager, host syncs per step, graphs compiled, the warm-up's seconds (compilation
    included). FAIL on an error, a non-finite loss, a first-step loss off eager's (2e-2 relative in bf16, 1e-4 in
    fp32), or CUDA graphs that inductor skipped. Speed has no floor. Not run here: the config path (`settle`, the
    warm-up before the clock). The CPU dry run: a small CNN at 32 px, eager and default only."""
    import copy

    import torch
    import torch._dynamo.utils as dynamo_utils
    import torchvision

    from data import DataConfig, build_image_data
    from trainer.classification import ClassificationTask, ClassificationTrainConfig
    from trainer.compiling import allow_graphs, apply_compile
    from trainer.optim import OptimConfig, build_optimizer
    from trainer.schedules import Phase

    require_device(device)
    gpu = device.type == "cuda"
    bf16 = gpu and torch.cuda.is_bf16_supported()
    phase = Phase(start_epoch=0, end_epoch=1, image_size=224 if gpu else 32, batch_size=256 if gpu else 8)
    data = build_image_data(DataConfig(backend="synthetic"), 0, 1, seed=0, device=device)
    if gpu:
        model = torchvision.models.resnet50(num_classes=data.num_classes, zero_init_residual=True)
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                    torch.nn.Linear(16, data.num_classes))
    model = model.to(device).to(memory_format=torch.channels_last)
    start = copy.deepcopy(model.state_dict())
    arch = "resnet50" if gpu else "small CNN"
    optim_cfg = OptimConfig(name="lars", lr=0.1, momentum=0.9, weight_decay=5e-5, trust_coefficient=0.001,
                            trust_clip=True)
    cfg = ClassificationTrainConfig(epochs=1, amp="bf16" if bf16 else "off", loss_scale="off",
                                    nonfinite_check="device", channels_last=True)
    tolerance = 2e-2 if bf16 else 1e-4
    modes = ("off", "default", "reduce-overhead") if gpu else ("off", "default")
    allow_graphs(len(modes))
    rows, eager = [], {}
    with one_rank_world(device) as topo, tempfile.TemporaryDirectory() as log_dir:
        for mode in modes:
            model.load_state_dict(start)
            apply_compile(model, mode)
            comm = one_rank_communicator("dense", model, topo, bucket_mb=25.0, density=1.0)
            task = ClassificationTask(model, data, topo, [phase], cfg, 0.1)
            trainer = _trainer(cfg, topo, model, task, build_optimizer(model, optim_cfg), comm, log_dir)
            batches = task.train_batches(phase, 0)
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
            skips = dynamo_utils.counters["inductor"]["cudagraph_skips"]
            t0 = time.perf_counter()
            first, _, _ = trainer.train_step(next(batches))  # the same first batch and weights for every mode
            for _ in range(2):  # warm-up: compiles (and, in reduce-overhead, records the graphs)
                trainer.train_step(next(batches))
            sync(device)
            warm_s = time.perf_counter() - t0
            r = _train_steps(trainer, batches, device, warmup=0, timed=10 if gpu else 2, units=lambda b: len(b[1]))
            batches.close()
            comm.detach()
            first = float(first)
            eager = eager or {"per_s": r["per_s"], "first": first}
            graphs = dynamo_utils.counters["stats"]["unique_graphs"] - graphs
            skipped = dynamo_utils.counters["inductor"]["cudagraph_skips"] - skips
            off = abs(first - eager["first"]) / max(abs(eager["first"]), 1e-12)
            ok = (math.isfinite(r["loss"]) and off <= tolerance
                  and (mode != "reduce-overhead" or skipped == 0))
            rows.append(Row(f"compile {mode} {arch} {phase.batch_size} @ {phase.image_size} px", verdict(ok),
                            _step_detail(r, "images", gpu) + f"; {r['per_s'] / eager['per_s']:.2f}x eager; first "
                            f"loss {off:.1e} off eager's (limit {tolerance:g}); {graphs} graph(s) compiled"
                            + (f", {skipped} CUDA graph skip(s)" if mode == "reduce-overhead" else "")
                            + f"; warm-up {warm_s:.0f} s; {'bf16' if bf16 else 'fp32'}, no loss scaler",
                            {k: r[k] for k in ("per_s", "syncs", "loss")}
                            | {"vs_eager": r["per_s"] / eager["per_s"], "warm_up_s": warm_s, "graphs": graphs,
                               "first_loss_rel_diff": off, "cudagraph_skips": skipped}))
        apply_compile(model, "off")
    return rows


@check("selftest", timeout_s=60, hidden=True, light=True)
def check_selftest(device: str) -> list[Row]:
    """The harness itself, run only when named: GPU_CHECK_SELFTEST=raise raises, =hang sleeps past any
    timeout, =exit ends the process without a result; unset, it passes."""
    mode = os.environ.get("GPU_CHECK_SELFTEST", "")
    if mode == "raise":
        raise RuntimeError("raised on purpose (GPU_CHECK_SELFTEST=raise)")
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        os._exit(3)
    return [Row("selftest", "PASS", "a check ran in its own subprocess and reported")]


# ---------------------------------------------------------------- child: one check


def run_one(name: str, device_name: str, result_file: str) -> int:
    """Runs one check in this process and writes {"rows": [...], "machine": {...}} to `result_file`."""
    spec = CHECKS[name]
    try:
        for module in spec.requires + spec.requires_on.get(device_name, ()):
            reason = missing_module(module)
            if reason:
                raise Skip(reason)
        if spec.light:
            rows = spec.fn(device_name)
        else:
            import torch

            if device_name == "auto":
                device_name = "cuda" if torch.cuda.is_available() else "cpu"
                MACHINE["device"] = device_name  # the parent's `auto`, whether or not the check gets further
            # with an index: init_process_group(device_id=...) and the comm thread's set_device need one
            cuda = device_name == "cuda" and torch.cuda.is_available()
            rows = spec.fn(torch.device("cuda", 0) if cuda else torch.device(device_name))
    except Skip as reason:
        rows = [Row(name, "SKIP", str(reason))]
    except Exception as err:  # noqa: BLE001 - the check's failure is its result
        traceback.print_exc()
        rows = [Row(name, "FAIL", f"{type(err).__name__}: {err}".splitlines()[0][:400])]
    Path(result_file).write_text(strict_json({"rows": [asdict(r) for r in rows], "machine": MACHINE}))
    return 0


def finite(value: Any) -> Any:
    """`value` with every non-finite float (a NaN loss, an infinite rate) as the string 'nan', 'inf' or '-inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def strict_json(value: Any) -> str:
    """JSON that any parser reads: non-finite floats written as strings (`finite`)."""
    return json.dumps(finite(value), allow_nan=False)


# ---------------------------------------------------------------- parent: every check, one table


def run_child(name: str, device: str, timeout_s: float) -> tuple[list[Row], dict, float]:
    """One check in a subprocess (its own process group, killed whole on timeout); its output goes to stderr."""
    # the GPU machine's Python has no install of the repository (see gpu_check.sh): the child imports it from ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check", "--run-one", name, "--device", device,
                                 "--result-file", str(result_file)], cwd=ROOT, env=env, stdout=sys.stderr,
                                stderr=sys.stderr, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # with the ranks or loader workers it started
            proc.wait()
            return [Row(name, "FAIL", f"timed out after {timeout_s:.0f} s (killed)")], {}, time.perf_counter() - start
        seconds = time.perf_counter() - start
        if not result_file.exists():
            return [Row(name, "FAIL", f"the check's process exited with status {code} without a result (its output "
                                      "is above, on stderr)")], {}, seconds
        result = json.loads(result_file.read_text())
    return [Row(**r) for r in result["rows"]], result.get("machine", {}), seconds


def print_table(rows: list[dict]) -> None:
    """check | result | seconds (of the check's subprocess, on its first row) | detail."""
    headers = ("check", "result", "seconds", "detail")
    cells = [(r["check"], r["result"], f"{r['seconds']:.1f}" if i == 0 or rows[i - 1]["group"] != r["group"] else "",
              r["detail"]) for i, r in enumerate(rows)]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers[:-1])]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " | detail")
    print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    for c in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(c, widths)) + " | " + c[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in CHECKS.values()]
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: cuda where torch sees a GPU, else a CPU dry run")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME",
                        help=f"run only these checks ({', '.join(n for n in names if not CHECKS[n].hidden)})")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds for the whole run; a check that cannot start in the time left is a FAIL")
    parser.add_argument("--timeout-s", type=float, default=0.0, help="cap on every check's timeout (0 = none)")
    parser.add_argument("--run-one", choices=names, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        return run_one(args.run_one, args.device, args.result_file)
    if importlib.util.find_spec("torch") is None:  # every check needs it: one line, not a table of FAILs
        print(f"gpu_check: torch is not installed in {sys.executable}; run it with a Python that has torch "
              "(PYTHON=/path/to/python scripts/gpu_check.sh)", file=sys.stderr)
        return 2

    start = time.perf_counter()
    deadline = start + args.budget_s
    selected = args.only or [n for n in names if not CHECKS[n].hidden]
    machine: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                               "cpus": os.cpu_count(), "python": platform.python_version()}
    device = args.device
    # preflight first: it names the machine, and decides the device for `auto`
    if "preflight" not in selected and device == "auto":
        selected = ["preflight", *selected]
    order = sorted(selected, key=lambda n: n != "preflight")
    rows: list[dict] = []
    for name in order:
        left = deadline - time.perf_counter()
        if left < 5:
            rows.append({**asdict(Row(name, "FAIL", f"not run: the {args.budget_s:.0f} s budget (--budget-s) was "
                                                    "spent by the checks before it")), "group": name, "seconds": 0.0})
            continue
        timeout = min(CHECKS[name].timeout_s, left, args.timeout_s or float("inf"))
        print(f"== {name} (device {device}, timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
        got, found, seconds = run_child(name, device, timeout)  # `auto` is resolved by the preflight child
        machine.update(found)
        if machine.get("missing"):  # the preflight's: every check would fail on the same import
            print(f"gpu_check: {', '.join(machine['missing'])} not installed in {sys.executable}, and the repository "
                  "imports them: install them, or run with a Python that has them (PYTHON=/path/to/python "
                  "scripts/gpu_check.sh)", file=sys.stderr, flush=True)
            return 2
        if device == "auto":
            # no report (the child died first): the next check resolves `auto` itself; never assume the CPU
            device = machine.get("device", "auto")
        rows += [{**asdict(r), "group": name, "seconds": round(seconds, 1)} for r in got]
        print(f"   {name}: {seconds:.1f} s, " + ", ".join(f"{r.check} {r.result}" for r in got), file=sys.stderr,
              flush=True)
    machine["device"] = device
    counts = {k.lower(): sum(r["result"] == k for r in rows) for k in RESULTS}
    gpus = machine.get("gpus") or []
    listed = ", ".join(gpus) or ("no CUDA device" if "gpus" in machine else "CUDA (no preflight report lists the GPUs)")
    where = {"cuda": listed, "cpu": "the CPU (dry run)"}.get(device, "a device no check reported (--device auto)")
    print(f"\nGPU check on {where}: {time.perf_counter() - start:.0f} s, {counts['pass']} PASS, {counts['fail']} FAIL, "
          f"{counts['skip']} SKIP")
    print_table(rows)
    print(strict_json({"bench": "gpu_check", "rows": rows, **counts, "machine": machine}), flush=True)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
