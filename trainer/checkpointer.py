"""The run's checkpoints: when to write one, what goes into it, and the resume from the newest valid one.

`Checkpointer.save` writes a checkpoint together on every rank (each rank its own state: RNG, communicator
residuals; rank 0 the model and the shared state, with the position inside the epoch), in the foreground or on
a background thread. `Checkpointer.load_latest` restores the newest one that verifies on every rank (torchrun's
restarts resume on their own: train.resume auto), also on another number of ranks or communicator layout (what
cannot follow is dropped, with a warning); with train.deterministic a resumed run ends bitwise equal to an
uninterrupted one. The files themselves are trainer/checkpoint.py's; layout and guarantees: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer.checkpoint import (MODEL, SHARED, CheckpointWriter, CheckpointWriteError, CorruptCheckpointError,
                                load_file, rank_file, read_manifest, step_dir_name, step_dirs, verify_files)
from trainer.choices import Decision
from trainer.comm import Communicator
from trainer.dist import Topology, all_reduce_sum, broadcast_module
from trainer.rng import rng_state, seed_rank, set_rng_state
from trainer.run_choices import NOT_CHECKPOINTED
from trainer.schedules import Phase, Schedule
from trainer.task import Task
from trainer.train_config import TrainConfig


class Checkpointed(Protocol):
    """What a checkpoint holds besides this rank's RNG: the Trainer's components and its loop state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    task: Task
    comm: Communicator
    decision: Decision | None
    schedule: Schedule
    epoch: int
    step_in_epoch: int
    step: int

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def settle_choices(self) -> None: ...
    def steps_per_epoch(self, phase: Phase) -> int: ...


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


