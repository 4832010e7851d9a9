"""`comm.kind: auto` on real gloo ranks (2 nodes x 2 ranks and 4 nodes x 1): mass conservation while buckets
switch between dense and sparse exchanges, the same decision on every rank, and a slow link (a test hook
that delays inter-node bytes) turning the large bucket sparse while a fast one keeps it dense."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import run_ranks
from trainer.comm import AutoCommunicator, CommConfig, build_communicator
from trainer.comm.auto import build_network, candidates, choose
from trainer.comm.cost import (DENSE, Choice, Layout, Link, Network, Selection, allgather_s, reduce_scatter_s,
                               ring_allreduce_s)
from trainer.dist import DistConfig, setup_distributed

pytestmark = pytest.mark.dist

SIZES = [3000, 70000, 18, 5001]
"""Packed into three buckets: 5019 (an odd size: hitopk pads its shards), 70000 and 3000 elements."""
BIG = 2**18


class Params(nn.Module):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in sizes)


def grads_of(rank: int, step: int, sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 8).round() for n in sizes]


def backward_with(model: Params, grads: list[torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    sum((p * g).sum() for p, g in zip(model.ps, grads)).backward()


def bucket_flat(comm: AutoCommunicator, tensors: list[torch.Tensor], model: Params) -> torch.Tensor:
    """`tensors` (one per parameter) in the communicator's bucket order, flat."""
    where = {id(p): i for i, p in enumerate(model.ps)}
    return torch.cat([tensors[where[id(p)]].reshape(-1) for b in comm.buckets for p in b.params])


def placed_residuals(comm: AutoCommunicator) -> torch.Tensor:
    """This rank's residuals at their positions in the flat bucket order (hitopk: this rank's shard)."""
    parts = []
    for b in comm.buckets:
        out = torch.zeros(b.numel, dtype=torch.float64)
        r = comm.residuals.get(b.index)
        if r is not None:
            lo = comm.topo.local_rank * r.numel() if comm._residual_kind[b.index] == "hitopk" else 0
            hi = min(b.numel, lo + r.numel())
            out[lo:hi] = r[:hi - lo].double()
        parts.append(out)
    return torch.cat(parts)


SCHEDULE = [(Choice("topk", 0.01), False), (Choice("hitopk", 0.01), False), (Choice("topk", 0.003), True),
            (Choice("topk", 0.003), False), (DENSE, False), (Choice("hitopk", 0.003), False),
            (Choice("dense16"), False), (Choice("dense16"), False), (Choice("hitopk", 0.01), True), (Choice("hitopk", 0.01), False),
            (Choice("topk", 0.01), False), (DENSE, False)]
"""(every large bucket's exchange, whether the optimizer skips the step) per step after calibration."""


def _switching_keeps_mass(rank: int, world: int, per_node: int) -> list[str]:
    topo = setup_distributed(DistConfig(ranks_per_node=per_node))
    model = Params(SIZES)
    cfg = CommConfig(kind="auto", bucket_mb=70000 * 4 / 2**20, dense_below=1000, calibration_steps=3,
                     densities=[0.01, 0.003], min_density=0.001, compression="fp16",  # fp16: exact on these sums
                     trial_steps=0)
    comm = build_communicator(cfg, model, topo)
    assert isinstance(comm, AutoCommunicator)
    assert per_node == 1 or any(b.numel % per_node for b in comm.buckets)  # the padding branch runs
    sent = torch.zeros(sum(SIZES), dtype=torch.float64)
    incoming = torch.zeros_like(sent)
    step = 0
    for step in range(cfg.calibration_steps):  # dense: calibration
        backward_with(model, grads_of(rank, step, SIZES))
        comm.finish()
        sent += bucket_flat(comm, [p.grad for p in model.ps], model).double() * world
        incoming += bucket_flat(comm, [sum(gs) for gs in zip(*(grads_of(r, step, SIZES) for r in range(world)))],
                                model).double()
    assert comm.calibrated
    decided = [c.label for c in comm.plan]
    for choice, skip in SCHEDULE:
        step += 1
        comm.set_plan([choice if b.numel >= cfg.dense_below else DENSE for b in comm.buckets])
        # the loss scale changes between the step that kept a residual and the one that folds it
        scale = 2.0 ** (step % 4)
        comm.set_grad_scale(torch.tensor(scale))
        backward_with(model, [g * scale for g in grads_of(rank, step, SIZES)])
        comm.finish()
        for p in model.ps:
            p.grad.div_(scale)
        if skip:  # the optimizer skipped this step: its residual updates (and folds) are undone
            comm.rollback()
            continue
        sent += bucket_flat(comm, [p.grad for p in model.ps], model).double() * world
        incoming += bucket_flat(comm, [sum(gs) for gs in zip(*(grads_of(r, step, SIZES) for r in range(world)))],
                                model).double()
        held = placed_residuals(comm)
        dist.all_reduce(held)
        torch.testing.assert_close(sent + held, incoming, rtol=0, atol=1e-6)
        if comm.plan[1].sparse:
            assert held.abs().sum() > 0  # something was held back
    return decided


