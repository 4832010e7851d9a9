"""`comm.kind: local` (trainer/comm/local.py) on real gloo ranks: H = 1 with plain averaging is data-parallel SGD
(with momentum too: the optimizer's state is averaged at a synchronisation); a round's synchronisation against
its rules computed here from every rank's weights (the outer Nesterov step, BatchNorm statistics, skips agreed
under a loss scaler); its state through torch.save restores a round mid-way; bad settings are config errors; and
a 2-rank recipe run stopped mid-round by a SIGTERM resumes to the uninterrupted run's weights, bit for bit."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import as_from_file, run_ranks
from trainer.comm import CommConfig, LocalSGD, build_communicator
from trainer.config import ConfigError
from trainer.dist import DistConfig, setup_distributed

STEPS = 6


def net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, comm, rank: int, step: int,
               scale: float | None = None) -> dict | None:
    """One step as the train loop takes it: backward, finish, the optimizer step, end_step."""
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x), y)
    comm.set_grad_scale(None if scale is None else torch.tensor(scale))
    (loss if scale is None else loss * scale).backward()
    comm.finish()
    if scale is not None:
        for p in model.parameters():
            p.grad.div_(scale)
    if all(torch.isfinite(p.grad).all() for p in model.parameters()):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return comm.end_step()


def gathered(topo, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's tensors, flattened: one row per rank."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return topo.world.all_gather(flat.reshape(1, -1), "test gather")


def resumed_from_rank0(topo, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: CommConfig, saved: dict
                       ) -> tuple[nn.Module, torch.optim.Optimizer, LocalSGD]:
    """A model, optimizer and communicator resumed from a checkpoint: the model file and the optimizer state are
    rank 0's, the communicator's state this rank's own `saved`."""
    restored = net(batchnorm=True)
    restored.load_state_dict(gathered_state_of_rank0(topo, model))
    opt = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for state in opt.state.values():
        for t in state.values():
            topo.world.broadcast_(t, src=0)
    comm = build_communicator(cfg, restored, topo, opt)
    comm.load_state_dict(saved)
    return restored, opt, comm


def _h1_is_data_parallel(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    for momentum in (0.0, 0.9):
        results = []
        for kind in ("dense", "local"):
            model = net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
            comm = build_communicator(CommConfig(kind=kind, local_steps=1), model, topo, optimizer)
            for step in range(STEPS):
                synced = train_step(model, optimizer, comm, rank, step)
                assert synced is not None  # H = 1: every step ends a round
            comm.detach()
            results.append([p.detach().clone() for p in model.parameters()])
        for dense, local in zip(*results):
            assert torch.allclose(dense, local, atol=1e-6), (momentum, (dense - local).abs().max())
        # and it trained: a wrong local kind that never moves would not match dense's moved weights
        assert not torch.allclose(results[0][0], net()[0].weight)


OPTIMIZERS = {"sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",)),
              "adam": (lambda ps: torch.optim.Adam(ps, lr=0.01), ("exp_avg", "exp_avg_sq"))}


