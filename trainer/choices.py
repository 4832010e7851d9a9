"""Measured choices: settings whose speed depends on the machine, timed at start-up instead of assumed.

For every key a config leaves at `auto` (precision, memory layout, convolution implementation), each
combination of the candidates runs a few forward + backward steps of the run's own model at every phase's
per-rank batch and image size; the combination with the least step time, weighted by each phase's steps in
the run, is kept for the whole run, as `cudnn.benchmark` does for convolution algorithms. Candidates are
interleaved round by round (drift hits them alike) and the median of each one's rounds counts. Every rank
measures; the ranks' costs are averaged before the pick, so all take one decision. A candidate that fails
(an unsupported kernel, out of memory) is dropped with a warning.

The decision is cached per machine under a key of everything that changes the answer (`run_key`), recorded in
the run folder, the metrics and every checkpoint, and a resumed run reuses the checkpoint's. docs/measured-
choices.md describes the procedure, the cache and what each choice changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import statistics
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from trainer.dist import Topology, all_reduce_sum
from trainer.precision import AMP_DTYPES, autocast

Choice = dict[str, Any]
"""One combination: a value per choice name, e.g. {"amp": "bf16", "channels_last": False}."""


@dataclass(frozen=True)
class Probe:
    """One shape the run trains at: a batch of that shape, the steps the run takes at it, a name for logs."""

    batch: Any
    steps: float
    name: str


class Subject(Protocol):
    """What is measured: a choice is applied, then steps are timed at each probe's batch."""

    def apply(self, choice: Choice) -> None:
        """Switch the model (and whatever else the choice names) to `choice`."""
        ...

    def prepare(self, batch: Any) -> Any:
        """`batch` as a step under the applied choice takes it (e.g. in its memory layout); not timed."""
        ...

    def step(self, batch: Any) -> None:
        """One training step's forward and backward on a prepared `batch` under the applied choice."""
        ...

    def preserved(self) -> contextlib.AbstractContextManager:
        """A context that leaves weights, buffers, gradients and random generators as they were before."""
        ...


Timer = Callable[[Callable[[], None], Choice], float]
"""Runs the step it is given and returns its seconds (the choice is what was applied, for test doubles)."""


def wall_timer(device: torch.device) -> Timer:
    """Wall-clock seconds of a step, the device's queued work included."""
    def timed(step: Callable[[], None], choice: Choice) -> float:
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    return timed


def combinations(space: dict[str, Sequence[Any]]) -> list[Choice]:
    """Every combination of the candidates, in the space's order (the first value of each name first)."""
    names = list(space)
    return [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]


def label(choice: Choice) -> str:
    """A short name for logs and metric tags: `amp_bf16-channels_last_off`."""
    def word(value: Any) -> str:
        return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
    return "-".join(f"{name}_{word(value)}" for name, value in choice.items())


@dataclass
class Decision:
    """The kept combination, how it was reached and what it cost."""

    choice: Choice
    source: str
    """measured | cache | checkpoint | pinned (nothing left at auto) | default (no probe batch to measure with:
    the first candidate of each choice)."""
    costs_s: dict[str, float] = field(default_factory=dict)
    """Per candidate label: the predicted seconds of the run's forward and backward passes (each phase's steps
    x its median step time, mean over the ranks), inf for a candidate that failed; from the measurement that
    made the decision (a cached decision's too)."""
    seconds: float = 0.0
    """Wall time spent deciding in this start (measuring, or reading the cache)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Decision":
        return cls(dict(d["choice"]), str(d["source"]), dict(d.get("costs_s", {})), float(d.get("seconds", 0.0)))

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics writers (TensorBoard, JSONL)."""
        out = {"choices/seconds": self.seconds, "choices/cached": float(self.source == "cache"),
               "choices/measured": float(self.source == "measured")}
        out.update({f"choices/{name}_s": value for name, value in self.costs_s.items() if math.isfinite(value)})
        return out

    def describe(self) -> str:
        kept = ", ".join(f"{name} {value}" for name, value in self.choice.items())
        if self.source in ("pinned", "default"):
            return (f"choices pinned by the config: {kept}" if self.source == "pinned" else
                    f"choices unmeasured (the task gives no batch to measure with), first candidates: {kept}")
        ranked = sorted(self.costs_s.items(), key=lambda kv: kv[1])
        table = "; ".join(f"{name} {seconds:.1f} s" for name, seconds in ranked)
        how = {"measured": "measured", "cache": "from the cache", "checkpoint": "from the checkpoint"}[self.source]
        return (f"choices {how} in {self.seconds:.1f} s: {kept}" +
                (f" (predicted forward+backward seconds of the run: {table})" if table else ""))