@pytest.mark.parametrize("world,per_node", [(4, 2), (4, 1)])
def test_switching_buckets_keeps_the_mass_and_all_ranks_decide_alike(tmp_path, world, per_node):
    decisions = run_ranks(_switching_keeps_mass, world, tmp_path, per_node, timeout=240)
    assert all(d == decisions[0] for d in decisions), decisions


SELECTION_S = 0.05
"""Every sparse exchange (and the calibration's probe of it) costs this much more (test hook): the choice
does not depend on how fast this CPU selects."""


def _loads_topk_and_hitopk_states(rank: int, world: int) -> list[dict[int, str]]:
    """The residual layout auto reads from a topk and from a hitopk communicator's state."""
    topo = setup_distributed(DistConfig(ranks_per_node=2))
    cfg = CommConfig(bucket_mb=70000 * 4 / 2**20, dense_below=1000)
    kinds = []
    for kind in ("topk", "hitopk"):
        model = Params(SIZES)
        fixed = build_communicator(CommConfig(**{**vars(cfg), "kind": kind}), model, topo)
        backward_with(model, grads_of(rank, 0, SIZES))
        fixed.finish()
        fixed.detach()
        auto = build_communicator(CommConfig(**{**vars(cfg), "kind": "auto"}), model, topo)
        auto.load_state_dict(fixed.state_dict())
        kinds.append(dict(auto._residual_kind))
        auto.detach()
    return kinds


def test_auto_reads_the_residual_layout_of_a_topk_and_a_hitopk_state(tmp_path):
    kinds = run_ranks(_loads_topk_and_hitopk_states, 4, tmp_path, timeout=180)
    topk, hitopk = kinds[0]
    assert topk and set(topk.values()) == {"topk"}, topk
    assert hitopk and set(hitopk.values()) == {"hitopk"}, hitopk


def _auto_comm(topo, **overrides) -> tuple[CommConfig, Params, AutoCommunicator]:
    """An auto communicator over Params([BIG, 3000]): one bucket above dense_below (the large one), one below."""
    cfg = CommConfig(**{"kind": "auto", "bucket_mb": BIG * 4 / 2**20, "dense_below": 16384, "calibration_steps": 3,
                        "densities": [0.01], "min_density": 0.01, **overrides})
    model = Params([BIG, 3000])
    return cfg, model, build_communicator(cfg, model, topo)


def _decide_with_links(rank: int, world: int, per_node: int) -> list[list[str]]:
    """The plan (parameter order) with a slow inter-node link, then with the fast local one."""
    topo = setup_distributed(DistConfig(ranks_per_node=per_node))
    plans = []
    for delay_s_per_mb in (0.3, 0.0):
        cfg, model, comm = _auto_comm(topo, trial_steps=0)
        comm.inter_delay_s_per_mb, comm.sparse_delay_s = delay_s_per_mb, SELECTION_S
        for step in range(cfg.calibration_steps):
            backward_with(model, grads_of(rank, step, [BIG, 3000]))
            comm.finish()
        comm.detach()
        plans.append([c.kind for c in reversed(comm.plan)])  # parameter order: the large bucket first
    return plans


