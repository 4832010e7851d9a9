"""What a GPU cluster relies on, checked on CPU gloo ranks: error feedback under a changing loss scale and
skipped steps, order-deterministic sparse sums, the replica-consistency guard, the exchange thread's device,
and no host-blocking waits on NCCL."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from kernels import build_adam
from tests.conftest import run_ranks
from tests.test_comm import BUCKET_MB, Params, flat_in_bucket_order, grads_of, layout, residual_total
from trainer.comm import CommConfig, build_communicator
from trainer.comm.execute import PlanExecutor
from trainer.comm.sparse import scatter_payloads
from trainer.config import ConfigError
from trainer.dist import (DistConfig, ReplicaDivergenceError, ReplicaGuard, Topology, TorchGroup, setup_distributed,
                          weights_checksum)
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.train_config import Components, LoopConfig, TrainConfig

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- error feedback and the loss scale

OVERFLOW_STEP, OVERFLOW_RANK = 3, 1


class LinearTask:
    """loss = sum(p * g) with integer-valued g = grads_of(rank, step): the gradient is exactly g times the
    loss scale, so every sum below is exact and the identity can be checked bit for bit. At OVERFLOW_STEP one
    element of OVERFLOW_RANK's gradient is inf (an fp16 overflow)."""

    unit, targets = "items", {}

    def __init__(self, model: Params, rank: int) -> None:
        self.model, self.rank = model, rank

    def loss(self, step: int) -> tuple[torch.Tensor, int]:
        grads = grads_of(self.rank, step, integer=True)
        if step == OVERFLOW_STEP and self.rank == OVERFLOW_RANK:
            grads[2][7] = float("inf")
        return sum((p * g).sum() for p, g in zip(self.model.ps, grads)), 1


def _feedback_survives_scale_changes(rank: int, world: int, kind: str, per_node: int, tmp: str, optim: str,
                                     selection: str) -> None:
    if selection == "device":  # CUDA's sync-free MSTopK: NaN values for a non-finite input instead of raising
        import trainer.comm.sparse as sparse
        from kernels import mstopk_device_ops
        sparse.mstopk = lambda x, k, iters=20: mstopk_device_ops(x, k, iters)
    topo = setup_distributed(DistConfig(ranks_per_node=per_node))
    model = Params()
    comm = build_communicator(CommConfig(kind=kind, bucket_mb=BUCKET_MB, density=0.05, dense_below=20), model, topo)
    # A plain optimizer is not called on a skipped step; torch's fused Adam always is, and skips inside.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0) if optim == "sgd" else build_adam(model.parameters(), lr=0.0)
    trainer = Trainer(LoopConfig(TrainConfig(loss_scale="dynamic"), log=LogConfig(dir=tmp)), topo,
                      LinearTask(model, rank), Components(model, optimizer, comm))
    # The scale doubles after every good step and halves at the overflow: it changes at every step.
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    averaged: list[torch.Tensor] = []
    finish = comm.finish

    def finish_and_keep() -> dict:
        stats = finish()
        averaged.append(flat_in_bucket_order(comm, model, [p.grad.clone() for p in model.ps]))
        return stats

    comm.finish = finish_and_keep
    local, _ = layout(kind, world, per_node)
    before = residual_total(comm, world, local)
    scales = []
    for step in range(6):
        scale = trainer.scaler.get_scale()
        scales.append(scale)
        mine_before = {i: r.clone() for i, r in comm.residuals.items()}
        trainer.train_step(step)
        after = residual_total(comm, world, local)
        if step == OVERFLOW_STEP:  # skipped: every residual of every rank exactly as before the step
            assert trainer.skipped_steps == 1
            assert set(comm.residuals) == set(mine_before)
            assert all(torch.equal(comm.residuals[i], r) for i, r in mine_before.items())
            assert torch.equal(after, before)
        else:  # in unscaled units: W * averaged / S + residuals' == sum of gradients + residuals, exactly
            incoming = flat_in_bucket_order(comm, model, [sum(gs) for gs in zip(*(grads_of(r, step, True)
                                                                                   for r in range(world)))])
            assert torch.equal(averaged[-1] * world / scale + after, incoming + before), step
            assert after.abs().sum() > 0
        before = after
    assert len(set(scales)) >= 4, scales  # the scale really moved (up, down at the skip, up again)


@pytest.mark.parametrize("kind,world,per_node,optim,selection", [
    ("topk", 2, 0, "sgd", "cpu"), ("topk", 2, 0, "adam", "cpu")])
@pytest.mark.dist
def test_error_feedback_is_exact_across_loss_scale_changes_and_skipped_steps(tmp_path, kind, world, per_node, optim,
                                                                              selection):
    run_ranks(_feedback_survives_scale_changes, world, tmp_path, kind, per_node, str(tmp_path / "run"), optim,
              selection)


