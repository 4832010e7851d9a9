"""The train loop: phases → epochs → steps, with evaluation, time-to-target, checkpoints and metrics.

What a step computes belongs to a `Task` (trainer/task.py: image classification, translation); the loop
owns what every recipe shares. Gradients are averaged by the communicator (launched from autograd hooks
during backward, waited on in `train_step`), not by DDP, so that the sparse communicators can replace the
dense one by config. DAWNBench counts total wall-clock time, so evaluation and checkpointing are inside
the clock.

Reliability (docs/reliability.md): a checkpoint is a folder in which every rank writes its own state (RNG,
communicator residuals) and rank 0 the shared state (trainer/checkpoint.py), with the position inside the
epoch, so a run killed anywhere resumes where its newest checkpoint was taken and, with
`train.deterministic`, ends bitwise equal to an uninterrupted run; torchrun's restarts resume on their own
(`train.resume: auto`), also on a different number of ranks. SIGTERM or SIGUSR1 (a preemption notice) makes
every rank finish its step, write a checkpoint together and exit with PREEMPTED_EXIT_CODE, which torchrun
restarts and Slurm can requeue. Non-finite gradients never reach the weights: the loss scaler skips and
counts such steps, and without one the run stops naming the step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol

import torch
from torch import nn
from tqdm import tqdm

from trainer.checkpoint import (MODEL, SHARED, CheckpointWriter, CheckpointWriteError, CorruptCheckpointError,
                                load_file, rank_file, read_manifest, step_dir_name,
                                step_dirs, verify_files)
from trainer.comm import CommConfig, Communicator, build_communicator
from trainer.config import require, to_dict
from trainer.dist import ReplicaGuard, Topology, all_reduce_sum, broadcast_flag, broadcast_module
from trainer.metrics import LogConfig, MetricsLogger
from trainer.optim import set_lr_momentum
from trainer.choices import ChoiceCache, Decision, cache_folder
from trainer.precision import AMP_DTYPES, amp_candidates, autocast, build_grad_scaler
from trainer.run_choices import NOT_CHECKPOINTED, RunStep, settle
from trainer.run_record import add_to_run_record
from trainer.rng import rng_state, seed_rank, set_rng_state
from trainer.schedules import Phase, ScheduleConfig, build_schedule
from trainer.task import Task

PREEMPTED_EXIT_CODE = 75
"""The exit status after a stop signal and its checkpoint: EX_TEMPFAIL of sysexits.h ("try again later").
torchrun --max-restarts restarts on any non-zero status but never passes it on (it exits 1): under torchrun
the batch script requeues explicitly (scripts/slurm/); without torchrun, Slurm's RequeueExit=75 requeues it
(docs/reliability.md)."""
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ranks(first: int, last: int) -> str:
    """'rank 2' or 'ranks 0-1', for messages."""
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def describe_error(error: BaseException) -> str:
    """A checkpoint failure in words: a CheckpointWriteError's own message, else the exception's type and text."""
    return str(error) if isinstance(error, CheckpointWriteError) else f"{type(error).__name__}: {error}"


def holds_tensors(value: Any) -> bool:
    """Whether a state entry holds tensors (nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensors(v) for v in value)
    return False


