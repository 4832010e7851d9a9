"""`comm.kind: auto`: measure the live cluster during dense warm-up steps, then choose per bucket the exchange
(dense fp32, dense 16-bit wire, flat top-k, hierarchical top-k) and density with the least predicted
exposed time - the time the optimizer waits after backward, not the bytes.

Calibration (the first `calibration_steps` steps, every bucket dense fp32, on the exchange thread):
- each bucket's ready time (how long before the end of backward it was launched) and its dense exchange
  time during backward;
- after the last of those steps, a few probe collectives per group at two sizes (world allreduce in fp32 and
  16-bit, world allgather, inter-node allgather, intra-node reduce-scatter and allgather): latency and
  bandwidth of each link (trainer/comm/cost.py's alpha-beta links);
- the sparse local work (residual add, MSTopK, pack, clear, scatter-add) on each bucket's own gradient:
  seconds per element on this device; and the 16-bit casts.
On CUDA the times are CUDA events on the main and exchange streams (the host runs ahead of the kernels),
read at the end of each timed step; the probes synchronize. Every rank's measurements are gathered: probes
and spans reduced to their maximum over ranks (a step is as slow as its slowest rank), bucket and ready times
to their minimum (the rank that launched last waited least for its peers), so every rank fits the same
model; rank 0's plan is broadcast all the same, so ranks cannot disagree.

The model (`choose`): each bucket's exchange is `cost.describe`'s list of collectives plus local work; the
collectives are scaled by the measured/modelled ratio of the largest bucket's dense exchange during
backward (contention with the compute); on a CPU the local work also delays backward (same cores). Starting from all dense, each
bucket in turn takes the candidate that lowers the predicted exposed time by more than a small margin, so
a bucket whose exchange hides behind backward stays dense. Densities below `comm.min_density` (the recipe's
safe bound) are never candidates.

Trial: when the model's plan is not all dense, it and the fastest uniform plans the model predicts faster than
all dense (one candidate on every bucket; at most `MAX_TRIALS` plans), then all dense, each run
`comm.trial_steps` steps, timed. The plan that measured fastest is kept if it beat the all-dense trial by the
choice's margin, else every bucket goes back to dense: both are measured the same way, after the warm-up (the
calibration's own dense steps pay first touches and run beside the probes). The model is fitted from probes
taken apart from backward; a trial is what a plan costs inside the step (on a CPU the sparse local work
competes with backward for the cores).

Drift: the last steps (`WINDOW`) before every `redecide_every`-th are timed; the ready times follow them.
Rank 0 then decides and broadcasts, in one call. The links have moved when the largest bucket's measured
chain time moved by more than `hysteresis` from the current plan's first measured window, the same way in two
windows in a row (one noisy window does not re-decide). Under an all-dense
plan the model's link scale follows the ratio and the plan is re-decided; a new plan is adopted only if it
is predicted `hysteresis` faster. Under a sparse plan the next window runs all dense first, so that the
decision and the guard below start from what dense costs on the links as they are now.
Never slower than dense: when a plan that is not all dense measures (median over the window) more than
`hysteresis` slower than the last measured all-dense window, the next window runs all dense, to compare on the
same links and the same backward (a longer backward, e.g. a larger image size, lengthens both). The plan
comes back if it beat that window by the choice's margin; otherwise every bucket stays dense, no link change
re-decides for `HOLD_CHECKS` checks, and after that dense is left only when the links move again. A link that
gets faster under a sparse plan is seen only through the sparse chains (the allgathers in them), not by a
fresh dense measurement: the sparse plan is kept against the older, slower dense baseline.

Switching a bucket keeps error feedback exact: a residual kept for one layout (topk: this rank's whole
bucket; hitopk: this rank's 1/L shard of the node's sum) is added, at the step's loss scale, into this
rank's gradient before an exchange of another kind, and dropped; every rank contributes its residual once
to the sum, so no gradient mass is lost or counted twice. `rollback()` restores folded residuals too.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from kernels import mstopk_warm_up
from trainer.comm.base import Bucket
from trainer.comm.config import CommConfig
from trainer.comm.cost import (CODES, DENSE, KINDS, Choice, Layout, Link, Network, Selection, allgather_s, describe,
                               exchange_bytes, exposed_s, fit_affine, fit_link, k_of, plan_summary, reduce_scatter_s,
                               ring_allreduce_s)
from trainer.comm.dense import WIRE_DTYPES
from trainer.comm.sparse import TopKCommunicator, sparse_local_work
from trainer.dist import Group, Topology

HOLD_CHECKS = 5
"""After a plan measured slower than all dense, this many drift checks do not re-decide (the plan stays all
dense; after them a link change may re-decide)."""

MAX_TRIALS = 3
"""Plans tried, measured, after calibration (the model's and the fastest uniform ones it predicts)."""

SCALE_RANGE = (0.05, 100.0)
"""Bounds of the measured/modelled scale of the collectives (a wild measurement cannot zero or explode it)."""

WINDOW = 8
"""Steps timed before each drift check."""

MARGIN = 0.02
"""A bucket leaves dense only for a predicted saving above this fraction of the step's exposed time
(plus a tenth of a millisecond): ties stay dense."""


def candidates(n: int, layout: Layout, densities: Sequence[float], min_density: float, dense_below: int
               ) -> list[Choice]:
    """The exchanges auto considers for a bucket of n elements (dense first)."""
    out = [DENSE, Choice("dense16")]
    if layout.world == 1 or n < dense_below:
        return out
    safe = sorted({d for d in densities if d >= min_density}, reverse=True)
    out += [Choice("topk", d) for d in safe]
    if layout.per_node > 1 and layout.nodes > 1:
        out += [Choice("hitopk", d) for d in safe]
    return out


def predict(sizes: Sequence[int], ready_before_end: Sequence[float], plan: Sequence[Choice], net: Network,
            local_competes: bool) -> tuple[float, list[float]]:
    """(predicted exposed seconds, each bucket's chain seconds) of `plan`."""
    chains, local = [], 0.0
    for n, choice in zip(sizes, plan):
        ex = describe(n, choice, net.layout)
        chains.append(net.chain_s(ex))
        local += net.local_s(ex)
    return exposed_s(ready_before_end, chains, local if local_competes else 0.0), chains


def choose(sizes: Sequence[int], ready_before_end: Sequence[float], net: Network,
           options: Callable[[int], list[Choice]], local_competes: bool,
           start: Sequence[Choice] | None = None) -> tuple[list[Choice], float]:
    """The plan with the least predicted exposed time, and that time.

    Coordinate descent (largest buckets first) from `start` (default all dense) and from every uniform plan
    (each candidate on every bucket that has it): with many small buckets no single bucket's move may clear
    the margin while moving them all does. Another start's plan replaces the first one's only if it is
    predicted faster by the margin, so ties stay with `start`."""
    first = list(start) if start is not None else [DENSE] * len(sizes)
    plan, best = _descend(sizes, ready_before_end, net, options, local_competes, first)
    uniform = {c: None for n in sizes for c in options(n)}  # ordered, no duplicates
    for choice in uniform:
        trial = [choice if choice in options(n) else DENSE for n in sizes]
        if trial == first:
            continue
        other, t = _descend(sizes, ready_before_end, net, options, local_competes, trial)
        if t < best - MARGIN * best - 1e-4:
            plan, best = other, t
    return plan, best


def _descend(sizes: Sequence[int], ready_before_end: Sequence[float], net: Network,
             options: Callable[[int], list[Choice]], local_competes: bool, plan: list[Choice]
             ) -> tuple[list[Choice], float]:
    """Coordinate descent from `plan`: a bucket changes only for a predicted saving above the margin."""
    best, _ = predict(sizes, ready_before_end, plan, net, local_competes)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    for _ in range(3):
        changed = False
        for i in order:
            for choice in options(sizes[i]):
                if choice == plan[i]:
                    continue
                trial = plan[:i] + [choice] + plan[i + 1:]
                t, _ = predict(sizes, ready_before_end, trial, net, local_competes)
                if t < best - MARGIN * best - 1e-4:
                    plan, best, changed = trial, t, True
        if not changed:
            break
    return plan, best


class AutoCommunicator(TopKCommunicator):
    """Per-bucket exchange chosen from live measurements (see the module docstring)."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology) -> None:
        super().__init__(cfg, model, topo, intra=topo.intra_node, inter=topo.inter_node)
        self.cfg = cfg
        # bf16 unless the config names a 16-bit wire: fp16's range needs a loss scaler behind it
        self.wire16 = WIRE_DTYPES[cfg.compression] or torch.bfloat16
        self.net_layout = Layout(topo.num_nodes, topo.ranks_per_node)
        self.calibration_steps = max(cfg.calibration_steps, cfg.dense_warmup_steps)
        self.plan: list[Choice] = [DENSE] * len(self.buckets)
        self.net: Network | None = None
        """The fitted model (None until calibrated)."""
        self.ready_before_end: list[float] = []
        self.predicted_chain_s: list[float] = []
        self.predicted_exposed_s = 0.0
        self.calibration: dict[str, float] = {}
        """The measurements, for the logs and `scripts/plan.py --from-run`."""
        self._unlogged: dict[str, float] = {}
        self.inter_delay_s_per_mb = 0.0
        """Test hook: seconds of extra delay per MB this rank sends over inter-node links (a slow link)."""
        self._local_steps = 0
        """Exchanges since this process started (calibration is per process: a resumed run measures again)."""
        self._residual_kind: dict[int, str] = {}
        self._folded: list[tuple[int, torch.Tensor, str]] = []
        self._launched: dict[int, float | torch.cuda.Event] = {}
        self._chain: dict[int, tuple[float | torch.cuda.Event, float | torch.cuda.Event]] = {}
        self._rows: list[tuple[list[float], list[float], float, float]] = []
        """Per measured step: ready-before-end and chain seconds per bucket, the first-launch-to-usable span
        and the exposed wait (end of backward to usable gradients)."""
        self._first_launch: float | torch.cuda.Event = 0.0
        self._measuring_step = True
        self._since_check = 0
        """Steps since calibration or the last drift check."""
        self.dense_cost_s = 0.0
        """The measured all-dense step cost (`_gather_window`) the plan must not exceed by more than `hysteresis`."""
        self.dense_hold = 0
        """Drift checks left before a plan reverted to dense may leave it again."""
        self._reference_chain: list[float] | None = None
        """Rank 0: the measured chain seconds per bucket drift is judged against (the current plan's first
        window; None: the next window sets it)."""
        self._trials: list[list[Choice]] = []
        """The plans tried after calibration (the same list on every rank)."""
        self._trial_at = 0
        """The running trial's index (len(_trials): none running)."""
        self._trial_left = 0
        """Steps left of the running trial."""
        self._fresh_plan = False
        """The next step is a new plan's first: not timed (allocations, first touch of its buffers)."""
        self._tried: list[tuple[float, list[float]]] = []
        """Rank 0: each finished trial's measured step cost and chain seconds per bucket."""
        self._reference_settling = False
        """Rank 0: the reference is a new plan's first window; the next window replaces it."""
        self._moved_before: bool | None = None
        """Rank 0: the last window's chains moved (True: slower, False: faster), not yet confirmed."""
        self._remeasure = False
        """Rank 0: the links moved under a sparse plan; the next window runs all dense to measure it."""
        self._guarded: tuple[list[tuple[str, float]], float] | None = None
        """Rank 0: a plan that measured slower than dense (as (kind, density) pairs) and its step cost, while the
        next window measures all dense to compare."""
        self.sparse_delay_s = 0.0
        """Test hook: seconds of extra delay in every sparse exchange (a plan that measures slower than dense)."""
        self._options = lambda n: candidates(n, self.net_layout, cfg.densities, cfg.min_density, cfg.dense_below)

    # ------------------------------------------------------------ the exchange

    @property
    def calibrated(self) -> bool:
        """Measured, decided, and the decision tried (the plan is settled until the next drift check)."""
        return self.net is not None and self._trial_at >= len(self._trials)

    def _mark(self) -> float | torch.cuda.Event:
        """A point in time on the current stream: on CUDA an event (the host runs ahead of the kernels, and
        NCCL's wait does not block it), on a CPU the clock."""
        if self.topo.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        """Seconds between two marks (CUDA: `end` must have completed)."""
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    @property
    def measuring(self) -> bool:
        """Whether this step is timed: every calibration step, and the last steps before each drift check
        (on CUDA timing adds a host sync at the end of the step)."""
        if not self.calibrated:
            return True
        return self._since_check >= self.cfg.redecide_every - min(self.cfg.redecide_every, WINDOW)

    def launch(self, bucket: Bucket) -> None:
        if self._measuring_step:
            now = self._mark()
            if not self._launched:
                self._first_launch = now
            self._launched[bucket.index] = now
        super().launch(bucket)

    def exchange(self, bucket: Bucket) -> torch.Tensor:
        start = self._mark() if self._measuring_step else None  # on the exchange stream
        choice = self.plan[bucket.index]
        folded = self._fold_residual(bucket, choice.kind)
        if choice.kind == "dense":
            out = self.dense_exchange(bucket)
        elif choice.kind == "dense16":  # a folded residual is sent exactly: fp32 this once
            out = self.dense_exchange(bucket, None if folded else self.wire16)
        elif choice.kind == "topk" or self.intra is None or self.inter is None:
            out = self.sparse_exchange(bucket, None, self.topo.world, choice.density)
            self._residual_kind[bucket.index] = "topk"
        else:
            out = self.sparse_exchange(bucket, self.intra, self.inter, choice.density)
            self._residual_kind[bucket.index] = "hitopk"
        if self.inter_delay_s_per_mb:
            _, inter = exchange_bytes(describe(bucket.numel, choice, self.net_layout), self.net_layout)
            time.sleep(inter / 2**20 * self.inter_delay_s_per_mb)
        if self.sparse_delay_s and choice.sparse:
            time.sleep(self.sparse_delay_s)
        if start is not None:
            self._chain[bucket.index] = (start, self._mark())
        return out

    def _fold_residual(self, bucket: Bucket, kind: str) -> bool:
        """Before an exchange of another kind than the residual's: add the residual into this rank's gradient
        (at this step's loss scale) and drop it. Whether it did."""
        index = bucket.index
        old = self._residual_kind.get(index)
        residual = self.residuals.get(index)
        if residual is None or old == kind:
            return False
        flat = bucket.buffer
        lo = 0
        if old == "hitopk":
            lo = self.topo.local_rank * residual.numel()
        hi = min(flat.numel(), lo + residual.numel())
        part = residual[:hi - lo] if self.grad_scale is None else residual[:hi - lo] * self.grad_scale
        flat[lo:hi] += part.to(flat.dtype)
        self._folded.append((index, residual, old))
        del self.residuals[index], self._residual_kind[index]
        self._spare.pop(index, None)
        return True

    def begin_step(self) -> None:
        super().begin_step()
        self._folded = []
        self._measuring_step = self.measuring

    def rollback(self) -> None:
        super().rollback()
        for index, residual, kind in reversed(self._folded):
            self.residuals[index], self._residual_kind[index] = residual, kind
        self._folded = []

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["residual_kinds"] = {i: CODES[k] for i, k in self._residual_kind.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._residual_kind = {int(i): KINDS[int(c)] for i, c in state.get("residual_kinds", {}).items()}
        for i, residual in self.residuals.items():  # a state from a topk/hitopk communicator: from its size
            if i not in self._residual_kind:
                self._residual_kind[i] = self._layout_of_residual(i, residual.numel())
        self._folded = []

    def _layout_of_residual(self, index: int, size: int) -> str:
        """"topk" for a residual of the whole bucket, "hitopk" for one of this rank's 1/L shard."""
        n = self.buckets[index].numel
        if size == n:
            return "topk"
        if size == math.ceil(n / self.local_size):
            return "hitopk"
        raise ValueError(f"comm state: the residual of bucket {index} has {size} elements, neither the bucket's "
                         f"{n} (topk) nor its 1/{self.local_size} shard (hitopk): saved with other buckets")

    # ------------------------------------------------------------ measuring and deciding

    def finish(self) -> dict[str, float]:
        if self._next == 0:  # no bucket launched yet: begin_step runs inside super().finish()
            self._measuring_step = self.measuring
        timed = self._measuring_step
        end = self._mark() if timed else None  # backward has ended
        stats = super().finish()
        if timed:
            done = self._mark()  # the gradients are usable
            if not isinstance(done, float):
                done.synchronize()
            if self._local_steps > 0 and not self._fresh_plan:  # a first step pays allocations and set-up
                ready = [max(self._seconds(self._launched[b.index], end), 0.0) if b.index in self._launched
                         else 0.0 for b in self.buckets]  # launched by finish itself: ready at the end
                chain = [self._seconds(*self._chain[b.index]) if b.index in self._chain else 0.0
                         for b in self.buckets]
                first = self._first_launch if self._launched else end
                self._rows.append((ready, chain, self._seconds(first, done), self._seconds(end, done)))
        self._local_steps += 1
        self._fresh_plan = False
        self._launched, self._chain = {}, {}
        if self.net is None:
            if self._local_steps >= self.calibration_steps:
                self._calibrate()
        elif not self.calibrated:
            self._trial_left -= 1
            if self._trial_left == 0:
                self._end_trial()
        else:
            self._since_check += 1
            if self._since_check >= self.cfg.redecide_every:
                self._since_check = 0
                self._check_drift()
        return {**stats, **self.decision_stats(stats)}

    def decision_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """The per-bucket choices and predicted vs measured times, for TensorBoard and the JSONL log."""
        out = {"calibrated": float(self.calibrated), "predicted_exposed_ms": self.predicted_exposed_s * 1e3,
               "measured_exposed_ms": stats.get("wait_s", 0.0) * 1e3}
        for b, choice in zip(self.buckets, self.plan):
            out[f"choice/{b.index}"] = float(CODES[choice.kind])
            out[f"choice_density/{b.index}"] = choice.density
            if self.predicted_chain_s:
                out[f"predicted_ms/{b.index}"] = self.predicted_chain_s[b.index] * 1e3
            if self._rows:
                out[f"measured_ms/{b.index}"] = self._rows[-1][1][b.index] * 1e3
        return out

    def trial_results(self) -> list[tuple[str, float]]:
        """Rank 0: (plan summary, measured step cost in seconds) of each finished trial, all dense last."""
        return [(plan_summary(plan), cost) for plan, (cost, _) in zip(self._trials, self._tried)]

    def pop_records(self) -> dict[str, float]:
        """The calibration (`calib/<key>`), once after it is measured."""
        out, self._unlogged = self._unlogged, {}
        return out

    def _medians(self, rows: list[tuple[list[float], list[float], float, float]]
                 ) -> tuple[list[float], list[float], float, float]:
        ready = [statistics.median(r[0][i] for r in rows) for i in range(len(self.buckets))]
        chain = [statistics.median(r[1][i] for r in rows) for i in range(len(self.buckets))]
        return ready, chain, statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)

    def _over_ranks(self, values: list[float]) -> tuple[list[float], list[float]]:
        """(maximum, minimum) of each value over the ranks."""
        # on the ranks' device: an NCCL-only group has no CPU backend (NCCL and gloo both carry float64)
        t = torch.tensor(values, dtype=torch.float64, device=self.topo.device)
        gathered = self.topo.world.all_gather(t, "calibration measurements").view(self.topo.world_size, -1).cpu()
        return gathered.max(dim=0).values.tolist(), gathered.min(dim=0).values.tolist()

    def _calibrate(self) -> None:
        ready, chain, span, exposed = self._medians(self._rows)
        probes = self._probe_links()
        select_pts, cast_pt = self._probe_local_work()
        names = sorted(probes)
        flat = ready + chain + [span, exposed] + [t for name in names for _, t in probes[name]] \
            + [t for _, t in select_pts] + [cast_pt[1]]
        flat, least = self._over_ranks(flat)
        nb = len(self.buckets)
        # A bucket's exchange on the rank that launched it last has the least wait for its peers in it, and
        # the earliest-ready rank bounds how much of it hides: minima. Probes and spans: a step is as slow as
        # its slowest rank, maxima.
        ready, chain, span, exposed = least[:nb], least[nb:2 * nb], flat[2 * nb], flat[2 * nb + 1]
        self.dense_cost_s = span  # the step cost `_gather_window` measures
        pos = 2 * nb + 2
        for name in names:
            probes[name] = [(x, flat[pos + j]) for j, (x, _) in enumerate(probes[name])]
            pos += len(probes[name])
        select_pts = [(x, flat[pos + j]) for j, (x, _) in enumerate(select_pts)]
        pos += len(select_pts)
        cast_s = flat[pos]
        self.net = build_network(self.net_layout, probes, select_pts, cast_s / max(cast_pt[0], 1))
        sizes = [b.numel for b in self.buckets]
        dense_pred = [self.net.network_s(describe(n, DENSE, self.net_layout)) for n in sizes]
        # from the bucket with the most bytes: a small bucket's time is mostly the wait for the slowest rank
        top = max(range(len(sizes)), key=lambda i: dense_pred[i])
        ratio = chain[top] / dense_pred[top] if dense_pred[top] > 0 else 1.0
        self.net.net_scale = min(max(ratio, SCALE_RANGE[0]), SCALE_RANGE[1])
        self.ready_before_end = ready
        self.calibration = {"nodes": float(self.net_layout.nodes), "ranks_per_node": float(self.net_layout.per_node),
                            "min_density": self.cfg.min_density, "dense_below": float(self.dense_below),
                            **{f"density/{i}": d for i, d in enumerate(self.cfg.densities)},
                            "local_competes": float(self.local_competes), "dense_span_s": span,
                            "dense_exposed_s": exposed, "net_scale": self.net.net_scale,
                            "select_per_element_s": self.net.selection.per_element_s,
                            "select_fixed_s": self.net.selection.fixed_s, "cast_per_element_s": self.net.cast_per_element_s,
                            **{f"link/{k}/alpha_s": v.alpha_s for k, v in self.net.links.items()},
                            **{f"link/{k}/bytes_per_s": v.bytes_per_s for k, v in self.net.links.items()},
                            **{f"bucket/{i}/elements": float(n) for i, n in enumerate(sizes)},
                            **{f"bucket/{i}/ready_before_end_s": r for i, r in enumerate(ready)},
                            **{f"bucket/{i}/dense_s": c for i, c in enumerate(chain)}}
        self._unlogged = {f"calib/{k}": v for k, v in self.calibration.items()}
        self._decide()
        self._reference_chain = chain if all(c == DENSE for c in self.plan) else None  # measured all dense
        self._rows = []
        if self.topo.is_main:
            print(self.table(chain), flush=True)
            if self._trials:
                print(f"comm auto: trying {len(self._trials) - 1} plan(s), then all dense, {self.cfg.trial_steps} "
                      "steps each", flush=True)

    def _decide(self) -> None:
        """Rank 0's plan and the plans to try, broadcast; the first of them from the next step on."""
        plans = None
        if self.topo.is_main:
            plans = [[(c.kind, c.density) for c in p] for p in self._trial_plans()]
        chosen = [[Choice(k, d) for k, d in p] for p in self.topo.world.broadcast_object(plans, src=0)]
        # no trials: the model's plan (the first) is kept as it is; with trials, all dense is the last
        self._trials = chosen + [[DENSE] * len(self.buckets)] if self.cfg.trial_steps and chosen else []
        self._trial_at, self._tried = 0, []
        self.set_plan(list(chosen[0]) if chosen else [DENSE] * len(self.buckets))
        self._trial_left = self.cfg.trial_steps if self._trials else 0

    def _trial_plans(self) -> list[list[Choice]]:
        """The model's plan, then the uniform plans (one candidate on every bucket that has it) it predicts
        faster than all dense, fastest first: at most `MAX_TRIALS`, none if the model's plan is all dense."""
        sizes = [b.numel for b in self.buckets]
        dense = [DENSE] * len(sizes)

        def predicted(plan: list[Choice]) -> float:
            return predict(sizes, self.ready_before_end, plan, self.net, self.local_competes)[0]

        plan, _ = choose(sizes, self.ready_before_end, self.net, self._options, self.local_competes)
        if plan == dense:
            return []
        dense_s = predicted(dense)
        uniform = [[c if c in self._options(n) else DENSE for n in sizes]
                   for c in {c: None for n in sizes for c in self._options(n)}]
        out = [plan]
        for other in sorted(uniform, key=predicted):
            if other not in out and other != dense and predicted(other) < dense_s and len(out) < MAX_TRIALS:
                out.append(other)
        return out

    def _end_trial(self) -> None:
        """The running trial's measurements (max over ranks); after the last trial (all dense) rank 0 keeps the
        plan that measured fastest, if it beat all dense by the choice's margin, else all dense: the model can be
        wrong where it matters most, inside the step on the device it has just fitted."""
        _, chain, cost = self._gather_window()
        nb = len(self.buckets)
        if self.topo.is_main:
            self._tried.append((cost, chain))
            print(f"comm auto: tried {plan_summary(self.plan)}: {cost * 1e3:.1f} ms", flush=True)
        self._trial_at += 1
        if self._trial_at < len(self._trials):
            self.set_plan(list(self._trials[self._trial_at]))
            self._trial_left = self.cfg.trial_steps
            return
        decision = None
        if self.topo.is_main:
            dense_cost = self._tried[-1][0]
            best = min(range(len(self._tried) - 1), key=lambda i: self._tried[i][0])
            decision = (best if self._tried[best][0] < (1 - MARGIN) * dense_cost else -1, dense_cost)
        pick, self.dense_cost_s = self.topo.world.broadcast_object(decision, src=0)
        self.set_plan(list(self._trials[pick]) if pick >= 0 else [DENSE] * nb)
        if self.topo.is_main:
            self._reference_chain = self._tried[pick][1] if pick >= 0 else None  # the kept plan's measured window
            print(f"comm auto: all dense measured {self.dense_cost_s * 1e3:.1f} ms; keeping "
                  f"{plan_summary(self.plan)}", flush=True)

    def set_plan(self, plan: list[Choice]) -> None:
        """Use `plan` from the next step on (every rank must set the same one; after calibration)."""
        if self.net is None:
            raise RuntimeError("comm auto: set_plan before calibration; the plan is predicted with the measured model")
        if len(plan) != len(self.buckets):
            raise ValueError(f"comm auto: a plan needs one choice per bucket ({len(self.buckets)}), got {len(plan)}")
        if list(plan) != self.plan:
            self._reference_chain = None  # drift is judged against the new plan's own first window
            self._moved_before = None
            self._fresh_plan = True
        self.plan = list(plan)
        self.predicted_exposed_s, self.predicted_chain_s = predict(
            [b.numel for b in self.buckets], self.ready_before_end, self.plan, self.net, self.local_competes)
        sizes = set()
        for b, c in zip(self.buckets, self.plan):
            if c.sparse:
                n = math.ceil(b.numel / (self.local_size if c.kind == "hitopk" else 1))
                sizes.add((n, k_of(n, c.density)))
        if sizes:  # compile the selection kernels for the new sizes now, not inside a timed step
            mstopk_warm_up(self.topo.device, sorted(sizes), self.iters)

    @property
    def local_competes(self) -> bool:
        """On a CPU the exchange's local work runs on the cores backward needs."""
        return self.topo.device.type == "cpu"

    def _check_drift(self) -> None:
        """Every rank gathers the window's measurements; rank 0 decides whether and what changes and broadcasts
        that in one call, so every rank takes the same branch."""
        window = self._gather_window()
        if window is not None:  # backward's length moves (progressive resizing): the ready times follow it
            self.ready_before_end = window[0]
        update = self._drift_update(window[1], window[2]) if self.topo.is_main and window is not None else None
        update = self.topo.world.broadcast_object(update, src=0)
        if update is None:
            return
        self.net.net_scale, self.dense_cost_s, self.dense_hold = \
            update["net_scale"], update["dense_cost_s"], update["dense_hold"]
        plan = [Choice(k, d) for k, d in update["plan"]] if update["plan"] is not None else self.plan
        self.set_plan(plan)  # with a new plan, or the same one predicted with the new scale
        if self.topo.is_main and update["message"]:
            print(update["message"] + ", ".join(f"{b.index}:{c.label}" for b, c in zip(self.buckets, self.plan)),
                  flush=True)

    def _gather_window(self) -> tuple[list[float], list[float], float] | None:
        """A collective (every rank calls it): the timed rows' medians over the ranks, the rows cleared. Ready
        and chain seconds per bucket take their minimum over ranks; the step cost - the span from the first
        launch to usable gradients, which holds the wait after backward and any slowing of backward by the
        exchange's own work - its maximum. None when no step was timed (the same on every rank)."""
        nb = len(self.buckets)
        timed = bool(self._rows)
        values = [0.0] * (2 * nb + 1)
        if timed:
            ready, chain, span, _ = self._medians(self._rows)
            values = ready + chain + [span]
        self._rows = []
        most, least = self._over_ranks(values)
        return (least[:nb], least[nb:2 * nb], most[2 * nb]) if timed else None

    def _drift_update(self, chain: list[float], cost: float) -> dict:
        """Rank 0: the link scale, plan (None: the same), all-dense baseline and hold after a window's
        measurements (chain: seconds per bucket; cost: `_gather_window`'s step cost)."""
        h = self.cfg.hysteresis
        sizes = [b.numel for b in self.buckets]
        # drift is a change of the measured chains under the same plan (against the plan's first window), not
        # a gap between model and measurement: a model that fits one plan's chains less well than another's
        # would otherwise flip between them
        reference = self._reference_chain
        if reference is None or len(reference) != len(chain) or self._reference_settling:
            # a new plan's first windows set the reference; the second replaces the first, whose steps can
            # still be settling (allocator, selection kernels, caches)
            self._reference_settling = reference is None
            self._reference_chain, reference = chain, chain
        # the bucket the model gives the longest chain: a small bucket's time is mostly the wait for its peers
        top = max(range(len(chain)), key=lambda i: self.predicted_chain_s[i])
        ratio = chain[top] / reference[top] if reference[top] > 0 else 1.0
        # a move counts when two windows in a row moved the same way: one noisy window does not re-decide
        moved = abs(ratio - 1) > h and self._moved_before == (ratio > 1)
        self._moved_before = (ratio > 1) if abs(ratio - 1) > h and not moved else None
        if moved:
            self._reference_chain = chain
        dense_now = all(c == DENSE for c in self.plan)
        if dense_now and self._remeasure:
            # the all-dense window after the links moved under a sparse plan: the link scale from what dense
            # measures now against what the model predicted for it, then a decision from there
            self._remeasure = False
            ratio = chain[top] / self.predicted_chain_s[top] if self.predicted_chain_s[top] > 0 else 1.0
            moved = True
        scale = min(max(self.net.net_scale * ratio, SCALE_RANGE[0]), SCALE_RANGE[1]) if moved else self.net.net_scale
        # the guard's baseline is always a measured all-dense step under today's links: it follows the
        # measurements while the plan is all dense, and a link change under a sparse plan measures it again
        dense_cost = cost if dense_now else self.dense_cost_s
        out = {"net_scale": scale, "plan": None, "message": "", "dense_cost_s": dense_cost,
               "dense_hold": max(self.dense_hold - 1, 0)}
        to_dense = [(DENSE.kind, DENSE.density)] * len(sizes)
        if dense_now and self._guarded is not None:  # the all-dense window after a plan measured slower
            plan, plan_cost = self._guarded
            self._guarded = None
            if plan_cost < (1 - MARGIN) * cost:
                self._reference_chain = None
                return {**out, "plan": plan, "message": f"comm auto: all dense measures {cost * 1e3:.1f} ms now, "
                                                        f"the plan {plan_cost * 1e3:.1f} ms; back to it: "}
            return {**out, "dense_hold": HOLD_CHECKS,
                    "message": f"comm auto: all dense measures {cost * 1e3:.1f} ms now, the plan "
                               f"{plan_cost * 1e3:.1f} ms; staying dense: "}
        if not dense_now and moved:
            self._remeasure, self._reference_chain = True, None
            return {**out, "plan": to_dense,
                    "message": f"comm auto: link times moved x{ratio:.2f}; one window all dense to measure it: "}
        # the guard needs its dense baseline on the same links: not while a move awaits its second window
        if not dense_now and cost > (1 + h) * dense_cost and self._moved_before is None:
            self._reference_chain = None
            self._guarded = ([(c.kind, c.density) for c in self.plan], cost)
            return {**out, "plan": to_dense,
                    "message": f"comm auto: measured {cost * 1e3:.1f} ms against {dense_cost * 1e3:.1f} ms all "
                               "dense; one window all dense to compare: "}
        if not moved or out["dense_hold"] > 0:
            return out
        old, self.net.net_scale = self.net.net_scale, scale
        current, _ = predict(sizes, self.ready_before_end, self.plan, self.net, self.local_competes)
        plan, t = choose(sizes, self.ready_before_end, self.net, self._options, self.local_competes)
        self.net.net_scale = old
        if t < (1 - h) * current:
            self._reference_chain = None  # the new plan's first window is its reference
            return {**out, "plan": [(c.kind, c.density) for c in plan],
                    "message": f"comm auto: link times moved x{ratio:.2f}; new plan: "}
        return out

    # ------------------------------------------------------------ probes

    def _timed(self, fn: Callable[[], object], reps: int = 2) -> float:
        sync = torch.cuda.synchronize if self.topo.device.type == "cuda" else (lambda: None)
        fn()
        times = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()  # the kernels' time, not their launch
            times.append(time.perf_counter() - start)
        return min(times)

    def _probe_links(self) -> dict[str, list[tuple[float, float]]]:
        """{probe: [(bytes, seconds)]} of each group's collectives at two sizes (all ranks, in the same order)."""
        topo, lay = self.topo, self.net_layout
        per = lay.per_node
        delay = self.inter_delay_s_per_mb
        out: dict[str, list[tuple[float, float]]] = {}

        def probe(name: str, group: Group, op: str, sizes: Sequence[int], dtype: torch.dtype, inter_share: float) -> None:
            rows = []
            for n in sizes:
                t = torch.ones(n, dtype=dtype, device=topo.device)
                nbytes = n * t.element_size()

                def run() -> None:
                    if op == "allreduce":
                        group.all_reduce_(t, "probe allreduce")
                    elif op == "allgather":
                        group.all_gather(t, "probe allgather")
                    else:
                        group.reduce_scatter(t, "probe reduce-scatter")
                    if delay and inter_share:
                        time.sleep(inter_share * nbytes / 2**20 * delay)
                rows.append((float(nbytes), self._timed(run)))
            out[name] = rows

        w = lay.world
        ring_inter = 2 * (w - 1) / w * (lay.nodes / w if lay.nodes > 1 else 0.0)
        probe("world", topo.world, "allreduce", (2**13, 2**17), torch.float32, ring_inter)
        probe("world16", topo.world, "allreduce", (2**13, 2**17), self.wire16, ring_inter)
        probe("world_gather", topo.world, "allgather", (2**11, 2**15), torch.float32,
              (w - 1) * (lay.nodes / w if lay.nodes > 1 else 0.0))  # node-major ring: N of W hops cross
        if lay.per_node > 1 and lay.nodes > 1:
            probe("inter", topo.inter_node, "allgather", (2**11, 2**15), torch.float32, lay.nodes - 1)
            probe("intra_gather", topo.intra_node, "allgather", (2**13, 2**17), torch.float32, 0.0)
            probe("intra_scatter", topo.intra_node, "reduce_scatter",  # sizes the ranks of a node divide evenly
                  (2**14 // per * per, 2**18 // per * per), torch.float32, 0.0)
        return out

    def _probe_local_work(self) -> tuple[list[tuple[float, float]], tuple[float, float]]:
        """Seconds of the sparse local work on each large bucket's gradient (and a shard of it), and of a 16-bit
        round trip of the largest bucket: [(elements, s)], (elements, s)."""
        density = max([d for d in self.cfg.densities if d >= self.cfg.min_density] or [self.cfg.min_density])
        peers = max(self.inter.size if self.inter is not None else 1, 1)
        points = []
        big = [b for b in self.buckets if b.numel >= self.dense_below and b.buffer is not None]
        for b in big:
            for part in sorted({b.numel, math.ceil(b.numel / self.local_size)}):
                # this bucket's values (selection cost depends on them), made finite: after an fp16 overflow
                # the live gradient holds inf/NaN, which selection rejects
                g = torch.nan_to_num(b.buffer[:part].float(), nan=0.0, posinf=0.0, neginf=0.0)
                points.append((float(part), self._timed(sparse_local_work(g, density, peers, self.iters),
                                                        reps=1)
                               + self.sparse_delay_s))
        largest = max(self.buckets, key=lambda b: b.numel)
        cast = self._timed(lambda: largest.buffer.to(self.wire16).to(largest.buffer.dtype), reps=1) \
            if largest.buffer is not None else 0.0
        return points, (float(largest.numel), cast)

    def table(self, dense_chain: Sequence[float]) -> str:
        """The decision, one line per bucket (printed on rank 0 at the end of calibration)."""
        net = self.net
        head = (f"comm auto: {self.net_layout.nodes} nodes x {self.net_layout.per_node} ranks; links "
                + ", ".join(f"{k} {v.bytes_per_s * 8 / 1e9:.2f} Gbit/s {v.alpha_s * 1e6:.0f} us"
                            for k, v in net.links.items())
                + f"; measured/modelled during backward x{net.net_scale:.2f}; selection "
                f"{net.selection.per_element_s * 1e9:.1f} ns/element; min density {self.cfg.min_density:g}")
        lines = [head, f"{'bucket':>6} {'elements':>10} {'ready ms':>9} {'dense ms':>9} {'choice':>14} {'pred ms':>8}"]
        for b, choice in zip(self.buckets, self.plan):
            lines.append(f"{b.index:>6} {b.numel:>10} {self.ready_before_end[b.index] * 1e3:>9.1f} "
                         f"{dense_chain[b.index] * 1e3:>9.1f} {choice.label:>14} {self.predicted_chain_s[b.index] * 1e3:>8.1f}")
        dense_exposed, _ = predict([b.numel for b in self.buckets], self.ready_before_end, [DENSE] * len(self.buckets),
                                   net, self.local_competes)
        lines.append(f"predicted exposed exchange: {self.predicted_exposed_s * 1e3:.1f} ms (all dense: "
                     f"{dense_exposed * 1e3:.1f} ms); ready ms = launched this long before backward ended")
        return "\n".join(lines)


def build_network(layout: Layout, probes: dict[str, list[tuple[float, float]]],
                  select_points: Sequence[tuple[float, float]], cast_per_element_s: float) -> Network:
    """The links and local costs fitted to probe measurements ({probe: [(bytes, seconds)]}, see
    AutoCommunicator._probe_links) and the sparse local work's [(elements, seconds)]."""
    w, per, nodes = layout.world, layout.per_node, layout.nodes
    links = {"world": fit_collective(probes["world"], ring_allreduce_s, w)}
    if "world16" in probes:  # a link carries bytes: a 16-bit wire is never faster per byte (its sums may be slower)
        fitted = fit_collective(probes["world16"], ring_allreduce_s, w)
        links["world16"] = Link(max(fitted.alpha_s, links["world"].alpha_s),
                                min(fitted.bytes_per_s, links["world"].bytes_per_s))
    if "world_gather" in probes:
        links["world_gather"] = fit_collective(probes["world_gather"], allgather_s, w)
    if "inter" in probes:  # the node's L local ranks gather at once over its link
        links["inter"] = fit_collective(probes["inter"], lambda b, p, link: allgather_s(b, p, link, sharing=per),
                                        nodes)
    if "intra_gather" in probes:  # one link from both intra-node collectives: bytes scaled by each one's volume
        pts = [(b * _volume(allgather_s, per), t) for b, t in probes["intra_gather"]]
        pts += [(b * _volume(reduce_scatter_s, per), t) for b, t in probes.get("intra_scatter", [])]
        links["intra"] = fit_link(pts, _rounds(allgather_s, per), 1.0)
    selection = Selection(0.0, 0.0)
    if select_points:
        fixed, per_element = fit_affine(select_points)
        if per_element <= 0:  # noise between sizes: the average cost per element
            fixed, per_element = 0.0, sum(t for _, t in select_points) / sum(n for n, _ in select_points)
        selection = Selection(fixed, per_element)
    return Network(layout, links, selection, cast_per_element_s)


def _rounds(formula: Callable[[float, int, Link], float], p: int) -> float:
    """The latency terms of a collective's formula at p ranks: its time for no bytes at 1 s per step."""
    return formula(0.0, p, Link(1.0, 1.0))


def _volume(formula: Callable[[float, int, Link], float], p: int) -> float:
    """The bytes through the busiest link per byte of a collective's size: its time at 1 B/s, no latency."""
    return formula(1.0, p, Link(0.0, 1.0))


def fit_collective(points: Sequence[tuple[float, float]], formula: Callable[[float, int, Link], float], p: int
                   ) -> Link:
    """The link that makes `formula` (a `cost` collective: bytes, ranks, link -> seconds) fit the measured
    (bytes, seconds) at p ranks: least squares on the formula's own rounds and volume."""
    return fit_link(points, _rounds(formula, p), _volume(formula, p))


def network_from_calibration(cal: dict[str, float], layout: Layout) -> tuple[Network, list[int], list[float]]:
    """The fitted network, the bucket sizes and their ready times from `AutoCommunicator.calibration` (also
    logged as `comm/calib/<key>`)."""
    links = {key.split("/")[1]: Link(value, cal[f"link/{key.split('/')[1]}/bytes_per_s"])
             for key, value in cal.items() if key.startswith("link/") and key.endswith("/alpha_s")}
    if "world" not in links:
        raise ValueError("calibration: no link/world/* entries (not an auto communicator's calibration)")
    net = Network(layout, links, Selection(cal["select_fixed_s"], cal["select_per_element_s"]),
                  cal["cast_per_element_s"], net_scale=cal["net_scale"])
    count = sum(1 for key in cal if key.startswith("bucket/") and key.endswith("/elements"))
    sizes = [int(cal[f"bucket/{i}/elements"]) for i in range(count)]
    ready = [cal[f"bucket/{i}/ready_before_end_s"] for i in range(count)]
    return net, sizes, ready
