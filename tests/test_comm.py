"""The gradient communicators on real gloo groups: dense, topk, hitopk, against a single-process reference.

Gradients are fed through a real backward pass (so buckets launch from the autograd hooks, in order). Each
rank's gradient at each step is a deterministic function of (rank, step), so every rank can also compute
the whole expected exchange in one process with the same MSTopK and compare.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kernels import mstopk
from recipes.resnet50 import main
from tests.conftest import rejoin_group, run_ranks
from trainer.checkpoint import CheckpointWriter, latest_checkpoint, load_file, rank_file
from trainer.comm import CommConfig, CommTimeoutError, build_communicator
from trainer.dist import DistConfig, setup_distributed

pytestmark = pytest.mark.dist

SIZES = [5, 301, 4099, 17, 2500, 7]  # odd sizes: shards of 2 ranks need padding
BUCKET_MB = 4100 * 4 / 2**20  # a few buckets of mixed sizes


class Params(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SIZES)


def grads_of(rank: int, step: int, integer: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for n in SIZES:
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 10
        out.append(x.round() if integer else x)  # integers: sums are exact in any order
    return out


def backward_with(model: Params, grads: list[torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    sum((p * g).sum() for p, g in zip(model.ps, grads)).backward()


def layout(kind: str, world: int, per_node: int) -> tuple[int, int]:
    """(ranks per 'node' as the communicator sees it, number of such nodes)."""
    return (1, world) if kind == "topk" else (per_node, world // per_node)


def reference_step(kind: str, world: int, per_node: int, cfg: CommConfig, step: int, buckets: list[list[int]],
                   residuals: dict, integer: bool) -> list[torch.Tensor]:
    """The whole exchange of every rank in one process: the expected averaged gradient per parameter."""
    local, nodes = layout(kind, world, per_node)
    per_rank = [grads_of(r, step, integer) for r in range(world)]
    averaged: dict[int, torch.Tensor] = {}
    for b, members in enumerate(buckets):
        flats = [torch.cat([per_rank[r][i] for i in members]) for r in range(world)]
        n = flats[0].numel()
        if n < cfg.dense_below or step < cfg.dense_warmup_steps:
            total = sum(flats)
        elif nodes == 1:  # hitopk on one node: reduce-scatter + allgather, dense
            total = sum(flats)
        else:
            padded = math.ceil(n / local) * local
            s = padded // local
            node_sums = [sum(nn.functional.pad(flats[r], (0, padded - n)) for r in range(a * local, (a + 1) * local))
                         for a in range(nodes)]
            total = torch.zeros(padded)
            for lr in range(local):
                for a in range(nodes):
                    acc = node_sums[a][lr * s:(lr + 1) * s].clone()
                    if (a, lr, b) in residuals:
                        acc += residuals[(a, lr, b)]
                    values, idx = mstopk(acc, min(s, max(1, math.ceil(cfg.density * s))))
                    total[lr * s:(lr + 1) * s].index_add_(0, idx, values)
                    acc[idx] = 0
                    residuals[(a, lr, b)] = acc
            total = total[:n]
        averaged[b] = total / world
    out = []
    for b, members in enumerate(buckets):
        offset = 0
        for i in members:
            out.append((i, averaged[b][offset:offset + SIZES[i]]))
            offset += SIZES[i]
    return [g for _, g in sorted(out, key=lambda t: t[0])]


def _matches_reference(rank: int, world: int, kind: str, per_node: int, density: float, warmup: int,
                       integer: bool, steps: int, backend: str = "auto") -> None:
    topo = setup_distributed(DistConfig(ranks_per_node=per_node, backend=backend))
    cfg = CommConfig(kind=kind, bucket_mb=BUCKET_MB, density=density, dense_below=20, dense_warmup_steps=warmup)
    model = Params()
    comm = build_communicator(cfg, model, topo)
    index = {id(p): i for i, p in enumerate(model.ps)}
    buckets = [[index[id(p)] for p in b.params] for b in comm.buckets]
    assert len(buckets) >= 3 and any(len(m) > 1 for m in buckets)
    residuals: dict = {}
    for step in range(steps):
        backward_with(model, grads_of(rank, step, integer))
        stats = comm.finish()
        expected = reference_step(kind, world, per_node or world, cfg, step, buckets, residuals, integer)
        for i, (p, want) in enumerate(zip(model.ps, expected)):
            if integer:  # exact: the sparse paths must reproduce a dense allreduce bit for bit
                assert torch.equal(p.grad, want), (step, i, (p.grad - want).abs().max())
            else:
                torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=f"step {step}, param {i}")
        assert stats["bytes_sent"] > 0 and 0 < stats["density"] <= 1
        if density < 1 and step >= warmup and kind == "topk":
            assert stats["density"] < 0.5 and stats["select_s"] > 0


# Per world size, the layouts (ranks per node; 0 = one node) and communicators to check: 1xN, Nx1 and 2x2.
LAYOUTS = {2: [(0, "topk"), (0, "hitopk"), (1, "hitopk")],
           3: [(0, "topk"), (0, "hitopk"), (1, "hitopk")],
           4: [(2, "topk"), (2, "hitopk"), (0, "hitopk"), (1, "hitopk")]}


def _all_layouts(rank: int, world: int) -> None:
    for per_node, kind in LAYOUTS[world]:
        _matches_reference(rank, world, kind, per_node, 1.0, 0, True, 2)  # density 1: exactly dense
        _matches_reference(rank, world, kind, per_node, 0.05, 0, False, 4)  # sparse, several steps
    _matches_reference(rank, world, "hitopk", LAYOUTS[world][-1][0], 0.05, 2, False, 4)  # dense warm-up first


@pytest.mark.parametrize("world", [2, 3, 4])
def test_topk_and_hitopk_match_the_single_process_reference(tmp_path, world):
    """Density 1.0 equals dense bit for bit; density 0.05 equals the reference over steps, on every layout."""
    run_ranks(_all_layouts, world, tmp_path)


def residual_total(comm, world: int, local: int) -> torch.Tensor:
    """Every rank's residual shards, summed at their offsets in the flat bucket order (a collective)."""
    mine = [comm.residuals.get(b.index) for b in comm.buckets]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    parts = []
    for b in comm.buckets:
        s = math.ceil(b.numel / local)
        total = torch.zeros(s * local)
        for r, res in enumerate(gathered):
            if res[b.index] is not None:
                lr = r % local
                total[lr * s:(lr + 1) * s] += res[b.index]
        parts.append(total[:b.numel])
    return torch.cat(parts)


