"""The train loop: phases → epochs → steps, with evaluation, time-to-accuracy, checkpoints and metrics.

Gradients are averaged by the communicator (launched from autograd hooks during backward, waited on in
`train_step`), not by DDP, so that the sparse communicators can replace the dense one by config.
DAWNBench counts total wall-clock time, so evaluation and checkpointing are inside the clock.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from trainer.checkpoint import Checkpointer
from trainer.comm import Communicator
from trainer.config import ConfigError, require
from trainer.dist import Topology, all_reduce_sum, broadcast_flag
from trainer.metrics import LogConfig, MetricsLogger
from trainer.optim import OptimConfig, set_lr_momentum
from trainer.schedules import Phase, ScheduleConfig, get_lr, get_momentum, get_phase


@dataclass
class TrainConfig:
    epochs: int = 10
    """Training epochs (the phase table must end here)."""
    target_top1: float = 0.0
    """Time-to-accuracy target on validation top-1 (fraction, e.g. 0.95); 0 = none."""
    target_top5: float = 0.0
    """Time-to-accuracy target on validation top-5 (fraction, e.g. 0.93); 0 = none."""
    stop_at_target: bool = True
    """Stop as soon as every set target is reached (DAWNBench style)."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs (and always after the last one)."""
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    """Mixed precision: auto = fp16 with loss scaling on CUDA, off on CPU."""
    channels_last: bool = True
    """Use the channels-last memory format for the model and images."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    max_steps_per_epoch: int = 0
    """Cap on steps per epoch for debugging; 0 = the whole epoch."""
    checkpoint_every_epochs: int = 1
    """Write a checkpoint every this many epochs (and at the end); 0 = never."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool = False
    """Resume from the newest valid checkpoint in log.dir/checkpoints (also: --resume)."""
    threads: int = 0
    """torch CPU threads per rank; 0 = leave the launcher's setting (torchrun sets 1 per rank)."""

    def __post_init__(self) -> None:
        require(self.epochs > 0, f"train.epochs: must be > 0, got {self.epochs}")
        for name in ("target_top1", "target_top5"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"train.{name}: a fraction in [0, 1] (e.g. 0.93), got {value}")
        require(self.eval_every_epochs > 0, f"train.eval_every_epochs: must be > 0, got {self.eval_every_epochs}")
        require(self.max_steps_per_epoch >= 0 and self.checkpoint_every_epochs >= 0 and self.keep_checkpoints > 0,
                "train.max_steps_per_epoch and train.checkpoint_every_epochs must be >= 0, "
                "train.keep_checkpoints > 0")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full precision."""
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp: fp16 needs CUDA; use bf16 or off on the CPU")
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def broadcast_module(module: nn.Module, topo: Topology, buffers_only: bool = False) -> None:
    """Rank 0's weights (or BatchNorm statistics) on every rank."""
    if not topo.distributed:
        return
    tensors = list(module.buffers()) + ([] if buffers_only else list(module.parameters()))
    with torch.no_grad():
        for t in tensors:
            topo.world.broadcast_(t.data, src=0)


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Number of top-1 and top-5 hits (top-k capped at the number of classes)."""
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return int((top[:, 0] == labels).sum()), int((top == labels[:, None]).any(dim=1).sum())


class Trainer:
    """Runs the configured phases; all training state lives here and is checkpointable."""

    def __init__(self, train: TrainConfig, schedule: ScheduleConfig, optim: OptimConfig, log: LogConfig,
                 topo: Topology, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, comm: Communicator, data: Any, metrics: MetricsLogger,
                 run_config: dict) -> None:
        self.cfg, self.schedule, self.optim_cfg, self.log_cfg = train, schedule, optim, log
        self.topo, self.model, self.loss_fn, self.optimizer, self.comm, self.data = (
            topo, model, loss_fn, optimizer, comm, data)
        self.metrics, self.run_config = metrics, run_config
        self.phases: list[Phase] = schedule.phases
        for p in self.phases:
            require(p.batch_size % topo.world_size == 0,
                    f"schedule.phases: batch_size {p.batch_size} (global) is not divisible by the world size "
                    f"{topo.world_size}")
        self.amp_dtype = resolve_amp(train.amp, topo.device)
        self.scaler = torch.amp.GradScaler(topo.device.type, enabled=self.amp_dtype == torch.float16)
        self.checkpointer = Checkpointer(Path(log.dir) / "checkpoints", train.keep_checkpoints)
        self.memory_format = torch.channels_last if train.channels_last else torch.contiguous_format
        # State (checkpointed): next epoch, global step, wall-clock seconds so far, eval history, target time.
        self.epoch, self.step, self.elapsed_s = 0, 0, 0.0
        self.history: list[dict] = []
        self.time_to_target_s: float | None = None
        self._loader_phase: Phase | None = None
        self._loader = None

    # ------------------------------------------------------------ state

    def state_dict(self, comm_state: dict) -> dict:
        """Everything needed to resume; `comm_state` is the communicator's state of every rank
        (`Communicator.gather_state()`, a collective)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "comm": comm_state,
                "trainer": {"epoch": self.epoch, "step": self.step, "elapsed_s": self.elapsed_s,
                            "history": self.history, "time_to_target_s": self.time_to_target_s},
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                "config": self.run_config}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.comm.load_gathered_state(state["comm"])
        t = state["trainer"]
        self.epoch, self.step, self.elapsed_s = t["epoch"], t["step"], t["elapsed_s"]
        self.history, self.time_to_target_s = t["history"], t["time_to_target_s"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])

    def maybe_resume(self) -> str | None:
        """With train.resume, load the newest valid checkpoint (read by rank 0, broadcast to the others)."""
        if not self.cfg.resume:
            return None
        found = self.checkpointer.load_latest() if self.topo.is_main else None
        found = (found[0], str(found[1])) if found else None
        if self.topo.distributed:
            found = self.topo.world.broadcast_object(found, src=0)
        if found is None:
            return None
        self.load_state_dict(found[0])
        return found[1]

    def maybe_checkpoint(self, last: bool) -> None:
        every = self.cfg.checkpoint_every_epochs
        if not every or not (last or self.epoch % every == 0):
            return
        broadcast_module(self.model, self.topo, buffers_only=True)
        comm_state = self.comm.gather_state()  # every rank's error-feedback residuals, on rank 0
        if self.topo.is_main:
            self.checkpointer.save(self.state_dict(comm_state), self.step)

    # ------------------------------------------------------------ data

    def steps_per_epoch(self, phase: Phase) -> int:
        per_rank = self.data.train_size // self.topo.world_size // (phase.batch_size // self.topo.world_size)
        return min(per_rank, self.cfg.max_steps_per_epoch) if self.cfg.max_steps_per_epoch else per_rank

    def loader_for(self, phase: Phase):
        """The phase's training loader, rebuilt only when the phase changes."""
        if phase is not self._loader_phase:
            self._loader = self.data.train_loader(phase.image_size, phase.batch_size // self.topo.world_size,
                                                  phase.min_scale)
            self._loader_phase = phase
        return self._loader

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.topo.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        return images, labels.to(self.topo.device, non_blocking=True)

    # ------------------------------------------------------------ steps

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topo.device.type, dtype=self.amp_dtype)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward, backward (buckets launch from hooks), wait for the gradient exchange, optimizer step."""
        self.model.train()
        with self.autocast():
            loss = self.loss_fn(self.model(images), labels)
        self.scaler.scale(loss).backward()
        comm_stats = self.comm.finish()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), comm_stats

    @torch.no_grad()
    def evaluate(self, phase: Phase) -> dict[str, float]:
        """Top-1/top-5 and loss over the whole validation set, each image counted once across ranks."""
        broadcast_module(self.model, self.topo, buffers_only=True)  # rank 0's BatchNorm statistics everywhere
        self.model.eval()
        size = phase.val_image_size or phase.image_size
        loader = self.data.val_loader(size, max(1, phase.batch_size // self.topo.world_size))
        hits1 = hits5 = count = loss_sum = 0.0
        for images, labels in loader:
            images, labels = self.to_device(images, labels)
            with self.autocast():
                logits = self.model(images)
            loss_sum += float(nn.functional.cross_entropy(logits.float(), labels, reduction="sum"))
            h1, h5 = accuracy_counts(logits, labels)
            hits1, hits5, count = hits1 + h1, hits5 + h5, count + len(labels)
        hits1, hits5, count, loss_sum = all_reduce_sum([hits1, hits5, count, loss_sum], self.topo)
        return {"eval/top1": hits1 / count, "eval/top5": hits5 / count, "eval/loss": loss_sum / count,
                "eval/images": count}

    def target_reached(self, record: dict[str, float]) -> bool:
        if not (self.cfg.target_top1 or self.cfg.target_top5):
            return False
        return record["eval/top1"] >= self.cfg.target_top1 and record["eval/top5"] >= self.cfg.target_top5

    # ------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to the end (or to the target); returns the run summary."""
        resumed_from = self.maybe_resume()
        if resumed_from is None:
            broadcast_module(self.model, self.topo)
        self.print_plan(resumed_from)
        total_steps = sum(self.steps_per_epoch(get_phase(self.phases, e)) for e in range(self.cfg.epochs))
        done_steps = sum(self.steps_per_epoch(get_phase(self.phases, e)) for e in range(self.epoch))
        bar = tqdm(total=total_steps, initial=done_steps, disable=not (self.topo.is_main and self.log_cfg.progress),
                   unit="step", dynamic_ncols=True)
        clock = time.perf_counter() - self.elapsed_s
        stop = self.time_to_target_s is not None and self.cfg.stop_at_target
        while self.epoch < self.cfg.epochs and not stop:
            phase = get_phase(self.phases, self.epoch)
            epoch_start = time.perf_counter()
            train_record = self.train_epoch(phase, bar)
            record = {"epoch": self.epoch, "phase/image_size": phase.image_size, "phase/batch_size": phase.batch_size,
                      **train_record}
            last = self.epoch + 1 == self.cfg.epochs
            if last or (self.epoch + 1) % self.cfg.eval_every_epochs == 0:
                record.update(self.evaluate(phase))
                reached = broadcast_flag(self.target_reached(record), self.topo)
                if reached and self.time_to_target_s is None:
                    self.time_to_target_s = time.perf_counter() - clock
                stop = reached and self.cfg.stop_at_target
                bar.set_postfix(epoch=self.epoch, top1=f"{record['eval/top1']:.4f}", top5=f"{record['eval/top5']:.4f}")
            self.elapsed_s = time.perf_counter() - clock
            record.update({"time/epoch_s": time.perf_counter() - epoch_start, "time/elapsed_s": self.elapsed_s})
            record.update(self.data.stats())  # cache hits/misses/bytes per level, skipped images (this rank)
            if "eval/top1" in record:
                self.history.append({k: record[k] for k in ("epoch", "eval/top1", "eval/top5", "time/elapsed_s")})
            self.metrics.log("epoch", self.step, record)
            self.epoch += 1
            self.maybe_checkpoint(last or stop)
        bar.close()
        return self.finish_summary()

    def train_epoch(self, phase: Phase, bar: tqdm) -> dict[str, float]:
        loader = self.loader_for(phase)
        loader.set_epoch(self.epoch)
        steps = self.steps_per_epoch(phase)
        peak, total = self.optim_cfg.lr, float(self.cfg.epochs)
        images_seen, data_s, done = 0, 0.0, 0
        loss_sum = torch.zeros((), device=self.topo.device)  # summed on the device: no per-step host sync
        window_start, window_images = time.perf_counter(), 0
        epoch_start = time.perf_counter()
        batches = iter(loader)
        for i in range(steps):
            fetch = time.perf_counter()
            try:
                images, labels = next(batches)
            except StopIteration:
                break
            images, labels = self.to_device(images, labels)
            data_s += time.perf_counter() - fetch
            lr = get_lr(self.epoch + i / steps, self.schedule, peak, total) * phase.lr_scale
            momentum = get_momentum(lr, peak, self.schedule, self.optim_cfg.momentum)
            set_lr_momentum(self.optimizer, lr, momentum)
            loss, comm_stats = self.train_step(images, labels)
            loss_sum += loss.float()
            self.step, done = self.step + 1, done + 1
            images_seen += len(labels) * self.topo.world_size
            window_images += len(labels) * self.topo.world_size
            bar.update(1)
            if self.step % self.log_cfg.every_steps == 0:
                value = float(loss)
                if not np.isfinite(value):
                    raise FloatingPointError(f"non-finite training loss {value} at step {self.step} "
                                             f"(epoch {self.epoch}); stopping rather than training on NaNs")
                now = time.perf_counter()
                self.metrics.log("step", self.step, {
                    "epoch": self.epoch + i / steps, "loss/train": value, "schedule/lr": lr,
                    "schedule/momentum": momentum, "time/images_per_s": window_images / (now - window_start),
                    **{f"comm/{k}": v for k, v in comm_stats.items()}})
                bar.set_postfix(epoch=self.epoch, loss=f"{value:.3f}", lr=f"{lr:.3g}")
                window_start, window_images = now, 0
        seconds = time.perf_counter() - epoch_start
        return {"loss/train_epoch": float(loss_sum) / max(1, done), "time/images_per_s_epoch": images_seen / seconds,
                "time/data_share": data_s / seconds}

    def print_plan(self, resumed_from: str | None) -> None:
        """Derived sizes, printed once on rank 0."""
        if not self.topo.is_main:
            return
        t = self.topo
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"world {t.world_size} = {t.num_nodes} node(s) x {t.ranks_per_node} rank(s) on {t.device}; "
              f"amp {self.amp_dtype}; {n_params / 1e6:.2f} M parameters; {self.data.train_size} training images")
        for p in self.phases:
            print(f"  epochs {p.start_epoch:>3}-{p.end_epoch - 1:<3} {p.image_size:>4} px  global batch "
                  f"{p.batch_size} ({p.batch_size // t.world_size}/rank)  {self.steps_per_epoch(p)} steps/epoch")
        if resumed_from:
            print(f"resumed from {resumed_from} at epoch {self.epoch}, step {self.step}")

    def finish_summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        summary = {"epochs_run": self.epoch, "steps": self.step, "elapsed_s": self.elapsed_s,
                   "time_to_target_s": self.time_to_target_s, "target_top1": self.cfg.target_top1,
                   "target_top5": self.cfg.target_top5, "final_top1": last.get("eval/top1"),
                   "final_top5": last.get("eval/top5"), "world_size": self.topo.world_size,
                   "history": self.history}
        self.metrics.summary(summary)
        return summary
