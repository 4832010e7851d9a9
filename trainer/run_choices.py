"""What a training run measures at start-up (trainer/choices.py times, caches and picks): the model's step under
each combination of precision, memory layout and convolution implementation (`RunStep`); the communicator's
top-k selection at its own selection sizes (`SelectionStep`); the input pipeline's threads on the run's own
loader and model (`InputStep`). docs/measured-choices.md describes each.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import math
import os
from typing import Any, Iterator, Sequence

import torch

from trainer.choices import (Choice, ChoiceCache, Decision, Probe, Timer, checked_choice, decide, label, run_key,
                             wall_timer)
from trainer.comm.sparse import SparseLocalWork
from trainer.compiling import allow_graphs, apply_compile, eager
from trainer.dist import Topology
from trainer.precision import AMP_DTYPES, autocast

NOT_CHECKPOINTED = ("workers",)
"""Choices that leave the numerics alone (augmentation is seeded per image, whatever the threads): measured again,
or read from the cache, on every start, resumes included, and not kept in checkpoints."""


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
    """The Subject of a training run: the task's loss under the choice's autocast, then backward and the
    optimizer's step (training probes) or the forward alone (evaluation probes), with the communicator's hooks
    detached (no exchange, no residual touched); the task applies its own choices (memory layout, convolution
    implementation). Weights, buffers, gradients, the optimizer's state and the generators are restored
    afterwards."""

    def __init__(self, task: Any, comm: Any, optimizer: torch.optim.Optimizer, device: torch.device,
                 exchange: Any = None) -> None:
        self.task, self.comm, self.optimizer, self.device = task, comm, optimizer, device
        self.exchange = exchange
        """A dense communicator over the node's ranks hooked in while measuring (None when the node has one
        rank): every training probe's gradients are averaged from backward's hooks, as in a training step,
        without touching the run's own communicator (its residuals and measurements)."""
        self.dtype: torch.dtype | None = None

    def apply(self, choice: Choice) -> None:
        self.dtype = AMP_DTYPES[choice.get("amp", "off")]
        self.task.apply_choices({k: v for k, v in choice.items() if k not in ("amp", "compile")})
        apply_compile(self.task.model, choice.get("compile", "off"))

    def step(self, batch: Any, train: bool) -> None:
        model = self.task.model
        model.train(train)
        try:
            compiled = contextlib.nullcontext() if train else eager()  # evaluation eager, as Trainer.evaluate
            with torch.set_grad_enabled(train), autocast(self.device, self.dtype), compiled:
                loss, _ = self.task.loss(self.task.prepare_probe(batch))
            if train:
                loss.backward()
                if self.exchange is not None:
                    self.exchange.finish()
                self.optimizer.step()  # its kernels see the layout of the weights and gradients too
        finally:
            model.zero_grad(set_to_none=True)  # a failed candidate leaves no partial gradients either

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        self.comm.detach()
        if self.exchange is not None:
            self.exchange.attach()
        training = self.task.model.training
        optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        try:
            with preserved_module(self.task.model, self.device):
                yield
        finally:
            self.optimizer.load_state_dict(optimizer_state)
            self.task.model.train(training)
            if self.exchange is not None:
                self.exchange.detach()
            self.comm.attach()


