"""`comm.kind: auto` choosing powersgd per bucket: its price in the cost model (the factors' allreduces, the dense
rest and its local work at a measured seconds per flop), `comm.auto_kinds`, and on real gloo ranks (2 nodes x 2
ranks) the gradient mass conserved while buckets move between powersgd and the other kinds, and its state (Q, the
random draws) resumed bit for bit. The model and gradients are tests/test_comm_powersgd.py's, the helpers that
place residuals and gradients in bucket order tests/test_comm_auto.py's."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from recipes.resnet50 import Config
from tests.conftest import as_from_file, run_ranks
from tests.test_comm_auto import backward_with, bucket_flat, placed_residuals
from tests.test_comm_powersgd import BUCKET_MB, PHASE, Params, grads_of, step_both
from trainer.comm import AutoCommunicator, CommConfig, build_communicator
from trainer.comm.auto import network_from_calibration
from trainer.comm.cost import (DENSE, Choice, Layout, Link, Network, Selection, candidates, choose, describe,
                               predict, with_inter_rate)
from trainer.comm.plan import AUTO_CHOOSABLE, AUTO_KINDS, CODES
from trainer.config import ConfigError, load_config
from trainer.dist import DistConfig, setup_distributed

pytestmark = pytest.mark.dist

ALL_KINDS = list(AUTO_CHOOSABLE)


# ---------------------------------------------------------------- the cost model (no processes)


def _ring(nbytes: float, p: int, link: Link) -> float:
    """A ring allreduce by hand: 2(p-1) latencies and 2(p-1)/p of the buffer through each link."""
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bytes_per_s


@pytest.mark.unit
def test_powersgd_is_priced_from_its_factors_the_dense_rest_and_its_flops():
    lay, link = Layout(2, 2), Link(2e-5, 1e8)
    rows, cols, r, rest = 300, 200, 2, 5000
    n = rows * cols + rest
    net = Network(lay, {"world": link}, seconds_per_flop=3e-11)
    ex = describe(n, Choice("powersgd"), lay, [(rows, cols, r)])
    flops = 6 * rows * cols * r + 2 * (rows + cols) * r * r
    assert ex.flops == flops
    network = _ring(4 * rest, 4, link) + _ring(4 * rows * r, 4, link) + _ring(4 * cols * r, 4, link)
    assert net.network_s(ex) == pytest.approx(network, rel=1e-12)
    assert net.local_s(ex) == pytest.approx(3e-11 * flops, rel=1e-12)
    # predict: the chain is both, and on a CPU the flops compete with backward (the exposed time counts them)
    exposed, chains = predict([n], [1.0], [Choice("powersgd")], net, True, [[(rows, cols, r)]])
    assert chains == [pytest.approx(network + 3e-11 * flops, rel=1e-12)]
    assert exposed == pytest.approx(3e-11 * flops, rel=1e-12)  # ready 1 s before the end: only the local work shows
    # a network without the term prices the flops at nothing (an old calibration); a rate change keeps it
    assert Network(lay, {"world": link}).chain_s(ex) == pytest.approx(network, rel=1e-12)
    assert with_inter_rate(net, 2.0).seconds_per_flop == 3e-11
    with pytest.raises(ValueError, match="tensor shapes"):
        predict([n], [0.0], [Choice("powersgd")], net, False)


@pytest.mark.unit
def test_candidates_offer_powersgd_only_when_listed_and_for_a_bucket_with_matrices():
    lay, shapes = Layout(2, 2), ((300, 200, 2),)
    with_psgd = candidates(100_000, lay, [0.01], 0.01, 1000, ALL_KINDS, shapes)
    assert with_psgd[0] == DENSE and with_psgd[-1] == Choice("powersgd")
    assert Choice("powersgd") not in candidates(100_000, lay, [0.01], 0.01, 1000, AUTO_KINDS, shapes)
    assert Choice("powersgd") not in candidates(100_000, lay, [0.01], 0.01, 1000, ALL_KINDS, ())
    assert Choice("powersgd") not in candidates(500, lay, [0.01], 0.01, 1000, ALL_KINDS, shapes)  # below dense_below
    # the default kinds are the size-only ones, and a list without a kind leaves it out
    assert candidates(100_000, lay, [0.01], 0.01, 1000) == candidates(100_000, lay, [0.01], 0.01, 1000, AUTO_KINDS)
    assert [c.kind for c in candidates(100_000, lay, [0.01], 0.01, 1000, ["dense", "topk"])] == ["dense", "topk"]


SLOW = Link(1e-4, 5e7)
"""A 400 Mbit/s link."""


def _slow_net(seconds_per_flop: float) -> Network:
    # a slow selection, so that top-k is no bargain either: the choice is between the network's kinds
    return Network(Layout(2, 2), {"world": SLOW, "world16": SLOW, "world_gather": SLOW, "inter": SLOW,
                                  "intra": Link(1e-6, 1e10)}, Selection(1e-3, 1e-7), 1e-10,
                   seconds_per_flop=seconds_per_flop)


@pytest.mark.unit
def test_choose_picks_powersgd_on_a_slow_link_for_a_big_matrix_bucket_only_when_listed():
    lay = Layout(2, 2)
    n = 1024 * 1024 + 3000  # one 1024 x 1024 matrix and a few biases
    shapes = [((1024, 1024, 2),), ()]
    sizes = [n, n]  # the same size, but the second bucket has no matrix: never powersgd

    def options(kinds: list[str]):
        return lambda i: candidates(sizes[i], lay, [0.01], 0.01, 16384, kinds, shapes[i])

    plan, t = choose(sizes, [0.0, 0.0], _slow_net(1e-11), options(ALL_KINDS), False, shapes=shapes)
    assert plan[0] == Choice("powersgd") and plan[1].kind != "powersgd", plan
    dense, _ = predict(sizes, [0.0, 0.0], [DENSE, DENSE], _slow_net(1e-11), False, shapes)
    assert t < dense / 2
    plan, _ = choose(sizes, [0.0, 0.0], _slow_net(1e-11), options(list(AUTO_KINDS)), False, shapes=shapes)
    assert all(c.kind != "powersgd" for c in plan), plan
    # its local work priced: at a slow enough rate per flop it does not pay
    plan, _ = choose(sizes, [0.0, 0.0], _slow_net(1e-7), options(ALL_KINDS), False, shapes=shapes)
    assert all(c.kind != "powersgd" for c in plan), plan


@pytest.mark.unit
def test_a_calibration_carries_the_seconds_per_flop_and_one_without_it_loads_as_zero():
    cal = {"link/world/alpha_s": 1e-5, "link/world/bytes_per_s": 1e9, "select_fixed_s": 1e-4,
           "select_per_element_s": 1e-9, "cast_per_element_s": 1e-10, "net_scale": 1.5,
           "bucket/0/elements": 5000.0, "bucket/0/ready_before_end_s": 0.01}
    net, sizes, ready = network_from_calibration({**cal, "seconds_per_flop": 2e-11}, Layout(2, 1))
    assert net.seconds_per_flop == 2e-11 and sizes == [5000] and ready == [0.01]
    net, _, _ = network_from_calibration(cal, Layout(2, 1))
    assert net.seconds_per_flop == 0.0


# ---------------------------------------------------------------- comm.auto_kinds


@pytest.mark.unit
def test_auto_kinds_default_leaves_powersgd_out_and_bad_lists_are_config_errors():
    assert "powersgd" not in CommConfig().auto_kinds and CommConfig().auto_kinds == list(AUTO_KINDS)
    cfg = load_config(Config, None, [PHASE, "comm.kind=auto", "comm.auto_kinds=[dense, topk, powersgd]"])
    assert cfg.comm.auto_kinds == ["dense", "topk", "powersgd"]
    with pytest.raises(ConfigError, match=r"comm\.auto_kinds: 'powersdg' is not .*did you mean powersgd"):
        load_config(Config, None, [PHASE, "comm.kind=auto", "comm.auto_kinds=[dense, powersdg]"])
    with pytest.raises(ConfigError, match=r"comm\.auto_kinds: 'local' is not an exchange auto can choose"):
        CommConfig(auto_kinds=["dense", "local"])
    with pytest.raises(ConfigError, match=r"comm\.auto_kinds: must include dense"):
        CommConfig(auto_kinds=["topk", "powersgd"])


# ---------------------------------------------------------------- real ranks

PSGD = Choice("powersgd")
TOPK = Choice("topk", 0.01)
HITOPK = Choice("hitopk", 0.01)

SCHEDULE = [(PSGD, False), (PSGD, False), (PSGD, True), (PSGD, False), (TOPK, False), (PSGD, False),
            (HITOPK, False), (PSGD, False), (Choice("dense16"), False), (PSGD, False), (DENSE, False)]
"""(the exchange of every bucket with a matrix, whether the optimizer skips the step) per step after calibration:
powersgd's residual folded into each other kind (dense16 right after it: sent exactly), and theirs into it."""