@pytest.mark.parametrize("optim,selection", [("sgd", "cpu"), ("adam", "device")])
@pytest.mark.long  # 4 ranks: 15 s or more each
def test_hierarchical_error_feedback_is_exact_across_loss_scale_changes_and_skipped_steps(tmp_path, optim,
                                                                                           selection):
    run_ranks(_feedback_survives_scale_changes, 4, tmp_path, "hitopk", 2, str(tmp_path / "run"), optim, selection)


# ---------------------------------------------------------------- deterministic sparse sums


def test_sparse_sums_add_the_payloads_in_rank_order():
    """Colliding indices whose float sum depends on the order: the result is the rank-order sum, bit for bit
    (on CUDA a single index_add_ over all payloads would add them with atomics, in any order)."""
    big, small = 2.0**25, 1.0  # big + small rounds to big in fp32; the order decides what survives
    parts = [(torch.tensor([big, 3.0]), torch.tensor([4, 0])),
             (torch.tensor([small, 5.0]), torch.tensor([4, 1])),
             (torch.tensor([-big, 7.0]), torch.tensor([4, 2]))]
    payloads = torch.cat([torch.cat([v, i.to(torch.int32).view(torch.float32)]) for v, i in parts])
    out = scatter_payloads(payloads, 3, 6)
    expected = torch.zeros(6)
    for values, indices in parts:  # left to right, one payload at a time
        for v, i in zip(values, indices):
            expected[i] = (expected[i] + v).float()
    assert torch.equal(out, expected)
    assert out[4] == 0.0  # ((0 + 2^25) + 1) - 2^25 in fp32; (2^25 - 2^25) + 1, another order, gives 1.0
    # On the CPU a single index_add_ is sequential too, so the values above cannot tell the two apart: the
    # structure can. Every addition must be one payload with distinct indices (no collision within a call).
    calls: list[torch.Tensor] = []
    real = torch.Tensor.index_add_

    def recording(self, dim, index, source, *args, **kwargs):
        calls.append(index.clone())
        return real(self, dim, index, source, *args, **kwargs)
    torch.Tensor.index_add_ = recording
    try:
        scatter_payloads(payloads, 3, 6)
    finally:
        torch.Tensor.index_add_ = real
    assert len(calls) == 3 and all(c.unique().numel() == c.numel() for c in calls)
    torch.use_deterministic_algorithms(True)  # no nondeterministic kernel on the path
    try:
        assert torch.equal(scatter_payloads(payloads, 3, 6), expected)
    finally:
        torch.use_deterministic_algorithms(False)


# ---------------------------------------------------------------- the replica guard


def _guard(rank: int, world: int, odd: int) -> None:
    topo = setup_distributed(DistConfig())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    guard = ReplicaGuard(5, topo)
    guard.maybe_check(model, 5)  # equal replicas: passes
    with torch.no_grad():
        if rank == odd:  # one ulp on one weight of one rank
            w = model[1].weight
            w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
    guard.maybe_check(model, 7)  # not due: no collective, no error
    with pytest.raises(ReplicaDivergenceError, match=rf"step 10: .*rank {odd}'s weights are not bitwise equal to the "
                                                      rf"other ranks' \(diverged ranks: \[{odd}\]; equal at the "
                                                      rf"previous check, step 5\)"):
        guard.maybe_check(model, 10)


@pytest.mark.dist
@pytest.mark.parametrize("odd", [0, 2])
def test_the_replica_guard_names_the_diverged_rank(tmp_path, odd):
    """Named by the majority, so a diverged rank 0 is named too (not every other rank)."""
    run_ranks(_guard, 3, tmp_path, odd)


def _guard_in_training(rank: int, world: int, tmp: str) -> None:
    topo = setup_distributed(DistConfig())
    model = Params()
    comm = build_communicator(CommConfig(kind="dense", bucket_mb=BUCKET_MB), model, topo)
    trainer = Trainer(LoopConfig(TrainConfig(), log=LogConfig(dir=tmp)), topo, LinearTask(model, rank),
                      Components(model, torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                 guard=ReplicaGuard(DistConfig(check_every_steps=2).check_every_steps, topo)))
    for step in range(3):  # the guard checks after optimizer steps 2 and 4 (trainer.step counts them)
        if step == 2 and rank == 1:  # a bad update on one rank, as a bit flip or a nondeterministic kernel makes
            with torch.no_grad():
                model.ps[3][0] += 1e-3
        trainer.train_step(10 + step)  # steps of LinearTask without an overflow
        trainer.step += 1
    with pytest.raises(ReplicaDivergenceError, match=r"step 4: .*rank 1's weights"):
        trainer.train_step(13)