class Checkpointer:
    """Checkpoints of `run` in `folder` (log.dir/checkpoints) as train.* says (`cfg`); `config` is the run's
    resolved root config, stored in every checkpoint."""

    def __init__(self, cfg: TrainConfig, folder: Path, topo: Topology, run: Checkpointed,
                 config: dict[str, Any]) -> None:
        self.cfg, self.topo, self.run, self.config = cfg, topo, run, config
        self.writer = CheckpointWriter(folder, topo.rank, topo.world_size, cfg.keep_checkpoints)
        self.token = ""
        """This attempt's mark on its checkpoint records (set by `load_latest`, equal on every rank)."""
        self.last_step = -1
        """The step of the newest checkpoint this attempt started (-1: none)."""
        self.started = 0
        """Checkpoints this attempt started (each write's token ends with its number)."""
        self.seconds = 0.0
        """Seconds the training thread spent on checkpoints (time/checkpoint_s)."""
        self.write_s: float | None = None
        """Seconds this rank's newest complete checkpoint write took (a foreground one; a background one's
        snapshot and thread), None before any: what a stop's checkpoint is expected to take
        (trainer/preemption.py)."""
        self._snapshot_s = 0.0  # the newest background write's snapshot, on the training thread

    # ------------------------------------------------------------ when

    def should_save_step(self, step: int) -> bool:
        """Every train.checkpoint_every_steps optimizer steps (never when 0)."""
        every = self.cfg.checkpoint_every_steps
        return bool(every) and step % every == 0

    def should_save_epoch(self, epoch: int, last: bool) -> bool:
        """After epoch `epoch` - 1 ended: every checkpoint_every_epochs, and at the end if any are written."""
        every, every_steps = self.cfg.checkpoint_every_epochs, self.cfg.checkpoint_every_steps
        return (bool(every) and epoch % every == 0) or (last and bool(every or every_steps))

    # ------------------------------------------------------------ save

    def shared_state(self, comm: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's part of a checkpoint besides the model: what is equal on every rank (the optimizer's state,
        from averaged gradients), the loop's position (the run's `state_dict`), and the plain entries of the
        communicator's state `comm` (its tensors are per rank)."""
        run = self.run
        return {"optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
                "task": run.task.state_dict(), "trainer": run.state_dict(),
                "comm_shared": {k: v for k, v in comm.items() if not holds_tensors(v)},
                "comm_per_rank": sorted(k for k, v in comm.items() if holds_tensors(v)),
                "comm_layout": self.comm_layout(),
                "choices": None if run.decision is None else {k: v for k, v in run.decision.choice.items()
                                                               if k not in NOT_CHECKPOINTED},
                "config": self.config}

    def files(self) -> dict[str, Any]:
        """This rank's files of a checkpoint: its own state; on rank 0 also the model and the shared state. The
        rank file is made of copies already (the communicator's state_dict copies its residuals to host memory,
        the generators' states are new tensors): a background write need not snapshot it again."""
        comm = self.run.comm.state_dict()  # once: the residuals are copied to host memory here, and only here
        files: dict[str, Any] = {rank_file(self.topo.rank): {
            "rank": self.topo.rank, "world_size": self.topo.world_size, "comm": comm,
            "rng": rng_state(self.topo.device)}}
        if self.topo.is_main:
            files[MODEL] = self.run.model.state_dict()
            files[SHARED] = self.shared_state(comm)
        return files

    def save(self, background: bool | None = None) -> None:
        """Collective: every rank writes its own files of the checkpoint, then rank 0 the manifest; if any rank
        cannot (a full disk), all ranks stop together with the previous checkpoints intact (and the failed
        folder removed). In the background (train.checkpoint_in_background, unless `background` says
        otherwise) each rank snapshots its state to host memory and a thread writes it; rank 0's thread writes
        the manifest once every rank's record is there. The seconds on the training thread are counted in
        `seconds` (inside the time-to-accuracy clock)."""
        start, step = time.perf_counter(), self.run.step
        background = self.cfg.checkpoint_in_background if background is None else background
        # The previous background write is complete everywhere (rank 0's manifest and pruning included) before
        # any rank starts the next one: pruning never meets a folder being written.
        self.wait()
        if not self.run.comm.periodic:  # a periodic kind averages them at its rounds' ends and keeps its own mid-round
            broadcast_module(self.run.model, self.topo, buffers_only=True)
        self.started += 1
        token = f"{self.token}-{self.started}"  # a rewrite of the same step is a new attempt
        # Any failure (a full disk, a pickling error, MemoryError) is passed to every rank: raised on this one
        # alone, it would leave the others waiting in their next collective.
        error, ckpt_dir = "", self.writer.folder / step_dir_name(step)
        if background:
            snapshot_start = time.perf_counter()
            try:  # the snapshot to host memory, here; the write's own failures come from `wait`
                self.writer.write_in_background(step, self.files(), token, copied=(rank_file(self.topo.rank),))
                self._snapshot_s = time.perf_counter() - snapshot_start
            except Exception as e:  # noqa: BLE001
                error = describe_error(e)
            self.raise_if_failed(error)
        else:
            write_start = time.perf_counter()
            try:
                self.writer.write(step, self.files(), token)
            except Exception as e:  # noqa: BLE001
                error = describe_error(e)
            self.raise_if_failed(error, ckpt_dir)
            if self.topo.is_main:
                try:
                    self.writer.finish(step, token)
                except Exception as e:  # noqa: BLE001
                    error = describe_error(e)
            self.raise_if_failed(error, ckpt_dir)
            self.write_s = time.perf_counter() - write_start
        self.last_step = step
        self.seconds += time.perf_counter() - start

    def wait(self) -> None:
        """Collective: wait for a background checkpoint write; all ranks stop together if one failed, rank 0
        removing the unfinished folder. First every rank's own part, then rank 0's manifest: a rank that cannot
        write (a full disk) cannot record that either, and rank 0 must not wait for its record."""
        step = self.writer.pending_step
        if step is None:  # the same on every rank: background writes start and end together
            return
        ckpt_dir, error = self.writer.folder / step_dir_name(step), ""
        try:
            self.writer.wait_written()
        except CheckpointWriteError as e:
            error = str(e)
        failed = self.any_failed(error)
        if failed:
            self.writer.abort()
            self.raise_if_failed(error, ckpt_dir, step, failed)
        try:
            seconds = self.writer.wait()  # rank 0: the manifest and pruning; the others' threads are done
            self.write_s = self._snapshot_s + seconds if seconds is not None else self.write_s
        except CheckpointWriteError as e:
            error = str(e)
        self.raise_if_failed(error, ckpt_dir, step)

    def any_failed(self, error: str) -> int:
        """Collective: how many ranks have an `error`."""
        (failed,) = all_reduce_sum([1.0 if error else 0.0], self.topo)
        return int(failed)

    def raise_if_failed(self, error: str, ckpt_dir: Path | None = None, step: int | None = None,
                        failed: int | None = None) -> None:
        """Collective (unless the ranks have just counted the `failed` ones): stop every rank if any rank's
        `error` is set (the others would otherwise wait in the next collective); rank 0 first removes the
        unfinished `ckpt_dir` of the checkpoint of `step` (default: this step), whose writers are all done."""
        failed = self.any_failed(error) if failed is None else failed
        if not failed:
            return
        if ckpt_dir is not None and self.topo.is_main:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        step = self.run.step if step is None else step
        raise CheckpointWriteError(f"step {step}: {error}; stopping (free space, or point log.dir elsewhere, then "
                                   "resume)" if error else
                                   f"step {step}: {failed} rank(s) could not write their part of the checkpoint "
                                   "(their errors say why); stopping with the previous checkpoints intact")

    # ------------------------------------------------------------ resume

    def load_latest(self) -> str | None:
        """Collective, once at the start of an attempt: mark the attempt (`token`), then, when resuming
        (train.resume), restore the newest checkpoint whose manifest and files verify on every rank and return
        its folder. Each rank checks and reads only the model, the shared state and its own rank file; a
        checkpoint one rank finds torn is skipped by all of them."""
        token = uuid.uuid4().hex
        self.token = self.topo.world.broadcast_object(token, src=0) if self.topo.distributed else token
        if not self.cfg.should_resume():
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
            self.load(ckpt_dir, manifest)
            return str(ckpt_dir)
        return None

    def load(self, ckpt_dir: Path, manifest: dict[str, Any]) -> None:
        """Restore a verified checkpoint on this rank. On another world size than the one that wrote it, the
        model, optimizer, loss scaler and position (`replan_position`) are restored, the
        communicator's per-rank tensors (error-feedback residuals) are dropped, and ranks without a saved state
        seed their generators from train.seed; rank 0 warns saying exactly that. On the same world size under
        another communicator layout (`comm_layout`: ranks per node, communicator, buckets) only the residuals
        are dropped, with a warning."""
        run = self.run
        run.model.load_state_dict(load_file(ckpt_dir, MODEL, verify=False))
        shared = load_file(ckpt_dir, SHARED, verify=False)
        if shared.get("choices") is not None:  # the interrupted run's choices: it trains on as it would have
            run.decision = Decision(shared["choices"], "checkpoint")
        run.settle_choices()  # before the loss scaler's state: fp16 or not decides which scaler loads it
        run.optimizer.load_state_dict(shared["optimizer"])
        run.scaler.load_state_dict(shared["scaler"])
        run.task.load_state_dict(shared["task"])
        run.load_state_dict(shared["trainer"])
        saved_world, rank = manifest["world_size"], self.topo.rank
        mine = load_file(ckpt_dir, rank_file(rank), verify=False) if rank < saved_world else None
        layout_then, layout = shared.get("comm_layout"), self.comm_layout()
        if saved_world == self.topo.world_size and layout_then == layout:
            run.comm.load_state_dict(mine["comm"])
            set_rng_state(mine["rng"], self.topo.device)
            return
        fresh = run.comm.state_dict()  # the residuals follow the ranks and buckets that wrote them: zero ones
        fresh.update(shared["comm_shared"])
        run.comm.load_state_dict(fresh)
        if mine is not None:
            set_rng_state(mine["rng"], self.topo.device)
        else:
            seed_rank(self.cfg.seed, rank, run.step)
        if saved_world == self.topo.world_size:
            if self.topo.is_main:
                self.warn_layout_changed(ckpt_dir, manifest, shared, layout_then, layout)
            return
        position = self.replan_position(shared["trainer"])
        if self.topo.is_main:
            self.warn_world_size_changed(ckpt_dir, manifest, shared, position)

    def replan_position(self, saved: dict[str, Any]) -> str:
        """Where the unfinished epoch continues on another world size (from the saved loop state `saved`), said
        in words. Where the epoch has as many steps as before (the global batch is fixed in samples), the same
        samples: the same step. Where the task plans its batches per world size (token-batched translation:
        a fixed number of tokens per rank), the rest of the epoch is re-planned and continues at the same share
        of the epoch."""
        run = self.run
        phase = run.schedule.phase(min(run.epoch, self.cfg.epochs - 1))
        steps, steps_then = run.steps_per_epoch(phase), saved.get("steps_per_epoch")
        if steps_then is None or steps_then == steps:
            run.step_in_epoch = saved["samples_in_epoch"] // phase.batch_size
            return (f"data position kept: sample {saved['samples_in_epoch']} of epoch {run.epoch} = step "
                    f"{run.step_in_epoch} at global batch {phase.batch_size}")
        run.step_in_epoch = min(steps, round(saved["step_in_epoch"] * steps / steps_then))
        return (f"the rest of epoch {run.epoch} is re-planned for {self.topo.world_size} ranks ({steps} steps "
                f"instead of {steps_then}): it continues at step {run.step_in_epoch} (step "
                f"{saved['step_in_epoch']} before, the same share of the epoch), so in this epoch some pairs may be "
                "trained twice and some skipped")

    def comm_layout(self) -> dict[str, Any]:
        """What the communicator's per-rank state is laid out by: ranks per node (a hierarchical shard per local
        rank), the communicator's class and its buckets (sizes, in order). Residuals saved under another layout
        do not fit and are dropped at resume."""
        buckets = [bucket.numel for bucket in getattr(self.run.comm, "buckets", [])]
        return {"ranks_per_node": self.topo.ranks_per_node, "comm": type(self.run.comm).__name__,
                "buckets": hashlib.sha256(json.dumps(buckets).encode()).hexdigest()[:16]}

    def dropped_comm_state(self, manifest: dict[str, Any], shared: dict[str, Any]) -> str:
        """The warning's words for the communicator's per-rank state dropped at resume."""
        saved = manifest["world_size"]
        rank_bytes = sum(manifest["files"][rank_file(r)]["bytes"] for r in range(saved))
        dropped = shared["comm_per_rank"]
        return (f"dropped the communicator's per-rank state {dropped} (error-feedback residuals) of all {saved} "
                f"ranks ({rank_bytes / 1e6:.2f} MB of rank files): every rank starts with zero residuals"
                if dropped else "the communicator had no per-rank tensors to drop")

    def warn_layout_changed(self, ckpt_dir: Path, manifest: dict[str, Any], shared: dict[str, Any],
                            then: dict[str, Any] | None, now: dict[str, Any]) -> None:
        """Rank 0's account of a resume on the same number of ranks under another communicator layout."""
        then = then or {}
        changed = ", ".join(f"{key} {then.get(key, 'unrecorded')} -> {now[key]}" for key in now
                            if then.get(key) != now[key])
        warnings.warn(f"resuming {ckpt_dir} on the same {self.topo.world_size} ranks but another communicator "
                      f"layout ({changed}): model, optimizer, loss scaler, step {self.run.step}, data position and "
                      f"random generators restored; {self.dropped_comm_state(manifest, shared)}", stacklevel=2)

    def warn_world_size_changed(self, ckpt_dir: Path, manifest: dict[str, Any], shared: dict[str, Any],
                                position: str) -> None:
        """Rank 0's account of a resume on another number of ranks: what was kept, dropped and re-seeded."""
        saved, world = manifest["world_size"], self.topo.world_size
        comm = self.dropped_comm_state(manifest, shared)
        rng = (f"{ranks(saved, world - 1)} seeded random generators from train.seed, {ranks(0, saved - 1)} "
               "restored theirs" if world > saved else f"{ranks(0, world - 1)} restored their random generators")
        warnings.warn(f"resuming {ckpt_dir}, written by {saved} ranks, on {world} ranks: model, optimizer, loss "
                      f"scaler and step {self.run.step} restored; {comm}; {rng}; {position}", stacklevel=2)