@pytest.mark.parametrize("world,per_node", [(4, 2), (4, 1)])
def test_a_slow_link_turns_the_large_bucket_sparse_and_a_fast_one_keeps_it_dense(tmp_path, world, per_node):
    plans = run_ranks(_decide_with_links, world, tmp_path, per_node, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    slow, fast = plans[0]
    assert slow[0] in ("topk", "hitopk") and slow[1].startswith("dense"), slow
    assert fast[0].startswith("dense"), fast


def _run_steps(comm: AutoCommunicator, model: Params, rank: int, steps: int) -> None:
    for step in range(steps):
        backward_with(model, grads_of(rank, step, [BIG, 3000]))
        comm.finish()


def _one_rank_selects_slowly(rank: int, world: int) -> list[str]:
    """The plan on a slow link when rank 1 alone selects slowly: on its own measurements rank 1 would keep
    the large bucket dense and every other rank would make it sparse."""
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    cfg, model, comm = _auto_comm(topo, trial_steps=0)
    comm.inter_delay_s_per_mb, comm.sparse_delay_s = 0.3, (5.0 if rank == 1 else SELECTION_S)
    _run_steps(comm, model, rank, cfg.calibration_steps)
    comm.detach()
    return [c.kind for c in reversed(comm.plan)]


def test_ranks_that_measure_differently_still_take_the_same_decision(tmp_path):
    plans = run_ranks(_one_rank_selects_slowly, 4, tmp_path, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    # the slowest rank bounds the step: its slow selection keeps the large bucket dense for everyone
    assert plans[0][0].startswith("dense"), plans


def _live_link_change(rank: int, world: int, delays_s_per_mb: list[float], trial_steps: int) -> list[list[str]]:
    """The plan once calibrated (and tried), then after each window, the link's delay per MB set per window."""
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    # hysteresis: the link changes are x3 and more; 3-step windows of ~20 ms steps are noisy
    cfg, model, comm = _auto_comm(topo, redecide_every=3, trial_steps=trial_steps, hysteresis=0.5)
    comm.sparse_delay_s = SELECTION_S
    plans = []
    for delay_s_per_mb in delays_s_per_mb:
        comm.inter_delay_s_per_mb = delay_s_per_mb
        if plans:
            _run_steps(comm, model, rank, cfg.redecide_every)
        else:
            while not comm.calibrated:
                _run_steps(comm, model, rank, 1)
        plans.append([c.kind for c in reversed(comm.plan)])
    return plans


def test_a_link_that_slows_down_on_a_live_run_is_re_decided_once(tmp_path):
    # a fast link (where top-k's selection does not pay), then a slow one
    plans = run_ranks(_live_link_change, 4, tmp_path, [0.02, 0.02] + [0.3] * 7, 3, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    calibrated, unchanged, *slow = plans[0]
    assert calibrated[0].startswith("dense") and unchanged == calibrated, plans[0]  # nothing changed: it holds
    # the link slowed down: re-decided to top-k once two windows confirm it (after a new plan's reference
    # settles, plus a dense window from dense16)
    first = next(i for i, p in enumerate(slow) if p[0] == "topk")
    assert first <= 3 and all(p[0].startswith("dense") for p in slow[:first]), plans[0]
    assert all(p[0] == "topk" for p in slow[first:]), plans[0]  # and no flapping back


def test_a_link_change_under_a_sparse_plan_measures_dense_again_before_deciding(tmp_path):
    # the guard against being slower than dense needs what dense costs on today's link, not before it slowed
    plans = run_ranks(_live_link_change, 4, tmp_path, [0.3, 0.3, 0.3, 2.0, 2.0, 2.0, 2.0, 2.0], 0, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    kinds = [p[0] for p in plans[0]]
    # two windows settle top-k's reference; the second slow window confirms the move: one window all dense,
    # then top-k again
    assert kinds == ["topk", "topk", "topk", "topk", "dense", "topk", "topk", "topk"], plans[0]


def _tried_plans(rank: int, world: int) -> list[list[str]]:
    """The plan after calibration on a slow link and after the trials: as modelled, then with the sparse
    exchange made far slower than the model's probes saw (a model that is wrong)."""
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    plans = []
    for extra_s in (0.0, 1.0):
        cfg, model, comm = _auto_comm(topo, trial_steps=3)
        comm.inter_delay_s_per_mb, comm.sparse_delay_s = 0.3, SELECTION_S
        _run_steps(comm, model, rank, cfg.calibration_steps)
        plans.append([c.kind for c in reversed(comm.plan)])
        assert not comm.calibrated and len(comm._trials) >= 3  # the model's plan, dense16 everywhere, dense
        comm.sparse_delay_s += extra_s
        _run_steps(comm, model, rank, cfg.trial_steps * len(comm._trials))
        assert comm.calibrated
        plans.append([c.kind for c in reversed(comm.plan)])
        comm.detach()
    return plans


def test_the_model_s_plan_is_tried_with_others_and_kept_only_if_it_measures_fastest(tmp_path):
    plans = run_ranks(_tried_plans, 4, tmp_path, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    chosen, kept, chosen_again, after_slow_trial = plans[0]
    assert chosen[0] == "topk" and kept[0] == "topk", plans[0]
    # sparse measured far slower than modelled: the 16-bit dense plan, tried too, measured faster than dense
    assert chosen_again[0] == "topk" and after_slow_trial[0] == "dense16", plans[0]


def _link_faster_after_calibration(rank: int, world: int) -> list[list[str]]:
    """Calibrated on a slow link (the model picks top-k), which is fast again during the trials."""
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    cfg, model, comm = _auto_comm(topo, trial_steps=3)
    comm.inter_delay_s_per_mb, comm.sparse_delay_s = 0.3, SELECTION_S
    _run_steps(comm, model, rank, cfg.calibration_steps)
    plans = [[c.kind for c in reversed(comm.plan)]]
    comm.inter_delay_s_per_mb = 0.0
    # the 16-bit dense plan, tried too, would beat top-k whatever top-k is compared with: left out
    comm._trials = [t for t in comm._trials if Choice("dense16") not in t]
    while not comm.calibrated:
        _run_steps(comm, model, rank, 1)
    return plans + [[c.kind for c in reversed(comm.plan)]]


def test_the_tried_plans_are_compared_with_all_dense_tried_alike_not_with_the_calibration(tmp_path):
    plans = run_ranks(_link_faster_after_calibration, 4, tmp_path, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    chosen, kept = plans[0]
    # top-k beats the calibration's slow dense steps, but not dense on the link as it is during the trials
    assert chosen[0] == "topk" and kept[0] == "dense", plans[0]


def _longer_backward(rank: int, world: int) -> list[list[str]]:
    """The plan after calibration and trials on a slow link, then after each window of steps whose backward
    runs a while longer between the small bucket's launch and the large one's (a larger image size)."""
    import time

    topo = setup_distributed(DistConfig(ranks_per_node=1))
    # hysteresis: a noisy chain must not count as a link move, which defers the guard
    cfg, model, comm = _auto_comm(topo, trial_steps=3, redecide_every=3, hysteresis=0.5)
    comm.inter_delay_s_per_mb, comm.sparse_delay_s = 0.3, SELECTION_S
    while not comm.calibrated:
        _run_steps(comm, model, rank, 1)
    plans = [[c.kind for c in reversed(comm.plan)]]
    # longer than dense's whole exchange: the sparse step now takes longer than the dense step did
    longer_s = 2 * comm.dense_cost_s
    model.ps[0].register_hook(lambda g: (time.sleep(longer_s), g)[1])
    for _ in range(3):
        _run_steps(comm, model, rank, cfg.redecide_every)
        plans.append([c.kind for c in reversed(comm.plan)])
    return plans


def test_a_longer_backward_compares_with_dense_measured_again_and_keeps_the_plan(tmp_path):
    plans = run_ranks(_longer_backward, 4, tmp_path, timeout=300)
    assert all(p == plans[0] for p in plans), plans
    # top-k, measured slower than the old dense step: one window all dense, which now costs more still, and
    # top-k again
    assert [p[0] for p in plans[0]] == ["topk", "dense", "topk", "topk"], plans[0]


def _slow_sparse_reverts(rank: int, world: int) -> list[list[str]]:
    """A sparse plan that measures slower than all dense goes back to dense, and a link change during the hold
    does not make it leave dense."""
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    cfg, model, comm = _auto_comm(topo, redecide_every=3, trial_steps=0)
    _run_steps(comm, model, rank, cfg.calibration_steps)
    comm.set_plan([Choice("topk", 0.01) if b.numel >= cfg.dense_below else DENSE for b in comm.buckets])
    comm.sparse_delay_s = 0.3  # sparse far slower than the calibration's probes said
    plans = []
    for delay_s_per_mb in (0.0, 0.0, 0.0, 1.0, 1.0):
        # the revert, two windows that settle dense's reference, then a link far slower for two windows (a
        # confirmed move) within the hold: without the hold the model, which still thinks sparse is cheap,
        # would re-decide to top-k
        comm.inter_delay_s_per_mb = delay_s_per_mb
        _run_steps(comm, model, rank, cfg.redecide_every)
        plans.append([c.kind for c in reversed(comm.plan)])
    return plans


def test_a_plan_measured_slower_than_dense_reverts_to_dense_and_holds(tmp_path):
    plans = run_ranks(_slow_sparse_reverts, 4, tmp_path, timeout=240)
    assert all(p == plans[0] for p in plans), plans
    assert all(p[0] == "dense" for p in plans[0]), plans[0]


def test_a_bucket_that_hides_behind_backward_stays_dense_and_the_safe_density_bounds_the_choice():
    lay = Layout(2, 2)
    slow = Link(1e-4, 10e6)
    net = Network(lay, {"world": slow, "world16": slow, "world_gather": slow, "inter": slow,
                        "intra": Link(1e-5, 5e9)}, Selection(1e-4, 2e-9))
    sizes = [6_000_000, 6_000_000]
    opts = lambda n: candidates(n, lay, [0.01, 0.001], 0.01, 16384)  # noqa: E731
    assert all(c.density >= 0.01 for c in opts(sizes[0]))
    # bucket 0 is ready long before backward ends (its dense exchange hides), bucket 1 at the very end
    plan, t = choose(sizes, [100.0, 0.0], net, opts, local_competes=False)
    assert plan[0] == DENSE and plan[1].sparse
    _, all_dense = choose(sizes, [100.0, 0.0], net, lambda n: [DENSE], local_competes=False)
    assert t < all_dense
    assert math.isfinite(t)


def test_many_small_buckets_move_together_when_no_single_move_clears_the_margin():
    # 50 buckets ready at the end of backward: each one's 16-bit wire saves ~1% of the exposed time, below the
    # per-move margin, but all of them together halve it
    lay = Layout(2, 2)
    link = Link(1e-5, 1e9)
    net = Network(lay, {"world": link, "world16": link, "intra": Link(1e-6, 1e10)})
    sizes = [250_000] * 50
    opts = lambda n: [DENSE, Choice("dense16")]  # noqa: E731
    plan, t = choose(sizes, [0.0] * 50, net, opts, local_competes=False)
    assert plan == [Choice("dense16")] * 50, plan
    _, all_dense = choose(sizes, [0.0] * 50, net, lambda n: [DENSE], local_competes=False)
    assert t < 0.6 * all_dense
    # with nothing to gain the uniform starts do not win: ties stay dense
    same = Network(lay, {"world": link, "world16": Link(1e-5, 0.5e9), "intra": Link(1e-6, 1e10)})
    plan, _ = choose(sizes, [0.0] * 50, same, opts, local_competes=False)
    assert plan == [DENSE] * 50


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 1), (3, 4)])
def test_probes_timed_by_the_cost_formulas_give_back_their_links(nodes, per_node):
    # probe times made by the cost model's own collective formulas from known links: the fit must return them
    lay = Layout(nodes, per_node)
    world, gather, inter, intra = Link(3e-5, 2e9), Link(5e-5, 1e9), Link(8e-5, 3e8), Link(2e-6, 8e9)
    w, per = lay.world, per_node
    probes = {"world": [(b, ring_allreduce_s(b, w, world)) for b in (2.0**15, 2.0**19)],
              "world_gather": [(b, allgather_s(b, w, gather)) for b in (2.0**13, 2.0**17)]}
    if per > 1 and nodes > 1:
        probes["inter"] = [(b, allgather_s(b, nodes, inter, sharing=per)) for b in (2.0**13, 2.0**17)]
        probes["intra_gather"] = [(b, allgather_s(b, per, intra)) for b in (2.0**15, 2.0**19)]
        probes["intra_scatter"] = [(b, reduce_scatter_s(b, per, intra)) for b in (2.0**16, 2.0**20)]
    net = build_network(lay, probes, [], 0.0)
    expected = {"world": world, "world_gather": gather, **({"inter": inter, "intra": intra} if "inter" in probes else {})}
    assert set(net.links) == set(expected)
    for name, link in expected.items():
        assert net.links[name].alpha_s == pytest.approx(link.alpha_s, rel=1e-6), name
        assert net.links[name].bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-6), name


def test_link_fit_recovers_latency_and_bandwidth_and_survives_noise():
    from trainer.comm.cost import fit_link, ring_allreduce_s

    link = Link(2e-3, 50e6)
    points = [(4 * n, ring_allreduce_s(4 * n, 4, link)) for n in (1e4, 1e6)]
    fitted = fit_link(points, 6, 1.5)
    assert math.isclose(fitted.alpha_s, 2e-3, rel_tol=1e-6) and math.isclose(fitted.bytes_per_s, 50e6, rel_tol=1e-6)
    noisy = fit_link([(1e4, 0.02), (1e6, 0.01)], 6, 1.5)  # the larger probe came out faster
    assert noisy.alpha_s == 0 and math.isclose(noisy.bytes_per_s, 1.5e6 / 0.01)
