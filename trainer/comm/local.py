"""`comm.kind: local`: local SGD and DiLoCo. Each rank steps its own copy of the weights with the recipe's optimizer
on its own gradients for a round of `comm.local_steps` (H) steps; then one synchronisation.

The rules (docs/communicators.md, "local"):

- A round ends every H steps (the loss scaler's skipped steps count; every step during the first
  `comm.dense_warmup_steps`) and at every epoch's end, so evaluation,
  epoch-end checkpoints, export and the replica guard see equal replicas; the guard checks only when a round ends.
- The synchronisation: the pseudo-gradient (the weights at the round's start, the anchor, minus this rank's
  weights) is averaged by one allreduce (on a 16-bit wire under `comm.compression`), an outer SGD step
  (`comm.outer_lr`, Nesterov `comm.outer_momentum`; torch.optim.SGD) moves the anchor, and every rank copies it.
  The BatchNorm statistics and the optimizer's per-element state (momentum, Adam's moments) are averaged too, in
  fp32, so a round starts from one state on every rank; H = 1 with outer_lr 1, outer_momentum 0 is data-parallel
  SGD, with or without momentum. `comm.local_state: keep` leaves each rank its own optimizer state (DiLoCo).
- `comm.local_density` < 1 (SparseLoCo): each rank adds its residual to its pseudo-gradient, sends its top-k
  (value, index) pairs to every rank (one allgather) and keeps the rest as its new residual; the average of the
  gathered pairs is what the outer step takes, the same on every rank.
- The ranks agree on every step's non-finite gradients (one 1-element allreduce per step): when any rank's
  overflow, every rank's gradients are marked so. Under a loss scaler every rank then skips, so the scale stays
  equal everywhere and a checkpoint's scaler is every rank's; without one, every rank stops at the same step.
- Every synchronisation first checks that the ranks hold the same optimizer state (a parameter without a
  gradient on some rank leaves its state missing there) and stops every rank together, naming it, if not.
- `comm.local_overlap`: a round that ends mid-epoch (after the warm-up) snapshots this rank's weights, starts the
  allreduce of the anchor minus them and trains on; at the next round's end (or the epoch's) it lands: the outer
  step moves the anchor, and each rank's weights become the new anchor plus the steps it took since its snapshot.
  The BatchNorm statistics and the optimizer's state are averaged only by the epochs' ends' synchronisations,
  which wait; only these leave equal replicas, so the moving average folds and the replica guard checks there.
- The moving average of the weights (train.ema_decay) folds in the synchronised weights once per round (under
  `comm.local_overlap`, once per epoch).
- A checkpoint mid-round holds, per rank, the anchor, the outer optimizer's state and this rank's own weights,
  BatchNorm statistics and optimizer state (under `local_state: keep` or an overlapped synchronisation at every
  checkpoint), the top-k residual and an overlapped synchronisation's snapshot (its allreduce starts again): a
  resume on the same ranks restores the round. On another world size that per-rank state is dropped and a new
  round starts from the checkpoint's weights (rank 0's), with no residual.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import mstopk_warm_up
from trainer.comm.base import NO_BYTES, Communicator
from trainer.comm.config import CommConfig
from trainer.comm.cost import describe_local, exchange_bytes, k_of, layout_of
from trainer.comm.execute import WIRE_DTYPES
from trainer.comm.sparse import scatter_payloads, select_payload
from trainer.dist import Topology


@dataclass
class Overlapped:
    """A synchronisation under way behind the next round (comm.local_overlap)."""

    snapshot: list[torch.Tensor]
    """This rank's weights at the round's end."""
    wire: torch.Tensor
    """The pseudo-gradient being summed in place (on the wire's element type)."""
    work: Any
    """The allreduce's handle."""
    steps: int
    """The round's steps."""


class LocalSGD(Communicator):
    """`comm.kind: local` over the model's trainable parameters and BatchNorm running statistics, with `optimizer`
    as the inner optimizer (its per-element state is averaged at every synchronisation)."""

    periodic = True

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(topo)
        self.every, self.optimizer, self.warmup = cfg.local_steps, optimizer, cfg.dense_warmup_steps
        self.outer_lr, self.outer_momentum = cfg.outer_lr, cfg.outer_momentum
        self.wire = WIRE_DTYPES[cfg.compression]
        self.density, self.keep_state, self.iters = cfg.local_density, cfg.local_state == "keep", cfg.selection_iters
        self.selection = "mstopk" if cfg.selection == "auto" else cfg.selection
        self.measure_selection = cfg.selection == "auto"
        self.overlap = cfg.local_overlap
        self.pending: Overlapped | None = None
        """comm.local_overlap: the synchronisation under way (checkpointed as its snapshot)."""
        self.background = topo.world.twin() if self.overlap else topo.world
        """The group the overlapped allreduce runs on: not the world's own, whose every-step 1-element allreduce
        would queue behind it (NCCL's stream, gloo's connections)."""
        self.residual: torch.Tensor | None = None
        """local_density < 1: what this rank's top-k left unsent (error feedback, checkpointed)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                        for b in (m.running_mean, m.running_var) if b is not None]
        if self.density < 1:  # compile the selection now, not inside the first synchronisation
            n = sum(p.numel() for p in self.params)
            mstopk_warm_up(topo.device, [(n, k_of(n, self.density))], self.iters)
        self.layout = layout_of(topo)
        self.since_sync = 0
        """Steps of the open round (checkpointed)."""
        self.anchor: list[torch.Tensor] | None = None
        """The weights at the round's start: taken at the first step, then moved by each outer step."""
        self.outer: torch.optim.SGD | None = None
        self.per_step = {"bytes_sent": 0.0, "bytes_inter_node": 0.0}
        """The last synchronisation's bytes over its round's steps (what each step's stats report)."""

    # ------------------------------------------------------------ the step

    def finish(self) -> dict[str, float]:
        """Nothing to exchange: the gradients stay this rank's. The first step takes the anchor; a non-finite
        gradient on any rank is marked on every rank."""
        if self.anchor is None:
            self.new_round()
        self.steps += 1
        self.agree_on_nonfinite()
        return {**NO_BYTES, **self.per_step}

    def agree_on_nonfinite(self) -> None:
        """One 1-element allreduce: if any rank's gradients hold inf/NaN, put an inf into this rank's too, so that
        the loss scaler's (or the non-finite check's) own test decides alike on every rank."""
        grads = [p.grad for p in self.params if p.grad is not None]
        mine = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum() if grads else \
            torch.zeros((), device=self.topo.device)
        bad = (~torch.isfinite(mine)).float().reshape(1)
        if self.topo.world.all_reduce_(bad, "all-reduce of the step's non-finite flag").item() and grads:
            grads[0].view(-1)[0] = float("inf")

    def end_step(self) -> dict[str, float] | None:
        """The H-th step of a round synchronises (every step of the first comm.dense_warmup_steps: a stable
        start): its stats; None mid-round (the replicas differ), and when the synchronisation goes on behind the
        next round (comm.local_overlap)."""
        self.since_sync += 1
        warm = self.steps <= self.warmup
        if self.since_sync < (1 if warm else self.every):
            return None
        if self.overlap and not warm:
            self.start_overlapped()
            return None
        return self.sync()

    def end_round(self) -> dict[str, float] | None:
        """The epoch's end: an open round synchronises now, waiting (an overlapped synchronisation lands first);
        its stats, or None when nothing was open."""
        if self.since_sync > 0:
            return self.sync()
        if self.pending is None:
            return None
        # the epoch's last step ended a round, whose synchronisation is under way: once it lands the replicas are
        # equal (no step since the snapshot), and their state is averaged
        start, steps = time.perf_counter(), self.pending.steps
        self.land()
        state = self.average_state()
        sent, inter = self.sync_bytes(0, state, 4, 0)
        self.per_step = {"bytes_sent": self.per_step["bytes_sent"] + sent / steps,
                         "bytes_inter_node": self.per_step["bytes_inter_node"] + inter / steps}
        return {**NO_BYTES, **self.per_step, "wait_s": time.perf_counter() - start}

    # ------------------------------------------------------------ top-k selection (trainer/choices.py)

    def selection_sizes(self) -> dict[tuple[int, float], float]:
        """The one selection of a synchronisation: 1/H per step (the warm-up's and the epochs' ends' extra
        synchronisations are not counted: this weighs the candidates, it does not predict the run)."""
        return {(sum(p.numel() for p in self.params), self.density): 1 / self.every} if self.density < 1 else {}

    # ------------------------------------------------------------ the synchronisation

    def new_round(self) -> None:
        """Anchor at the current weights, a fresh outer optimizer (no momentum yet)."""
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        self.since_sync = 0

    def per_element_state(self) -> list[torch.Tensor]:
        """The inner optimizer's state tensors shaped as their parameter, in parameter order: every rank
        lists the same ones (the ranks take the same steps: skips are agreed)."""
        return [value for p in self.params for value in self.optimizer.state.get(p, {}).values()
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == p.shape]

    def averaged_state(self) -> list[torch.Tensor]:
        """What a synchronisation averages besides the weights: the BatchNorm statistics, and the optimizer's
        per-element state unless each rank keeps its own."""
        return self.buffers + ([] if self.keep_state else self.per_element_state())

    def check_same_state(self, state: list[torch.Tensor]) -> None:
        """Stop every rank together, in words, when the ranks' state tensors differ in number or size (the
        averaging allreduce would fail or hang)."""
        sizes = torch.tensor([len(state), sum(t.numel() for t in state)], dtype=torch.float64, device=self.topo.device)
        every = self.topo.world.all_gather(sizes.reshape(1, -1), "all-gather of the optimizer state's sizes")
        if not torch.equal(every.min(0).values, every.max(0).values):
            raise RuntimeError(
                f"comm.kind local: at the synchronisation after step {self.steps} the ranks hold different optimizer "
                f"state (tensors, elements per rank: {every.long().tolist()}): a parameter got no gradient on some "
                "rank in this round, so its optimizer state exists on some ranks only. Use a per-step comm.kind, or "
                "make every parameter take part in every step")

    def sync(self) -> dict[str, float]:
        """Average the pseudo-gradient, step the anchor, copy it into the weights; average the BatchNorm statistics
        and the optimizer's per-element state (an overlapped synchronisation lands first). Stats: bytes this rank
        sent, seconds taken."""
        assert self.anchor is not None
        start = time.perf_counter()
        if self.pending is not None:
            self.land()
        with torch.no_grad():
            flat = self.pseudo_gradient([p.detach() for p in self.params])
            if self.density < 1:
                averaged, sent_k, wire_bytes = self.sparse_average(flat), k_of(flat.numel(), self.density), 4
            else:
                wire = self.on_wire(flat)
                self.topo.world.all_reduce_(wire, "all-reduce of the pseudo-gradient")
                averaged, sent_k, wire_bytes = wire.float().div_(self.topo.world_size), 0, wire.element_size()
            self.outer_step(averaged)
            torch._foreach_copy_([p.detach() for p in self.params], self.anchor)
        state = self.average_state()
        self.round_ended(*self.sync_bytes(flat.numel(), state, wire_bytes, sent_k))
        return {**NO_BYTES, **self.per_step, "wait_s": time.perf_counter() - start}

    def round_ended(self, sent: float, inter: float) -> None:
        """The round's synchronisation sends `sent` bytes (`inter` across nodes): per step of the round, as every
        step reports it until the next synchronisation (a log step samples the rate whether or not it
        synchronised); a new round starts."""
        self.per_step = {"bytes_sent": sent / self.since_sync, "bytes_inter_node": inter / self.since_sync}
        self.since_sync = 0

    def pseudo_gradient(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """The anchor minus `weights`, flat."""
        assert self.anchor is not None
        return torch.cat([d.reshape(-1) for d in torch._foreach_sub(self.anchor, weights)])

    def on_wire(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` in the wire's element type (itself on an fp32 wire)."""
        return flat if self.wire is None else flat.to(self.wire)

    def outer_step(self, averaged: torch.Tensor) -> None:
        """The outer SGD step of the anchor on the averaged pseudo-gradient (a non-finite one stops every rank:
        it is every rank's sum)."""
        assert self.anchor is not None and self.outer is not None
        if not bool(torch.isfinite(averaged).all()):
            self.diverged()
        for a, g in zip(self.anchor, averaged.split([a.numel() for a in self.anchor])):
            a.grad = g.view_as(a)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)  # views of the averaged buffer: not kept for a round

    def average_state(self) -> list[torch.Tensor]:
        """Average the BatchNorm statistics and the optimizer's per-element state (unless kept) over the ranks, in
        fp32; the tensors averaged."""
        state = self.averaged_state()
        self.check_same_state(state)
        if state:
            with torch.no_grad():
                both = torch.cat([t.detach().float().reshape(-1) for t in state])
                self.topo.world.all_reduce_(both, "all-reduce of the BatchNorm statistics and optimizer state")
                both.div_(self.topo.world_size)
                for t, mean in zip(state, both.split([t.numel() for t in state])):
                    t.copy_(mean.view_as(t))
        return state

    def sync_bytes(self, n: int, state: list[torch.Tensor], wire_bytes: int, k: int) -> tuple[float, float]:
        """Bytes this rank sends in a synchronisation of `n` pseudo-gradient elements and `state`: all links, and
        those crossing nodes (the cost model's count)."""
        return exchange_bytes(describe_local(n, sum(t.numel() for t in state), self.layout, wire_bytes, k=k),
                              self.layout)

    # ------------------------------------------------------------ the overlapped synchronisation

    def start_overlapped(self) -> None:
        """The round's end under comm.local_overlap: the previous round's synchronisation lands, then this rank's
        weights are kept as the snapshot and its pseudo-gradient's allreduce starts; training goes on."""
        if self.pending is not None:
            self.land()
        with torch.no_grad():
            self.launch([p.detach().clone() for p in self.params], self.since_sync)
        assert self.pending is not None
        self.round_ended(*self.sync_bytes(self.pending.wire.numel(), [], self.pending.wire.element_size(), 0))

    def launch(self, snapshot: list[torch.Tensor], steps: int) -> None:
        """Start the allreduce of the anchor minus `snapshot` (the weights at a round's end)."""
        wire = self.on_wire(self.pseudo_gradient(snapshot))
        self.pending = Overlapped(snapshot, wire, self.background.all_reduce_async(wire), steps)

    def land(self) -> None:
        """Wait for the overlapped allreduce, step the anchor with its average; each rank's weights become the new
        anchor plus the steps it took since its snapshot."""
        pending, self.pending = self.pending, None
        assert pending is not None
        self.background.wait(pending.work, "all-reduce of the pseudo-gradient (overlapped)")
        with torch.no_grad():
            self.outer_step(pending.wire.float().div_(self.topo.world_size))
            params = [p.detach() for p in self.params]
            torch._foreach_sub_(params, pending.snapshot)
            torch._foreach_add_(params, self.anchor)

    def diverged(self) -> None:
        """Stop (every rank calls it at the same synchronisation: the finiteness it tests is every rank's)."""
        raise FloatingPointError(
            f"comm.kind local: the pseudo-gradient at step {self.steps} is not finite (a rank's weights diverged "
            "during the round); the newest checkpoint holds finite weights")

    def sparse_average(self, flat: torch.Tensor) -> torch.Tensor:
        """The average over the ranks of each rank's top-k of `flat` plus its residual (`flat` is overwritten: it
        becomes the new residual, what was not sent)."""
        world = self.topo.world
        if self.residual is not None:
            flat.add_(self.residual)
        # a rank's non-finite values would stop its selection alone and leave the others waiting in the allgather
        bad = (~torch.isfinite(flat.sum())).float().reshape(1)
        if world.all_reduce_(bad, "all-reduce of the pseudo-gradient's non-finite flag").item():
            self.diverged()
        payload = select_payload(flat, k_of(flat.numel(), self.density), self.iters, self.selection)
        self.residual = flat
        gathered = world.all_gather(payload, "all-gather of the pseudo-gradient's top-k pairs")
        return scatter_payloads(gathered, self.topo.world_size, flat.numel()).div_(self.topo.world_size)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """`steps`, `since_sync`, and `round` (per rank, host copies): the anchor and the outer momentum, and
        mid-round this rank's own weights, BatchNorm statistics and optimizer per-element state (its step
        counters are every rank's, in the checkpoint's optimizer state), and an overlapped synchronisation's
        snapshot (the allreduce starts again on resume); None before the first step."""
        if self.anchor is None or self.outer is None:
            return {"steps": self.steps, "since_sync": 0, "round": None}
        momentum = [self.outer.state[a].get("momentum_buffer") for a in self.anchor]
        mine = None
        if self.since_sync > 0 or self.keep_state or self.pending is not None:  # the replicas or their states differ
            mine = {"params": host(self.params), "buffers": host(self.buffers),
                    "optimizer": host(self.per_element_state())}
        pending = None
        if self.pending is not None:
            pending = {"snapshot": host(self.pending.snapshot), "steps": self.pending.steps}
        return {"steps": self.steps, "since_sync": self.since_sync,
                "round": {"anchor": host(self.anchor),
                          "outer_momentum": host(momentum) if all(m is not None for m in momentum) else None,
                          "mine": mine, "residual": None if self.residual is None else host([self.residual])[0],
                          "overlapped": pending}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state (after the checkpoint's model and optimizer state are loaded); without a
        `round` (another world size), a new round starts from the current weights."""
        self.steps = state["steps"]
        saved = state.get("round")
        self.pending = None
        if saved is None:
            self.anchor, self.outer, self.since_sync, self.residual = None, None, 0, None
            return
        self.new_round()
        assert self.anchor is not None and self.outer is not None
        with torch.no_grad():
            for a, kept in zip(self.anchor, saved["anchor"]):
                a.copy_(kept)
            for a, kept in zip(self.anchor, saved["outer_momentum"] or []):
                self.outer.state[a]["momentum_buffer"] = kept.to(a.device, copy=True)
            residual = saved.get("residual")  # dropped when this run sends the whole pseudo-gradient
            self.residual = None if residual is None or self.density >= 1 else residual.to(self.topo.device, copy=True)
            mine = saved["mine"]
            if mine is not None:
                live = self.params + self.buffers + self.per_element_state()
                kept = mine["params"] + mine["buffers"] + mine["optimizer"]
                assert len(live) == len(kept), "the optimizer's state does not match the checkpoint's round"
                for t, k in zip(live, kept):
                    t.detach().copy_(k)
        self.since_sync = state["since_sync"]
        overlapped = saved.get("overlapped")
        if overlapped is not None and self.overlap:  # the same sums as the interrupted allreduce's
            with torch.no_grad():
                self.launch([t.to(self.topo.device, copy=True) for t in overlapped["snapshot"]], overlapped["steps"])
        elif overlapped is not None:  # resumed without comm.local_overlap: the round goes on from the anchor, its
            self.since_sync += overlapped["steps"]  # pseudo-gradient holding both rounds' steps


def host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host-memory copies: later steps cannot change them while a checkpoint is written."""
    return [t.detach().to("cpu", copy=True) for t in tensors]