@pytest.mark.dist
def test_the_trainer_runs_the_replica_guard(tmp_path):
    run_ranks(_guard_in_training, 2, tmp_path, str(tmp_path / "run"))


def test_weights_checksum_sees_one_bit_and_a_swap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    base = weights_checksum(model)
    assert base.dtype == torch.int64 and base.dim() == 0
    with torch.no_grad():
        model[0].weight.view(-1).view(torch.int32)[3] ^= 1  # the lowest mantissa bit
    assert weights_checksum(model) != base
    twin = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():  # the same tensors, in the other order
        twin[0].weight.copy_(model[1].weight), twin[1].weight.copy_(model[0].weight)
        twin[0].bias.copy_(model[1].bias), twin[1].bias.copy_(model[0].bias)
    assert weights_checksum(twin) != weights_checksum(model)


def test_the_replica_guard_is_off_on_one_process_and_when_disabled():
    topo = Topology()
    assert not ReplicaGuard(1, topo).should_check(1)
    assert not ReplicaGuard(0, Topology(world_size=2)).should_check(500)
    assert ReplicaGuard(500, Topology(world_size=2)).should_check(1000)
    with pytest.raises(ConfigError, match=r"dist.check_every_steps: must be >= 0, got -1"):
        DistConfig(check_every_steps=-1)


# ---------------------------------------------------------------- the exchange thread's device


