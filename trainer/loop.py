"""The train loop: phases → epochs → steps, with evaluation, time-to-target, checkpoints and metrics.

What a step computes belongs to a `Task` (trainer/task.py: image classification, translation); the loop
owns what every recipe shares. Gradients are averaged by the communicator (launched from autograd hooks
during backward, waited on in `train_step`), not by DDP, so that the sparse communicators can replace the
dense one by config. DAWNBench counts total wall-clock time, so evaluation and checkpointing are inside
the clock.

Reliability (README "Reliability"): checkpoints carry every rank's state (RNG, communicator residuals) and
the position inside the epoch, so a run killed anywhere resumes where its newest checkpoint was taken and,
with `train.deterministic`, ends bitwise equal to an uninterrupted run; torchrun's restarts resume on
their own (`train.resume: auto`). Non-finite gradients never reach the weights: the loss scaler skips
and counts such steps, and without one the run stops naming the step.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from trainer.checkpoint import Checkpointer, CheckpointWriteError
from trainer.comm import Communicator
from trainer.config import ConfigError, require
from trainer.dist import ReplicaGuard, Topology, all_reduce_sum, broadcast_flag, broadcast_module
from trainer.metrics import LogConfig, MetricsLogger
from trainer.optim import OptimConfig, set_lr_momentum
from trainer.schedules import Phase, ScheduleConfig, get_lr, get_momentum, get_phase
from trainer.task import Task


@dataclass
class TrainConfig:
    epochs: int = 10
    """Training epochs (the phase table must end here)."""
    stop_at_target: bool = True
    """Stop as soon as every set target is reached (DAWNBench style)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (and always after the last one)."""
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    """Mixed precision: auto = fp16 with loss scaling on CUDA, off on CPU; bf16 pays on CPUs with
    AVX512-BF16 or AMX only (a warning says so elsewhere)."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    max_steps_per_epoch: int = 0
    """Cap on steps per epoch for debugging; 0 = the whole epoch."""
    checkpoint_every_epochs: int = 1
    """Write a checkpoint every this many epochs (and at the end); 0 = never."""
    checkpoint_every_steps: int = 0
    """Also write a checkpoint every this many optimizer steps, inside epochs (a resume continues mid-epoch):
    bounds the work a crash loses; 0 = at epoch ends only."""
    checkpoint_in_background: bool = False
    """Snapshot checkpoints to host memory and write them on a background thread (training goes on during
    the write; a failed write stops the run at the next checkpoint or at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool | Literal["auto"] = "auto"
    """Resume from the newest valid checkpoint in log.dir/checkpoints: true (also --resume); false = a fresh
    run (what log.dir held is archived); auto = when torchrun restarts the job after a failure
    (torchrun --max-restarts N sets TORCHELASTIC_RESTART_COUNT), else fresh."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms): with the same world size and thread
    count, a run killed and resumed ends bitwise equal to an uninterrupted one."""
    loss_scale: Literal["auto", "dynamic", "off"] = "auto"
    """Loss scaling: auto = dynamic with fp16, else off; dynamic = a dynamic scaler at any precision (a step
    with non-finite gradients is skipped and counted in train/skipped_steps); off = none, and a non-finite
    gradient stops the run naming the step."""
    max_skipped_steps: int = 50
    """Stop when the loss scaler skips this many steps in a row (the weights or the data are broken: not an
    fp16 overflow, which one or two skips fix)."""
    threads: int = 0
    """torch CPU threads per rank; 0 = leave the launcher's setting (torchrun sets 1 per rank)."""

    def __post_init__(self) -> None:
        require(self.epochs > 0, f"train.epochs: must be > 0, got {self.epochs}")
        require(self.eval_every_epochs > 0, f"train.eval_every_epochs: must be > 0, got {self.eval_every_epochs}")
        require(self.max_steps_per_epoch >= 0 and self.checkpoint_every_epochs >= 0 and self.keep_checkpoints > 0
                and self.checkpoint_every_steps >= 0,
                "train.max_steps_per_epoch, train.checkpoint_every_epochs and train.checkpoint_every_steps must be "
                ">= 0, train.keep_checkpoints > 0")
        require(self.max_skipped_steps > 0, f"train.max_skipped_steps: must be > 0, got {self.max_skipped_steps}")

    def should_resume(self) -> bool:
        """Whether this start resumes: asked for, or (auto) a torchrun restart after a rank failed."""
        if self.resume == "auto":
            return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        return bool(self.resume)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch; `deterministic` also forbids nondeterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible GEMMs (read when its handle is created):
        # https://docs.nvidia.com/cuda/cublas/#results-reproducibility
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators (one entry per rank in a checkpoint)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX); elsewhere oneDNN emulates it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence the getattr
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full precision."""
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp: fp16 needs CUDA; use bf16 or off on the CPU")
    if amp == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        # measured: ResNet-18 steps ~20x slower than fp32 on an AVX2-only EPYC, 1.4-1.7x faster with AVX512-BF16
        warnings.warn("train.amp: bf16 on a CPU without AVX512-BF16 or AMX is emulated and far slower than "
                      "fp32 here; train.amp=off is the fast choice on this machine", stacklevel=2)
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


class Trainer:
    """Runs the schedule's phases over a `Task`; all training state lives here and is checkpointable."""

    def __init__(self, train: TrainConfig, schedule: ScheduleConfig, optim: OptimConfig, log: LogConfig,
                 topo: Topology, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer, comm: Communicator,
                 metrics: MetricsLogger, run_config: dict, guard: ReplicaGuard | None = None) -> None:
        self.cfg, self.schedule, self.optim_cfg, self.log_cfg = train, schedule, optim, log
        self.topo, self.model, self.task, self.optimizer, self.comm = topo, model, task, optimizer, comm
        self.metrics, self.run_config = metrics, run_config
        self.guard = guard or ReplicaGuard(0, topo)
        # No phase table (e.g. translation): one phase spanning the run.
        self.phases: list[Phase] = schedule.phases or [Phase(start_epoch=0, end_epoch=train.epochs)]
        self.amp_dtype = resolve_amp(train.amp, topo.device)
        scaled = train.loss_scale == "dynamic" or (train.loss_scale == "auto" and self.amp_dtype == torch.float16)
        self.scaler = torch.amp.GradScaler(topo.device.type, enabled=scaled)
        # The scaler skips optimizer.step() after an overflow; this hook tells us whether it ran, without
        # reading the scale back from the device (the scaler's own check is the step's one host sync).
        self._stepped = False
        optimizer.register_step_post_hook(self._on_optimizer_step)
        self.checkpointer = Checkpointer(Path(log.dir) / "checkpoints", train.keep_checkpoints)
        # State (checkpointed): next epoch and the steps of it already done, global step, wall-clock seconds
        # so far, eval history, target time, steps the loss scaler skipped.
        self.epoch, self.step_in_epoch, self.step, self.elapsed_s = 0, 0, 0, 0.0
        self.history: list[dict] = []
        self.time_to_target_s: float | None = None
        self.skipped_steps, self.skipped_in_a_row = 0, 0
        self.checkpoint_s = 0.0
        self._clock = time.perf_counter()

    # ------------------------------------------------------------ state

    def state_dict(self, comm_state: dict, rng_states: list[dict]) -> dict:
        """Everything needed to resume. Per-rank parts come gathered (collectives, on rank 0): `comm_state`
        from `Communicator.gather_state()`, `rng_states` one entry per rank. Model and optimizer are rank
        0's: identical on every rank (averaged gradients), BatchNorm statistics broadcast before saving."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "comm": comm_state, "task": self.task.state_dict(),
                "trainer": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "step": self.step,
                            "elapsed_s": self.elapsed_s, "history": self.history,
                            "time_to_target_s": self.time_to_target_s, "skipped_steps": self.skipped_steps},
                "rng": rng_states, "config": self.run_config}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.comm.load_gathered_state(state["comm"])
        self.task.load_state_dict(state.get("task", {}))
        t = state["trainer"]
        self.epoch, self.step_in_epoch, self.step = t["epoch"], t.get("step_in_epoch", 0), t["step"]
        self.elapsed_s, self.history, self.time_to_target_s = t["elapsed_s"], t["history"], t["time_to_target_s"]
        self.skipped_steps = t.get("skipped_steps", 0)
        rng = state["rng"]  # one entry per rank (a dict in checkpoints older than per-rank RNG)
        set_rng_state(rng[self.topo.rank] if isinstance(rng, list) else rng, self.topo.device)

    def maybe_resume(self) -> str | None:
        """When resuming (train.resume), load the newest valid checkpoint (rank 0 reads, broadcasts)."""
        if not self.cfg.should_resume():
            return None
        found = self.checkpointer.load_latest() if self.topo.is_main else None
        found = (found[0], str(found[1])) if found else None
        if self.topo.distributed:
            found = self.topo.world.broadcast_object(found, src=0)
        if found is None:
            return None
        self.load_state_dict(found[0])
        return found[1]

    def should_checkpoint_step(self) -> bool:
        every = self.cfg.checkpoint_every_steps
        return bool(every) and self.step % every == 0

    def should_checkpoint_epoch(self, last: bool) -> bool:
        """After `self.epoch` was advanced: every checkpoint_every_epochs, and at the end if any are written."""
        every = self.cfg.checkpoint_every_epochs
        return (bool(every) and self.epoch % every == 0) or (last and bool(every or self.cfg.checkpoint_every_steps))

    def checkpoint(self) -> None:
        """Collective: rank 0 writes every rank's state; if it cannot (a full disk), all ranks stop together.
        The seconds it takes on the training thread are counted in `time/checkpoint_s` (they are inside the
        time-to-accuracy clock)."""
        start = time.perf_counter()
        self.elapsed_s = start - self._clock
        broadcast_module(self.model, self.topo, buffers_only=True)
        comm_state = self.comm.gather_state()  # every rank's error-feedback residuals, on rank 0
        rng = rng_state(self.topo.device)
        rng_states = self.topo.world.gather_object(rng) if self.topo.distributed else [rng]
        error = ""
        if self.topo.is_main:
            try:
                state = self.state_dict(comm_state, rng_states)
                if self.cfg.checkpoint_in_background:
                    self.checkpointer.save_in_background(state, self.step)
                else:
                    self.checkpointer.save(state, self.step)
            except CheckpointWriteError as e:
                error = str(e)
        self.raise_if_checkpoint_failed(error)
        self.checkpoint_s += time.perf_counter() - start

    def wait_for_checkpoints(self) -> None:
        """Collective: wait for a background checkpoint write; all ranks stop together if it failed."""
        error = ""
        if self.topo.is_main:
            try:
                self.checkpointer.wait()
            except CheckpointWriteError as e:
                error = str(e)
        self.raise_if_checkpoint_failed(error)

    def raise_if_checkpoint_failed(self, error: str) -> None:
        if broadcast_flag(bool(error), self.topo):  # the others would otherwise wait in the next collective
            raise CheckpointWriteError(f"step {self.step}: {error}; stopping (free space, or point log.dir "
                                       "elsewhere, then resume)" if error else
                                       f"step {self.step}: rank 0 could not write the checkpoint (its error "
                                       "says why); stopping with the previous checkpoints intact")

    # ------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topo.device.type, dtype=self.amp_dtype)

    def steps_per_epoch(self, phase: Phase) -> int:
        steps = self.task.steps_per_epoch(phase)
        return min(steps, self.cfg.max_steps_per_epoch) if self.cfg.max_steps_per_epoch else steps

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def train_step(self, batch: Any) -> tuple[torch.Tensor, int, dict[str, float]]:
        """Forward, backward (buckets launch from hooks), wait for the gradient exchange, optimizer step.

        With a loss scaler the communicator gets the step's scale as a device tensor (its error feedback keeps
        residuals unscaled), and a step the scaler skips is rolled back in the communicator too."""
        self.model.train()
        with self.autocast():
            loss, units = self.task.loss(batch)
        if self.scaler.is_enabled():
            self.comm.set_grad_scale(self.scaler.scale(torch.ones((), device=self.topo.device)))
        self.scaler.scale(loss).backward()
        comm_stats = self.comm.finish()
        self._stepped = False
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # skipped when the gradients hold inf/NaN
            self.scaler.update()
            if not self._stepped:
                self.comm.rollback()
            self.count_skip(not self._stepped)
        else:
            self.check_finite(loss)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.maybe_check(self.model, self.step + 1)
        return loss.detach(), units, comm_stats

    def check_finite(self, loss: torch.Tensor) -> None:
        """Stop before a non-finite update: one host sync. The gradients are averaged (equal on every rank; a
        rank's NaN reaches all of them), so every rank stops at the same step. A plain sum finds any inf or NaN
        (they propagate through it) and is one vectorized pass; the max-abs norm took 30 ms per ResNet-18 step
        on the CPU, 15x more."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        sums = [g.sum(dtype=torch.float32) for g in grads] or [torch.zeros((), device=self.topo.device)]
        total, value = torch.stack([torch.stack(sums).sum(),
                                    loss.detach().float().to(self.topo.device)]).tolist()
        if not math.isfinite(total):
            raise FloatingPointError(
                f"non-finite gradient at step {self.step + 1} (epoch {self.epoch}, step {self.step_in_epoch + 1} "
                f"of the epoch; this rank's loss {value}): stopped before the optimizer step, so the weights are "
                "untouched and the newest checkpoint is good (train.loss_scale=dynamic would skip such steps)")

    def count_skip(self, skipped: bool) -> None:
        if not skipped:
            self.skipped_in_a_row = 0
            return
        self.skipped_steps, self.skipped_in_a_row = self.skipped_steps + 1, self.skipped_in_a_row + 1
        if self.topo.is_main:
            tqdm.write(f"step {self.step + 1}: non-finite gradients, step skipped (loss scale now "
                       f"{self.scaler.get_scale():g}; {self.skipped_steps} skipped so far)")
        if self.skipped_in_a_row >= self.cfg.max_skipped_steps:
            raise FloatingPointError(
                f"the loss scaler skipped {self.skipped_in_a_row} steps in a row, up to step {self.step + 1}: "
                "the gradients are never finite (broken weights or data, not an fp16 overflow); stopping "
                "(train.max_skipped_steps)")

    def evaluate(self, phase: Phase) -> dict[str, float]:
        """The task's `eval/*` metrics (a collective), under the run's autocast."""
        with torch.no_grad(), self.autocast():
            return self.task.evaluate(phase)

    # ------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to the end (or to the target); returns the run summary."""
        resumed_from = self.maybe_resume()
        if resumed_from is None:
            broadcast_module(self.model, self.topo)
        self.print_plan(resumed_from)
        total_steps = sum(self.steps_per_epoch(get_phase(self.phases, e)) for e in range(self.cfg.epochs))
        done_steps = sum(self.steps_per_epoch(get_phase(self.phases, e)) for e in range(self.epoch))
        bar = tqdm(total=total_steps, initial=min(total_steps, done_steps + self.step_in_epoch),
                   disable=not (self.topo.is_main and self.log_cfg.progress), unit="step", dynamic_ncols=True)
        self._clock = time.perf_counter() - self.elapsed_s
        stop = self.time_to_target_s is not None and self.cfg.stop_at_target
        while self.epoch < self.cfg.epochs and not stop:
            phase = get_phase(self.phases, self.epoch)
            # A phase has one image size: let cuDNN pick the fastest convolution algorithms for it (unless
            # deterministic kernels were asked for).
            torch.backends.cudnn.benchmark = not self.cfg.deterministic
            epoch_start = time.perf_counter()
            record = {"epoch": self.epoch, **self.train_epoch(phase, bar)}
            last = self.epoch + 1 == self.cfg.epochs
            if self.should_evaluate(last):
                record.update(self.evaluate(phase))
                reached = broadcast_flag(self.task.target_reached(record), self.topo)
                if reached and self.time_to_target_s is None:
                    self.time_to_target_s = time.perf_counter() - self._clock
                stop = reached and self.cfg.stop_at_target
                bar.set_postfix(epoch=self.epoch, **{k[5:]: f"{v:.4f}" for k, v in record.items()
                                                     if k.startswith("eval/") and k != "eval/loss"})
            self.elapsed_s = time.perf_counter() - self._clock
            record.update({"time/epoch_s": time.perf_counter() - epoch_start, "time/elapsed_s": self.elapsed_s,
                           "time/checkpoint_s": self.checkpoint_s, "train/skipped_steps": self.skipped_steps})
            record.update(self.task.stats())  # e.g. cache hits/misses per level, skipped images (this rank)
            if any(k.startswith("eval/") for k in record):
                self.history.append({k: v for k, v in record.items()
                                     if k in ("epoch", "time/elapsed_s") or k.startswith("eval/")})
            self.metrics.log("epoch", self.step, record)
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            if self.should_checkpoint_epoch(last or stop):
                self.checkpoint()
        bar.close()
        self.wait_for_checkpoints()
        return self.finish_summary()

    def should_evaluate(self, last: bool) -> bool:
        return last or (self.epoch + 1) % self.cfg.eval_every_epochs == 0

    def should_log(self) -> bool:
        return self.step % self.log_cfg.every_steps == 0

    def train_epoch(self, phase: Phase, bar: tqdm) -> dict[str, float]:
        """The rest of the epoch: from `self.step_in_epoch` (0, or where a mid-epoch checkpoint was taken)."""
        steps, start = self.steps_per_epoch(phase), self.step_in_epoch
        peak, total, unit = self.optim_cfg.lr, float(self.cfg.epochs), self.task.unit
        units_seen, data_s, done = 0, 0.0, 0
        loss_sum = torch.zeros((), device=self.topo.device)  # summed on the device: no per-step host sync
        window_start, window_units, window_data_s, window_steps = time.perf_counter(), 0, 0.0, 0
        epoch_start = time.perf_counter()
        batches = self.task.train_batches(phase, self.epoch, start) if start < steps else iter(())
        for i in range(start, steps):
            fetch = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            waited = time.perf_counter() - fetch
            data_s, window_data_s, window_steps = data_s + waited, window_data_s + waited, window_steps + 1
            lr = get_lr(self.epoch + i / steps, self.schedule, peak, total) * phase.lr_scale
            momentum = get_momentum(lr, peak, self.schedule, self.optim_cfg.momentum)
            set_lr_momentum(self.optimizer, lr, momentum)
            loss, units, comm_stats = self.train_step(batch)
            loss_sum += loss.float()
            self.step, self.step_in_epoch, done = self.step + 1, i + 1, done + 1
            units_seen, window_units = units_seen + units, window_units + units
            bar.update(1)
            if self.should_log():
                value = float(loss)
                (window_units,) = all_reduce_sum([window_units], self.topo)  # every rank's, not ours times W
                now = time.perf_counter()
                self.metrics.log("step", self.step, {
                    "epoch": self.epoch + i / steps, "loss/train": value, "schedule/lr": lr,
                    "schedule/momentum": momentum, f"time/{unit}_per_s": window_units / (now - window_start),
                    "time/data_wait_s": window_data_s / max(1, window_steps),
                    "train/skipped_steps": self.skipped_steps, **{f"comm/{k}": v for k, v in comm_stats.items()},
                    **self.optimizer_metrics()})
                bar.set_postfix(epoch=self.epoch, loss=f"{value:.3f}", lr=f"{lr:.3g}")
                window_start, window_units, window_data_s, window_steps = now, 0, 0.0, 0
            if self.should_checkpoint_step():
                self.checkpoint()
        if hasattr(batches, "close"):
            batches.close()  # let the task's generator release its loader state now
        seconds = time.perf_counter() - epoch_start
        (units_seen,) = all_reduce_sum([units_seen], self.topo)
        return {"loss/train_epoch": float(loss_sum) / max(1, done), f"time/{unit}_per_s_epoch": units_seen / seconds,
                "time/data_share": data_s / seconds}

    def optimizer_metrics(self) -> dict[str, float]:
        """The optimizer's own per-step scalars (e.g. FusedLARS's clipped trust ratios), read on log steps."""
        read = getattr(self.optimizer, "step_metrics", None)
        return {name: float(value) for name, value in read().items()} if read is not None else {}

    def print_plan(self, resumed_from: str | None) -> None:
        """Derived sizes, printed once on rank 0."""
        if not self.topo.is_main:
            return
        t = self.topo
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"world {t.world_size} = {t.num_nodes} node(s) x {t.ranks_per_node} rank(s) on {t.device}; "
              f"amp {self.amp_dtype}; {n_params / 1e6:.2f} M parameters")
        for p in self.phases:
            print(f"  epochs {p.start_epoch:>3}-{p.end_epoch - 1:<3} {self.task.describe(p)}  "
                  f"{self.steps_per_epoch(p)} steps/epoch")
        if resumed_from:
            print(f"resumed from {resumed_from} at epoch {self.epoch}, step {self.step}")

    def finish_summary(self) -> dict[str, Any]:
        """The run's summary: `final` is the last evaluation, `final_<name>`/`target_<name>` per task target."""
        final = self.history[-1] if self.history else {}
        summary = {"epochs_run": self.epoch, "steps": self.step, "elapsed_s": self.elapsed_s,
                   "time_to_target_s": self.time_to_target_s,
                   **{f"target_{name}": value for name, value in self.task.targets.items()},
                   **{f"final_{name}": final.get(f"eval/{name}") for name in self.task.targets},
                   "final": final, "skipped_steps": self.skipped_steps, "checkpoint_s": self.checkpoint_s,
                   "world_size": self.topo.world_size,
                   "history": self.history}
        self.metrics.summary(summary)
        return summary