def _a_round_follows_its_rules(rank: int, world: int, name: str) -> None:
    topo = setup_distributed(DistConfig())
    model = net(batchnorm=True)
    build, keys = OPTIMIZERS[name]
    optimizer = build(model.parameters())
    cfg = CommConfig(kind="local", local_steps=3, outer_lr=0.7, outer_momentum=0.9)
    comm = build_communicator(cfg, model, topo, optimizer)
    assert isinstance(comm, LocalSGD)
    params, buffers = list(model.parameters()), [model[1].running_mean, model[1].running_var]
    start = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    anchor, velocity = start.clone(), torch.zeros_like(start)
    for step in range(2 * 3):
        if step % 3 == 2:  # the round's last step: what every rank holds before the synchronisation
            x, y = batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            comm.finish()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            before = gathered(topo, params)
            stats_before = gathered(topo, buffers)
            moments = gathered(topo, [optimizer.state[p][k] for p in params for k in keys])
            assert not torch.equal(before[0], before[1])  # the ranks drifted apart during the round
            synced = comm.end_step()
            n = sum(p.numel() for p in params)  # per step of the round: weights, BN statistics, optimizer state
            assert synced is not None and synced["bytes_sent"] == pytest.approx(4 * (n + 16 + len(keys) * n) / 3)
            delta = anchor - before.mean(0)  # torch.optim.SGD's Nesterov step on the mean pseudo-gradient
            velocity = 0.9 * velocity + delta
            anchor = anchor - 0.7 * (delta + 0.9 * velocity)
            after = gathered(topo, params)
            assert torch.equal(after[0], after[1])
            assert torch.allclose(after[rank], anchor, atol=1e-6)
            assert torch.allclose(gathered(topo, buffers)[rank], stats_before.mean(0), atol=1e-6)
            mine = torch.cat([optimizer.state[p][k].reshape(-1) for p in params for k in keys])
            assert not torch.equal(moments[0], moments[1])  # they differed: the average is a real test
            assert torch.allclose(mine, moments.mean(0), atol=1e-6)
        else:
            assert train_step(model, optimizer, comm, rank, step) is None  # mid-round: nothing exchanged


