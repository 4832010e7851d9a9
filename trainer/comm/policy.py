"""`comm.kind: auto`'s decisions as a pure state machine: measured windows in, the next action out.

The executor (`trainer/comm/auto.py`) runs each `Action`'s plan for its steps, times the last `timed` of them
and feeds their `Window` back (`Policy.observe`). Only rank 0 holds a policy; its actions are broadcast, so
ranks cannot disagree. No clocks, no collectives: a policy is tested by feeding it windows. The mechanism
(calibration, trials, drift, the comparison with dense) is described in docs/communicators.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from trainer.comm.config import CommConfig
from trainer.comm.cost import (DENSE, MARGIN, Choice, Network, Shapes, choose, describe, plan_summary, predict,
                               shapes_at, uniform_plans)
from trainer.comm.plan import Plan

HOLD_CHECKS = 5
"""After a plan measured slower than all dense, this many drift checks do not re-decide (the plan stays all
dense; after them a link change may re-decide)."""

MAX_TRIALS = 3
"""Plans tried, measured, after calibration (the model's and the fastest uniform ones it predicts)."""

TRIAL_REACH = 2.0
"""A planned trial runs only while its plan could still be the fastest: predicted (all dense: as the calibration
measured it) within this factor of the fastest trial measured so far. The model is mostly optimistic (it leaves
out overheads) and can be far off for a sparse plan on a CPU, so the order of the trials stays the model's and
only a plan already beaten by this factor in measured time is skipped: on a slow link, all dense's trial would
spend `comm.trial_steps` of its slowest steps confirming what the calibration measured."""

SCALE_RANGE = (0.05, 100.0)
"""Bounds of the measured/modelled scale of the collectives (a wild measurement cannot zero or explode it)."""

WINDOW = 8
"""Steps timed before each drift check."""

NETWORK_SHARE = 0.25
"""A sparse plan's chain measures the links' move only if the model puts at least this share of it on the network
(the rest is the plan's own local work: selection, casts, factor products)."""

MEASURING_DENSE = ("measure_dense", "compare_dense", "recheck_dense")
"""The actions whose all-dense window only measures (the next check decides): the steps it times, + 1, not
`comm.redecide_every` when that is longer (each a dense step on what may be a slow link)."""


ActionKind = Literal["try", "keep", "switch", "measure_dense", "compare_dense", "recheck_dense", "restore", "hold"]
"""try: a plan on trial; keep: the same plan (after the trials: the one kept); switch: a new plan the model
predicts faster on moved links; measure_dense: the links moved under a sparse plan and dense could now be the
faster plan, all dense measures them;
compare_dense: the plan measured slower than dense, all dense is measured again to compare; recheck_dense: a plan
other than all dense ran `comm.dense_recheck_every` checks, one short all-dense window compares them on today's
links; restore: the plan beat that window and comes back; hold: it did not, dense stays for `HOLD_CHECKS`
checks."""


@dataclass(frozen=True)
class Window:
    """Timed steps of one plan, reduced over the ranks (medians over the steps)."""

    plan: Plan
    """The plan the steps ran."""
    ready_before_end: tuple[float, ...]
    """Per bucket: seconds before the end of backward it was launched (minimum over ranks)."""
    chain_s: tuple[float, ...]
    """Per bucket: seconds of its exchange chain (minimum over ranks: the last to launch waited least)."""
    cost_s: float
    """The step cost: first launch to usable gradients (maximum over ranks: a step is as slow as its slowest)."""

    @staticmethod
    def merged(per_rank: Sequence[Window]) -> Window:
        """Every rank's window of the same steps as the one window every rank decides on."""
        first = per_rank[0]
        return Window(first.plan, tuple(map(min, zip(*(w.ready_before_end for w in per_rank)))),
                      tuple(map(min, zip(*(w.chain_s for w in per_rank)))), max(w.cost_s for w in per_rank))


@dataclass(frozen=True)
class Action:
    """Run `plan` for `steps` steps, time the last `timed` of them (a plan's first step never counts), then
    report their window; predict with `net_scale` and `ready_before_end` meanwhile."""

    kind: ActionKind
    plan: Plan
    steps: int
    timed: int
    net_scale: float
    ready_before_end: tuple[float, ...]
    message: str = ""
    """What rank 0 prints (empty: nothing happened worth a line)."""

    @property
    def trial(self) -> bool:
        return self.kind == "try"


def _pairs(plan: Plan) -> str:
    return ", ".join(f"{i}:{c.label}" for i, c in enumerate(plan))


class Policy:
    """The decisions of one run after its calibration: which plans to try, which to keep, when the links or
    backward moved enough to measure dense again or re-decide. Feed it `start` once, then `observe` with the
    window of each action's steps."""

    def __init__(self, cfg: CommConfig, sizes: Sequence[int], options: Callable[[int], list[Choice]],
                 local_competes: bool, shapes: Sequence[Shapes | None] | None = None) -> None:
        self.cfg = cfg
        self.sizes = list(sizes)
        self.options = options
        """The candidate exchanges of bucket i (`cost.candidates` with its size and matrices)."""
        self.shapes = list(shapes) if shapes is not None else None
        """Per bucket, the matrices powersgd would compress (`cost.Shapes`; None: no bucket may take it)."""
        self.local_competes = local_competes
        """The exchange's local work runs on the cores backward needs (a CPU)."""
        self.net: Network | None = None
        """The model, with the link scale followed so far (None before `start`)."""
        self.ready: list[float] = []
        """Per bucket: seconds before the end of backward it is ready (the calibration's, then each drift
        window's)."""
        self.plan: Plan = (DENSE,) * len(self.sizes)
        self.dense_cost_s = 0.0
        """The last measured all-dense step cost (after a link move not measured again, an estimate of today's:
        `_check`): a plan slower than it by more than `hysteresis` is compared."""
        self.dense_hold = 0
        """Drift checks left before a plan reverted to dense may leave it again."""
        self.trials: list[Plan] = []
        """The plans tried after calibration, all dense last unless it was out of reach (`TRIAL_REACH`)."""
        self.tried: list[tuple[float, list[float]]] = []
        """Each finished trial's step cost and chain seconds per bucket."""
        self.calibration: tuple[float, list[float]] = (0.0, [])
        """The calibration's all-dense step cost and chain seconds per bucket: all dense's when its trial is
        skipped."""
        self._reference: list[float] | None = None
        """The chain seconds per bucket drift is judged against (None: the next window sets it)."""
        self._settling = False
        """The reference is a new plan's first window: the next window replaces it."""
        self._moved_before: bool | None = None
        """The last window's chains moved (True: slower, False: faster), not yet confirmed."""
        self._remeasure = False
        """The links moved under a sparse plan: the window under way runs all dense to measure them."""
        self._guarded: tuple[Plan, float, bool] | None = None
        """A plan that measured slower than dense (or is rechecked: True) and its step cost, while the window under
        way runs all dense."""
        self._since_dense = 0
        """Drift checks since the last all-dense window (`comm.dense_recheck_every`)."""

    # ------------------------------------------------------------ calibration and trials

    def start(self, net: Network, calibration: Window) -> Action:
        """The first action after the calibration's all-dense `calibration` window, with `net` fitted to the
        probes: its link scale is set here, from the largest bucket's measured dense chain."""
        net = dataclasses.replace(net, net_scale=1.0)
        dense_pred = [net.network_s(describe(n, DENSE, net.layout)) for n in self.sizes]
        # from the bucket with the most bytes: a small bucket's time is mostly the wait for the slowest rank
        top = max(range(len(self.sizes)), key=lambda i: dense_pred[i])
        ratio = calibration.chain_s[top] / dense_pred[top] if dense_pred[top] > 0 else 1.0
        self.net = dataclasses.replace(net, net_scale=_clamp(ratio))
        self.ready, self.dense_cost_s = list(calibration.ready_before_end), calibration.cost_s
        self.calibration = (calibration.cost_s, list(calibration.chain_s))
        plans = self._trial_plans()
        first = plans[0] if plans else self.dense
        self.trials = plans + [self.dense] if self.cfg.trial_steps and plans else []
        self._use(first)
        self._reference = list(calibration.chain_s) if first == self.dense else None
        if self.trials:
            return self._action("try", f"comm auto: trying {len(self.trials) - 1} plan(s), then all dense, "
                                       f"{self.cfg.trial_steps} steps each, while within x{TRIAL_REACH:g} of the "
                                       "fastest measured")
        return self._action("keep")

    def _trial_plans(self) -> list[Plan]:
        """The model's plan, then the uniform plans (one candidate on every bucket that has it) it predicts
        faster than all dense, fastest first: at most `MAX_TRIALS`, none if the model's plan is all dense."""
        plan, _ = choose(self.sizes, self.ready, self.net, self.options, self.local_competes, shapes=self.shapes)
        if tuple(plan) == self.dense:
            return []
        dense_s = self._predicted(self.dense)
        uniform = [tuple(p) for p in uniform_plans(len(self.sizes), self.options)]
        out = [tuple(plan)]
        for other in sorted(uniform, key=self._predicted):
            if other not in out and other != self.dense and self._predicted(other) < dense_s and len(out) < MAX_TRIALS:
                out.append(other)
        return out

    def _end_trial(self, window: Window) -> Action:
        """The next trial still within reach; after the last one the plan that measured fastest, if it beat all
        dense (its trial, or the calibration when its trial was out of reach) by the choice's margin, else all
        dense: the model can be wrong where it matters most, inside the step."""
        self.tried.append((window.cost_s, list(window.chain_s)))
        message = f"comm auto: tried {plan_summary(self.plan)}: {window.cost_s * 1e3:.1f} ms"
        fastest = min(cost for cost, _ in self.tried)
        done, planned = self.trials[:len(self.tried)], self.trials[len(self.tried):]
        self.trials = done + [plan for plan in planned if self._estimate(plan) <= TRIAL_REACH * fastest]
        skipped = len(done) + len(planned) - len(self.trials)
        if skipped:
            message += f"\ncomm auto: {skipped} trial(s) skipped: beyond x{TRIAL_REACH:g} of {fastest * 1e3:.1f} ms"
        if len(self.tried) < len(self.trials):
            self._use(self.trials[len(self.tried)])
            return self._action("try", message)
        measured = list(zip(self.trials, self.tried))
        if self.trials[-1] != self.dense:
            measured.append((self.dense, self.calibration))
        *others, (_, dense) = measured
        self.dense_cost_s = dense[0]
        where = "" if self.trials[-1] == self.dense else " (calibration)"
        plan, (cost, chain) = min(others, key=lambda pair: pair[1][0])
        if not _ahead(cost, self.dense_cost_s):
            plan, chain = self.dense, dense[1]
        self._use(plan)
        # the kept plan's measured window (all dense: its trial, else the calibration), so a link change in the
        # window after the trials is a move from it, not a new plan's settling reference that absorbs it
        self._reference = list(chain)
        return self._action("keep", f"{message}\ncomm auto: all dense measured {self.dense_cost_s * 1e3:.1f} ms"
                                    f"{where}; keeping {plan_summary(self.plan)}")

    def _estimate(self, plan: Plan) -> float:
        """A planned trial's step cost before it runs: all dense's as the calibration measured it, another plan's
        as the model predicts it."""
        return self.calibration[0] if plan == self.dense else self._predicted(plan)

    def trial_results(self) -> list[tuple[str, float]]:
        """(plan summary, measured step cost in seconds) of each finished trial, all dense last: its trial, or
        the calibration (marked so) when its trial was out of reach."""
        out = [(plan_summary(plan), cost) for plan, (cost, _) in zip(self.trials, self.tried)]
        if self.trials and len(self.tried) == len(self.trials) and self.trials[-1] != self.dense:
            out.append((f"{plan_summary(self.dense)} (calibration)", self.calibration[0]))
        return out

    # ------------------------------------------------------------ drift

    def observe(self, window: Window) -> Action:
        """The next action after the steps of the last one, from their window."""
        if self.net is None:
            raise RuntimeError("comm auto: Policy.observe before start")
        if len(self.tried) < len(self.trials):
            return self._end_trial(window)
        self._use(window.plan)  # a plan set from outside (`AutoCommunicator.set_plan`) is judged as its own
        self.ready = list(window.ready_before_end)  # backward's length moves (progressive resizing)
        return self._check(list(window.chain_s), window.cost_s)

    def _check(self, chain: list[float], cost: float) -> Action:
        """A drift check: the link scale, plan, all-dense baseline and hold after a window's chain seconds per
        bucket and step cost."""
        h = self.cfg.hysteresis
        # drift is a change of the measured chains under the same plan (against the plan's first window), not
        # a gap between model and measurement: a model that fits one plan's chains less well than another's
        # would otherwise flip between them
        reference = self._reference
        if reference is None or self._settling:
            # a new plan's first windows set the reference; the second replaces the first, whose steps can
            # still be settling (allocator, selection kernels, caches)
            self._settling = reference is None
            self._reference, reference = chain, chain
        # the bucket whose chain measured longest in the reference: a small bucket's time is mostly the wait for
        # its peers (not the model's longest: one link scale, from the large bucket's bytes, also scales a small
        # bucket's latency, and can make it the longest predicted when it measures a tenth)
        predicted = predict(self.sizes, self.ready, self.plan, self.net, self.local_competes, self.shapes)[1]
        top = max(range(len(chain)), key=lambda i: reference[i])
        ratio = chain[top] / reference[top] if reference[top] > 0 else 1.0
        # a move counts when two windows in a row moved the same way: one noisy window does not re-decide
        moved = abs(ratio - 1) > h and self._moved_before == (ratio > 1)
        self._moved_before = (ratio > 1) if abs(ratio - 1) > h and not moved else None
        if moved:
            self._reference = chain
        dense_now = self.plan == self.dense
        self._since_dense = 0 if dense_now else self._since_dense + 1
        if dense_now and self._remeasure:
            # the all-dense window after the links moved under a sparse plan: the link scale from what dense
            # measures now against what the model predicted for it, then a decision from there
            self._remeasure = False
            ratio = chain[top] / predicted[top] if predicted[top] > 0 else 1.0
            moved = True
        # under a sparse plan the links moved as its chain's network part did (None: too small a part to tell, and
        # the whole chain's move, which understates the links', stands in)
        link_move = None if dense_now or not moved else self._link_move(chain, reference, top)
        scale = ratio if link_move is None else link_move
        if moved:
            self.net = dataclasses.replace(self.net, net_scale=_clamp(self.net.net_scale * scale))
        # the comparison's baseline is a measured all-dense step under today's links: it follows the measurements
        # while the plan is all dense; a link change under a sparse plan measures it again, or scales it (below)
        if dense_now:
            self.dense_cost_s = cost
        self.dense_hold = max(self.dense_hold - 1, 0)
        if dense_now and self._guarded is not None:  # the all-dense window after a plan measured slower
            plan, plan_cost, recheck = self._guarded
            self._guarded = None
            said = f"comm auto: all dense measures {cost * 1e3:.1f} ms now, the plan {plan_cost * 1e3:.1f} ms"
            # this window also measures the links: a move that fell into the plan's first windows became its
            # reference and was never seen as drift; if dense moved from its prediction, the model follows it and
            # decides again (another plan may fit the new links better than the plan or dense)
            ratio = chain[top] / predicted[top] if predicted[top] > 0 else 1.0
            if abs(ratio - 1) > h:
                net = dataclasses.replace(self.net, net_scale=_clamp(self.net.net_scale * ratio))
                if recheck:  # the window's purpose: the model follows the links whatever comes next
                    self.net = net
                other, t = choose(self.sizes, self.ready, net, self.options, self.local_competes, shapes=self.shapes)
                was = predict(self.sizes, self.ready, plan, net, self.local_competes, self.shapes)[0]
                if tuple(other) not in (plan, self.dense) and t < (1 - h) * was:
                    # an unmeasured plan is taken on the model's word only where the refitted model ranks the two
                    # plans just measured as they measured: one scale cannot fit a dense chain whose time is
                    # mostly the wait for a loaded peer, and a model that still puts top-k ahead of a dense
                    # window that beat it would pick top-k again
                    if self._contradicts(net, was, plan_cost, cost):
                        kept = "kept" if recheck else "not applied"
                        said += (f"; link times moved x{ratio:.2f} ({kept}), but the model on them ranks the two the "
                                 f"other way: not switching to its {_pairs(other)}")
                    else:
                        self.net, self._reference = net, None
                        self._use(tuple(other))
                        return self._action("switch", f"{said}; link times moved x{ratio:.2f}; new plan: "
                                                      f"{_pairs(self.plan)}")
            if _ahead(plan_cost, cost):
                self._reference = None
                self._use(plan)
                return self._action("restore", f"{said}; back to it: {_pairs(self.plan)}")
            self.dense_hold = HOLD_CHECKS
            return self._action("hold", f"{said}; staying dense: {_pairs(self.plan)}")
        if not dense_now and moved:
            # all dense measures the moved links only where it could be the faster plan on them (on a slow link a
            # dense window costs what it measures). On slower links its last step is a lower bound of its step
            # now. On faster links that step scaled by the links' move is an estimate (its compute does not
            # shrink, but its collectives may move more than a plan's network part that is mostly latency; the
            # periodic recheck below catches that), 0 where this plan's chain cannot tell the move
            if ratio > 1:
                bound = self.dense_cost_s
            else:
                bound = 0.0 if link_move is None else self.dense_cost_s * link_move
            if bound < (1 + h) * cost:
                self._remeasure, self._reference = True, None
                self._use(self.dense)
                return self._action("measure_dense", f"comm auto: link times moved x{scale:.2f}; one window all "
                                                     f"dense to measure it: {_pairs(self.plan)}")
            self.dense_cost_s = bound
        # a sparse plan's chains are mostly its own selection: a link that got faster barely shows in them, so
        # every `dense_recheck_every` checks a short all-dense window measures today's links and is compared
        every = self.cfg.dense_recheck_every
        if not dense_now and every and self._since_dense >= every and self._moved_before is None:
            self._reference = None
            self._guarded = (self.plan, cost, True)
            self._use(self.dense)
            return self._action("recheck_dense", f"comm auto: {every} checks since all dense last ran; one short "
                                                 f"window all dense to compare on today's links: {_pairs(self.plan)}")
        # the comparison needs its dense baseline on the same links: not while a move awaits its second window
        if not dense_now and cost > (1 + h) * self.dense_cost_s and self._moved_before is None:
            self._reference = None
            self._guarded = (self.plan, cost, False)
            self._use(self.dense)
            return self._action("compare_dense", f"comm auto: measured {cost * 1e3:.1f} ms against "
                                                 f"{self.dense_cost_s * 1e3:.1f} ms all dense; one window all dense "
                                                 f"to compare: {_pairs(self.plan)}")
        if not moved or self.dense_hold > 0:
            return self._action("keep")
        current = self._predicted(self.plan)
        plan, t = choose(self.sizes, self.ready, self.net, self.options, self.local_competes, shapes=self.shapes)
        if t < (1 - h) * current:
            self._reference = None  # the new plan's first window is its reference
            self._use(tuple(plan))
            return self._action("switch", f"comm auto: link times moved x{scale:.2f}; new plan: {_pairs(self.plan)}")
        return self._action("keep")

    # ------------------------------------------------------------ helpers

    @property
    def dense(self) -> Plan:
        return (DENSE,) * len(self.sizes)

    def _link_move(self, chain: Sequence[float], reference: Sequence[float], top: int) -> float | None:
        """The links' move between two windows of the current plan, from bucket `top`'s chain less the local work
        the model puts in it; None when the network's part of the reference is under `NETWORK_SHARE`."""
        local = self.net.local_s(describe(self.sizes[top], self.plan[top], self.net.layout,
                                          shapes_at(self.shapes, top)))
        was, now = reference[top] - local, chain[top] - local
        if was < NETWORK_SHARE * reference[top]:
            return None
        return max(now, 0.0) / was

    def _contradicts(self, net: Network, was: float, plan_cost: float, dense_cost: float) -> bool:
        """`net`, which predicts `was` for a plan, puts the slower of that plan and all dense as measured ahead of
        the faster (each beyond the other by `MARGIN`)."""
        dense = predict(self.sizes, self.ready, self.dense, net, self.local_competes, self.shapes)[0]
        return (_ahead(dense_cost, plan_cost) and _ahead(was, dense)) or (_ahead(plan_cost, dense_cost) and
                                                                          _ahead(dense, was))

    def _predicted(self, plan: Sequence[Choice]) -> float:
        return predict(self.sizes, self.ready, plan, self.net, self.local_competes, self.shapes)[0]

    def _use(self, plan: Sequence[Choice]) -> None:
        """Make `plan` the current one; a different plan's drift is judged against its own first window."""
        plan = tuple(plan)
        if plan != self.plan:
            self._reference, self._moved_before = None, None
        self.plan = plan

    def _action(self, kind: ActionKind, message: str = "") -> Action:
        if kind == "try":
            steps = timed = self.cfg.trial_steps
        elif kind in MEASURING_DENSE:  # all dense at today's (maybe slow) links: only the steps it times, + 1
            timed = min(self.cfg.redecide_every, WINDOW)
            # a move's or a comparison's window is never longer than the plan's own
            steps = timed + 1 if kind == "recheck_dense" else min(self.cfg.redecide_every, timed + 1)
        else:
            steps, timed = self.cfg.redecide_every, min(self.cfg.redecide_every, WINDOW)
        return Action(kind, self.plan, steps, timed, self.net.net_scale, tuple(self.ready), message)


def _ahead(a: float, b: float) -> bool:
    """`a` is faster than `b` by more than `MARGIN`."""
    return a < (1 - MARGIN) * b


def _clamp(scale: float) -> float:
    return min(max(scale, SCALE_RANGE[0]), SCALE_RANGE[1])