def test_the_exchange_thread_is_bound_to_its_ranks_gpu(monkeypatch):
    """CUDA's current device is per thread: the comm thread must set it before its first CUDA call."""
    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((threading.current_thread().name, d)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    topo = Topology(rank=3, world_size=4, local_rank=3, ranks_per_node=4, device=torch.device("cuda", 3))
    comm = PlanExecutor(CommConfig(bucket_mb=1.0), nn.Linear(4, 4), topo, "dense", replans=True)
    try:
        comm._thread.submit(lambda: None).result()
    finally:
        comm._thread.shutdown()
        comm.detach()
    assert bound == [("comm-rank3_0", torch.device("cuda", 3))]


# ---------------------------------------------------------------- waits on NCCL


class RecordingWork:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def wait(self, *args) -> bool:
        self.calls.append(args)
        return True


def _waits(rank: int, world: int) -> None:
    import datetime

    import trainer.dist.torch_backend as tdist
    setup_distributed(DistConfig(timeout_s=30))
    timeout = datetime.timedelta(seconds=30)
    group = TorchGroup(None, rank, timeout)
    assert group.host_wait  # gloo: a bounded host wait
    work = RecordingWork()
    group.wait(work, "x")
    assert work.calls == [(timeout,)]
    real = tdist.dist.get_backend
    tdist.dist.get_backend = lambda pg=None: "nccl"  # a group over an NCCL process group
    try:
        group = TorchGroup(None, rank, timeout)
    finally:
        tdist.dist.get_backend = real
    work = RecordingWork()
    group.wait(work, "x")
    assert work.calls == [()]  # stream-ordered: no timeout, so no host sync per bucket


@pytest.mark.dist
def test_nccl_waits_do_not_block_the_host(tmp_path):
    run_ranks(_waits, 2, tmp_path)


# ---------------------------------------------------------------- GPU settings on a machine without a GPU


def test_arch_support_reads_native_code_and_ptx():
    from trainer.devices import arch_supported
    archs = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1's CUDA 13 build
    assert arch_supported((9, 0), archs) and arch_supported((7, 5), archs)
    assert arch_supported((8, 9), archs)  # L4 / L40S: sm_86 code runs on the newer minor version
    assert arch_supported((10, 3), archs) and arch_supported((12, 1), archs)
    assert not arch_supported((7, 0), archs)  # V100: no Volta code and no older PTX
    assert not arch_supported((11, 0), archs)  # no code of major 11 and no PTX
    assert arch_supported((11, 0), archs + ["compute_100"])  # ... unless PTX of an older one is there
    assert not arch_supported((8, 0), ["sm_86"])  # code for a newer minor does not run on an older one


@pytest.mark.e2e
def test_a_gpu_config_stops_before_any_work_on_a_machine_without_cuda(tmp_path, monkeypatch):
    """The flagship config asks for NCCL and fp16: here it stops with one line naming both and the reason,
    before a process group, a dataset or a model exists (data.root does not even exist)."""
    import subprocess
    import sys
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = subprocess.run([sys.executable, "-m", "recipes.resnet50", "--config", "configs/resnet50_dawnbench.yaml",
                             f"data.root={tmp_path / 'nowhere'}", f"log.dir={tmp_path / 'run'}", "train.amp=fp16"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("config error: dist.backend: nccl, train.amp: fp16 need a usable CUDA GPU, and ")
    assert "is_available() is False" in lines[0] or "no CUDA support" in lines[0]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- checkpoints out of the clock


@pytest.mark.e2e
def test_background_checkpoints_are_complete_and_timed(tmp_path, digits_root):
    """train.checkpoint_in_background: the files are written by a thread from a host snapshot, every one
    verifies and holds the step it was taken at, and the training thread's time is in time/checkpoint_s."""
    import json

    from recipes.resnet50 import main
    from tests.test_trainer import TINY, phases
    from trainer.checkpoint import checkpoint_dirs, read_checkpoint
    out = tmp_path / "run"
    summary = main(["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", f"log.dir={out}",
                    "train.epochs=2", phases(2), "train.max_steps_per_epoch=3", *TINY,
                    "train.checkpoint_in_background=true", "train.checkpoint_every_steps=2", "train.keep_checkpoints=9",
                    "dist.backend=gloo", "comm.kind=dense"])
    found = checkpoint_dirs(out)  # complete: manifests written, every file's digest verified
    steps = sorted(int(d.name[5:]) for d in found)
    assert steps == [2, 3, 4, 6]  # every 2 steps, and at the end of each epoch (3 steps per epoch)
    for ckpt_dir in found:
        assert read_checkpoint(ckpt_dir)["trainer"]["step"] == int(ckpt_dir.name[5:])
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "epoch"]
    assert epochs[-1]["time/checkpoint_s"] > 0 and summary["checkpoint_s"] >= epochs[-1]["time/checkpoint_s"]


def test_a_host_snapshot_does_not_change_with_the_live_tensors():
    from trainer.checkpoint import to_host
    live = {"w": torch.zeros(3), "nested": [torch.ones(2), (torch.zeros(1), 5)], "n": 1}
    snap = to_host(live)
    live["w"].add_(1), live["nested"][0].add_(1), live["nested"][1][0].add_(1)
    assert torch.equal(snap["w"], torch.zeros(3)) and torch.equal(snap["nested"][0], torch.ones(2))
    assert torch.equal(snap["nested"][1][0], torch.zeros(1)) and snap["nested"][1][1] == 5 and snap["n"] == 1


# ---------------------------------------------------------------- host syncs of a train step


def test_a_loss_scaled_train_step_reads_the_device_once(tmp_path, monkeypatch):
    """One host read per step: the scaler's own inf check. The scale is never read back (on CUDA every
    `.item()` waits for the whole step)."""
    model = Params()
    topo = Topology()
    comm = build_communicator(CommConfig(), model, topo)
    trainer = Trainer(LoopConfig(TrainConfig(loss_scale="dynamic"), log=LogConfig(dir=str(tmp_path))), topo,
                      LinearTask(model, 0), Components(model, torch.optim.SGD(model.parameters(), lr=0.1), comm))
    trainer.train_step(0)  # the scaler initialises its state on the first step
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name):
            reads.append(_name)
            return _real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    trainer.train_step(1)
    assert reads == ["item"], reads


@pytest.mark.e2e
def test_dali_is_unavailable_without_the_nvidia_package(tmp_path):
    """`find_spec("nvidia.dali")` imports `nvidia` first: with no such package it must say False, not raise."""
    import subprocess
    import sys
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'nvidia' or name.startswith('nvidia.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    code = "from data import dali_available, resolve_backend; print(dali_available(), resolve_backend('auto'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "torchvision"]


def test_any_failure_of_the_background_writer_is_a_checkpoint_write_error(tmp_path):
    from trainer.checkpoint import MODEL, CheckpointWriter, CheckpointWriteError, checkpoint_dirs
    writer = CheckpointWriter(tmp_path / "checkpoints", 0, 1)
    writer.write_in_background(1, {MODEL: {"fn": lambda: None}}, "attempt")  # a lambda cannot be pickled
    with pytest.raises(CheckpointWriteError, match=r"background checkpoint write failed: .*previous checkpoints"):
        writer.wait()
    assert checkpoint_dirs(tmp_path) == []
    writer.write_in_background(2, {MODEL: {"w": torch.ones(2)}}, "attempt")
    writer.wait()
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-00000002"]


def test_nccl_needs_a_gpu_per_rank_on_the_machine(monkeypatch):
    from trainer.dist.torch_backend import gpu_index_of
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert gpu_index_of(3, 4) == 3
    with pytest.raises(ConfigError, match=r"dist.backend: nccl: 8 ranks on this machine but 4 GPU\(s\) visible"):
        gpu_index_of(5, 8)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.warns(UserWarning, match="TORCH_NCCL_BLOCKING_WAIT is set"):
        gpu_index_of(0, 4)