def _auto(topo, model: Params, warm: bool = True) -> AutoCommunicator:
    cfg = CommConfig(kind="auto", bucket_mb=BUCKET_MB, dense_below=100, calibration_steps=3, trial_steps=0,
                     redecide_every=1000, densities=[0.01], min_density=0.01, auto_kinds=ALL_KINDS,
                     powersgd_warm_start=warm)
    comm = build_communicator(cfg, model, topo)
    assert isinstance(comm, AutoCommunicator)
    return comm


def _calibrate(comm: AutoCommunicator, model: Params, rank: int) -> None:
    for step in range(comm.calibration_steps):
        backward_with(model, grads_of(rank, step))
        comm.finish()
    assert comm.calibrated


def _plan(comm: AutoCommunicator, choice: Choice) -> list[Choice]:
    """`choice` on every bucket with a matrix, the others dense."""
    return [choice if shapes else DENSE for shapes in comm.shapes]


def _keeps_mass(rank: int, world: int) -> dict:
    topo = setup_distributed(DistConfig(ranks_per_node=2))
    model = Params()
    comm = _auto(topo, model)
    squeezed = [i for i, s in enumerate(comm.shapes) if s]
    assert len(squeezed) >= 2 and len(squeezed) < len(comm.buckets), comm.shapes
    sent = torch.zeros(sum(p.numel() for p in model.ps), dtype=torch.float64)
    incoming = torch.zeros_like(sent)
    steps = [(None, False)] * comm.calibration_steps + SCHEDULE  # calibration: all dense
    for step, (choice, skip) in enumerate(steps):
        if choice is not None:
            comm.set_plan(_plan(comm, choice))
        # the loss scale changes between the step that kept a residual and the one that folds it
        scale = 2.0 ** (step % 4)
        comm.set_grad_scale(torch.tensor(scale))
        backward_with(model, [g * scale for g in grads_of(rank, step)])
        comm.finish()
        for p in model.ps:
            p.grad.div_(scale)
        if skip:
            comm.rollback()
            continue
        sent += bucket_flat(comm, [p.grad for p in model.ps], model).double() * world
        incoming += bucket_flat(comm, [sum(gs) for gs in zip(*(grads_of(r, step) for r in range(world)))],
                                model).double()
        held = placed_residuals(comm)
        dist.all_reduce(held)
        torch.testing.assert_close(sent + held, incoming, rtol=0, atol=2e-4, msg=lambda m: f"step {step}: {m}")
        if step == comm.calibration_steps - 1:
            assert comm.calibrated
            out = {"seconds_per_flop": comm.net.seconds_per_flop, "calib": comm.calibration["seconds_per_flop"]}
        if choice is None:
            continue
        if choice == PSGD:
            assert all(comm._residual_kind[i] == "powersgd" for i in squeezed), comm._residual_kind
            assert held.abs().sum() > 0
            assert comm.state_dict()["residual_kinds"][squeezed[0]] == CODES["powersgd"]
            table = comm.table([0.0] * len(comm.buckets))
            assert sum("powersgd" in line for line in table.splitlines()[2:]) == len(squeezed), table
        if choice.kind in ("dense", "dense16"):
            assert not comm.residuals  # the folded residual went out exactly
        # a bucket that left powersgd keeps its Q
        assert set(comm.powersgd.q) == set(squeezed)
    comm.detach()
    return out


