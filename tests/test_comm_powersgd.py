"""The powersgd kind (trainer/comm/powersgd.py) against PyTorch's own `powerSGD_hook` on real 2-rank gloo groups,
its state through a checkpoint and a skipped step, its cost description and its configuration errors.

Every rank's gradient at each step is a deterministic function of (rank, step), fed through a real backward pass
so the buckets launch from the autograd hooks. The hook is driven with a hand-made `GradBucket` (buffer, index,
gradients as views of the buffer, is_last) built from the same gradients in the communicator's bucket order.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from recipes.resnet50 import Config
from tests.conftest import as_from_file, run_ranks
from trainer.comm import CommConfig, PowerSGDCommunicator, build_communicator
from trainer.comm.cost import Layout, describe, exchange_bytes
from trainer.comm.plan import CODES, KINDS, Choice, fixed_plan
from trainer.comm.powersgd import EPSILON, bucket_view, max_rank
from trainer.config import ConfigError, load_config
from trainer.dist import DistConfig, Topology, setup_distributed

pytestmark = pytest.mark.dist

VIEWED = [(3, 4), (5,), (24, 20), (24,), (8, 4, 3, 3), (16, 36), (8, 36), (7,), (40, 30)]
"""Matrices worth compressing (24x20, 8x36 twice in one bucket: grouped by shape, 16x36, 40x30), and tensors that
go dense inside a compressed bucket (3x4, biases)."""
SHAPES = [(6, 5), (4,), (36, 36), *VIEWED]
"""Packed last first into buckets of 1300 elements: 40x30 + 7 | 8x36, 16x36, 8x4x3x3, 24 | 24x20, 5, 3x4 | 36x36,
4 | 6x5, a bucket below `DENSE_BELOW`."""
PHASE = "schedule.phases=[{start_epoch: 0, end_epoch: 10, image_size: 32, batch_size: 8}]"
BUCKET_MB = 1300 * 4 / 2**20
DENSE_BELOW = 100
WARMUP = 2


class Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in SHAPES)


def grads_of(rank: int, step: int) -> list[torch.Tensor]:
    """A low-rank signal shared by the ranks plus each rank's own noise (NaN everywhere for step -1)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    out = []
    for s in SHAPES:
        if len(s) >= 2:
            rows, cols = s[0], torch.Size(s[1:]).numel()
            signal = torch.randn(rows, 2, generator=shared) @ torch.randn(2, cols, generator=shared)
            x = (signal + 0.3 * torch.randn(rows, cols, generator=g)).view(s)
        else:
            x = torch.randn(s, generator=g)
        out.append(x if step >= 0 else torch.full(s, float("nan")))
    return out


