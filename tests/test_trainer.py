"""The trainer for real: gloo ranks, the dense communicator, the ResNet recipe on the digits, checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from data import DatasetNotFoundError
from recipes.resnet50 import main
from trainer.checkpoint import Checkpointer, load_verified
from trainer.comm import CommConfig, build_communicator
from trainer.dist import DistConfig, setup_distributed
from tests.conftest import run_ranks

TINY = ["model.arch=resnet18", "data.workers=0", "train.channels_last=false", "train.threads=1", "log.progress=false",
        "log.tensorboard=true", "log.every_steps=1", "optim.lr=0.05", "schedule.total_epochs=3", "schedule.warmup_epochs=0"]


def phases(epochs: int, batch: int = 16) -> str:
    return f"schedule.phases=[{{start_epoch: 0, end_epoch: {epochs}, image_size: 16, batch_size: {batch}}}]"


def small_net() -> nn.Module:  # no BatchNorm: per-rank batch statistics would differ from the full batch's
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.Linear(5, 5))


def _grads_match_full_batch(rank: int, world: int, compression: str) -> None:
    topo = setup_distributed(DistConfig())
    torch.manual_seed(1)
    x, y = torch.randn(4 * world, 3, 8, 8), torch.randint(0, 5, (4 * world,))
    reference = small_net()
    nn.functional.cross_entropy(reference(x), y).backward()
    model = small_net()
    comm = build_communicator(CommConfig(bucket_mb=0.001, compression=compression), model, topo)
    assert len(comm.buckets) >= 3  # several buckets, launched from hooks in order
    for _ in range(2):  # twice: bucket state must reset between steps
        model.zero_grad(set_to_none=True)
        mine = slice(4 * rank, 4 * rank + 4)
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        stats = comm.finish()
        tol = 1e-6 if compression == "none" else 2e-3  # fp16 wire: ~3 significant digits
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)
        assert stats["bytes_sent"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_dense_allreduce_equals_full_batch_gradient(tmp_path, world):
    run_ranks(_grads_match_full_batch, world, tmp_path, "none")


def test_dense_fp16_wire_is_close(tmp_path):
    run_ranks(_grads_match_full_batch, 2, tmp_path, "fp16")


def _recipe_rank(rank: int, world: int, argv: list[str]) -> None:
    main(argv)


def test_two_rank_recipe_run_writes_all_outputs(tmp_path, digits_root):
    out = tmp_path / "run"
    argv = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", f"log.dir={out}", "train.epochs=2",
            phases(2), "train.max_steps_per_epoch=3", *TINY]
    run_ranks(_recipe_rank, 2, tmp_path, argv)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1] and all(r["eval/images"] == 360 for r in epochs)
    assert {"loss/train", "schedule/lr", "time/images_per_s", "comm/bytes_sent"} <= set(records[0])
    tsv = (out / "dawnbench.tsv").read_text().splitlines()
    assert tsv[0] == "epoch\thours\ttop1Accuracy\ttop5Accuracy" and len(tsv) == 3
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "git_commit" in (out / "config.yaml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, digits_root):
    common = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", "train.max_steps_per_epoch=4",
              "train.target_top1=0", *TINY]
    main([*common, f"log.dir={tmp_path / 'straight'}", "train.epochs=3", phases(3)])
    main([*common, f"log.dir={tmp_path / 'split'}", "train.epochs=2", phases(2)])
    main([*common, f"log.dir={tmp_path / 'split'}", "train.epochs=3", phases(3), "--resume"])
    straight, _ = Checkpointer(tmp_path / "straight" / "checkpoints").load_latest()
    split, _ = Checkpointer(tmp_path / "split" / "checkpoints").load_latest()
    assert straight["trainer"]["step"] == split["trainer"]["step"] == 12
    for name, value in straight["model"].items():
        assert torch.equal(value, split["model"][name]), name


def test_torn_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save({"step": 1}, 1)
    newest = ckpt.save({"step": 2}, 2)
    newest.write_bytes(newest.read_bytes()[:-10])  # torn write
    with pytest.warns(UserWarning, match="truncated"):
        state, path = ckpt.load_latest()
    assert state["step"] == 1 and path.name == "ckpt-00000001.pt"
    flipped = ckpt.save({"step": 3}, 3)
    data = bytearray(flipped.read_bytes())
    data[10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_verified(flipped)


def test_missing_dataset_names_where_it_looked(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"no dataset at .*nowhere/train .*make digits"):
        main(["--config", "configs/quickstart_cpu.yaml", f"data.root={tmp_path / 'nowhere'}",
              f"log.dir={tmp_path / 'run'}"])


def test_a_fresh_run_archives_what_an_earlier_run_left(tmp_path):
    from trainer.metrics import LogConfig, build_metrics
    (tmp_path / "metrics.jsonl").write_text('{"old": 1}\n')
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-00000001.pt").write_bytes(b"old")
    metrics = build_metrics(LogConfig(dir=str(tmp_path), tensorboard=False), is_main=True, fresh=True)
    metrics.log("step", 1, {"loss/train": 1.0})
    metrics.close()
    (archived,) = (tmp_path / "previous").iterdir()
    assert (archived / "metrics.jsonl").read_text() == '{"old": 1}\n'
    assert (archived / "checkpoints" / "ckpt-00000001.pt").read_bytes() == b"old"
    assert not (tmp_path / "checkpoints").exists() and "old" not in (tmp_path / "metrics.jsonl").read_text()
    resumed = build_metrics(LogConfig(dir=str(tmp_path), tensorboard=False), is_main=True, fresh=False)
    resumed.log("step", 2, {"loss/train": 0.5})
    resumed.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # a resume appends
