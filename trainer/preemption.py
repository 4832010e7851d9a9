"""Preemption: SIGTERM or SIGUSR1 (a spot instance's notice, Slurm's `--signal`) makes every rank finish its
step, write a checkpoint together and exit with PREEMPTED_EXIT_CODE, which torchrun restarts and Slurm can
requeue; a grace timer (train.preempt_grace_s) makes a rank that cannot get there exit with that status anyway.

The signal handler only records the signal; the ranks agree on it at step ends (`Preemption.agreed`) and
`Preemption.stop` leaves after the stop's checkpoint. More in docs/reliability.md ("Preemption").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, NoReturn

import torch

from trainer.dist import Topology, all_reduce_sum

PREEMPTED_EXIT_CODE = 75
"""The exit status after a stop signal and its checkpoint: EX_TEMPFAIL of sysexits.h ("try again later").
torchrun --max-restarts restarts on any non-zero status but never passes it on (it exits 1): under torchrun
the batch script requeues explicitly (scripts/slurm/); without torchrun, Slurm's RequeueExit=75 requeues it
(docs/reliability.md)."""
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


CHECK_SHARE = 0.5
"""Under train.preempt_check_every_steps: auto, the share of train.preempt_grace_s that the steps up to the next
check and the stop's checkpoint may take together; the rest is margin (a slower step, an evaluation between)."""
UNTIMED_CHECKPOINT_SHARE = 0.25
"""The share of the grace assumed for the stop's checkpoint before this attempt has timed one."""