def backward_with(model: Params, grads: list[torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    sum((p * g).sum() for p, g in zip(model.ps, grads)).backward()


def step_both(comm_a: object, comm_b: object, straight: Params, restored: Params, grads: list[torch.Tensor],
              skipped: list[torch.Tensor] | None, label: object) -> None:
    """One exchange of `grads` by comm_a (the uninterrupted run) and by comm_b (the resumed one), and the same
    averaged gradients from both, bit for bit. `skipped`: non-finite gradients comm_b exchanges and rolls back
    first, as a step the loss scaler skipped."""
    # one communicator at a time: two exchange threads would interleave their collectives differently
    comm_b.detach()
    comm_a.attach()
    backward_with(straight, grads)
    comm_a.finish()
    comm_a.detach()
    comm_b.attach()
    if skipped is not None:
        backward_with(restored, skipped)
        comm_b.finish()
        assert all(not torch.isfinite(p.grad).all() for p in restored.ps)
        comm_b.rollback()
    backward_with(restored, grads)
    comm_b.finish()
    for p, q in zip(straight.ps, restored.ps):
        assert torch.equal(p.grad, q.grad), label


def config(**kw: object) -> CommConfig:
    base = dict(kind="powersgd", bucket_mb=BUCKET_MB, dense_below=DENSE_BELOW, dense_warmup_steps=WARMUP)
    return CommConfig(**{**base, **kw})


class GradBucket:
    """What `powerSGD_hook` reads of DDP's GradBucket: the flat buffer and its tensors as views of it."""

    def __init__(self, index: int, last: bool, tensors: list[torch.Tensor]) -> None:
        self._index, self._last = index, last
        self._buffer = torch.cat([t.reshape(-1) for t in tensors])
        self._views, at = [], 0
        for t in tensors:
            self._views.append(self._buffer[at:at + t.numel()].view_as(t))
            at += t.numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return self._last


def hook_step(state: PowerSGDState, comm: PowerSGDCommunicator, grads: list[torch.Tensor],
              index: dict[int, int]) -> list[torch.Tensor]:
    """The hook's averaged gradients (model order) for this rank's `grads`, bucketed as `comm` buckets them;
    a bucket the communicator's plan leaves dense is a plain average."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    last = max(b.index for b in comm.buckets if comm.plan[b.index].kind == "powersgd")
    for b in comm.buckets:
        members = [index[id(p)] for p in b.params]
        bucket = GradBucket(b.index, b.index == last, [grads[i].clone() for i in members])
        if comm.plan[b.index].kind == "powersgd":
            averaged = powerSGD_hook(state, bucket).wait()
            assert averaged.data_ptr() == bucket.buffer().data_ptr()
        else:
            dist.all_reduce(bucket.buffer())
            bucket.buffer().div_(dist.get_world_size())
        for i, view in zip(members, bucket.gradients()):
            out[i] = view
    return out


def _matches_the_hook(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    for rank_r, warm in ((2, True), (1, True), (3, True), (2, False)):
        model = Params()
        comm = build_communicator(config(powersgd_rank=rank_r, powersgd_warm_start=warm), model, topo)
        assert isinstance(comm, PowerSGDCommunicator)
        kinds = [c.kind for c in comm.plan]
        assert "powersgd" in kinds and kinds[-1] == "dense", kinds  # the last bucket is small: dense
        index = {id(p): i for i, p in enumerate(model.ps)}
        state = PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=WARMUP,
                              use_error_feedback=True, warm_start=warm, orthogonalization_epsilon=EPSILON,
                              random_seed=0)
        before = torch.zeros(sum(p.numel() for p in model.ps))
        for step in range(WARMUP + 4):
            grads = grads_of(rank, step)
            backward_with(model, grads)
            stats = comm.finish()
            want = hook_step(state, comm, grads, index)
            for i, (p, w) in enumerate(zip(model.ps, want)):
                torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank_r} warm {warm} step {step} param {i}: {m}")
            if step < WARMUP:
                assert not comm.residuals and stats["density"] == 1.0
                continue
            assert 0 < stats["density"] < 1
            # a ring allreduce on 2 ranks sends its buffer once: each dense and factor element, 4 bytes
            assert stats["bytes_sent"] == 4 * sum(bucket_view(b.params, rank_r).sent_elements
                                                  if c.kind == "powersgd" else b.numel
                                                  for b, c in zip(comm.buckets, comm.plan))
            for i, err in state.error_dict.items():  # the hook's error is this rank's residual
                torch.testing.assert_close(comm.residuals[i], err, rtol=1e-5, atol=1e-5)
            assert set(comm.powersgd.q) == (set(state.q_memory_dict) if warm else set())
            for i, q in comm.powersgd.q.items():
                torch.testing.assert_close(q, state.q_memory_dict[i], rtol=1e-4, atol=1e-5)
            # no gradient mass lost or counted twice: W x applied + residuals = gradients + previous residuals
            residuals = flat_in_bucket_order(comm, model, None)
            incoming = flat_in_bucket_order(comm, model, [g.clone() for g in grads])
            applied = flat_in_bucket_order(comm, model, [p.grad.clone() for p in model.ps])
            for t in (residuals, incoming, before):
                dist.all_reduce(t)
            torch.testing.assert_close(applied * world + residuals, incoming + before, rtol=1e-5, atol=1e-4)
            before = flat_in_bucket_order(comm, model, None)
        comm.detach()


def flat_in_bucket_order(comm: PowerSGDCommunicator, model: Params, tensors: list[torch.Tensor] | None
                         ) -> torch.Tensor:
    """Per-parameter tensors (model order) in the communicator's bucket order; None: this rank's residuals."""
    if tensors is None:
        return torch.cat([comm.residuals[b.index].clone() if b.index in comm.residuals else torch.zeros(b.numel)
                          for b in comm.buckets])
    index = {id(p): i for i, p in enumerate(model.ps)}
    return torch.cat([tensors[index[id(p)]].reshape(-1) for b in comm.buckets for p in b.params])


def test_powersgd_matches_torchs_powersgd_hook(tmp_path):
    """Ranks 1, 2 (Gram-Schmidt) and 3 (QR), with and without warm start, after a dense warm-up: the same
    averaged gradients, residuals (the hook's error feedback) and warm-started Q as the hook over 4 steps;
    the gradient mass conserved, and the bytes of the factors counted."""
    run_ranks(_matches_the_hook, 2, tmp_path)


def _resumes_and_rolls_back(rank: int, world: int) -> None:
    for warm in (True, False):
        _resume_and_roll_back(rank, warm)


def _resume_and_roll_back(rank: int, warm: bool) -> None:
    """state_dict after 3 steps (through torch.save and a weights-only load) into a fresh communicator: the
    same next steps, bit for bit. A step of NaN gradients rolled back (the loss scaler skipped it) leaves no
    trace: neither in the residuals nor in Q or the random draws."""
    topo = setup_distributed(DistConfig())
    cfg = config(powersgd_warm_start=warm, dense_warmup_steps=1)
    straight, restored = Params(), Params()
    comm_a = build_communicator(cfg, straight, topo)
    for step in range(3):
        backward_with(straight, grads_of(rank, step))
        comm_a.finish()
    state = as_from_file(comm_a.state_dict())
    assert set(state) == {"steps", "residuals", "powersgd"} and state["steps"] == 3
    # 4 compressed buckets, 2 compressed steps: one draw per bucket, or per bucket and step
    assert bool(state["powersgd"]["q"]) == warm and state["powersgd"]["draws"] == (4 if warm else 8)
    comm_a.detach()
    comm_b = build_communicator(cfg, restored, topo)
    comm_b.load_state_dict(state)
    for step in (3, 4, 5):  # a skipped step before step 4
        step_both(comm_a, comm_b, straight, restored, grads_of(rank, step),
                  grads_of(rank, -1) if step == 4 else None, step)
    a, b = comm_a.state_dict(), comm_b.state_dict()
    assert a["powersgd"]["draws"] == b["powersgd"]["draws"]
    for key in ("residuals",):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][i], b[key][i]) for i in a[key])
    assert all(torch.equal(a["powersgd"]["q"][i], b["powersgd"]["q"][i]) for i in a["powersgd"]["q"])


def test_powersgd_state_resumes_bitwise_and_a_skipped_step_leaves_no_trace(tmp_path):
    """With and without warm start."""
    run_ranks(_resumes_and_rolls_back, 2, tmp_path)


@pytest.mark.unit
def test_describe_sends_both_factors_and_the_uncompressed_rest():
    lay = Layout(2, 1)
    ex = describe(1000 + 24 * 20, Choice("powersgd"), lay, [(24, 20, 2)])
    assert [(c.op, c.nbytes) for c in ex.collectives] == [("allreduce", 4000), ("allreduce", 4 * 48),
                                                          ("allreduce", 4 * 40)]
    assert ex.flops == 6 * 24 * 20 * 2 + 2 * 44 * 4
    assert exchange_bytes(ex, lay)[0] == 4 * (1000 + 88)
    with pytest.raises(ValueError, match="tensor shapes"):
        describe(100, Choice("powersgd"), lay)


@pytest.mark.unit
def test_powersgd_is_a_kind_and_small_buckets_stay_dense():
    assert KINDS[CODES["powersgd"]] == "powersgd" and KINDS[:4] == ("dense", "dense16", "topk", "hitopk")
    assert [c.kind for c in fixed_plan("powersgd", [50, 500], dense_below=100)] == ["dense", "powersgd"]
    assert Choice("powersgd").label == "powersgd" and not Choice("powersgd").sparse


@pytest.mark.unit
def test_bucket_view_follows_the_hooks_choice_of_matrices():
    params = [nn.Parameter(torch.zeros(s)) for s in VIEWED]
    view = bucket_view(params, 2)
    # grouped by shape in order of first appearance: 24x20, 8x36 (twice), 16x36, 40x30
    assert [(m.rows, m.cols) for m in view.matrices] == [(24, 20), (8, 36), (8, 36), (16, 36), (40, 30)]
    assert view.dense == ((0, 17), (17 + 480, 24), (17 + 480 + 24 + 288 + 576 + 288, 7))
    assert max_rank(24, 20) == 5 and max_rank(3, 4) == 0
    assert max_rank(16, 36) == 5 and [(m.rows, m.cols) for m in bucket_view(params, 6).matrices] == [(40, 30)]


@pytest.mark.unit
def test_bad_powersgd_settings_are_one_config_error():
    with pytest.raises(ConfigError, match=r"comm\.powersgd_rank: must be >= 1, got 0"):
        load_config(Config, None, [PHASE, "comm.kind=powersgd", "comm.powersgd_rank=0"])
    cfg = load_config(Config, None, [PHASE, "comm.kind=powersgd", "comm.powersgd_rank=4",
                                     "comm.powersgd_warm_start=false"])
    assert (cfg.comm.kind, cfg.comm.powersgd_rank, cfg.comm.powersgd_warm_start) == ("powersgd", 4, False)
    topo = Topology(world_size=2)  # no collective runs while a communicator is built
    with pytest.raises(ConfigError, match=r"comm\.powersgd_rank: 50 compresses no tensor .*at most 8 compresses "
                                          r"the 40 x 30 matrix"):
        PowerSGDCommunicator(config(powersgd_rank=50), Params(), topo)
    # every bucket below dense_below: all dense, as the config says (top-k does the same)
    assert {c.kind for c in PowerSGDCommunicator(config(dense_below=100_000), Params(), topo).plan} == {"dense"}
