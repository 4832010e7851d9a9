"""The extension point for kinds that synchronise every H steps around `optimizer.step` instead of exchanging
gradients every step (local SGD, DiLoCo, SparseLoCo). Only the contract lives here: no kind implements it and
the train loop and checkpointer do not call it yet (the first kind wires the calls below in, with its tests).
docs/communicators.md, "Periodic kinds", describes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from trainer.comm.base import Communicator


class PeriodicSync(Communicator, ABC):
    """A communicator whose per-step exchange is empty and whose synchronisation runs every `every` taken steps (a
    contract: not called by the train loop yet).

    Per step the gradients stay local: `finish()` exchanges nothing (it counts the step and returns zero-byte
    stats) and the inner optimizer steps on this rank's own gradients. The train loop is to call, on every rank
    in the same order:

    - `before_optimizer_step(step)` after the gradients are unscaled and checked finite, before the inner
      `optimizer.step()`;
    - `after_optimizer_step(step)` after an inner step that was taken, never after one the loss scaler skipped
      (a skipped step changes nothing here, so `rollback()` has nothing to undo). On every `every`-th taken
      step it synchronises: the pseudo-gradient (anchor - parameters) is exchanged (DiLoCo: averaged by a dense
      allreduce; SparseLoCo: chunked top-k with this rank's error feedback), the outer optimizer steps the
      anchor with it, the anchor is copied into the parameters, and the BatchNorm running statistics (buffers
      no optimizer trains) are averaged over the ranks.

    State, as two parts because a resume treats them differently:

    - `shared_state_dict()`: what is identical on every rank - the anchor (the parameters at the last
      synchronisation), the outer optimizer's state, the taken steps since the last synchronisation (a resumed
      run synchronises at the same step). To be written once, with the model, and restored on any world size.
    - `state_dict()`: this rank's own - its error-feedback residuals (SparseLoCo) and `steps`. To be written per
      rank like the gradient communicators' residuals, and dropped like them when the world size or layout changes.
    """

    every: int
    """Taken inner steps between synchronisations (H)."""

    def finish(self) -> dict[str, float]:
        self.steps += 1
        return {"bytes_sent": 0.0, "bytes_inter_node": 0.0, "wait_s": 0.0, "select_s": 0.0, "density": 1.0}

    @abstractmethod
    def before_optimizer_step(self, step: int) -> None:
        """Before the inner `optimizer.step()` of global step `step` (gradients unscaled, finite)."""

    @abstractmethod
    def after_optimizer_step(self, step: int) -> dict[str, float]:
        """After a taken inner step: synchronise on every `every`-th; that synchronisation's stats (bytes sent,
        seconds), or {} on a step without one."""

    @abstractmethod
    def shared_state_dict(self) -> dict:
        """The state identical on every rank: anchor, outer optimizer state, taken steps since the last sync."""

    @abstractmethod
    def load_shared_state_dict(self, state: dict) -> None:
        """Restore `shared_state_dict()`'s state (on any world size)."""