@dataclass
class TrainConfig:
    epochs: int = 10
    """Training epochs (the phase table must end here)."""
    stop_at_target: bool = True
    """Stop as soon as every set target is reached (DAWNBench style)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (and always after the last one)."""
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    """Mixed precision: auto = measured at start-up (trainer/choices.py) among fp32 and bf16 on the CPU, bf16
    and fp16 (with loss scaling) on CUDA; off = fp32; a pinned value this device cannot run is a config
    error."""
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
    run (what log.dir held is archived); auto = when the job was restarted: by torchrun after a failure or a
    preemption (torchrun --max-restarts N sets TORCHELASTIC_RESTART_COUNT) or by a Slurm requeue
    (SLURM_RESTART_COUNT), else fresh."""
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
    preempt_grace_s: float = 25.0
    """Seconds between SIGTERM/SIGUSR1 and the forced exit: the ranks finish their step, write a checkpoint
    together and exit with status 75 (restartable); a rank still running after this many seconds exits at
    once with that status, without a checkpoint. Keep it below the platform's notice (30 s on GCP spot, the
    `--signal` time on Slurm) and, when torchrun itself is signalled, below its --shutdown-timeout (30 s by
    default), after which torchrun SIGKILLs the ranks (scripts/slurm/ pass 100 s and 110 s)."""
    calibration_rounds: int = 3
    """Measured choices (train.amp, train.channels_last, model.small_map_gemm left at auto): timed steps per
    candidate combination and phase shape at start-up, after one warm-up step each; the median counts."""
    calibration_budget: float = 0.1
    """Measured choices: no further round starts once the measurement has spent this fraction of the best
    candidate's predicted seconds for the run, one budget for all the choices measured (each one's warm-up and
    first measured round always run)."""
    choices_cache: str = "auto"
    """Folder of the per-machine cache of measured choices (a second identical run starts without measuring):
    auto = $XDG_CACHE_HOME/dawnbench-recipes/choices (~/.cache/... when unset); none = measure every run."""
    preempt_check_every_steps: int = 1
    """How often the ranks agree whether one of them was signalled: a one-number all-reduce (and a host sync)
    at every this many step ends. A signal is acted on up to this many steps late: keep that and a
    checkpoint's write well inside train.preempt_grace_s."""

    def __post_init__(self) -> None:
        require(self.epochs > 0, f"train.epochs: must be > 0, got {self.epochs}")
        require(self.eval_every_epochs > 0, f"train.eval_every_epochs: must be > 0, got {self.eval_every_epochs}")
        require(self.max_steps_per_epoch >= 0 and self.checkpoint_every_epochs >= 0 and self.keep_checkpoints > 0
                and self.checkpoint_every_steps >= 0,
                "train.max_steps_per_epoch, train.checkpoint_every_epochs and train.checkpoint_every_steps must be "
                ">= 0, train.keep_checkpoints > 0")
        require(self.max_skipped_steps > 0, f"train.max_skipped_steps: must be > 0, got {self.max_skipped_steps}")
        require(self.calibration_rounds >= 1, f"train.calibration_rounds: must be >= 1, got {self.calibration_rounds}")
        require(self.calibration_budget > 0, f"train.calibration_budget: must be > 0, got {self.calibration_budget}")
        require(self.preempt_grace_s > 0 and self.preempt_check_every_steps > 0,
                "train.preempt_grace_s and train.preempt_check_every_steps must be > 0")

    def should_resume(self) -> bool:
        """Whether this start resumes: asked for, or (auto) a torchrun restart or a requeued Slurm job."""
        if self.resume == "auto":
            return any(int(os.environ.get(name, "0") or 0) > 0
                       for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        return bool(self.resume)


class RunConfig(Protocol):
    """The sections of a root config the Trainer reads (a recipe's `Config`, or `LoopConfig`)."""

    train: TrainConfig
    schedule: ScheduleConfig
    log: LogConfig


@dataclass
class LoopConfig:
    """A root config of only the sections the Trainer reads: for a Trainer built without a recipe (tests,
    benchmarks, the GPU check)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Epochs, precision, checkpoints."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning rate, momentum and phases."""
    log: LogConfig = field(default_factory=LogConfig)
    """Outputs."""


@dataclass
class Components:
    """The runtime objects a Trainer drives, built from the other sections (`trainer.run` builds them)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    comm: Communicator
    metrics: MetricsLogger = field(default_factory=lambda: MetricsLogger([]))
    """Rank 0's writers; the null logger writes nothing."""
    guard: ReplicaGuard | None = None
    """The replica-consistency check (dist.check_every_steps); None = never."""


@dataclass
class Meter:
    """Items trained and seconds waited for data since `start`: over an epoch, or over a logging window."""

    start: float = field(default_factory=time.perf_counter)
    units: int = 0
    data_s: float = 0.0
    steps: int = 0

    def add(self, units: int, waited_s: float) -> None:
        self.units, self.data_s, self.steps = self.units + units, self.data_s + waited_s, self.steps + 1


def timed_next(batches: Iterator[Any]) -> tuple[Any, float]:
    """The next batch (None at the end) and the seconds spent waiting for it."""
    start = time.perf_counter()
    batch = next(batches, None)
    return batch, time.perf_counter() - start


class ProgressLines:
    """The progress bar's stand-in where output goes to a file: one line every `every` steps, e.g.
    `step 120/1000 (12%) 3.1 steps/s, 4m 44s left  epoch=1 loss=2.310 lr=0.1`, on stderr (the stream the bar
    would draw on, and the one whose terminal check chose the lines)."""

    def __init__(self, total: int, initial: int, every: int) -> None:
        self.total, self.n, self.every = total, initial, every
        self.start, self.start_n = time.perf_counter(), initial
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            rate = (self.n - self.start_n) / max(1e-9, time.perf_counter() - self.start)
            left = (self.total - self.n) / rate if rate > 0 else 0.0
            minutes, seconds = divmod(int(left), 60)
            print(f"step {self.n}/{self.total} ({100 * self.n / max(1, self.total):.0f}%) {rate:.3g} steps/s, "
                  f"{minutes}m {seconds:02d}s left  {self.postfix}".rstrip(), file=sys.stderr, flush=True)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        pass


class Trainer:
    """Runs the schedule's phases over a `Task`; all training state lives here and is checkpointable.

    `cfg` is the run's root config: the Trainer reads its `train`, `schedule` and `log` sections and
    stores all of it in every checkpoint."""

    def __init__(self, cfg: RunConfig, topo: Topology, task: Task, components: Components) -> None:
        self.train_cfg, self.log_cfg, self.run_config = cfg.train, cfg.log, to_dict(cfg)
        self.topo, self.task = topo, task
        self.model, self.optimizer, self.comm = components.model, components.optimizer, components.comm
        self.metrics = components.metrics
        self.guard = components.guard or ReplicaGuard(0, topo)
        self.schedule = build_schedule(cfg.schedule, self.optimizer, cfg.train.epochs)
        self.phases: list[Phase] = self.schedule.phases
        self.amp_candidates = amp_candidates(cfg.train.amp, topo.device)
        self.amp_dtype = AMP_DTYPES[self.amp_candidates[0]]
        self.scaler = build_grad_scaler(cfg.train.loss_scale, self.amp_dtype, topo.device)
        self.decision: Decision | None = None
        """The measured choices the run trains with: set by `settle_choices`, or restored from a checkpoint."""

        # Whether the scaler applied the step, learnt from the optimizer's post-step hook instead of reading
        # the scale back: a plain optimizer's step is not called after an overflow (the scaler's inf check is
        # the step's one host sync); a fused one (torch's fused Adam) is always called and skips inside,
        # with the scaler's `found_inf` tensor set on it during the call, which the hook reads (the one sync).
        self._stepped = False
        self.optimizer.register_step_post_hook(self._on_optimizer_step)
        self.writer = CheckpointWriter(Path(cfg.log.dir) / "checkpoints", topo.rank, topo.world_size,
                                       cfg.train.keep_checkpoints)
        self.token = ""
        """This attempt's mark on its checkpoint records (set in `fit`, equal on every rank)."""
        self.last_checkpoint_step = -1
        self.checkpoints_started = 0
        self.preempt_signal: int | None = None
        """The stop signal this rank received (SIGTERM, SIGUSR1), if any."""
        self.preempted_ranks = 0
        self.watchdog: threading.Timer | None = None
        """The grace timer (train.preempt_grace_s), armed by a stop signal or by the ranks' agreement on one."""
        self._handler_pid = os.getpid()
        # State (checkpointed): next epoch and the steps of it already done, global step, wall-clock seconds
        # so far, eval history, target time, steps the loss scaler skipped.
        self.epoch, self.step_in_epoch, self.step, self.elapsed_s = 0, 0, 0, 0.0
        self.history: list[dict] = []
        self.time_to_target_s: float | None = None
        self.skipped_steps, self.skipped_in_a_row = 0, 0
        self.checkpoint_s = 0.0
        self._clock = time.perf_counter()

    # ------------------------------------------------------------ state

    def shared_state(self, comm: dict[str, Any]) -> dict:
        """Rank 0's part of a checkpoint besides the model: what is equal on every rank (the optimizer's state,
        from averaged gradients), the loop's position (also in samples: a resume on another world size
        continues the data order), and the plain entries of the communicator's state `comm` (its tensors are
        per rank)."""
        phase = self.schedule.phase(min(self.epoch, self.train_cfg.epochs - 1))
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "task": self.task.state_dict(),
                "trainer": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                            "steps_per_epoch": self.steps_per_epoch(phase),
                            "samples_in_epoch": self.step_in_epoch * phase.batch_size, "step": self.step,
                            "elapsed_s": self.elapsed_s, "history": self.history,
                            "time_to_target_s": self.time_to_target_s, "skipped_steps": self.skipped_steps,
                            "world_size": self.topo.world_size},
                "comm_shared": {k: v for k, v in comm.items() if not holds_tensors(v)},
                "comm_per_rank": sorted(k for k, v in comm.items() if holds_tensors(v)),
                "comm_layout": self.comm_layout(),
                "choices": None if self.decision is None else {k: v for k, v in self.decision.choice.items()
                                                                if k not in NOT_CHECKPOINTED},
                "config": self.run_config}

    def checkpoint_files(self) -> dict[str, Any]:
        """This rank's files of a checkpoint: its own state; on rank 0 also the model and the shared state. The
        rank file is made of copies already (the communicator's state_dict copies its residuals to host memory,
        the generators' states are new tensors): a background write need not snapshot it again."""
        comm = self.comm.state_dict()  # once: the residuals are copied to host memory here, and only here
        files: dict[str, Any] = {rank_file(self.topo.rank): {
            "rank": self.topo.rank, "world_size": self.topo.world_size, "comm": comm,
            "rng": rng_state(self.topo.device)}}
        if self.topo.is_main:
            files[MODEL] = self.model.state_dict()
            files[SHARED] = self.shared_state(comm)
        return files

    def maybe_resume(self) -> str | None:
        """When resuming (train.resume): the newest checkpoint whose manifest and files verify on every rank.
        Each rank checks and reads only the model, the shared state and its own rank file; a checkpoint one
        rank finds torn is skipped by all of them."""
        if not self.train_cfg.should_resume():
            return None
        folder = self.writer.folder
        names = [d.name for d in step_dirs(folder)] if self.topo.is_main else None
        if self.topo.distributed:  # the same candidates on every rank, even if a listing races a writer
            names = self.topo.world.broadcast_object(names, src=0)
        for name in names:
            ckpt_dir = folder / name
            problem, manifest = "", None
            try:
                manifest = read_manifest(ckpt_dir)
                mine = [MODEL, SHARED] + ([rank_file(self.topo.rank)] if self.topo.rank < manifest["world_size"]
                                          else [])
                verify_files(ckpt_dir, manifest, mine)
            except CorruptCheckpointError as e:
                problem = str(e)
            problems = self.topo.world.gather_object(problem) if self.topo.distributed else [problem]
            problem = next((p for p in problems if p), "") if self.topo.is_main else None
            if self.topo.distributed:
                problem = self.topo.world.broadcast_object(problem, src=0)
            if problem:
                if self.topo.is_main:
                    warnings.warn(f"skipping checkpoint: {problem}", stacklevel=2)
                    print(f"skipping checkpoint: {problem}", flush=True)
                continue
            self.load_checkpoint(ckpt_dir, manifest)
            return str(ckpt_dir)
        return None

    def load_checkpoint(self, ckpt_dir: Path, manifest: dict) -> None:
        """Restore a verified checkpoint on this rank. On another world size than the one that wrote it, the
        model, optimizer, loss scaler and position (`replan_position`) are restored, the communicator's per-rank
        tensors (error-feedback residuals) are dropped, and ranks without a saved state seed their generators
        from train.seed; rank 0 warns saying exactly that. On the same world size under another communicator
        layout (`comm_layout`: ranks per node, communicator, buckets) only the residuals are dropped, with a
        warning."""
        self.model.load_state_dict(load_file(ckpt_dir, MODEL, verify=False))
        shared = load_file(ckpt_dir, SHARED, verify=False)
        if shared.get("choices") is not None:  # the interrupted run's choices: it trains on as it would have
            self.decision = Decision(shared["choices"], "checkpoint")
        self.settle_choices()  # before the loss scaler's state: fp16 or not decides which scaler loads it
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scaler.load_state_dict(shared["scaler"])
        self.task.load_state_dict(shared["task"])
        t = shared["trainer"]
        self.epoch, self.step_in_epoch, self.step = t["epoch"], t["step_in_epoch"], t["step"]
        self.elapsed_s, self.history, self.time_to_target_s = t["elapsed_s"], t["history"], t["time_to_target_s"]
        self.skipped_steps = t["skipped_steps"]
        saved_world, rank = manifest["world_size"], self.topo.rank
        mine = load_file(ckpt_dir, rank_file(rank), verify=False) if rank < saved_world else None
        layout_then, layout = shared.get("comm_layout"), self.comm_layout()
        if saved_world == self.topo.world_size and layout_then == layout:
            self.comm.load_state_dict(mine["comm"])
            set_rng_state(mine["rng"], self.topo.device)
            return
        fresh = self.comm.state_dict()  # the residuals follow the ranks and buckets that wrote them: zero ones
        fresh.update(shared["comm_shared"])
        self.comm.load_state_dict(fresh)
        if mine is not None:
            set_rng_state(mine["rng"], self.topo.device)
        else:
            seed_rank(self.train_cfg.seed, rank, self.step)
        if saved_world == self.topo.world_size:
            if self.topo.is_main:
                self.warn_layout_changed(ckpt_dir, manifest, shared, layout_then, layout)
            return
        position = self.replan_position(t)
        if self.topo.is_main:
            self.warn_world_size_changed(ckpt_dir, manifest, shared, position)

    def comm_layout(self) -> dict[str, Any]:
        """What the communicator's per-rank state is laid out by: ranks per node (a hierarchical shard per local
        rank), the communicator's class and its buckets (sizes, in order). Residuals saved under another layout
        do not fit and are dropped at resume."""
        buckets = [bucket.numel for bucket in getattr(self.comm, "buckets", [])]
        return {"ranks_per_node": self.topo.ranks_per_node, "comm": type(self.comm).__name__,
                "buckets": hashlib.sha256(json.dumps(buckets).encode()).hexdigest()[:16]}

    def dropped_comm_state(self, manifest: dict, shared: dict) -> str:
        """The warning's words for the communicator's per-rank state dropped at resume."""
        saved = manifest["world_size"]
        rank_bytes = sum(manifest["files"][rank_file(r)]["bytes"] for r in range(saved))
        dropped = shared["comm_per_rank"]
        return (f"dropped the communicator's per-rank state {dropped} (error-feedback residuals) of all {saved} "
                f"ranks ({rank_bytes / 1e6:.2f} MB of rank files): every rank starts with zero residuals"
                if dropped else "the communicator had no per-rank tensors to drop")

    def warn_layout_changed(self, ckpt_dir: Path, manifest: dict, shared: dict, then: dict | None,
                            now: dict) -> None:
        """Rank 0's account of a resume on the same number of ranks under another communicator layout."""
        then = then or {}
        changed = ", ".join(f"{key} {then.get(key, 'unrecorded')} -> {now[key]}" for key in now
                            if then.get(key) != now[key])
        warnings.warn(f"resuming {ckpt_dir} on the same {self.topo.world_size} ranks but another communicator "
                      f"layout ({changed}): model, optimizer, loss scaler, step {self.step}, data position and "
                      f"random generators restored; {self.dropped_comm_state(manifest, shared)}", stacklevel=2)

    def replan_position(self, saved: dict) -> str:
        """Where the unfinished epoch continues on another world size (from the saved loop state `saved`), said
        in words. Where the epoch has as many steps as before (the global batch is fixed in samples), the same
        samples: the same step. Where the task plans its batches per world size (token-batched translation:
        a fixed number of tokens per rank), the rest of the epoch is re-planned and continues at the same share
        of the epoch."""
        phase = self.schedule.phase(min(self.epoch, self.train_cfg.epochs - 1))
        steps, steps_then = self.steps_per_epoch(phase), saved.get("steps_per_epoch")
        if steps_then is None or steps_then == steps:
            self.step_in_epoch = saved["samples_in_epoch"] // phase.batch_size
            return (f"data position kept: sample {saved['samples_in_epoch']} of epoch {self.epoch} = step "
                    f"{self.step_in_epoch} at global batch {phase.batch_size}")
        self.step_in_epoch = min(steps, round(saved["step_in_epoch"] * steps / steps_then))
        return (f"the rest of epoch {self.epoch} is re-planned for {self.topo.world_size} ranks ({steps} steps "
                f"instead of {steps_then}): it continues at step {self.step_in_epoch} (step "
                f"{saved['step_in_epoch']} before, the same share of the epoch), so in this epoch some pairs may be "
                "trained twice and some skipped")

    def warn_world_size_changed(self, ckpt_dir: Path, manifest: dict, shared: dict, position: str) -> None:
        """Rank 0's account of a resume on another number of ranks: what was kept, dropped and re-seeded."""
        saved, world = manifest["world_size"], self.topo.world_size
        comm = self.dropped_comm_state(manifest, shared)
        rng = (f"{ranks(saved, world - 1)} seeded random generators from train.seed, {ranks(0, saved - 1)} "
               "restored theirs" if world > saved else f"{ranks(0, world - 1)} restored their random generators")
        warnings.warn(f"resuming {ckpt_dir}, written by {saved} ranks, on {world} ranks: model, optimizer, loss "
                      f"scaler and step {self.step} restored; {comm}; {rng}; {position}", stacklevel=2)

    def should_checkpoint_step(self) -> bool:
        """Every train.checkpoint_every_steps optimizer steps (never when 0)."""
        every = self.train_cfg.checkpoint_every_steps
        return bool(every) and self.step % every == 0

    def should_checkpoint_epoch(self, last: bool) -> bool:
        """After `self.epoch` was advanced: every checkpoint_every_epochs, and at the end if any are written."""
        every, every_steps = self.train_cfg.checkpoint_every_epochs, self.train_cfg.checkpoint_every_steps
        return (bool(every) and self.epoch % every == 0) or (last and bool(every or every_steps))

    def checkpoint(self, background: bool | None = None) -> None:
        """Collective: every rank writes its own files of the checkpoint, then rank 0 the manifest; if any rank
        cannot (a full disk), all ranks stop together with the previous checkpoints intact (and the failed
        folder removed). In the background (train.checkpoint_in_background, unless `background` says
        otherwise) each rank snapshots its state to host memory and a thread writes it; rank 0's thread writes
        the manifest once every rank's record is there. The seconds on the training thread are counted in
        `time/checkpoint_s` (inside the time-to-accuracy clock)."""
        start = time.perf_counter()
        background = self.train_cfg.checkpoint_in_background if background is None else background
        self.elapsed_s = start - self._clock
        # The previous background write is complete everywhere (rank 0's manifest and pruning included) before
        # any rank starts the next one: pruning never meets a folder being written.
        self.wait_for_checkpoints()
        broadcast_module(self.model, self.topo, buffers_only=True)
        self.checkpoints_started += 1
        token = f"{self.token}-{self.checkpoints_started}"  # a rewrite of the same step is a new attempt
        # Any failure (a full disk, a pickling error, MemoryError) is passed to every rank: raised on this one
        # alone, it would leave the others waiting in their next collective.
        error, ckpt_dir = "", self.writer.folder / step_dir_name(self.step)
        if background:
            try:  # the snapshot to host memory, here; the write's own failures come from wait_for_checkpoints
                self.writer.write_in_background(self.step, self.checkpoint_files(), token,
                                                copied=(rank_file(self.topo.rank),))
            except Exception as e:  # noqa: BLE001
                error = describe_error(e)
            self.raise_if_checkpoint_failed(error)
        else:
            try:
                self.writer.write(self.step, self.checkpoint_files(), token)
            except Exception as e:  # noqa: BLE001
                error = describe_error(e)
            self.raise_if_checkpoint_failed(error, ckpt_dir)
            if self.topo.is_main:
                try:
                    self.writer.finish(self.step, token)
                except Exception as e:  # noqa: BLE001
                    error = describe_error(e)
            self.raise_if_checkpoint_failed(error, ckpt_dir)
        self.last_checkpoint_step = self.step
        self.checkpoint_s += time.perf_counter() - start

    def wait_for_checkpoints(self) -> None:
        """Collective: wait for a background checkpoint write; all ranks stop together if one failed."""
        error = ""
        try:
            self.writer.wait()
        except CheckpointWriteError as e:
            error = str(e)
        self.raise_if_checkpoint_failed(error)

    def raise_if_checkpoint_failed(self, error: str, ckpt_dir: Path | None = None) -> None:
        """Collective: stop every rank if any rank's `error` is set (the others would otherwise wait in the
        next collective); rank 0 first removes the unfinished `ckpt_dir`, whose writers are all done."""
        (failed,) = all_reduce_sum([1.0 if error else 0.0], self.topo)
        if not failed:
            return
        if ckpt_dir is not None and self.topo.is_main:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        raise CheckpointWriteError(f"step {self.step}: {error}; stopping (free space, or point log.dir elsewhere, "
                                   "then resume)" if error else
                                   f"step {self.step}: {int(failed)} rank(s) could not write their part of the "
                                   "checkpoint (their errors say why); stopping with the previous checkpoints intact")

    # ------------------------------------------------------------ preemption

    def install_preemption_handlers(self) -> Callable[[], None]:
        """Catch SIGTERM and SIGUSR1 (on the main thread): the handler only records the signal, the loop acts at
        the next step end. Returns what restores the previous handlers. A process forked from this one (a
        DataLoader worker) inherits the handler; there it does nothing (the worker ignores the signal and
        ends with its loader), so that no worker arms a grace timer of its own."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        self._handler_pid = os.getpid()
        previous = {sig: signal.signal(sig, self.on_preemption_signal) for sig in PREEMPT_SIGNALS}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]  # type: ignore[func-returns-value]

    def on_preemption_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._handler_pid or self.preempt_signal is not None:
            return
        self.preempt_signal = signum
        self.arm_watchdog()

    def arm_watchdog(self) -> None:
        """Past train.preempt_grace_s from now, leave with the restartable status even without a checkpoint
        (before the platform's SIGKILL, so that the launcher still sees a restartable exit)."""
        if self.watchdog is not None:
            return
        self.watchdog = threading.Timer(self.train_cfg.preempt_grace_s, self.exit_after_grace)
        self.watchdog.daemon = True
        self.watchdog.start()

    def cancel_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()

    def exit_after_grace(self) -> None:
        what = (f"{signal.Signals(self.preempt_signal).name} received" if self.preempt_signal is not None else
                "the ranks agreed a stop signal reached one of them")
        print(f"rank {self.topo.rank}: {what} {self.train_cfg.preempt_grace_s:g} s ago and no checkpoint written "
              f"since (train.preempt_grace_s); exiting with status {PREEMPTED_EXIT_CODE} without one",
              file=sys.stderr, flush=True)
        os._exit(PREEMPTED_EXIT_CODE)

    def preemption_agreed(self) -> bool:
        """Collective every train.preempt_check_every_steps steps: whether any rank was signalled. Once they
        agree, every rank has a grace timer (the signalled ones since the signal, the others from now), so a
        rank stuck in the stop's checkpoint exits with the restartable status too."""
        if self.step % self.train_cfg.preempt_check_every_steps:
            return False
        if not self.topo.distributed:
            return self.preempt_signal is not None
        (signalled,) = all_reduce_sum([0.0 if self.preempt_signal is None else 1.0], self.topo)
        self.preempted_ranks = int(signalled)
        if signalled > 0:
            self.arm_watchdog()
        return signalled > 0

    def stop_for_preemption(self, bar: Any) -> None:
        """Collective: write a checkpoint now (unless this step's was just written), then leave every rank with
        the restartable status."""
        start = time.perf_counter()
        if self.last_checkpoint_step != self.step:
            self.checkpoint(background=False)
        else:
            self.wait_for_checkpoints()
        bar.close()
        self.cancel_watchdog()  # the checkpoint is complete: leave through the normal exit path
        if self.topo.is_main:
            print(f"preempted: a stop signal (SIGTERM/SIGUSR1) reached {max(1, self.preempted_ranks)} rank(s); "
                  f"checkpoint of step {self.step} complete in {time.perf_counter() - start:.1f} s; exiting with "
                  f"status {PREEMPTED_EXIT_CODE} (restartable: resume continues from it)", flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    # ------------------------------------------------------------ measured choices

    def settle_choices(self) -> None:
        """Collective, before the clock: the choices left at auto measured on this run, or read from this
        machine's cache, or (on a resume) the checkpoint's (`trainer/run_choices.settle`); then applied."""
        if self.decision is None:
            # cuDNN's autotuning as training will have it (run_epoch sets it per phase), so that the candidates'
            # convolutions are the ones they would train with
            torch.backends.cudnn.benchmark = not self.train_cfg.deterministic
        last = self.train_cfg.epochs - 1
        phases = [(p, self.steps_per_epoch(p) * (p.end_epoch - p.start_epoch),
                   sum(1 for e in range(p.start_epoch, p.end_epoch)
                       if e == last or (e + 1) % self.train_cfg.eval_every_epochs == 0)) for p in self.phases]
        folder = cache_folder(self.train_cfg.choices_cache)
        self.decision, _ = settle(
            self.decision, self.amp_candidates, phases,
            RunStep(self.task, self.comm, self.optimizer, self.topo.device, self.measuring_exchange()),
            self.topo, ChoiceCache(folder) if folder else None, self.train_cfg.calibration_rounds,
            self.train_cfg.calibration_budget)
        choice = self.decision.choice
        self.amp_dtype = AMP_DTYPES[choice["amp"]]
        self.scaler = build_grad_scaler(self.train_cfg.loss_scale, self.amp_dtype, self.topo.device)
        if "selection" in choice:
            self.comm.use_selection(choice["selection"])
        if "workers" in choice:
            self.task.use_workers(choice["workers"])

    def measuring_exchange(self) -> Communicator | None:
        """A dense communicator for the measurement's steps (detached at once: the measurement hooks it in)."""
        if not self.topo.distributed:
            return None
        exchange = build_communicator(CommConfig(kind="dense"), self.model, self.topo)
        exchange.detach()
        return exchange

    def record_choices(self) -> None:
        """Rank 0: the decision printed, logged at the current step and written to log.dir/env.json."""
        if self.topo.is_main and self.decision is not None:
            print(self.decision.describe(), flush=True)
            self.metrics.log("choices", self.step, self.decision.metrics())
            add_to_run_record(Path(self.log_cfg.dir), "choices", self.decision.to_dict())

    # ------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's autocast (train.amp) on this rank's device."""
        return autocast(self.topo.device, self.amp_dtype)

    def steps_per_epoch(self, phase: Phase) -> int:
        """The task's steps per epoch of `phase`, capped by train.max_steps_per_epoch."""
        steps = self.task.steps_per_epoch(phase)
        return min(steps, self.train_cfg.max_steps_per_epoch) if self.train_cfg.max_steps_per_epoch else steps

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler only around a fused step
        self._stepped = found_inf is None or not bool(found_inf.item())

    def train_step(self, batch: Any) -> tuple[torch.Tensor, int, dict[str, float]]:
        """Forward, backward (buckets launch from hooks), wait for the gradient exchange, optimizer step;
        (the loss, this rank's units, the communicator's stats)."""
        self.model.train()
        with self.autocast():
            loss, units = self.task.loss(batch)
        self.backward(loss)
        comm_stats = self.comm.finish()
        once = self.comm.pop_records()
        if once:  # e.g. the auto communicator's calibration, read back by `scripts/plan.py --from-run`
            self.metrics.log("comm", self.step + 1, {f"comm/{k}": v for k, v in once.items()})
        self.optimizer_step(loss)
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.maybe_check(self.model, self.step + 1)
        return loss.detach(), units, comm_stats

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled) loss. With a loss scaler the communicator gets the step's scale as a device
        tensor first: its error feedback keeps residuals unscaled."""
        if self.scaler.is_enabled():
            self.comm.set_grad_scale(self.scaler.scale(torch.ones((), device=self.topo.device)))
        self.scaler.scale(loss).backward()

    def optimizer_step(self, loss: torch.Tensor) -> None:
        """With a loss scaler: the step, unless the gradients hold inf/NaN; a skipped step is rolled back in the
        communicator too, and counted. Without one: a non-finite gradient stops the run before the step."""
        if not self.scaler.is_enabled():
            self.check_finite(loss)
            self.optimizer.step()
            return
        self._stepped = False
        self.scaler.step(self.optimizer)  # skipped when the gradients hold inf/NaN
        self.scaler.update()
        if not self._stepped:
            self.comm.rollback()
        self.count_skip(not self._stepped)

    def check_finite(self, loss: torch.Tensor) -> None:
        """Stop before a non-finite update: one host sync. The gradients are averaged (equal on every rank; a
        rank's NaN reaches all of them), so every rank stops at the same step. A plain sum finds any inf or NaN
        (they propagate through it) in one vectorized pass, cheaper than a max-abs norm."""
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
        """Count a step the loss scaler skipped; too many in a row (train.max_skipped_steps) stop the run."""
        if not skipped:
            self.skipped_in_a_row = 0
            return
        self.skipped_steps, self.skipped_in_a_row = self.skipped_steps + 1, self.skipped_in_a_row + 1
        if self.topo.is_main:
            tqdm.write(f"step {self.step + 1}: non-finite gradients, step skipped (loss scale now "
                       f"{self.scaler.get_scale():g}; {self.skipped_steps} skipped so far)")
        if self.skipped_in_a_row >= self.train_cfg.max_skipped_steps:
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
        """Train to the end (or to the target); returns the run summary. A stop signal (SIGTERM, SIGUSR1)
        during training ends it with a checkpoint and SystemExit(PREEMPTED_EXIT_CODE)."""
        token = uuid.uuid4().hex
        self.token = self.topo.world.broadcast_object(token, src=0) if self.topo.distributed else token
        resumed_from = self.maybe_resume()
        if resumed_from is None:
            broadcast_module(self.model, self.topo)
            self.settle_choices()
        self.record_choices()
        self.print_plan(resumed_from)
        untrained = self.test("untrained") if resumed_from is None else {}
        restore_handlers = self.install_preemption_handlers()
        try:
            bar = self.progress_bar()
            self._clock = time.perf_counter() - self.elapsed_s
            stop = self.time_to_target_s is not None and self.train_cfg.stop_at_target
            while self.epoch < self.train_cfg.epochs and not stop:
                stop = self.run_epoch(self.schedule.phase(self.epoch), bar)
            bar.close()
            self.wait_for_checkpoints()
        finally:
            # Training is over (its last checkpoint complete): a signal from here on is the platform's to act
            # on, and no grace timer outlives the loop.
            self.cancel_watchdog()
            restore_handlers()
        return self.finish_summary(untrained, self.test("trained"))

    def run_epoch(self, phase: Phase, bar: tqdm | ProgressLines) -> bool:
        """Train the epoch, evaluate and checkpoint when due, log it; whether the run stops at its target."""
        # A phase has one image size: let cuDNN pick the fastest convolution algorithms for it (unless
        # deterministic kernels were asked for).
        torch.backends.cudnn.benchmark = not self.train_cfg.deterministic
        epoch_start = time.perf_counter()
        record = {"epoch": self.epoch, **self.train_epoch(phase, bar)}
        self.guard.check(self.model, self.step)  # evaluation and checkpoints assume equal replicas
        last = self.epoch + 1 == self.train_cfg.epochs
        stop = False
        if self.should_evaluate(last):
            record.update(self.evaluate(phase))
            stop = self.check_target(record)
            bar.set_postfix(epoch=self.epoch, **{k[5:]: f"{v:.4f}" for k, v in record.items()
                                                 if k.startswith("eval/") and k != "eval/loss"})
        self.log_epoch(record, epoch_start)
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if self.should_checkpoint_epoch(last or stop):
            self.checkpoint()
        return stop

    def train_epoch(self, phase: Phase, bar: tqdm | ProgressLines) -> dict[str, float]:
        """The rest of the epoch: from `self.step_in_epoch` (0, or where a mid-epoch checkpoint was taken)."""
        steps, first = self.steps_per_epoch(phase), self.step_in_epoch
        epoch, window, done = Meter(), Meter(), 0
        loss_sum = torch.zeros((), device=self.topo.device)  # summed on the device: no per-step host sync
        batches = self.task.train_batches(phase, self.epoch, first) if first < steps else iter(())
        for i in range(first, steps):
            batch, waited_s = timed_next(batches)
            if batch is None:
                break
            lr, momentum = self.apply_schedule(self.epoch + i / steps, phase)
            loss, units, comm_stats = self.train_step(batch)
            loss_sum += loss.float()
            self.step, self.step_in_epoch, done = self.step + 1, i + 1, done + 1
            epoch.add(units, waited_s)
            window.add(units, waited_s)
            bar.update(1)
            if self.should_log():
                self.log_step(self.epoch + i / steps, loss, lr, momentum, comm_stats, window, bar)
                window = Meter()
            if self.should_checkpoint_step():
                self.checkpoint()
            if self.preemption_agreed():
                self.stop_for_preemption(bar)
        if hasattr(batches, "close"):
            batches.close()  # let the task's generator release its loader state now
        seconds = time.perf_counter() - epoch.start
        (units,) = all_reduce_sum([epoch.units], self.topo)
        return {"loss/train_epoch": float(loss_sum) / max(1, done), f"time/{self.task.unit}_per_s_epoch":
                units / seconds, "time/data_share": epoch.data_s / seconds}

    def apply_schedule(self, epoch: float, phase: Phase) -> tuple[float, float | None]:
        """Set the scheduled lr and momentum for the step at fractional `epoch`; returns both."""
        lr = self.schedule.lr(epoch, phase)
        momentum = self.schedule.momentum(lr)
        set_lr_momentum(self.optimizer, lr, momentum)
        return lr, momentum

    def check_target(self, record: dict[str, float]) -> bool:
        """Collective: whether the evaluation in `record` meets the task's target (rank 0 decides; the first
        time stops the clock); True when the run should stop there (train.stop_at_target)."""
        reached = broadcast_flag(self.task.target_reached(record), self.topo)
        if reached and self.time_to_target_s is None:
            self.time_to_target_s = time.perf_counter() - self._clock
        return reached and self.train_cfg.stop_at_target

    def test(self, when: str) -> dict[str, float]:
        """Collective: the task's held-out test scores (`when`: untrained or trained), logged as
        eval/test_<name>_<when>; outside the clock."""
        with torch.no_grad(), self.autocast():
            scores = self.task.test()
        if scores:
            self.metrics.log("test", self.step, {f"eval/test_{name}_{when}": v for name, v in scores.items()})
        return scores

    def should_evaluate(self, last: bool) -> bool:
        return last or (self.epoch + 1) % self.train_cfg.eval_every_epochs == 0

    def should_log(self) -> bool:
        return self.step % self.log_cfg.every_steps == 0

    # ------------------------------------------------------------ logging

    def log_step(self, epoch: float, loss: torch.Tensor, lr: float, momentum: float | None,
                 comm_stats: dict[str, float], window: Meter, bar: tqdm | ProgressLines) -> None:
        """The step record: loss, schedule, throughput and data wait over the window, comm and optimizer stats."""
        value = float(loss)
        (units,) = all_reduce_sum([window.units], self.topo)  # every rank's, not ours times W
        self.metrics.log("step", self.step, {
            "epoch": epoch, "loss/train": value, "schedule/lr": lr,
            **({} if momentum is None else {"schedule/momentum": momentum}),
            f"time/{self.task.unit}_per_s": units / (time.perf_counter() - window.start),
            "time/data_wait_s": window.data_s / max(1, window.steps), "train/skipped_steps": self.skipped_steps,
            **{f"comm/{k}": v for k, v in comm_stats.items()}, **self.optimizer_metrics()})
        bar.set_postfix(epoch=self.epoch, loss=f"{value:.3f}", lr=f"{lr:.3g}")

    def log_epoch(self, record: dict[str, float], epoch_start: float) -> None:
        """The epoch record, with times and the task's counters; evaluations also go into the history."""
        self.elapsed_s = time.perf_counter() - self._clock
        record.update({"time/epoch_s": time.perf_counter() - epoch_start, "time/elapsed_s": self.elapsed_s,
                       "time/checkpoint_s": self.checkpoint_s, "train/skipped_steps": self.skipped_steps})
        record.update(self.task.stats())  # e.g. cache hits/misses per level, skipped images (this rank)
        if any(k.startswith("eval/") for k in record):
            self.history.append({k: v for k, v in record.items()
                                 if k in ("epoch", "time/elapsed_s") or k.startswith("eval/")})
        self.metrics.log("epoch", self.step, record)

    def optimizer_metrics(self) -> dict[str, float]:
        """The optimizer's own per-step scalars (e.g. FusedLARS's clipped trust ratios), read on log steps."""
        read = getattr(self.optimizer, "step_metrics", None)
        return {name: float(value) for name, value in read().items()} if read is not None else {}

    def progress_bar(self) -> tqdm | ProgressLines:
        """Steps over the whole run on rank 0 (log.progress), starting where a resumed run left off: a tqdm bar
        on a terminal; in a log file (stderr not a terminal: Slurm, nohup, CI) a plain line on stderr every
        log.every_steps steps instead of a bar redrawn into the file."""
        steps = [self.steps_per_epoch(self.schedule.phase(e)) for e in range(self.train_cfg.epochs)]
        total = sum(steps)
        done = min(total, sum(steps[:self.epoch]) + self.step_in_epoch)
        show = self.topo.is_main and self.log_cfg.progress
        if show and not sys.stderr.isatty():
            return ProgressLines(total, done, self.log_cfg.every_steps)
        return tqdm(total=total, initial=done, unit="step", dynamic_ncols=True, disable=not show)

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
        print("  " + self.schedule.describe(lambda e: self.steps_per_epoch(self.schedule.phase(e))))
        if resumed_from:
            print(f"resumed from {resumed_from} at epoch {self.epoch}, step {self.step}")

    def finish_summary(self, untrained: dict[str, float], trained: dict[str, float]) -> dict[str, Any]:
        """The run's summary: `final` is the last evaluation, `final_<name>`/`target_<name>` per task target,
        `test_<name>` and `test_<name>_untrained` per held-out test score (None where not scored)."""
        final = self.history[-1] if self.history else {}
        summary = {"epochs_run": self.epoch, "steps": self.step, "elapsed_s": self.elapsed_s,
                   "time_to_target_s": self.time_to_target_s,
                   **{f"target_{name}": value for name, value in self.task.targets.items()},
                   **{f"final_{name}": final.get(f"eval/{name}") for name in self.task.targets},
                   "final": final, "skipped_steps": self.skipped_steps, "checkpoint_s": self.checkpoint_s,
                   "world_size": self.topo.world_size, "history": self.history,
                   "choices": None if self.decision is None else self.decision.to_dict(),
                   **{f"test_{name}_untrained": untrained.get(name) for name in trained},
                   **{f"test_{name}": value for name, value in trained.items()}}
        self.metrics.summary(summary)
        return summary