class SelectionStep:
    """The Subject of `comm.selection`: a probe's batch is (elements, density); a step is the sparse exchange's
    local work on a gradient-like vector of that many elements (residual add, selection by the candidate, pack,
    clear, scatter-add), the part of a step the selection changes. One vector and its buffers per size."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters
        self.works: dict[int, SparseLocalWork] = {}
        self.selection = "mstopk"

    def apply(self, choice: Choice) -> None:
        self.selection = choice["selection"]

    def step(self, batch: tuple[int, float], train: bool) -> None:
        n, density = batch
        if n not in self.works:
            gen = torch.Generator().manual_seed(n)
            self.works[n] = SparseLocalWork(torch.randn(n, generator=gen).to(self.device), peers=1, iters=self.iters)
        self.works[n](density, self.selection)

    def preserved(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class InputStep:
    """The Subject of `data.workers`: a loader per candidate for `phase`, built once; applying a
    candidate first takes, untimed, the batches its loader prepared while the others were measured (its queue:
    `drain` batches, fetched without computing) and then one training step (during which the loader refills; a
    loader slower than the model may still hold up to workers - 1 batches more than in steady training when the
    timed steps begin), so that a step - `steps` training steps of the run's model on the loader's batches,
    fetch included - times the loader and the model running together, at the pace they keep, under the choices
    `run_step` has applied. Applying warms a candidate up (its loader built, its queue drained), so no warm-up
    round is needed."""

    warmed_by_apply = True

    def __init__(self, task: Any, run_step: RunStep, phase: Any, steps: int = 4) -> None:
        self.task, self.run_step, self.phase, self.steps = task, run_step, phase, steps
        self.batches: dict[int, Iterator[Any]] = {}
        self.current: Iterator[Any] = iter(())

    @staticmethod
    def drain(workers: int) -> int:
        """Batches a loader may hold ready after idling: two per worker (torchvision's prefetch factor; DALI's
        queue of 2 and its prefetch thread's share), and the one in flight."""
        return 2 * max(1, workers) + 1

    def apply(self, choice: Choice) -> None:
        workers = choice["workers"]
        if workers not in self.batches:
            self.batches[workers] = self.task.input_batches(self.phase, workers)
        self.current = self.batches[workers]
        for _ in itertools.islice(self.current, self.drain(workers)):
            pass
        self.run_step.step(next(self.current), True)

    def step(self, batch: Any, train: bool) -> None:
        for batch in itertools.islice(self.current, self.steps):
            self.run_step.step(batch, True)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        try:
            with self.run_step.preserved():
                yield
        finally:
            for batches in self.batches.values():
                batches.close()  # stops the candidate's loader: threads, worker processes
            self.batches.clear()


def cores_per_rank(topo: Topology) -> int:
    """The cores this process may use, shared with the other processes of the run on this machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or topo.ranks_per_node
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))


def settle(restored: Decision | None, amp_candidates: list[str], phases: list[tuple[Any, int, int]],
           run_step: RunStep, topo: Topology, cache: ChoiceCache | None, rounds: int, budget: float,
           timer: Timer | None = None, cores: int | None = None, compile_modes: Sequence[str] = ("off",)
           ) -> tuple[Decision, dict[str, list[Any]]]:
    """Collective: the run's choices and the space of those that go with the model (precision, torch.compile's
    mode where `compile_modes` offers more than "off", and the task's own). In turn: precision, compilation,
    memory layout and convolutions, measured together on the model at every shape it trains and evaluates at
    (`phases`: (phase, training steps, evaluations)), a compiled model then compiled at every training shape
    before the clock; the communicator's top-k selection
    at its selection sizes; the input threads on the run's loader at the phase with the most steps, under the
    choices already made; the later two measure no further round once the three together have spent `budget` of
    the run's predicted seconds (each one's first measured round always runs). The model's choices are left
    applied to the task. A `restored` decision (a resume) keeps its numerics-changing choices, checked against the
    config; the input threads are settled afresh on every start. `timer` (default: the wall clock) and `cores`
    (default: `cores_per_rank`) are for tests."""
    task, comm = run_step.task, run_step.comm
    compiling = list(compile_modes) != ["off"]
    space = {"amp": amp_candidates, **({"compile": list(compile_modes)} if compiling else {}), **task.choice_space()}
    # The probes' batches are built once: measuring and compiling before the clock both run them.
    probes = task.probes(phases) if restored is None or compiling else []
    if compiling:
        # a graph per combination and shape (training probes and the compiled ones of the task's own)
        allow_graphs(math.prod(len(v) for v in space.values()) * len(probes))
    selection = comm.selection_candidates()
    timer = timer or wall_timer(topo.device)
    total_steps = sum(steps for _, steps, _ in phases)
    if restored is not None:
        restored.choice = checked_choice({k: v for k, v in restored.choice.items() if k not in NOT_CHECKPOINTED},
                                         {**space, **({"selection": selection} if selection else {})})
        decision = restored
    else:
        decision = decide(space, probes, run_step, topo, cache, run_key(topo, task.model, space, probes, rounds),
                          rounds, timer, budget)
    model_choice = {k: v for k, v in decision.choice.items() if k in space}
    run_step.apply(model_choice)  # the task trains with it; the later groups measure and key the model under it
    if model_choice.get("compile", "off") != "off":
        # Compiled at every training shape now, not inside the clock (after a measurement: cached, quick).
        with run_step.preserved():
            for probe in probes:
                if probe.train:
                    run_step.step(probe.batch, True)
    # One budget for every group: a share of the run's predicted seconds (the kept combination's cost)
    run_s = min((c for c in decision.costs_s.values() if c is not None and math.isfinite(c)), default=math.inf)

    def left() -> float:
        return max(0.0, budget * run_s - decision.seconds)

    if restored is None and selection:
        sel_space = {"selection": selection}
        sel_probes = [Probe((n, density), count * total_steps, f"select {n} at {density:g}, {comm.iters} iterations")
                      for (n, density), count in sorted(comm.selection_sizes().items())]
        decision = decision.joined(decide(sel_space, sel_probes, SelectionStep(topo.device, comm.iters), topo, cache,
                                          run_key(topo, None, sel_space, sel_probes, rounds), rounds, timer, budget,
                                          left()))
    workers = task.input_candidates(cores or cores_per_rank(topo))
    if workers:
        phase = max(phases, key=lambda p: p[1])[0]
        step = InputStep(task, run_step, phase)
        w_space = {"workers": workers}
        # the data's settings (backend, folder, cache levels) change what a batch costs to load
        data = hashlib.sha256(repr(getattr(getattr(task, "data", None), "cfg", None)).encode()).hexdigest()[:16]
        batch = getattr(task, "per_rank_batch", lambda p: p.batch_size)(phase)
        probes = [Probe(None, total_steps / step.steps, f"train {batch}x{phase.image_size}px, loaded, data {data}, "
                                                          f"under {label(model_choice)}")]
        decision = decision.joined(decide(w_space, probes, step, topo, cache,
                                          run_key(topo, task.model, w_space, probes, rounds), rounds, timer, budget,
                                          left()))
    return decision, space