def test_moving_buckets_between_powersgd_and_other_kinds_keeps_the_mass(tmp_path):
    """Also: the calibration measured powersgd's local work (a rate per flop, the same on every rank)."""
    results = run_ranks(_keeps_mass, 4, tmp_path, timeout=300)
    rates = {r["seconds_per_flop"] for r in results}
    assert len(rates) == 1 and rates.pop() > 0, results
    assert all(r["calib"] == r["seconds_per_flop"] for r in results)


def _resumes(rank: int, world: int) -> None:
    for warm in (True, False):
        _resume(rank, warm)


def _resume(rank: int, warm: bool) -> None:
    """state_dict after two powersgd steps (through torch.save and a weights-only load) into a fresh, calibrated
    communicator: the next exchanges the same bit for bit, through a move to top-k and back and a skipped step."""
    topo = setup_distributed(DistConfig(ranks_per_node=2))
    straight, restored = Params(), Params()
    comm_a = _auto(topo, straight, warm)
    _calibrate(comm_a, straight, rank)
    comm_a.set_plan(_plan(comm_a, PSGD))
    for step in (3, 4):
        backward_with(straight, grads_of(rank, step))
        comm_a.finish()
    state = as_from_file(comm_a.state_dict())
    squeezed = [i for i, s in enumerate(comm_a.shapes) if s]
    assert bool(state["powersgd"]["q"]) == warm and state["powersgd"]["draws"] == len(squeezed) * (1 if warm else 2)
    comm_a.detach()
    comm_b = _auto(topo, restored, warm)
    _calibrate(comm_b, restored, rank)
    comm_b.load_state_dict(state)  # then a state without the entry: PowerSGD starts afresh, not from the last one
    comm_b.load_state_dict({k: v for k, v in state.items() if k != "powersgd"})
    assert not comm_b.powersgd.q and comm_b.powersgd.draws == 0
    comm_b.load_state_dict(state)
    comm_b.set_plan(_plan(comm_b, PSGD))
    for step, choice in ((5, PSGD), (6, TOPK), (7, PSGD), (8, PSGD)):
        comm_a.set_plan(_plan(comm_a, choice))
        comm_b.set_plan(_plan(comm_b, choice))
        # a skipped step before step 7: Q and the draws come back too
        step_both(comm_a, comm_b, straight, restored, grads_of(rank, step),
                  grads_of(rank, -1) if step == 7 else None, (warm, step))
    a, b = comm_a.state_dict(), comm_b.state_dict()
    assert a["powersgd"]["draws"] == b["powersgd"]["draws"] and a["residual_kinds"] == b["residual_kinds"]
    assert a["residuals"].keys() == b["residuals"].keys()
    assert all(torch.equal(a["residuals"][i], b["residuals"][i]) for i in a["residuals"])
    assert a["powersgd"]["q"].keys() == b["powersgd"]["q"].keys()
    assert all(torch.equal(a["powersgd"]["q"][i], b["powersgd"]["q"][i]) for i in a["powersgd"]["q"])
    comm_b.detach()


@pytest.mark.long
def test_auto_with_powersgd_resumes_bitwise_and_a_skipped_step_leaves_no_trace(tmp_path):
    """With and without warm start."""
    run_ranks(_resumes, 4, tmp_path, timeout=300)