def _sparse_rounds_keep_state(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    model = net(batchnorm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = CommConfig(kind="local", local_steps=2, local_density=0.25, local_state="keep", selection="torch")
    comm = build_communicator(cfg, model, topo, optimizer)
    params, buffers = list(model.parameters()), [model[1].running_mean, model[1].running_var]
    anchor = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    residuals = torch.zeros(world, anchor.numel())
    n = anchor.numel()
    k = -(-n // 4)
    for step in range(6):
        if step % 2 == 0:
            assert train_step(model, optimizer, comm, rank, step) is None
            continue
        x, y = batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        comm.finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before, stats_before = gathered(topo, params), gathered(topo, buffers)
        momentum = gathered(topo, [optimizer.state[p]["momentum_buffer"] for p in params])
        synced = comm.end_step()
        # each rank: its pseudo-gradient plus its residual, its k largest sent, the rest kept
        acc = anchor - before + residuals
        sent = torch.zeros_like(acc)
        for r in range(world):
            top = acc[r].abs().topk(k).indices
            sent[r, top] = acc[r, top]
        residuals = acc - sent
        anchor = anchor - sent.mean(0)
        after = gathered(topo, params)
        assert torch.equal(after[0], after[1]) and torch.allclose(after[rank], anchor, atol=1e-6)
        assert torch.allclose(comm.residual, residuals[rank], atol=1e-6)
        assert torch.allclose(gathered(topo, buffers)[rank], stats_before.mean(0), atol=1e-6)
        # keep: each rank's momentum is its own, untouched by the synchronisation
        assert not torch.equal(momentum[0], momentum[1])
        assert torch.equal(gathered(topo, [optimizer.state[p]["momentum_buffer"] for p in params]), momentum)
        # per step of the round: the allgather of k pairs, then the BatchNorm statistics' allreduce (no state)
        assert synced["bytes_sent"] == pytest.approx((8 * k + 4 * 16) / 2)
    assert residuals.abs().sum() > 0  # something was held back: the error feedback is exercised


def _sparse_round_restores(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    cfg = CommConfig(kind="local", local_steps=3, local_density=0.3, local_state="keep")
    straight = net(batchnorm=True)
    opt_a = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    comm_a = build_communicator(cfg, straight, topo, opt_a)
    for step in range(6):  # synchronisations at steps 3 and 6: saved between rounds, the replicas equal
        train_step(straight, opt_a, comm_a, rank, step)
    saved = as_from_file(comm_a.state_dict())
    assert saved["since_sync"] == 0 and saved["round"]["residual"] is not None
    restored, opt_b, comm_b = resumed_from_rank0(topo, straight, opt_a, cfg, saved)
    for step in range(6, 13):
        train_step(straight, opt_a, comm_a, rank, step)
        train_step(restored, opt_b, comm_b, rank, step)
    for (name, a), b in zip(straight.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(comm_a.residual, comm_b.residual)


def synchronisation_error(comm, optimizer: torch.optim.Optimizer, error: type[Exception], match: str) -> str:
    """After a backward: finish the step, take it, and expect the round's synchronisation to raise; its message."""
    comm.finish()
    optimizer.step()
    with pytest.raises(error, match=match) as raised:
        comm.end_step()
    return str(raised.value)


def _a_diverged_rank_stops_every_rank(rank: int, world: int) -> str:
    topo = setup_distributed(DistConfig())
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CommConfig(kind="local", local_steps=2, local_density=0.25, selection="mstopk")
    comm = build_communicator(cfg, model, topo, optimizer)
    assert train_step(model, optimizer, comm, rank, 0) is None
    if rank == 1:  # this rank's weights diverge mid-round; its gradients stay finite
        with torch.no_grad():
            model[0].weight[0, 0] = float("inf")
    x, y = batch(rank, 1)
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.nan_to_num(p.grad)
    return synchronisation_error(comm, optimizer, FloatingPointError, "not finite")


@pytest.mark.dist
def test_a_rank_whose_pseudo_gradient_is_not_finite_stops_every_rank_before_the_allgather(tmp_path):
    """Without the agreed flag the diverged rank's selection raises alone (MSTopK rejects inf) and the other
    rank waits in the allgather: a hang, not one error on both."""
    messages = run_ranks(_a_diverged_rank_stops_every_rank, 2, tmp_path)
    assert messages[0] == messages[1]


@pytest.mark.dist
def test_sparse_rounds_send_the_top_k_with_error_feedback_and_keep_state_stays_per_rank(tmp_path):
    """SparseLoCo against a hand computation from every rank's weights: fails if the residual is not added
    before the selection or not kept, if the pairs are summed instead of averaged, if the optimizer state is
    averaged under keep, or on the wrong bytes."""
    run_ranks(_sparse_rounds_keep_state, 2, tmp_path)


@pytest.mark.dist
def test_a_sparse_round_with_kept_state_restores_mid_way_bitwise(tmp_path):
    """Fails if the checkpoint lacks the residual or, under keep, a rank's own optimizer state after a
    synchronisation (the restored rank 1 would continue with rank 0's momentum)."""
    run_ranks(_sparse_round_restores, 2, tmp_path)


def _warm_up_then_rounds(rank: int, world: int, overlap: bool) -> list[bool]:
    topo = setup_distributed(DistConfig())
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CommConfig(kind="local", local_steps=3, dense_warmup_steps=2, local_overlap=overlap)
    comm = build_communicator(cfg, model, topo, optimizer)
    return [train_step(model, optimizer, comm, rank, step) is not None for step in range(8)]


@pytest.mark.dist
def test_the_dense_warm_up_synchronises_every_step_then_rounds_of_h(tmp_path):
    """comm.dense_warmup_steps 2, H 3: steps 1 and 2 synchronise, then steps 5 and 8 end rounds (a local kind
    that ignored the warm-up, or counted it into the first round, fails); under local_overlap the warm-up's
    synchronisations wait too, and the rounds' ends after it do not."""
    synced = run_ranks(_warm_up_then_rounds, 2, tmp_path, False)
    assert synced[0] == synced[1] == [True, True, False, False, True, False, False, True]
    (tmp_path / "overlap").mkdir()
    synced = run_ranks(_warm_up_then_rounds, 2, tmp_path / "overlap", True)
    assert synced[0] == synced[1] == [True, True, False, False, False, False, False, False]


def _skips_agree_and_state_restores(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    cfg = CommConfig(kind="local", local_steps=4, outer_lr=0.8, outer_momentum=0.5)
    straight = net(batchnorm=True)
    opt_a = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    comm_a = build_communicator(cfg, straight, topo, opt_a)
    for step in range(6):  # a synchronisation at step 4, then two steps into the next round
        train_step(straight, opt_a, comm_a, rank, step)
    saved = as_from_file(comm_a.state_dict())
    assert saved["since_sync"] == 2 and saved["round"]["mine"] is not None
    # the checkpoint's model file and optimizer state are rank 0's: the round restores this rank's own
    restored, opt_b, comm_b = resumed_from_rank0(topo, straight, opt_a, cfg, saved)
    for step in range(6, 11):  # two steps to the synchronisation at step 8, then into the next round
        train_step(straight, opt_a, comm_a, rank, step)
        train_step(restored, opt_b, comm_b, rank, step)
    for (name, a), b in zip(straight.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    # under a loss scaler, an overflow on rank 1 alone makes both ranks skip: the weights stay equal at the
    # round's end, and only rank 1's gradients held inf
    comm_a.end_round()
    weights = [p.detach().clone() for p in straight.parameters()]
    scale = float("inf") if rank == 1 else 1.0
    assert train_step(straight, opt_a, comm_a, rank, 11, scale=scale) is None
    for p, before in zip(straight.parameters(), weights):
        assert torch.equal(p.detach(), before)  # skipped here too, though rank 0's gradients were finite
    # another world size: no round in the state, a new one starts from the current weights
    comm_c = build_communicator(cfg, straight, topo, opt_a)
    comm_c.load_state_dict({"steps": 3, "since_sync": 2, "round": None})
    assert comm_c.anchor is None and comm_c.since_sync == 0


def nesterov(anchor: torch.Tensor, velocity: torch.Tensor, delta: torch.Tensor, lr: float = 0.7,
             momentum: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.optim.SGD's Nesterov step of the anchor on the averaged pseudo-gradient `delta`."""
    velocity = momentum * velocity + delta
    return anchor - lr * (delta + momentum * velocity), velocity


OVERLAPPED = CommConfig(kind="local", local_steps=2, outer_lr=0.7, outer_momentum=0.9, local_overlap=True)


class Recorded:
    """A group that records when its allreduces start and when they are waited for."""

    def __init__(self, group, log: list[str]) -> None:
        self.group, self.log = group, log

    def all_reduce_async(self, t: torch.Tensor):
        self.log.append("start")
        return self.group.all_reduce_async(t)

    def wait(self, work, what: str) -> None:
        self.log.append("wait")
        self.group.wait(work, what)


def _overlapped_rounds_follow_their_rules(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    model = net(batchnorm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = build_communicator(OVERLAPPED, model, topo, optimizer)
    assert comm.background is not topo.world  # a group of its own: the per-step flag does not queue behind it
    log: list[str] = []
    comm.background = Recorded(comm.background, log)
    params, buffers = list(model.parameters()), [model[1].running_mean, model[1].running_var]
    anchor = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    velocity, snapshot, n = torch.zeros_like(anchor), None, anchor.numel()

    def momenta() -> torch.Tensor:
        return gathered(topo, [optimizer.state[p]["momentum_buffer"] for p in params])

    for step in range(7):
        if step % 2 == 0:
            events = len(log)
            assert train_step(model, optimizer, comm, rank, step) is None
            assert len(log) == events  # mid-round: the synchronisation under way is not waited for
        else:  # a round's end
            x, y = batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            comm.finish()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            before, events = gathered(topo, params), len(log)
            assert comm.end_step() is None
            after = gathered(topo, params)
            if snapshot is None:  # nothing under way to land; this round's starts, not waited for
                assert torch.equal(after, before) and log[events:] == ["start"]
            else:  # the previous round's synchronisation landed: the anchor's outer step, each rank's steps since
                anchor, velocity = nesterov(anchor, velocity, (anchor - snapshot).mean(0))
                assert torch.allclose(after, anchor + before - snapshot, atol=1e-6)
                assert log[events:] == ["wait", "start"]
            assert not torch.equal(after[0], after[1])  # the replicas stay apart
            assert comm.per_step["bytes_sent"] == pytest.approx(4 * n / 2)  # the weights' allreduce, no state
            snapshot = after
        if step in (3, 6):  # the epoch's end, right after a round's end (3) and mid-round (6)
            before, stats, moments = gathered(topo, params), gathered(topo, buffers), momenta()
            assert not torch.equal(stats[0], stats[1]) and not torch.equal(moments[0], moments[1])
            synced = comm.end_round()
            assert synced is not None and log[-1] == "wait"  # landed: the moving average and the guard may run
            anchor, velocity = nesterov(anchor, velocity, (anchor - snapshot).mean(0))
            mine = anchor + before - snapshot  # landed
            state_bytes = 4 * (16 + n)  # the BatchNorm statistics and the momentum, averaged
            if step == 6:  # then the open round's own synchronisation, waiting
                anchor, velocity = nesterov(anchor, velocity, (anchor - mine).mean(0))
                assert synced["bytes_sent"] == pytest.approx(4 * n + state_bytes)
            else:  # no step since the snapshot: the replicas are equal once it lands
                assert torch.allclose(mine[0], mine[1], atol=1e-6)
                assert synced["bytes_sent"] == pytest.approx((4 * n + state_bytes) / 2)
            after = gathered(topo, params)
            assert torch.equal(after[0], after[1]) and torch.allclose(after[rank], anchor, atol=1e-6)
            assert torch.allclose(gathered(topo, buffers)[rank], stats.mean(0), atol=1e-6)
            assert torch.allclose(momenta()[rank], moments.mean(0), atol=1e-6)
            snapshot = None
    assert comm.pending is None


def _overlapped_round_restores(rank: int, world: int, saved_after: int) -> None:
    topo = setup_distributed(DistConfig())
    straight = net(batchnorm=True)
    opt_a = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    comm_a = build_communicator(OVERLAPPED, straight, topo, opt_a)
    for step in range(saved_after):  # rounds end at steps 2 and 4, each starting a synchronisation
        train_step(straight, opt_a, comm_a, rank, step)
    saved = as_from_file(comm_a.state_dict())
    assert saved["since_sync"] == saved_after - 4 and saved["round"]["overlapped"] is not None
    restored, opt_b, comm_b = resumed_from_rank0(topo, straight, opt_a, OVERLAPPED, saved)
    # resumed without local_overlap: one round holding both rounds' steps, which the next step ends
    plain = replace(OVERLAPPED, local_overlap=False)
    other, opt_c, comm_c = resumed_from_rank0(topo, straight, opt_a, plain, saved)
    assert comm_c.pending is None and comm_c.since_sync == saved["since_sync"] + 2
    assert train_step(other, opt_c, comm_c, rank, saved_after) is not None
    weights = gathered(topo, list(other.parameters()))
    assert torch.equal(weights[0], weights[1])
    for step in range(saved_after, 10):
        train_step(straight, opt_a, comm_a, rank, step)
        train_step(restored, opt_b, comm_b, rank, step)
    assert comm_a.end_round() is not None and comm_b.end_round() is not None
    for (name, a), b in zip(straight.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.dist
def test_an_overlapped_synchronisation_lands_a_round_later_by_its_rules(tmp_path):
    """comm.local_overlap, H = 2: a round's end leaves the replicas apart and sends the weights alone; the next
    round's end applies the outer step to the anchor and adds each rank's steps since its snapshot; an epoch's
    end lands it and synchronises, waiting, with the state averaged. Fails on a synchronisation that waits (equal
    replicas at a round's end), on the outer step applied to the weights instead of the anchor, on a rank's steps
    since its snapshot dropped, or on state left per rank at an epoch's end."""
    run_ranks(_overlapped_rounds_follow_their_rules, 2, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("saved_after", [4, 5])
def test_an_overlapped_synchronisation_restores_mid_way_bitwise(tmp_path, saved_after):
    """Saved while a synchronisation is under way, right at a round's end (4) or a step later (5): the resumed
    ranks start its allreduce again and end, an epoch's end later, with the uninterrupted run's weights, bit for
    bit. Fails if the snapshot or (at a round's end) each rank's own weights were not saved. Resumed without
    local_overlap, the next step synchronises the replicas."""
    run_ranks(_overlapped_round_restores, 2, tmp_path, saved_after)


def gathered_state_of_rank0(topo, model: nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for v in state.values():
        topo.world.broadcast_(v, src=0)
    return state


@pytest.mark.dist
def test_local_with_h_1_and_plain_averaging_is_data_parallel_sgd(tmp_path):
    """A local kind that summed the pseudo-gradients instead of averaging them, flipped their sign, moved the
    anchor by something other than the averaged pseudo-gradient, or took the anchor after the first step,
    would not match dense within float tolerance. (Averaging SGD's momentum is linear here, so keeping each
    rank's would pass this test: the next one checks the state's averaging.)"""
    run_ranks(_h1_is_data_parallel, 2, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_round_synchronises_by_its_rules(tmp_path, name):
    """Fails on a wrong outer step (plain averaging instead of Nesterov, the pseudo-gradient's sign flipped), on
    BatchNorm statistics or optimizer state (SGD's momentum, both of Adam's moments) left per rank, and on an
    exchange mid-round."""
    run_ranks(_a_round_follows_its_rules, 2, tmp_path, name)


@pytest.mark.dist
def test_a_round_restores_mid_way_and_skips_are_agreed(tmp_path):
    """Fails if the saved round lacked this rank's own weights or optimizer state (the restored rank 1 would
    train on rank 0's), the anchor or the outer momentum, or if a rank with finite gradients stepped while
    another overflowed."""
    run_ranks(_skips_agree_and_state_restores, 2, tmp_path)


def _a_parameter_without_a_gradient_on_one_rank(rank: int, world: int) -> str:
    topo = setup_distributed(DistConfig())
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = build_communicator(CommConfig(kind="local", local_steps=1), model, topo, optimizer)
    x, _ = batch(rank, 0)
    (model(x).sum() if rank == 0 else model[0](x).sum()).backward()  # rank 1 leaves the last layer out
    return synchronisation_error(comm, optimizer, RuntimeError, "the ranks hold different optimizer state")


@pytest.mark.dist
def test_ranks_whose_optimizer_state_differs_stop_together_in_words(tmp_path):
    """Without the check the averaging allreduce gets buffers of different sizes: an error on some ranks and a
    hang on the others (NCCL), not one message on every rank."""
    messages = run_ranks(_a_parameter_without_a_gradient_on_one_rank, 2, tmp_path)
    assert messages[0] == messages[1] and "[[4, 83], [2, 56]]" in messages[0]


@pytest.mark.unit
@pytest.mark.parametrize("key, value", [("local_steps", 0), ("outer_lr", 0.0), ("outer_momentum", 1.0),
                                        ("compression", "fp16"), ("local_density", 0.0), ("local_density", 1.5),
                                        ("local_state", "drop")])
def test_bad_local_settings_are_config_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"comm.{key}"):
        CommConfig(kind="local", **{key: value})


@pytest.mark.unit
def test_an_overlapped_sparse_pseudo_gradient_is_a_config_error():
    with pytest.raises(ConfigError, match="comm.local_overlap"):
        CommConfig(kind="local", local_density=0.1, local_overlap=True)


@pytest.mark.unit
def test_a_16_bit_wire_with_a_sparse_pseudo_gradient_is_a_config_error():
    with pytest.raises(ConfigError, match="comm.local_density < 1"):
        CommConfig(kind="local", local_density=0.1, compression="bf16")


@pytest.mark.unit
def test_a_moving_average_on_a_stride_is_a_config_error_under_local():
    from recipes.resnet50 import Config
    from trainer.config import load_config
    phase = "schedule.phases=[{start_epoch: 0, end_epoch: 1, image_size: 16, batch_size: 8}]"
    with pytest.raises(ConfigError, match="train.ema_every_steps: must be 1 with comm.kind local"):
        load_config(Config, None, [phase, "train.epochs=1", "comm.kind=local", "train.ema_decay=0.9",
                                   "train.ema_every_steps=4"])
    load_config(Config, None, [phase, "train.epochs=1", "comm.kind=local", "train.ema_decay=0.9"])


@pytest.mark.long
def test_a_recipe_run_stopped_mid_round_resumes_bitwise(tmp_path, digits_root):
    """2 ranks of the ResNet recipe with comm.kind local, H = 2, 2 epochs x 3 steps: rounds end at steps 2 and 3
    (the epoch's end), 5 and 6. A SIGTERM to rank 1 in step 4 checkpoints mid-round; the resumed run ends with
    the uninterrupted run's weights bit for bit. Fails if a checkpoint kept only rank 0's weights mid-round (rank
    1 would resume on them), if the round's step count or anchor were lost, or if a round did not end with the
    epoch (the evaluation would see unequal replicas and the replica guard would stop the run)."""
    from tests.test_checkpoint import recipe_args, train
    from trainer.checkpoint import checkpoint_dirs, latest_checkpoint
    from trainer.preemption import PREEMPTED_EXIT_CODE
    local = ("comm.kind=local", "comm.local_steps=2", "comm.outer_lr=0.8", "comm.outer_momentum=0.5",
             "dist.check_every_steps=1")
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    first, stopped = train(tmp_path, 2, [(recipe_args(digits_root, straight, *local), ""),
                                         (recipe_args(digits_root, preempted, *local), "term:1:4")])
    assert [r["status"] for r in first] == [0, 0] and [r["status"] for r in stopped] == [PREEMPTED_EXIT_CODE] * 2
    newest = checkpoint_dirs(preempted)[0]
    assert newest.name == "step-00000004"
    state, _ = latest_checkpoint(preempted)
    rounds = [r["comm"]["round"] for r in state["ranks"]]
    assert all(r is not None and r["mine"] is not None for r in rounds) and state["ranks"][0]["comm"]["since_sync"] == 1
    assert not torch.equal(rounds[0]["mine"]["params"][0], rounds[1]["mine"]["params"][0])  # per rank, mid-round
    resumed = tmp_path / "resumed"
    shutil.copytree(preempted, resumed)
    (results,) = train(tmp_path, 2, [(recipe_args(digits_root, resumed, *local, "train.resume=true"), "")])
    assert [r["status"] for r in results] == [0, 0]
    a, b = latest_checkpoint(straight)[0], latest_checkpoint(resumed)[0]
    assert a["trainer"]["step"] == b["trainer"]["step"] == 6
    different = [k for k, v in a["model"].items() if not torch.equal(v, b["model"][k])]
    assert not different, different[:5]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (straight, resumed)]
    assert summaries[0]["final"]["eval/top1"] == summaries[1]["final"]["eval/top1"]


@pytest.mark.unit
@pytest.mark.parametrize("optim, per_param, compression", [("lars", 1, "none"), ("adam", 2, "bf16")])
def test_the_planner_prices_local_as_one_synchronisation_per_round(optim, per_param, compression):
    """A step of `local` costs its compute plus 1/H of two ring allreduces (the pseudo-gradient on its wire, the
    averaged state in fp32), with nothing hidden behind backward; it is offered only where the config asks for
    it. Fails if the round's H is not divided out, the optimizer state is not priced, or bf16 is not halved."""
    from trainer.comm.cost import Layout, Link, Network
    from trainer.comm.links import ring_allreduce_s
    from trainer.comm.planner import ModelSpec, strategies
    links = {"world": Link(1e-4, 1e8), "world16": Link(1e-4, 1.6e8)}  # a flat ring (gloo); 16-bit a link of its own
    net = Network(Layout(4, 2), links)
    n = 25_000_000
    model = ModelSpec("m", [n // 2, n - n // 2])
    comm = CommConfig(kind="local", local_steps=8, compression=compression)
    offered = strategies(comm, [0.01], per_param)
    local = offered[0]
    assert local.label == "local H=8" and local.is_configured(comm) and not offered[1].local_steps
    assert not any(s.local_steps for s in strategies(CommConfig(kind="dense"), [0.01]))
    step, plan = local.step_s(0.1, 0.2, model, net)
    wire = 2 if compression == "bf16" else 4
    expected = (ring_allreduce_s(wire * n, 8, links["world16" if wire == 2 else "world"])
                + ring_allreduce_s(4 * per_param * n, 8, links["world"])) / 8
    flag = ring_allreduce_s(4, 8, links["world"])  # every step's non-finite flag
    assert plan == [] and step == pytest.approx(0.3 + flag + expected)


@pytest.mark.unit
def test_the_planner_prices_a_sparse_round_with_kept_state_as_an_allgather_of_k_pairs():
    """SparseLoCo with kept optimizer state: a synchronisation is the allgather of each rank's k pairs (8 bytes
    each) and the selection from the n pseudo-gradient elements, no state (not even an empty allreduce's latency).
    Fails if the dense allreduce is priced, the state is still priced under keep, or the selection is left out."""
    from trainer.comm.cost import Layout, Link, Network, Selection, k_of
    from trainer.comm.links import allgather_s, ring_allreduce_s
    from trainer.comm.planner import ModelSpec, strategies
    links = {"world": Link(1e-4, 1e8)}
    net = Network(Layout(4, 2), links, Selection(0.01, 2e-9))
    n = 25_000_000
    comm = CommConfig(kind="local", local_steps=8, local_density=0.01, local_state="keep")
    local = strategies(comm, [0.01], 1)[0]
    assert local.label == "local H=8 top-k 0.01"
    step, _ = local.step_s(0.1, 0.2, ModelSpec("m", [n]), net)
    sync = allgather_s(8 * k_of(n, 0.01), 8, links["world"]) + 0.01 + 2e-9 * n
    assert step == pytest.approx(0.3 + ring_allreduce_s(4, 8, links["world"]) + sync / 8)


@pytest.mark.unit
def test_the_planner_hides_an_overlapped_synchronisation_behind_the_next_round():
    """comm.local_overlap: a synchronisation sends the weights alone (the state waits for the epoch's end), and a
    step pays only the part that the next round's H steps of compute do not hide. Fails if the state is still
    priced, or if nothing (or everything) is hidden."""
    from trainer.comm.cost import Layout, Link, Network
    from trainer.comm.links import ring_allreduce_s
    from trainer.comm.planner import ModelSpec, strategies
    links = {"world": Link(1e-4, 1e8)}
    net = Network(Layout(4, 2), links)
    n = 25_000_000
    local = strategies(CommConfig(kind="local", local_steps=8, local_overlap=True), [0.01])[0]
    assert local.label == "local H=8 overlapped"
    sync, flag = ring_allreduce_s(4 * n, 8, links["world"]), ring_allreduce_s(4, 8, links["world"])
    assert 8 * 0.01 < sync < 8 * 1.0
    for compute, exposed in ((0.01, sync - 8 * 0.01), (1.0, 0.0)):
        step, _ = local.step_s(compute / 3, 2 * compute / 3, ModelSpec("m", [n]), net)
        assert step == pytest.approx(compute + flag + exposed / 8)
