"""Measured choices: settings whose speed depends on the machine, timed at start-up instead of assumed.

The engine: candidates (every combination of the values of the choices measured together) are timed on probes
(the shapes a run works at, each weighted by the steps it takes there), interleaved round by round (drift hits
them alike), the median of each one's rounds counting; candidates far behind are dropped early; every rank
measures and the ranks' costs are averaged before the pick, so all take one decision; a candidate that fails
(an unsupported kernel, out of memory) is dropped with a warning. Decisions are cached per machine under a key
of everything that changes the answer (`run_key`). What a training run measures with it is in
trainer/run_choices.py; docs/measured-choices.md describes the procedure, the cache and each choice.
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
from typing import Any, Callable, Protocol, Sequence

import torch

from trainer.config import ConfigError
from trainer.dist import Topology, all_reduce_sum
from trainer.run_record import device_name, kernel_flags

Choice = dict[str, Any]
"""One combination: a value per choice name, e.g. {"amp": "bf16", "channels_last": False}."""
CONFIG_KEYS = {"amp": "train.amp", "channels_last": "train.channels_last", "small_map_gemm": "model.small_map_gemm",
               "selection": "comm.selection", "workers": "data.workers"}
"""The config key of each choice, for messages."""


@dataclass(frozen=True)
class Probe:
    """One shape the run trains or evaluates at: a batch of that shape (as the loader delivers it), the steps
    the run takes at it, a name for logs and the cache key, and whether it is a training step (forward and
    backward) or an evaluation step (forward, no gradients)."""

    batch: Any
    steps: float
    name: str
    train: bool = True
    warm: bool = True
    """Whether the warm-up round runs it; False: its warm-up step runs in the first measured round instead, just
    before its timed step, so that a candidate cut before reaching it never pays for it."""


class Subject(Protocol):
    """What is measured: a choice is applied, then steps are timed at each probe's batch."""

    def apply(self, choice: Choice) -> None:
        """Switch the model (and whatever else the choice names) to `choice`."""

    def step(self, batch: Any, train: bool) -> None:
        """One step on `batch` under the applied choice: moved into the choice's layout, then forward and
        backward (`train`) or forward alone without gradients (evaluation)."""

    def preserved(self) -> contextlib.AbstractContextManager:
        """A context that leaves weights, buffers, gradients and random generators as they were before."""