# ---------------------------------------------------------------- measurement


def measure(candidates: list[Choice], probes: list[Probe], subject: Subject, rounds: int, timer: Timer
            ) -> list[float]:
    """Per candidate: the sum over probes of (the probe's steps x the median of `rounds` timed steps), in
    seconds, after one untimed warm-up step per probe; candidates interleaved round by round. A candidate
    that raises is `inf` (dropped, with a warning naming it and the error)."""
    times: dict[tuple[int, int], list[float]] = {(c, p): [] for c in range(len(candidates)) for p in range(len(probes))}
    failed: set[int] = set()
    for r in range(rounds + 1):
        for c, choice in enumerate(candidates):
            if c in failed:
                continue
            try:
                subject.apply(choice)
                for p, probe in enumerate(probes):
                    batch = subject.prepare(probe.batch)
                    seconds = timer(lambda: subject.step(batch), choice)
                    if r:  # round 0 warms each candidate up (first-touch allocations, kernel selection)
                        times[c, p].append(seconds)
            except (RuntimeError, NotImplementedError, torch.OutOfMemoryError) as e:
                warnings.warn(f"measured choices: {label(choice)} failed and is dropped: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
                failed.add(c)
    return [math.inf if c in failed else
            sum(probe.steps * statistics.median(times[c, p]) for p, probe in enumerate(probes))
            for c in range(len(candidates))]


def pick(costs: Sequence[float]) -> int:
    """The index of the least finite cost (the first on a tie); ValueError when every candidate failed."""
    finite = [i for i, cost in enumerate(costs) if math.isfinite(cost)]
    if not finite:
        raise ValueError("measured choices: every candidate failed; pin the choices in the config "
                         "(train.amp, train.channels_last, model.small_map_gemm)")
    return min(finite, key=lambda i: costs[i])


# ---------------------------------------------------------------- the cache


def cache_folder(setting: str) -> Path | None:
    """train.choices_cache as a folder: auto = $XDG_CACHE_HOME (else ~/.cache)/dawnbench-recipes/choices;
    none = no cache."""
    if setting == "none":
        return None
    if setting == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "dawnbench-recipes" / "choices"
    return Path(setting).expanduser()


def _plain(value: Any) -> Any:
    """`value` as JSON reads it back (tuples become lists), so that keys compare equal after a round trip."""
    return json.loads(json.dumps(value, sort_keys=True))


class ChoiceCache:
    """One JSON file per key in `folder`, each written whole to a temporary file and renamed into place (a
    reader never sees half a file; two writers of the same key leave one complete entry). An entry that does
    not parse or does not hold its own key is ignored with a warning, never trusted."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f"{digest}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            warnings.warn(f"measured choices: ignoring the cache entry {path}, which cannot be read ({e}); "
                          "measuring again", stacklevel=2)
            return None
        if not isinstance(entry, dict) or entry.get("key") != _plain(key) or not isinstance(entry.get("choice"), dict):
            warnings.warn(f"measured choices: ignoring the cache entry {path}: it is not this machine's and run "
                          "shape's entry (foreign or damaged); measuring again", stacklevel=2)
            return None
        return entry

    def put(self, key: dict[str, Any], decision: Decision) -> None:
        """Write the entry; a failure (read-only or full disk) is a warning: the run goes on uncached."""
        path = self.path(key)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        entry = {"key": _plain(key), "choice": decision.choice, "costs_s": decision.costs_s,
                 "measured_s": decision.seconds, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"measured choices: could not write the cache entry {path} ({e}); the next run measures "
                          "again", stacklevel=2)


def kernels_build() -> str:
    """A digest of the project's kernel sources (the CPU library is built from them): a new build can
    change which candidate is fastest."""
    import kernels
    folder = Path(kernels.__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*folder.glob("*.py"), *folder.glob("csrc/*.cpp")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from trainer.run_record import cpu_info
    return str(cpu_info()["model"])


def run_key(topo: Topology, model: torch.nn.Module, space: dict[str, Sequence[Any]], probes: list[Probe],
            rounds: int) -> dict[str, Any]:
    """Everything that changes which candidate is fastest: the device model, cores and threads, torch and
    kernel builds, world size and ranks per node, the model (class, parameter count, structure), the per-rank
    batches and shapes with their steps, the candidates and the rounds."""
    structure = hashlib.sha256(repr(model).encode()).hexdigest()[:16]
    return _plain({
        "device": device_name(topo.device), "device_type": topo.device.type, "cores": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "kernels": kernels_build(), "world_size": topo.world_size, "ranks_per_node": topo.ranks_per_node,
        "model": {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                  "structure": structure},
        "probes": [[probe.name, probe.steps] for probe in probes], "space": {k: list(v) for k, v in space.items()},
        "rounds": rounds})


# ---------------------------------------------------------------- the decision


def decide(space: dict[str, Sequence[Any]], probes: list[Probe], subject: Subject, topo: Topology,
           cache: ChoiceCache | None, key: dict[str, Any], rounds: int, timer: Timer) -> Decision:
    """Collective: the combination every rank keeps. Nothing at auto: the pinned values, unmeasured. Else rank
    0's cache entry for `key` when there is one; else every rank measures, the costs are averaged over the
    ranks (all ranks then pick alike), the least is kept and rank 0 writes it to the cache."""
    start = time.perf_counter()
    candidates = combinations(space)
    if len(candidates) == 1 or not probes:
        return Decision(candidates[0], "pinned" if len(candidates) == 1 else "default")
    entry = cache.get(key) if cache is not None and topo.is_main else None
    if topo.distributed:
        entry = topo.world.broadcast_object(entry, src=0)
    if entry is not None and entry["choice"] in candidates:
        return Decision(entry["choice"], "cache", entry.get("costs_s", {}), time.perf_counter() - start)
    with subject.preserved():
        costs = measure(candidates, probes, subject, rounds, timer)
    if topo.distributed:
        costs = [cost / topo.world_size for cost in all_reduce_sum(costs, topo)]
    best = pick(costs)
    decision = Decision(candidates[best], "measured", {label(c): cost for c, cost in zip(candidates, costs)},
                        time.perf_counter() - start)
    if cache is not None and topo.is_main:
        cache.put(key, decision)
    return decision


@contextlib.contextmanager
def preserved_module(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Weights, buffers (BatchNorm statistics), gradients and the random generators as they were: the
    measurement steps leave no trace in the run."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {p: None if p.grad is None else p.grad.detach().clone() for p in model.parameters()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(saved[k])
            for p, g in grads.items():
                p.grad = g


class RunStep:
    """The Subject of a training run: the task's loss under the choice's autocast, then backward, with the
    communicator's hooks detached (no exchange, no residual touched); the task applies its own choices
    (memory layout, convolution implementation)."""

    def __init__(self, task: Any, comm: Any, device: torch.device) -> None:
        self.task, self.comm, self.device = task, comm, device
        self.dtype: torch.dtype | None = None

    def apply(self, choice: Choice) -> None:
        self.dtype = AMP_DTYPES[choice.get("amp", "off")]
        self.task.apply_choices({k: v for k, v in choice.items() if k != "amp"})

    def prepare(self, batch: Any) -> Any:
        return self.task.prepare_probe(batch)

    def step(self, batch: Any) -> None:
        self.task.model.train()
        with autocast(self.device, self.dtype):
            loss, _ = self.task.loss(batch)
        loss.backward()
        self.task.model.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        self.comm.detach()
        try:
            with preserved_module(self.task.model, self.device):
                yield
        finally:
            self.comm.attach()