def check_interval(grace_s: float, step_s: float, checkpoint_s: float | None) -> int:
    """Steps from one agreement on a stop signal to the next (train.preempt_check_every_steps: auto): the most N
    with N x `step_s` + `checkpoint_s` <= CHECK_SHARE x `grace_s`, at least 1 (a signal that comes just after a
    check is acted on N steps later, then the checkpoint is written). `checkpoint_s` None: none timed yet."""
    if checkpoint_s is None:
        checkpoint_s = UNTIMED_CHECKPOINT_SHARE * grace_s
    steps_s = CHECK_SHARE * grace_s - checkpoint_s
    if step_s <= 0 or steps_s <= 0:
        return 1
    n = int(steps_s // step_s)
    return max(1, n + 1 if (n + 1) * step_s <= steps_s else n)  # // rounds 2.5 // 0.1 down to 24


class Preemption:
    """This rank's stop signals: the handler, the grace timer and the ranks' agreement, for `grace_s`
    (train.preempt_grace_s), checked every `check_every_steps` steps (train.preempt_check_every_steps), or, when
    None (auto), at intervals the ranks agree from their measured step and checkpoint seconds
    (`check_interval`)."""

    def __init__(self, topo: Topology, grace_s: float, check_every_steps: int | None) -> None:
        self.topo, self.grace_s, self.check_every_steps = topo, grace_s, check_every_steps
        self.next_check = 1
        """Under auto, the step at whose end the ranks next agree (the first step's, then `check_interval`'s)."""
        self._interval = 1  # under auto, the steps between the last two checks: the next at most doubles it
        self._last_check: tuple[float, int] | None = None  # (time after the agreement, step) of the last check
        self._step_s = 0.0  # this rank's seconds per step between its last two checks (0: not measured yet)
        self.signal: int | None = None
        """The stop signal this rank received (SIGTERM, SIGUSR1), if any."""
        self.ranks = 0
        """How many ranks were signalled, as of the last agreement."""
        self.watchdog: threading.Timer | None = None
        """The grace timer, armed by a stop signal or by the ranks' agreement on one."""
        self._handler_pid = os.getpid()

    def install(self) -> Callable[[], None]:
        """Catch SIGTERM and SIGUSR1 (on the main thread): the handler only records the signal, the loop acts at
        the next step end. Returns what restores the previous handlers. A process forked from this one (a
        DataLoader worker) inherits the handler; there it does nothing (the worker ignores the signal and
        ends with its loader), so that no worker arms a grace timer of its own."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        self._handler_pid = os.getpid()
        previous = {sig: signal.signal(sig, self.on_signal) for sig in PREEMPT_SIGNALS}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]  # type: ignore[func-returns-value]

    def on_signal(self, signum: int, frame: Any) -> None:
        """The signal handler: record the first stop signal and arm the grace timer."""
        if os.getpid() != self._handler_pid or self.signal is not None:
            return
        self.signal = signum
        self.arm_watchdog()

    def arm_watchdog(self) -> None:
        """Past the grace seconds from now, leave with the restartable status even without a checkpoint
        (before the platform's SIGKILL, so that the launcher still sees a restartable exit)."""
        if self.watchdog is not None:
            return
        self.watchdog = threading.Timer(self.grace_s, self.exit_after_grace)
        self.watchdog.daemon = True
        self.watchdog.start()

    def cancel_watchdog(self) -> None:
        """Stop the grace timer, if one is running."""
        if self.watchdog is not None:
            self.watchdog.cancel()

    def exit_after_grace(self) -> None:
        """The grace timer's end: exit this process at once with the restartable status."""
        what = (f"{signal.Signals(self.signal).name} received" if self.signal is not None else
                "the ranks agreed a stop signal reached one of them")
        print(f"rank {self.topo.rank}: {what} {self.grace_s:g} s ago and no checkpoint written since "
              f"(train.preempt_grace_s); exiting with status {PREEMPTED_EXIT_CODE} without one",
              file=sys.stderr, flush=True)
        os._exit(PREEMPTED_EXIT_CODE)

    def remeasure(self, step: int) -> None:
        """Under auto, start the intervals afresh after `step` (a new epoch or phase: evaluation between, another
        image size, cuDNN tuning again): check at the next step end, then let the interval grow again."""
        if not self.check_every_steps:
            self.next_check, self._interval, self._last_check, self._step_s = step + 1, 1, None, 0.0

    def agreed(self, step: int, checkpoint_s: float | None = None) -> bool:
        """Collective at the end of every `check_every_steps`-th step (auto: of step `next_check`): whether any
        rank was signalled. Once they agree, every rank has a grace timer (the signalled ones since the signal, the
        others from now), so a rank stuck in the stop's checkpoint exits with the restartable status too.

        Under auto one all-gather carries, besides the flag, each rank's seconds per step over its previous
        interval (timed from one agreement's end to the next, which wait for the device) and `checkpoint_s`, its
        newest checkpoint write; every rank takes the slowest of each, so all derive the same next interval,
        which at most doubles the last one. Without a process group the check costs nothing: every step."""
        if step % self.check_every_steps if self.check_every_steps else step < self.next_check:
            return False
        flag = 0.0 if self.signal is None else 1.0
        if not self.topo.distributed:
            signalled = flag
            self.next_check = step + 1
        elif self.check_every_steps:
            (signalled,) = all_reduce_sum([flag], self.topo)
        else:
            values = torch.tensor([[flag, self._step_s, -1.0 if checkpoint_s is None else checkpoint_s]],
                                  dtype=torch.float64, device=self.topo.device)
            ranks = self.topo.world.all_gather(values, "preemption check").tolist()
            signalled = sum(r[0] for r in ranks)
            now = time.perf_counter()
            if self._last_check is not None:
                self._step_s = (now - self._last_check[0]) / max(1, step - self._last_check[1])
            self._last_check = (now, step)
            step_s, slowest_write = max(r[1] for r in ranks), max(r[2] for r in ranks)
            fits = check_interval(self.grace_s, step_s, slowest_write if slowest_write >= 0 else None)
            self._interval = min(fits, 2 * self._interval) if step_s > 0 else 1
            self.next_check = step + self._interval
        self.ranks = int(signalled)
        if signalled > 0:
            self.arm_watchdog()
        return signalled > 0

    def stop(self, step: int, save: Callable[[], None], bar: Any) -> NoReturn:
        """Collective: `save` (the stop's checkpoint of `step`), close the progress `bar`, then leave every rank
        with the restartable status."""
        start = time.perf_counter()
        save()
        bar.close()
        self.cancel_watchdog()  # the checkpoint is complete: leave through the normal exit path
        if self.topo.is_main:
            print(f"preempted: a stop signal (SIGTERM/SIGUSR1) reached {max(1, self.ranks)} rank(s); "
                  f"checkpoint of step {step} complete in {time.perf_counter() - start:.1f} s; exiting with "
                  f"status {PREEMPTED_EXIT_CODE} (restartable: resume continues from it)", flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)