Timer = Callable[[Callable[[], None], Choice], float]
"""Runs the step it is given and returns its seconds; the choice is the one applied (a timer may log or
weigh per candidate)."""


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
    costs_s: dict[str, float | None] = field(default_factory=dict)
    """Per candidate label: the predicted seconds of the run's training steps' forward and backward passes and
    its evaluations' forward passes (each shape's steps x its median time, mean over the ranks); inf (null in
    JSON) for a candidate that failed; from the measurement that made the decision (a cached decision's too)."""
    seconds: float = 0.0
    """Wall time spent deciding in this start (measuring, or reading the cache)."""
    parts_s: dict[str, float] = field(default_factory=dict)
    """`seconds` per group of choices decided together (its names joined by '+')."""

    def joined(self, other: Decision) -> Decision:
        """This decision and one over other choices, as one record; its source the first of checkpoint, measured,
        cache, default, pinned that either has (a resume that measures its input threads says checkpoint)."""
        order = ("checkpoint", "measured", "cache", "default", "pinned")  # a resume's record says so
        source = min(self.source, other.source, key=order.index)
        return Decision({**self.choice, **other.choice}, source, {**self.costs_s, **other.costs_s},
                        self.seconds + other.seconds, {**self.parts_s, **other.parts_s})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: a failed candidate's cost is null."""
        d = asdict(self)
        d["costs_s"] = {k: v if v is not None and math.isfinite(v) else None for k, v in self.costs_s.items()}
        return d

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics writers (TensorBoard, JSONL)."""
        out = {"choices/seconds": self.seconds, "choices/cached": float(self.source == "cache"),
               "choices/measured": float(self.source == "measured")}
        out.update({f"choices/{name}_s": value for name, value in self.costs_s.items()
                    if value is not None and math.isfinite(value)})
        return out

    def describe(self) -> str:
        kept = ", ".join(f"{name} {value}" for name, value in self.choice.items())
        if self.source in ("pinned", "default"):
            return (f"choices pinned by the config: {kept}" if self.source == "pinned" else
                    f"choices unmeasured (the task gives no batch to measure with), first candidates: {kept}")
        ranked = sorted(self.costs_s.items(), key=lambda kv: kv[1] if kv[1] is not None else math.inf)
        table = "; ".join(f"{name} {'failed' if seconds is None or not math.isfinite(seconds) else f'{seconds:.1f} s'}"
                          for name, seconds in ranked)
        how = {"measured": "measured", "cache": "from the cache", "checkpoint": "from the checkpoint"}[self.source]
        parts = f" ({', '.join(f'{group} {s:.1f} s' for group, s in self.parts_s.items())})" \
            if len(self.parts_s) > 1 else ""
        return (f"choices {how} in {self.seconds:.1f} s{parts}: {kept}" +
                (f" (predicted seconds of the run's steps and evaluations: {table})" if table else ""))


# ---------------------------------------------------------------- measurement


WARMUP_PRUNE = 4.0
"""After the warm-up round, a candidate more than this many times the best's cost is measured no further. A first
step carries one-time work (creating a kernel for the shape, first-touch allocations) that differs between
implementations by several times (oneDNN's convolutions against the GEMM path), so only a candidate far behind
even so is dropped on it."""
ROUND_PRUNE = 1.25
"""After each measured round, a candidate more than this many times the best's current cost is measured no
further (its cost stays its estimate so far)."""
PROBE_EXCHANGE = "dense over the node's ranks"
"""What a training probe's gradients go through on several ranks (trainer/loop.py, `measuring_exchange`); in the
cache key, so entries measured with another exchange are not reused."""


def measure(candidates: list[Choice], probes: list[Probe], subject: Subject, rounds: int, timer: Timer,
            reduce: Callable[[list[float]], list[float]] = lambda costs: costs, budget: float = math.inf,
            budget_s: float = math.inf) -> list[float]:
    """Per candidate: the sum over probes of (the probe's steps x the median of its timed steps), in seconds;
    candidates interleaved round by round. Round 0 warms each candidate up (first-touch allocations, kernel
    selection) at its `warm` probes (the others get an untimed step just before their first timed one) and is
    timed only to drop candidates far behind (`WARMUP_PRUNE`); then up to `rounds` measured rounds, after each of
    which candidates clearly behind are dropped (`ROUND_PRUNE`). Within the warm-up and the first measured round
    (whose times are a candidate's whole estimate), a candidate whose probes so far already cost more than that
    round's factor x its best complete cost is dropped at once, its part-round cost (a lower bound of the whole,
    so the cut drops only what the round's end would) kept as its cost; probes run largest first (by steps) so
    that the cut comes early. No further round starts once the measurement's own seconds exceed `budget` x the
    best candidate's cost, or `budget_s` (the first measured round always runs). A subject whose `apply` warms a
    candidate up itself (`warmed_by_apply`) skips round 0. `reduce` averages a cost list over the ranks, after
    every probe and every round, so every rank drops the same candidates at the same probe and stops alike. A
    candidate that raises (an unsupported kernel, out of memory, anything) is `inf`, with a warning naming it and
    the error, and dropped on every rank at that probe - when it raises on every rank, or outside a step's own
    collectives: one that raises on one rank in the middle of a training step's gradient exchange leaves the
    others waiting in that exchange until the process group's timeout names the rank."""
    times: dict[tuple[int, int], list[float]] = {(c, p): [] for c in range(len(candidates)) for p in range(len(probes))}
    failed: set[int] = set()
    active = list(range(len(candidates)))
    costs = [math.inf] * len(candidates)
    order = sorted(range(len(probes)), key=lambda p: -probes[p].steps)
    warmed: set[int] = set()
    start = time.perf_counter()
    for r in range(1 if getattr(subject, "warmed_by_apply", False) else 0, rounds + 1):
        factor = WARMUP_PRUNE if r == 0 else ROUND_PRUNE
        cut_factor = factor if r <= 1 else math.inf  # later rounds keep a median, which a part does not bound
        best = math.inf  # this round's best complete cost so far
        cut: dict[int, float] = {}
        timed = [p for p in order if r > 0 or probes[p].warm] or order
        warmed = set(timed) if r == 0 else warmed
        for c in active:
            partial = 0.0
            for i, p in enumerate(timed):
                probe = probes[p]
                try:
                    if i == 0:
                        subject.apply(candidates[c])
                    if r == 1 and not probe.warm and p not in warmed:
                        subject.step(probe.batch, probe.train)  # its warm-up step, untimed
                    seconds = timer(lambda: subject.step(probe.batch, probe.train), candidates[c])
                    if not math.isfinite(seconds):
                        raise FloatingPointError(f"the timer returned {seconds}")
                    # the warm-up's time stands until the first measured round replaces it
                    times[c, p] = [seconds] if r <= 1 else [*times[c, p], seconds]
                    partial += probe.steps * seconds
                except Exception as e:  # noqa: BLE001 - reported; the collective below drops it everywhere
                    warnings.warn(f"measured choices: {label(candidates[c])} failed and is dropped: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
                    failed.add(c)
                (so_far,) = reduce([math.inf if c in failed else partial])
                if not math.isfinite(so_far):
                    failed.add(c)
                    break
                if so_far > cut_factor * best:
                    cut[c] = so_far
                    break
            else:
                best = min(best, so_far)  # a complete round's cost, the same on every rank
        local = [math.inf if c in failed or not all(times[c, p] for p in timed) else
                 sum(probes[p].steps * statistics.median(times[c, p]) for p in timed)
                 for c in range(len(candidates))]
        *round_costs, spent = reduce([*local, time.perf_counter() - start])
        for c in active:
            costs[c] = cut.get(c, round_costs[c])
        best = min((costs[c] for c in active), default=math.inf)
        active = [c for c in active if c not in cut and math.isfinite(costs[c]) and costs[c] <= factor * best]
        if r >= 1 and spent > min(budget * best, budget_s):
            break
    return costs


def pick(costs: Sequence[float], names: Sequence[str] = ()) -> int:
    """The index of the least finite cost (the first on a tie); ValueError when every candidate failed."""
    finite = [i for i, cost in enumerate(costs) if math.isfinite(cost)]
    if not finite:
        keys = ", ".join(CONFIG_KEYS.get(n, n) for n in names) or "the keys left at auto"
        raise ValueError(f"measured choices: every candidate failed; pin the choices in the config ({keys})")
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
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
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
        entry = {"key": _plain(key), "choice": decision.choice, "costs_s": decision.to_dict()["costs_s"],
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


def run_key(topo: Topology, model: torch.nn.Module | None, space: dict[str, Sequence[Any]], probes: list[Probe],
            rounds: int) -> dict[str, Any]:
    """Everything that changes which candidate is fastest: the device model and the CPU's kernel-relevant flags,
    the cores this process may use and its threads, torch, CUDA and cuDNN versions and cuDNN's autotuning, the
    kernel sources, world size and ranks per node, the model (class, parameter count, structure), the probes
    (shapes and steps), the candidates, the rounds, the pruning factors and the probes' exchange (entries
    decided under other rules are not reused)."""
    return _plain({
        "device": device_name(topo.device), "device_type": topo.device.type, "cpu_flags": kernel_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if topo.device.type == "cuda" else None,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if topo.device.type == "cuda" else None,
        "kernels": kernels_build(), "world_size": topo.world_size, "ranks_per_node": topo.ranks_per_node,
        "model": None if model is None else {
            "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "structure": hashlib.sha256(repr(model).encode()).hexdigest()[:16]},
        "probes": [[probe.name, probe.steps] for probe in probes], "space": {k: list(v) for k, v in space.items()},
        "rounds": rounds, "pruning": [WARMUP_PRUNE, ROUND_PRUNE], "exchange": PROBE_EXCHANGE})


# ---------------------------------------------------------------- the decision


def checked_choice(choice: Choice, space: dict[str, Sequence[Any]]) -> Choice:
    """A restored `choice` (from a checkpoint) against this run's candidates: a name it lacks takes the first
    candidate, with a warning; a value the config or the device no longer allows is a ConfigError."""
    checked = {}
    for name, values in space.items():
        if name not in choice:
            warnings.warn(f"measured choices: the checkpoint holds no {name}; using {values[0]!r}", stacklevel=2)
            checked[name] = values[0]
        elif choice[name] not in values:
            raise ConfigError(f"{CONFIG_KEYS.get(name, name)}: the checkpoint trained with {choice[name]!r}, which "
                              f"this config and device allow no more (candidates {list(values)}); resume with it "
                              "pinned, or start a fresh run")
        else:
            checked[name] = choice[name]
    return checked


def decide(space: dict[str, Sequence[Any]], probes: list[Probe], subject: Subject, topo: Topology,
           cache: ChoiceCache | None, key: dict[str, Any], rounds: int, timer: Timer, budget: float = math.inf,
           budget_s: float = math.inf) -> Decision:
    """Collective: the combination every rank keeps. Nothing at auto: the pinned values, unmeasured. Else rank
    0's cache entry for `key` when there is one; else every rank measures, the costs are averaged over the
    ranks (all ranks then pick alike), the least is kept and rank 0 writes it to the cache."""
    start = time.perf_counter()
    candidates = combinations(space)
    if len(candidates) == 1 or not probes:
        return Decision(candidates[0], "pinned" if len(candidates) == 1 else "default")
    entry = None
    if cache is not None and topo.is_main:
        try:
            entry = cache.get(key)
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the broadcast below
            warnings.warn(f"measured choices: the cache could not be read ({e}); measuring", stacklevel=2)
    if topo.distributed:
        entry = topo.world.broadcast_object(entry, src=0)
    group = "+".join(space)
    if entry is not None and entry["choice"] in candidates:
        seconds = time.perf_counter() - start
        return Decision(entry["choice"], "cache", entry.get("costs_s", {}), seconds, {group: seconds})
    def mean_over_ranks(costs: list[float]) -> list[float]:
        return [cost / topo.world_size for cost in all_reduce_sum(costs, topo)] if topo.distributed else costs
    with subject.preserved():
        costs = measure(candidates, probes, subject, rounds, timer, mean_over_ranks, budget, budget_s)
    if topo.device.type == "cuda":
        torch.cuda.empty_cache()  # the candidates' workspaces
    best = pick(costs, list(space))
    seconds = time.perf_counter() - start
    decision = Decision(candidates[best], "measured", {label(c): cost for c, cost in zip(candidates, costs)},
                        seconds, {group: seconds})
    if cache is not None and topo.is_main:
        cache.put(key, decision)
    return decision