def flat_in_bucket_order(comm, model: Params, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-parameter tensors (in model order) concatenated in the communicator's bucket order."""
    index = {id(p): i for i, p in enumerate(model.ps)}
    return torch.cat([torch.cat([tensors[index[id(p)]] for p in b.params]) for b in comm.buckets])


def _mass_is_conserved(rank: int, world: int, kind: str, per_node: int) -> None:
    """W * averaged + sum of residuals == sum of gradients + sum of previous residuals, every step."""
    topo = setup_distributed(DistConfig(ranks_per_node=per_node))
    model = Params()
    comm = build_communicator(CommConfig(kind=kind, bucket_mb=BUCKET_MB, density=0.02, dense_below=20), model, topo)
    local, _ = layout(kind, world, per_node)

    def residual_total_() -> torch.Tensor:
        return residual_total(comm, world, local)

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return flat_in_bucket_order(comm, model, tensors)

    before = residual_total_()
    buffers = None
    for step in range(3):
        backward_with(model, grads_of(rank, step, False))
        comm.finish()
        # The flat buffers are allocated once and reused (a fresh one per step costs page faults on the CPU);
        # each residual alternates between two buffers (the spare one holds the previous step's, for rollback)
        pointers = [b.buffer.data_ptr() for b in comm.buckets] + sorted(
            r.data_ptr() for r in (*comm.residuals.values(), *comm._spare.values()) if r is not None)
        assert step < 2 or pointers == buffers
        buffers = pointers
        incoming = flat([sum(gs) for gs in zip(*(grads_of(r, step, False) for r in range(world)))])
        after = residual_total_()
        sent = flat([p.grad for p in model.ps]) * world
        torch.testing.assert_close(sent + after, incoming + before, rtol=1e-5, atol=1e-4)
        assert after.abs().sum() > 0  # something was held back
        before = after


@pytest.mark.parametrize("kind,world,per_node", [("topk", 3, 0), ("hitopk", 4, 2)])
def test_no_gradient_mass_is_lost_or_double_counted(tmp_path, kind, world, per_node):
    run_ranks(_mass_is_conserved, world, tmp_path, kind, per_node)


def _residuals_survive_a_checkpoint(rank: int, world: int, folder: str) -> None:
    topo = setup_distributed(DistConfig(ranks_per_node=2, timeout_s=60))
    cfg = CommConfig(kind="hitopk", bucket_mb=BUCKET_MB, density=0.05, dense_below=20)
    straight, restored = Params(), Params()
    comm_a, comm_b = build_communicator(cfg, straight, topo), build_communicator(cfg, restored, topo)
    for step in range(2):
        backward_with(straight, grads_of(rank, step, False))
        comm_a.finish()
    writer = CheckpointWriter(folder, rank, world)  # each rank writes its own file, rank 0 the manifest
    ckpt_dir = writer.write(2, {rank_file(rank): comm_a.state_dict()}, "attempt")
    dist.barrier()
    if rank == 0:
        writer.finish(2, "attempt")
    dist.barrier()
    comm_b.load_state_dict(load_file(ckpt_dir, rank_file(rank)))
    assert comm_b.steps == 2 and set(comm_b.residuals) == set(comm_a.residuals)
    for step in (2, 3):
        # One communicator at a time: two exchange threads would interleave their collectives differently
        # on different ranks.
        backward_with(straight, grads_of(rank, step, False))
        comm_a.finish()
        backward_with(restored, grads_of(rank, step, False))
        comm_b.finish()
        for p, q in zip(straight.ps, restored.ps):
            assert torch.equal(p.grad, q.grad)


@pytest.mark.long
def test_residuals_are_restored_from_a_checkpoint(tmp_path):
    run_ranks(_residuals_survive_a_checkpoint, 4, tmp_path, str(tmp_path / "ckpt"))


def _peer_never_joins(rank: int, world: int, kind: str, per_node: int) -> None:
    topo = setup_distributed(DistConfig(timeout_s=2, ranks_per_node=per_node))
    model = Params()
    comm = build_communicator(CommConfig(kind=kind, bucket_mb=BUCKET_MB, dense_below=20), model, topo)
    if rank == world - 1:  # hung: never reaches its backward pass
        time.sleep(6)
        os._exit(0)
    start = time.monotonic()
    backward_with(model, grads_of(rank, 0, False))
    with pytest.raises(CommTimeoutError, match=rf"rank {rank}: .*gradient bucket 0 .*did not complete within 2s"):
        comm.finish()
    assert time.monotonic() - start < 5.5
    os._exit(0)  # the group is unusable after a timeout; skip the harness's closing barrier


@pytest.mark.long
@pytest.mark.parametrize("kind,world,per_node", [("dense", 2, 0), ("topk", 2, 0), ("hitopk", 4, 2)])
def test_a_peer_that_never_joins_raises_a_timeout_error(tmp_path, kind, world, per_node):
    run_ranks(_peer_never_joins, world, tmp_path, kind, per_node)


TINY = ["model.arch=resnet18", "data.workers=0", "train.channels_last=false", "train.amp=off", "model.small_map_gemm=true", "train.threads=1", "log.progress=false",
        "optim.lr=0.05", "schedule.total_epochs=3", "schedule.warmup_epochs=0", "train.max_steps_per_epoch=3",
        "train.target_top1=0", "comm.kind=hitopk", "comm.density=0.05", "comm.dense_below=1000",
        "dist.ranks_per_node=1", "log.tensorboard=false", "comm.selection=torch"]  # the torch.topk selection, bitwise


def _recipes(rank: int, world: int, workdir: Path, runs: list[list[str]]) -> None:
    for i, argv in enumerate(runs):
        rejoin_group(rank, world, workdir / f"store{i}")
        main(argv)


@pytest.mark.long
def test_hitopk_run_resumes_bitwise(tmp_path, digits_root):
    """A 2-rank recipe run with hitopk, stopped after epoch 2 and resumed from that epoch's checkpoint with
    --resume, ends with the uninterrupted run's weights and residuals. The uninterrupted run and the first part
    share one spawn of ranks; the resume gets fresh processes, so only the checkpoint carries state into it."""
    def argv(name: str, epochs: int, *extra: str) -> list[str]:
        return ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", *TINY,
                f"log.dir={tmp_path / name}", f"train.epochs={epochs}",
                f"schedule.phases=[{{start_epoch: 0, end_epoch: {epochs}, image_size: 16, batch_size: 16}}]", *extra]
    for sub in "ab":
        (tmp_path / sub).mkdir()
    run_ranks(_recipes, 2, tmp_path / "a", tmp_path / "a", [argv("straight", 3), argv("split", 2)], timeout=240)
    run_ranks(_recipes, 2, tmp_path / "b", tmp_path / "b", [argv("split", 3, "--resume")])
    straight, _ = latest_checkpoint(tmp_path / "straight")
    split, _ = latest_checkpoint(tmp_path / "split")
    assert straight["trainer"]["step"] == split["trainer"]["step"] == 9
    assert len(split["ranks"]) == 2 and split["ranks"][1]["comm"]["residuals"]
    for name, value in straight["model"].items():
        assert torch.equal(value, split["model"][name]), name
    for r in (0, 1):  # each rank's error feedback went on from where it was
        for bucket, residual in straight["ranks"][r]["comm"]["residuals"].items():
            assert torch.equal(residual, split["ranks"][r]["comm"]["residuals"][bucket]), (r, bucket)
