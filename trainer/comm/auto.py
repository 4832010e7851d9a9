"""`comm.kind: auto`: the plan executor (`trainer/comm/execute.py`) plus what it measures - the calibration's
steps, link probes and local work, then timed windows of steps - to feed the decision policy
(`trainer/comm/policy.py`), whose actions rank 0 broadcasts. docs/communicators.md describes the mechanism;
the cost model, and the fit of the measured links, is `trainer/comm/cost.py`.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from trainer.comm.base import Bucket
from trainer.comm.config import CommConfig
from trainer.comm.cost import (CODES, DENSE, Choice, Layout, Link, Network, Selection, Shapes, build_network,
                               candidates, describe, predict)
from trainer.comm.execute import PlanExecutor
from trainer.comm.policy import Action, Policy, Window
from trainer.comm.powersgd import PowerSGDExecution, factor_work
from trainer.comm.sparse import TOPK, sparse_local_work
from trainer.dist import Group, Topology

__all__ = ["AutoCommunicator", "build_network", "network_from_calibration"]


class AutoCommunicator(PlanExecutor):
    """Per-bucket exchange chosen from live measurements (docs/communicators.md).

    With powersgd in `comm.auto_kinds` its state adds PowerSGD's (`powersgd`: Q per bucket, random draws). A
    bucket that leaves powersgd keeps its Q (the average, alike on every rank): if it comes back, the power
    iteration warm-starts from it, orthogonalised; its residual is folded like any other kind's."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology) -> None:
        self.powersgd: PowerSGDExecution | None = None
        """powersgd's execution, when `comm.auto_kinds` lists it."""
        executions = {"topk": TOPK, "hitopk": TOPK}
        if "powersgd" in cfg.auto_kinds:
            self.powersgd = executions["powersgd"] = PowerSGDExecution(cfg.powersgd_rank, cfg.powersgd_warm_start)
        super().__init__(cfg, model, topo, "dense", executions, intra=topo.intra_node,
                         inter=topo.inter_node, replans=True)
        self.shapes: list[Shapes] | None = None
        """Per bucket, the (rows, cols, rank) of the matrices powersgd would compress (None: powersgd is not
        among `comm.auto_kinds`)."""
        if self.powersgd is not None:
            self.shapes = [self.powersgd.view(b).shapes if b.numel >= cfg.dense_below else () for b in self.buckets]
        self.calibration_steps = max(cfg.calibration_steps, cfg.dense_warmup_steps)
        self.net: Network | None = None
        """The fitted model (None until calibrated)."""
        self.ready_before_end: list[float] = []
        self.predicted_chain_s: list[float] = []
        self.predicted_exposed_s = 0.0
        self.calibration: dict[str, float] = {}
        """The measurements, for the logs and `scripts/plan.py --from-run`."""
        self._unlogged: dict[str, float] = {}
        self._local_steps = 0
        """Exchanges since this process started (calibration is per process: a resumed run measures again)."""
        self._launched: dict[int, float | torch.cuda.Event] = {}
        self._chain: dict[int, tuple[float | torch.cuda.Event, float | torch.cuda.Event]] = {}
        self._rows: list[tuple[list[float], list[float], float, float]] = []
        """Per measured step: ready-before-end and chain seconds per bucket, the first-launch-to-usable span
        and the exposed wait (end of backward to usable gradients)."""
        self._first_launch: float | torch.cuda.Event = 0.0
        self._measuring_step = True
        self.policy: Policy | None = None
        """Rank 0, once calibrated: the decisions (trainer/comm/policy.py)."""
        self._action: Action | None = None
        """The policy's action being run (the same on every rank; None: calibrating)."""
        self._left = self.calibration_steps
        """Steps left before the next window is gathered (the calibration's, then each action's)."""
        self._timed_steps = self.calibration_steps
        """How many of the last steps before it are timed."""
        self._fresh_plan = False
        """The next step is a new plan's first: not timed (allocations, first touch of its buffers)."""
        self._options = lambda i: candidates(self.buckets[i].numel, self.net_layout, cfg.densities, cfg.min_density,
                                             cfg.dense_below, cfg.auto_kinds, self.shapes[i] if self.shapes else None)
        self.warm_up_options()

    # ------------------------------------------------------------ the exchange

    @property
    def calibrated(self) -> bool:
        """Measured, decided, and the decision tried (the plan is settled until the next drift check)."""
        return self._action is not None and not self._action.trial

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
        """Whether this step is timed: every calibration and trial step, and the last steps before each drift
        check (the action's `timed`; on CUDA timing adds a host sync at the end of the step)."""
        return self._left <= self._timed_steps

    def launch(self, bucket: Bucket) -> None:
        if self._measuring_step:
            now = self._mark()
            if not self._launched:
                self._first_launch = now
            self._launched[bucket.index] = now
        super().launch(bucket)

    def exchange(self, bucket: Bucket) -> torch.Tensor:
        start = self._mark() if self._measuring_step else None  # on the exchange stream
        out = super().exchange(bucket)
        if start is not None:
            self._chain[bucket.index] = (start, self._mark())
        return out

    def begin_step(self) -> None:
        super().begin_step()
        if self.powersgd is not None:
            self.powersgd.begin_step()
        self._measuring_step = self.measuring

    def rollback(self) -> None:
        super().rollback()
        if self.powersgd is not None:
            self.powersgd.rollback()

    def state_dict(self) -> dict:
        """The executor's (steps, residuals and their kinds); with powersgd among the kinds, `powersgd`: Q per
        bucket and the random draws so far."""
        state = super().state_dict()
        if self.powersgd is not None:
            state["powersgd"] = self.powersgd.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The executor's; a missing `powersgd` entry starts PowerSGD's Q and draws afresh."""
        super().load_state_dict(state)
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state.get("powersgd", {}), self.topo.device)

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
        self._left -= 1
        if self._left == 0:
            self._window_done()
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
        return self.policy.trial_results() if self.policy is not None else []

    def pop_records(self) -> dict[str, float]:
        """The calibration (`calib/<key>`), once after it is measured."""
        out, self._unlogged = self._unlogged, {}
        return out

    def _medians(self, rows: list[tuple[list[float], list[float], float, float]]
                 ) -> tuple[list[float], list[float], float, float]:
        ready = [statistics.median(r[0][i] for r in rows) for i in range(len(self.buckets))]
        chain = [statistics.median(r[1][i] for r in rows) for i in range(len(self.buckets))]
        return ready, chain, statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)

    def _over_ranks(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, by rank (a collective)."""
        # on the ranks' device: an NCCL-only group has no CPU backend (NCCL and gloo both carry float64)
        t = torch.tensor(values, dtype=torch.float64, device=self.topo.device)
        return self.topo.world.all_gather(t, "calibration measurements").view(self.topo.world_size, -1).cpu().tolist()

    def _calibrate(self) -> None:
        """Probe the links and the local work, fit the model to every rank's measurements, and start the policy."""
        ready, chain, span, exposed = self._medians(self._rows)
        probes = self._probe_links()
        select_pts, cast_pt = self._probe_local_work()
        flops_pt = self._probe_factor_work()
        names = sorted(probes)
        flat = ready + chain + [span, exposed] + [t for name in names for _, t in probes[name]] \
            + [t for _, t in select_pts] + [cast_pt[1], flops_pt[1]]
        rows = self._over_ranks(flat)
        nb = len(self.buckets)
        dense = (DENSE,) * nb
        window = Window.merged([Window(dense, tuple(r[:nb]), tuple(r[nb:2 * nb]), r[2 * nb]) for r in rows])
        # probes, the exposed wait and the local work: a step is as slow as its slowest rank
        most = [max(column) for column in zip(*rows)]
        exposed = most[2 * nb + 1]
        pos = 2 * nb + 2
        for name in names:
            probes[name] = [(x, most[pos + j]) for j, (x, _) in enumerate(probes[name])]
            pos += len(probes[name])
        select_pts = [(x, most[pos + j]) for j, (x, _) in enumerate(select_pts)]
        pos += len(select_pts)
        cast_s, flops_s = most[pos], most[pos + 1]
        self.net = build_network(self.net_layout, probes, select_pts, cast_s / max(cast_pt[0], 1),
                                 flops_s / flops_pt[0] if flops_pt[0] else 0.0)
        sizes = [b.numel for b in self.buckets]
        if self.topo.is_main:
            self.policy = Policy(self.cfg, sizes, self._options, self.local_competes, self.shapes)
        action = self._follow(lambda policy: policy.start(self.net, window))
        self._rows = []
        ready, chain = list(window.ready_before_end), list(window.chain_s)
        self.calibration = {"nodes": float(self.net_layout.nodes), "ranks_per_node": float(self.net_layout.per_node),
                            "min_density": self.cfg.min_density, "dense_below": float(self.dense_below),
                            **{f"density/{i}": d for i, d in enumerate(self.cfg.densities)},
                            "local_competes": float(self.local_competes), "dense_span_s": window.cost_s,
                            "dense_exposed_s": exposed, "net_scale": self.net.net_scale,
                            "select_per_element_s": self.net.selection.per_element_s,
                            "select_fixed_s": self.net.selection.fixed_s, "cast_per_element_s": self.net.cast_per_element_s,
                            "seconds_per_flop": self.net.seconds_per_flop,
                            **{f"link/{k}/alpha_s": v.alpha_s for k, v in self.net.links.items()},
                            **{f"link/{k}/bytes_per_s": v.bytes_per_s for k, v in self.net.links.items()},
                            **{f"bucket/{i}/elements": float(n) for i, n in enumerate(sizes)},
                            **{f"bucket/{i}/ready_before_end_s": r for i, r in enumerate(ready)},
                            **{f"bucket/{i}/dense_s": c for i, c in enumerate(chain)}}
        self._unlogged = {f"calib/{k}": v for k, v in self.calibration.items()}
        if self.topo.is_main:
            print(self.table(chain), flush=True)
            if action.message:
                print(action.message, flush=True)

    def _window_done(self) -> None:
        """After the calibration's steps, calibrate; after an action's, gather their window and follow the
        policy's next action (no step timed, which is the same on every rank: the same action again)."""
        if self.net is None:
            self._calibrate()
            return
        window = self._gather_window()
        if window is None:
            self._left = self._action.steps
            return
        action = self._follow(lambda policy: policy.observe(window))
        if self.topo.is_main and action.message:
            print(action.message, flush=True)

    def _follow(self, decide: Callable[[Policy], Action]) -> Action:
        """Rank 0's policy decides, every rank takes that action (one broadcast: ranks cannot disagree)."""
        action = decide(self.policy) if self.policy is not None else None
        action = self.topo.world.broadcast_object(action, src=0)
        self._action, self._left, self._timed_steps = action, action.steps, action.timed
        self.net.net_scale = action.net_scale
        self.ready_before_end = list(action.ready_before_end)
        self.set_plan(list(action.plan))  # with a new plan, or the same one predicted with the new scale
        return action

    def set_plan(self, plan: list[Choice]) -> None:
        """Use `plan` from the next step on (every rank must set the same one; after calibration)."""
        if self.net is None:
            raise RuntimeError("comm auto: set_plan before calibration; the plan is predicted with the measured model")
        if len(plan) != len(self.buckets):
            raise ValueError(f"comm auto: a plan needs one choice per bucket ({len(self.buckets)}), got {len(plan)}")
        unknown = sorted({c.kind for c in plan} - set(self.executions))
        if unknown:
            raise ValueError(f"comm auto: {', '.join(unknown)} is not among comm.auto_kinds {self.cfg.auto_kinds}")
        if list(plan) != self.plan:
            self._fresh_plan = True
        self.plan = list(plan)
        self.predicted_exposed_s, self.predicted_chain_s = predict(
            [b.numel for b in self.buckets], self.ready_before_end, self.plan, self.net, self.local_competes,
            self.shapes)
        self.warm_up(zip([b.numel for b in self.buckets], self.plan))

    def warm_up_options(self) -> None:
        """Compile the selection kernels for every size a plan may select from."""
        self.warm_up((b.numel, c) for i, b in enumerate(self.buckets) for c in self._options(i))

    def selection_sizes(self) -> dict[tuple[int, float], int]:
        """Every (elements, density) a plan may select from: each large bucket (topk) and its 1/L shard
        (hitopk), at each density auto may choose."""
        sizes: dict[tuple[int, float], int] = {}
        for i, b in enumerate(self.buckets):
            for c in self._options(i):
                if c.sparse:
                    key = (self.placement(self.runs_as(c).kind, b.numel)[1], c.density)
                    sizes[key] = sizes.get(key, 0) + 1
        return sizes

    @property
    def local_competes(self) -> bool:
        """On a CPU the exchange's local work runs on the cores backward needs."""
        return self.topo.device.type == "cpu"

    def _gather_window(self) -> Window | None:
        """A collective (every rank calls it): the timed rows' medians merged over the ranks (`Window.merged`),
        the rows cleared. None when no step was timed (the same on every rank)."""
        nb = len(self.buckets)
        timed = bool(self._rows)
        values = [0.0] * (2 * nb + 1)
        if timed:
            ready, chain, span, _ = self._medians(self._rows)
            values = ready + chain + [span]
        self._rows = []
        rows = self._over_ranks(values)
        if not timed:
            return None
        return Window.merged([Window(tuple(self.plan), tuple(r[:nb]), tuple(r[nb:2 * nb]), r[2 * nb]) for r in rows])

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
        out: dict[str, list[tuple[float, float]]] = {}

        def probe(name: str, group: Group, op: str, sizes: Sequence[int], dtype: torch.dtype) -> None:
            rows = []
            for n in sizes:
                t = torch.ones(n, dtype=dtype, device=topo.device)

                def run() -> None:
                    if op == "allreduce":
                        group.all_reduce_(t, "probe allreduce")
                    elif op == "allgather":
                        group.all_gather(t, "probe allgather")
                    else:
                        group.reduce_scatter(t, "probe reduce-scatter")
                rows.append((float(n * t.element_size()), self._timed(run)))
            out[name] = rows

        # The larger size moves a few MB over the slowest link: a shaped link (a cloud NIC's token bucket, tc tbf)
        # lets a burst of a few hundred KB through above its rate, so a probe that short fits too fast a link
        # (scripts/bench/links.py measures it); the smaller size carries the latency. An allgather's per-rank size
        # shrinks with its group, so that each link carries about 4 MB however many ranks gather.
        def gathered(group: Group) -> int:
            return max(2**11, 2**20 // max(group.size, 4))

        probe("world", topo.world, "allreduce", (2**13, 2**20), torch.float32)
        probe("world16", topo.world, "allreduce", (2**13, 2**20), self.wire16)
        probe("world_gather", topo.world, "allgather", (2**11, gathered(topo.world)), torch.float32)
        if lay.per_node > 1 and lay.nodes > 1:
            probe("inter", topo.inter_node, "allgather", (2**11, gathered(topo.inter_node)), torch.float32)
            probe("intra_gather", topo.intra_node, "allgather", (2**13, 2**20), torch.float32)
            probe("intra_scatter", topo.intra_node, "reduce_scatter",  # sizes the ranks of a node divide evenly
                  (2**14 // per * per, 2**21 // per * per), torch.float32)
        return out

    def _probe_local_work(self) -> tuple[list[tuple[float, float]], tuple[float, float]]:
        """Seconds of the sparse local work on each large bucket's gradient (and a shard of it), and of a 16-bit
        round trip of the largest bucket: [(elements, s)], (elements, s)."""
        density = max([d for d in self.cfg.densities if d >= self.cfg.min_density] or [self.cfg.min_density])
        nodes = max(self.inter.size if self.inter is not None else 1, 1)
        points = []
        big = [b for b in self.buckets if b.numel >= self.dense_below and b.buffer is not None]
        for b in big:
            # flat top-k selects from the whole bucket and scatter-adds one payload per rank; hitopk selects from
            # its shard and scatter-adds one per node
            for part, peers in sorted({(b.numel, self.topo.world_size), (self.placement("hitopk", b.numel)[1], nodes)}):
                # this bucket's values (selection cost depends on them), made finite: after an fp16 overflow
                # the live gradient holds inf/NaN, which selection rejects
                g = torch.nan_to_num(b.buffer[:part].float(), nan=0.0, posinf=0.0, neginf=0.0)
                points.append((float(part), self._timed(sparse_local_work(g, density, peers, self.iters,
                                                                          selection=self.selection),
                                                        reps=1)))
        largest = max(self.buckets, key=lambda b: b.numel)
        cast = self._timed(lambda: largest.buffer.to(self.wire16).to(largest.buffer.dtype), reps=1) \
            if largest.buffer is not None else 0.0
        return points, (float(largest.numel), cast)

    def _probe_factor_work(self) -> tuple[float, float]:
        """(flops, seconds) of powersgd's local work (`factor_work`; flops as `cost.describe` counts them) on the
        bucket with the most; (0, 0) when powersgd is not among the kinds or no bucket has a matrix."""
        if self.powersgd is None or not any(self.shapes or []):
            return 0.0, 0.0
        flops = [describe(b.numel, Choice("powersgd"), self.net_layout, s).flops if s else 0.0
                 for b, s in zip(self.buckets, self.shapes)]
        b = self.buckets[max(range(len(flops)), key=flops.__getitem__)]
        if b.buffer is None:
            return 0.0, 0.0
        # made finite: after an fp16 overflow the live gradient holds inf/NaN
        flat = torch.nan_to_num(b.buffer.float(), nan=0.0, posinf=0.0, neginf=0.0)
        return max(flops), self._timed(factor_work(flat, self.powersgd.view(b)), reps=1)

    def table(self, dense_chain: Sequence[float]) -> str:
        """The decision, one line per bucket (printed on rank 0 at the end of calibration)."""
        net = self.net
        head = (f"comm auto: {self.net_layout.nodes} nodes x {self.net_layout.per_node} ranks; links "
                + ", ".join(f"{k} {v.bytes_per_s * 8 / 1e9:.2f} Gbit/s {v.alpha_s * 1e6:.0f} us"
                            for k, v in net.links.items())
                + f"; measured/modelled during backward x{net.net_scale:.2f}; selection "
                f"{net.selection.per_element_s * 1e9:.1f} ns/element; min density {self.cfg.min_density:g}"
                + (f"; powersgd local work {net.seconds_per_flop * 1e12:.2f} ps/flop" if self.powersgd else ""))
        lines = [head, f"{'bucket':>6} {'elements':>10} {'ready ms':>9} {'dense ms':>9} {'choice':>14} {'pred ms':>8}"]
        for b, choice in zip(self.buckets, self.plan):
            lines.append(f"{b.index:>6} {b.numel:>10} {self.ready_before_end[b.index] * 1e3:>9.1f} "
                         f"{dense_chain[b.index] * 1e3:>9.1f} {choice.label:>14} {self.predicted_chain_s[b.index] * 1e3:>8.1f}")
        dense_exposed, _ = predict([b.numel for b in self.buckets], self.ready_before_end, [DENSE] * len(self.buckets),
                                   net, self.local_competes, self.shapes)
        lines.append(f"predicted exposed exchange: {self.predicted_exposed_s * 1e3:.1f} ms (all dense: "
                     f"{dense_exposed * 1e3:.1f} ms); ready ms = launched this long before backward ended")
        return "\n".join(lines)


def network_from_calibration(cal: dict[str, float], layout: Layout) -> tuple[Network, list[int], list[float]]:
    """The fitted network, the bucket sizes and their ready times from `AutoCommunicator.calibration` (also
    logged as `comm/calib/<key>`)."""
    links = {key.split("/")[1]: Link(value, cal[f"link/{key.split('/')[1]}/bytes_per_s"])
             for key, value in cal.items() if key.startswith("link/") and key.endswith("/alpha_s")}
    if "world" not in links:
        raise ValueError("calibration: no link/world/* entries (not an auto communicator's calibration)")
    net = Network(layout, links, Selection(cal["select_fixed_s"], cal["select_per_element_s"]),
                  cal["cast_per_element_s"], net_scale=cal["net_scale"],
                  seconds_per_flop=cal.get("seconds_per_flop", 0.0))  # absent: powersgd was not measured
    count = sum(1 for key in cal if key.startswith("bucket/") and key.endswith("/elements"))
    sizes = [int(cal[f"bucket/{i}/elements"]) for i in range(count)]
    ready = [cal[f"bucket/{i}/ready_before_end_s"] for i in range(count)]
    return net, sizes, ready
