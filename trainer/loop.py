"""The train loop: phases → epochs → steps, with evaluation, time-to-target, checkpoints and metrics.

What a step computes belongs to a `Task` (trainer/task.py); the loop owns what every recipe shares. Gradients
are averaged by the communicator (launched from autograd hooks during backward, waited on in `train_step`),
not by DDP, so that the sparse communicators can replace the dense one by config. Evaluation and checkpoints
are inside the DAWNBench clock. Non-finite gradients never reach the weights: the loss scaler skips and counts
such steps, and without one the run stops naming the step (checked before each step on the host, or flagged on
the device and read at log steps and checkpoints: trainer/nonfinite.py). Checkpoints are the `Checkpointer`'s
(trainer/checkpointer.py), stop signals the `Preemption`'s (trainer/preemption.py): docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpointer import Checkpointer
from trainer.choices import ChoiceCache, Decision, cache_folder
from trainer.comm import CommConfig, Communicator, build_communicator
from trainer.compiling import compile_candidates, eager
from trainer.config import ConfigError, to_dict
from trainer.dist import ReplicaGuard, Topology, all_reduce_sum, broadcast_flag, broadcast_module
from trainer.metrics import StepTimeSpread
from trainer.nonfinite import NonfiniteSteps, takes_found_inf
from trainer.optim import optimizer_metrics, set_lr_momentum
from trainer.precision import AMP_DTYPES, amp_candidates, autocast, build_grad_scaler
from trainer.preemption import Preemption
from trainer.progress import Meter, ProgressLines, build_progress_bar, print_plan, timed_next, write_line
from trainer.run_choices import RunStep, settle
from trainer.run_record import add_to_run_record
from trainer.schedules import Phase, build_schedule
from trainer.task import Task
from trainer.train_config import Components, RunConfig

if TYPE_CHECKING:  # trainer/progress.py imports it where a bar is drawn
    from tqdm import tqdm


class Trainer:
    """Runs the schedule's phases over a `Task`; all training state lives here and is checkpointable (the loop's
    position in `state_dict`; the `Checkpointer` saves it with the model, optimizer, scaler, task and comm).

    `cfg` is the run's root config: the Trainer reads its `train`, `schedule` and `log` sections and
    stores all of it in every checkpoint."""

    def __init__(self, cfg: RunConfig, topo: Topology, task: Task, components: Components) -> None:
        self.train_cfg, self.log_cfg = cfg.train, cfg.log
        self.topo, self.task = topo, task
        self.model, self.optimizer, self.comm = components.model, components.optimizer, components.comm
        self.metrics = components.metrics
        self.spread = StepTimeSpread(topo.rank, topo.world_size)
        """Each rank's own seconds per step, gathered at log steps: which rank is slow (trainer/metrics.py)."""
        self.guard = components.guard or ReplicaGuard(0, topo)
        self.schedule = build_schedule(cfg.schedule, self.optimizer, cfg.train.epochs)
        self.amp_candidates = amp_candidates(cfg.train.amp, topo.device)
        self.compile_candidates = compile_candidates(cfg.train.compile, cfg.train.cuda_graphs, topo.device,
                                                     topo.world_size)
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
        self.nonfinite = self.build_nonfinite_check()
        """Without a loss scaler: the device-side record of non-finite steps (None: the host check)."""
        # Task.after_step; a bare task of a check or a bench, which gives only `loss`, has none to call
        self._after_step = getattr(task, "after_step", lambda step: None)
        self.checkpointer = Checkpointer(cfg.train, Path(cfg.log.dir) / "checkpoints", topo, self, to_dict(cfg))
        every = cfg.train.preempt_check_every_steps
        self.preemption = Preemption(topo, cfg.train.preempt_grace_s, None if every == "auto" else every)
        # State (checkpointed): next epoch and the steps of it already done, global step, wall-clock seconds
        # so far, eval history, target time, steps the loss scaler skipped.
        self.epoch, self.step_in_epoch, self.step, self.elapsed_s = 0, 0, 0, 0.0
        self.history: list[dict] = []
        self.time_to_target_s: float | None = None
        self.skipped_steps, self.skipped_in_a_row = 0, 0
        self._guard_due = False
        self._clock = time.perf_counter()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The loop's checkpointed state: its position (also in samples: a resume on another world size
        continues the data order), wall-clock seconds, evaluation history, target time, skipped steps."""
        phase = self.schedule.phase(min(self.epoch, self.train_cfg.epochs - 1))
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "steps_per_epoch": self.steps_per_epoch(phase),
                "samples_in_epoch": self.step_in_epoch * phase.batch_size, "step": self.step,
                "elapsed_s": self.elapsed_s, "history": self.history, "time_to_target_s": self.time_to_target_s,
                "skipped_steps": self.skipped_steps, "world_size": self.topo.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved, the position as saved (`Checkpointer.replan_position` adapts it to
        another world size)."""
        self.epoch, self.step_in_epoch, self.step = state["epoch"], state["step_in_epoch"], state["step"]
        self.elapsed_s, self.history = state["elapsed_s"], state["history"]
        self.time_to_target_s, self.skipped_steps = state["time_to_target_s"], state["skipped_steps"]

    def checkpoint(self, background: bool | None = None) -> None:
        """Collective: a checkpoint of the run now, with the wall-clock seconds so far (`Checkpointer.save`)."""
        self.raise_if_nonfinite("before a checkpoint")
        self.elapsed_s = time.perf_counter() - self._clock
        self.checkpointer.save(background)

    def checkpoint_before_stop(self) -> None:
        """Collective: this step's checkpoint in the foreground, unless it was just written (then the wait for
        its background write)."""
        if self.checkpointer.last_step != self.step:
            self.checkpoint(background=False)
        else:
            self.checkpointer.wait()

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
                       if e == last or (e + 1) % self.train_cfg.eval_every_epochs == 0)) for p in self.schedule.phases]
        folder = cache_folder(self.train_cfg.choices_cache)
        self.decision, _ = settle(
            self.decision, self.amp_candidates, phases,
            RunStep(self.task, self.comm, self.optimizer, self.topo.device, self.measuring_exchange()),
            self.topo, ChoiceCache(folder) if folder else None, self.train_cfg.calibration_rounds,
            self.train_cfg.calibration_budget, compile_modes=self.compile_candidates)
        choice = self.decision.choice
        self.amp_dtype = AMP_DTYPES[choice["amp"]]
        self.scaler = build_grad_scaler(self.train_cfg.loss_scale, self.amp_dtype, self.topo.device)
        self.nonfinite = self.build_nonfinite_check()
        if "selection" in choice:
            self.comm.use_selection(choice["selection"])
        if "workers" in choice:
            self.task.use_workers(choice["workers"])

    def measuring_exchange(self) -> Communicator | None:
        """A dense communicator over this node's ranks for the measurement's steps (detached at once: the
        measurement hooks it in; None when the node has one rank, whose probes then exchange nothing). The
        candidates change each rank's own work, the packing of its gradients included, not the bytes that cross
        the links between nodes: a dense exchange over a slow link would add the same seconds to every
        candidate, and multiply the measurement's length (minutes at 200 Mbit/s)."""
        node = self.topo.this_node()
        if not node.distributed:
            return None
        exchange = build_communicator(CommConfig(kind="dense"), self.model, node)
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

    def build_nonfinite_check(self) -> NonfiniteSteps | None:
        """train.nonfinite_check resolved: the device-side record, or None (the host check; or a loss scaler,
        which skips such steps itself)."""
        if self.scaler.is_enabled():
            return None
        mode, takes = self.train_cfg.nonfinite_check, takes_found_inf(self.optimizer)
        if mode == "device" and not takes:
            raise ConfigError(f"train.nonfinite_check=device: {type(self.optimizer).__name__} cannot skip an "
                              "update on the device (it takes no found_inf); use optim.name lars, adam or adamw, "
                              "or train.nonfinite_check=host")
        on_device = mode == "device" or (mode == "auto" and takes and self.topo.device.type == "cuda")
        return NonfiniteSteps(self.topo.device) if on_device else None

    def raise_if_nonfinite(self, where: str) -> None:
        """The device-side record's host read (a no-op under the host check or a scaler, where there is none):
        stop if any step was non-finite."""
        if self.nonfinite is not None:
            self.nonfinite.raise_if_any(self.step, where)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.scaler.is_enabled():  # without a scaler a step that is called applies (or skips on the device)
            self._stepped = True
            return
        found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler only around a fused step
        self._stepped = found_inf is None or not bool(found_inf.item())

    def train_step(self, batch: Any) -> tuple[torch.Tensor, int, dict[str, float]]:
        """Forward, backward (buckets launch from hooks), wait for the gradient exchange, optimizer step;
        (the loss, this rank's units, the communicator's stats)."""
        start = time.perf_counter()
        self.model.train()
        with self.autocast():
            loss, units = self.task.loss(batch)
        self.backward(loss)
        # This rank's own time: up to the wait for the exchange (the slowest rank's gradients), and before any
        # host sync of the step (a loss scaler's or the host check's), which a GPU would spend waiting for it too.
        self.spread.add(time.perf_counter() - start)
        comm_stats = self.comm.finish()
        once = self.comm.pop_records()
        if once:  # e.g. the auto communicator's calibration, read back by `scripts/plan.py --from-run`
            self.metrics.log("comm", self.step + 1, {f"comm/{k}": v for k, v in once.items()})
        self.optimizer_step(loss)
        synced = self.comm.end_step()  # a periodic kind's round may end here; None: mid-round
        if synced:
            comm_stats = {**comm_stats, **synced}
        self.optimizer.zero_grad(set_to_none=True)
        self.after_replicas_change(synced, self.step + 1)
        return loss.detach(), units, comm_stats

    def after_replicas_change(self, synced: dict[str, float] | None, step: int) -> None:
        """After step `step`'s update (`synced`: `Communicator.end_step`'s or `end_round`'s answer): the weights'
        moving average (train.ema_decay) folds the new weights in, and the replica guard checks when due, both
        only where the replicas are equal: after every applied step of a gradient exchange, at the end of a
        periodic kind's round (a check due mid-round waits for it)."""
        self._guard_due = self._guard_due or self.guard.should_check(step)
        if synced is None:
            return
        if self._stepped or self.comm.periodic:
            self._after_step(step)
        if self._guard_due:
            self.guard.check(self.model, step)
            self._guard_due = False

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
            if self.nonfinite is None:
                self.check_finite(loss)
                self.optimizer.step()
                return
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.optimizer.found_inf = self.nonfinite.observe(grads, self.step + 1)  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
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
            write_line(f"step {self.step + 1}: non-finite gradients, step skipped (loss scale now "
                       f"{self.scaler.get_scale():g}; {self.skipped_steps} skipped so far)")
        if self.skipped_in_a_row >= self.train_cfg.max_skipped_steps:
            raise FloatingPointError(
                f"the loss scaler skipped {self.skipped_in_a_row} steps in a row, up to step {self.step + 1}: "
                "the gradients are never finite (broken weights or data, not an fp16 overflow); stopping "
                "(train.max_skipped_steps)")

    def evaluate(self, phase: Phase) -> dict[str, float]:
        """The task's `eval/*` metrics (a collective), under the run's autocast, eager, with cuDNN's autotuning
        off: rectangular validation batches come in many shapes, and each new one would be compiled or tuned
        anew."""
        benchmark, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
        try:
            with torch.no_grad(), self.autocast(), eager():
                return self.task.evaluate(phase)
        finally:
            torch.backends.cudnn.benchmark = benchmark

    # ------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to the end (or to the target); returns the run summary. A stop signal (SIGTERM, SIGUSR1)
        during training ends it with a checkpoint and SystemExit(PREEMPTED_EXIT_CODE) (trainer/preemption.py)."""
        resumed_from = self.checkpointer.load_latest()
        if resumed_from is None:
            broadcast_module(self.model, self.topo)
            self.settle_choices()
        self.record_choices()
        print_plan(self.topo, self.model, self.amp_dtype, self.task, self.schedule, self.steps_per_epoch,
                   resumed_from and f"resumed from {resumed_from} at epoch {self.epoch}, step {self.step}")
        untrained = self.test("untrained") if resumed_from is None else {}
        restore_handlers = self.preemption.install()
        try:
            bar = build_progress_bar([self.steps_per_epoch(self.schedule.phase(e)) for e in range(self.train_cfg.epochs)],
                                     self.epoch, self.step_in_epoch, self.topo.is_main and self.log_cfg.progress,
                                     self.log_cfg.every_steps)
            self._clock = time.perf_counter() - self.elapsed_s
            stop = self.time_to_target_s is not None and self.train_cfg.stop_at_target
            while self.epoch < self.train_cfg.epochs and not stop:
                stop = self.run_epoch(self.schedule.phase(self.epoch), bar)
            bar.close()
            self.checkpointer.wait()
        finally:
            # Training is over (its last checkpoint complete): a signal from here on is the platform's to act
            # on, and no grace timer outlives the loop.
            self.preemption.cancel_watchdog()
            restore_handlers()
        return self.finish_summary(untrained, self.test("trained"))

    def run_epoch(self, phase: Phase, bar: tqdm | ProgressLines) -> bool:
        """Train the epoch, evaluate and checkpoint when due, log it; whether the run stops at its target."""
        # A phase has one image size: let cuDNN pick the fastest convolution algorithms for it (unless
        # deterministic kernels were asked for).
        torch.backends.cudnn.benchmark = not self.train_cfg.deterministic
        epoch_start = time.perf_counter()
        self.preemption.remeasure(self.step)  # evaluation since the last check; maybe another image size
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
        if self.checkpointer.should_save_epoch(self.epoch, last or stop):
            self.checkpoint()
        return stop

    def train_epoch(self, phase: Phase, bar: tqdm | ProgressLines) -> dict[str, float]:
        """The rest of the epoch: from `self.step_in_epoch` (0, or where a mid-epoch checkpoint was taken)."""
        steps, first = self.steps_per_epoch(phase), self.step_in_epoch
        epoch, window, done = Meter(), Meter(), 0
        self.spread.reset()  # the same window as `window`
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
            if self.checkpointer.should_save_step(self.step):
                self.checkpoint()
            if self.preemption.agreed(self.step, self.checkpointer.write_s):
                self.preemption.stop(self.step, self.checkpoint_before_stop, bar)
        if hasattr(batches, "close"):
            batches.close()  # let the task's generator release its loader state now
        synced = self.comm.end_round()  # a periodic kind's open round ends with the epoch
        if synced is not None:
            self.after_replicas_change(synced, self.step)
        self.raise_if_nonfinite("at the epoch's end")
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
        with torch.no_grad(), self.autocast(), eager():
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
        """Collective: the step record: loss, schedule, throughput and data wait over the window, the ranks' spread
        of own seconds per step (and a line naming a slow rank: `StepTimeSpread`), comm and optimizer stats."""
        self.raise_if_nonfinite("at a log step")
        value = float(loss)
        # every rank's units, not ours times W, and every rank's own seconds per step, in one all-reduce
        units, *seconds = all_reduce_sum([window.units, *self.spread.share(window.data_s)], self.topo)
        spread, slow = self.spread.observe(seconds, self.step - window.steps + 1, self.step)
        for line in slow if self.topo.is_main else []:
            write_line(line)
        self.metrics.log("step", self.step, {
            "epoch": epoch, "loss/train": value, "schedule/lr": lr,
            **({} if momentum is None else {"schedule/momentum": momentum}),
            f"time/{self.task.unit}_per_s": units / (time.perf_counter() - window.start),
            "time/data_wait_s": window.data_s / max(1, window.steps), "train/skipped_steps": self.skipped_steps,
            **spread, **{f"comm/{k}": v for k, v in comm_stats.items()}, **optimizer_metrics(self.optimizer)})
        bar.set_postfix(epoch=self.epoch, loss=f"{value:.3f}", lr=f"{lr:.3g}")

    def log_epoch(self, record: dict[str, float], epoch_start: float) -> None:
        """The epoch record, with times and the task's counters; evaluations also go into the history."""
        self.elapsed_s = time.perf_counter() - self._clock
        record.update({"time/epoch_s": time.perf_counter() - epoch_start, "time/elapsed_s": self.elapsed_s,
                       "time/checkpoint_s": self.checkpointer.seconds, "train/skipped_steps": self.skipped_steps})
        record.update(self.task.stats())  # e.g. cache hits/misses per level, skipped images (this rank)
        if any(k.startswith("eval/") for k in record):
            self.history.append({k: v for k, v in record.items()
                                 if k in ("epoch", "time/elapsed_s") or k.startswith("eval/")})
        self.metrics.log("epoch", self.step, record)

    def finish_summary(self, untrained: dict[str, float], trained: dict[str, float]) -> dict[str, Any]:
        """The run's summary: `final` is the last evaluation, `final_<name>`/`target_<name>` per task target,
        `test_<name>` and `test_<name>_untrained` per held-out test score (None where not scored)."""
        final = self.history[-1] if self.history else {}
        summary = {"epochs_run": self.epoch, "steps": self.step, "elapsed_s": self.elapsed_s,
                   "time_to_target_s": self.time_to_target_s,
                   **{f"target_{name}": value for name, value in self.task.targets.items()},
                   **{f"final_{name}": final.get(f"eval/{name}") for name in self.task.targets},
                   "final": final, "skipped_steps": self.skipped_steps, "checkpoint_s": self.checkpointer.seconds,
                   "world_size": self.topo.world_size, "history": self.history,
                   "choices": None if self.decision is None else self.decision.to_dict(),
                   **{f"test_{name}_untrained": untrained.get(name) for name in trained},
                   **{f"test_{name}": value for name, value in trained.items()}}
        self.metrics.summary(summary)
        return summary
