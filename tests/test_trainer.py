"""The trainer for real: gloo ranks, the dense communicator, the ResNet recipe on the digits, checkpoints.

The faults (kill -9 under torchrun, SIGSTOP, NaN, full disk) have their own folder: tests/faults/.
"""

import json
import multiprocessing
import resource
import signal

import pytest
import torch
from torch import nn

from data import DataConfig, DatasetNotFoundError, build_image_data
from recipes.resnet50 import Config, main
from trainer.checkpoint import (MODEL, SHARED, CheckpointWriter, CheckpointWriteError, checkpoint_dirs,
                                latest_checkpoint, load_model_state, rank_file)
from trainer.config import ConfigError, load_config
from trainer.comm import CommConfig, build_communicator
from trainer.dist import DistConfig, Liveness, setup_distributed
from tests.conftest import run_ranks

pytestmark = pytest.mark.e2e

TINY = ["model.arch=resnet18", "data.workers=0", "train.channels_last=false", "train.amp=off", "model.small_map_gemm=true", "train.threads=1", "log.progress=false",
        "log.tensorboard=true", "log.every_steps=1", "optim.lr=0.05", "schedule.total_epochs=3", "schedule.warmup_epochs=0",
        "comm.selection=mstopk"]  # pinned as every measured choice: runs compared bitwise must not measure apart


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


@pytest.mark.long  # a 2-rank recipe run with every output: about 15 s
def test_two_rank_recipe_run_writes_all_outputs(tmp_path, digits_root):
    out = tmp_path / "run"
    argv = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", f"log.dir={out}", "train.epochs=2",
            phases(2), "train.max_steps_per_epoch=3", *TINY, "comm.kind=auto", "comm.calibration_steps=3"]
    run_ranks(_recipe_rank, 2, tmp_path, argv)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1] and all(r["eval/images"] == 360 for r in epochs)
    steps = [r for r in records if r["kind"] == "step"]
    assert {"loss/train", "schedule/lr", "time/images_per_s", "comm/bytes_sent", "comm/choice/0"} <= set(steps[0])
    # the auto communicator's calibration is logged once, at the step that measured it, not with every step
    calibrations = [r for r in records if any(k.startswith("comm/calib/") for k in r)]
    assert [(r["kind"], r["step"]) for r in calibrations] == [("comm", 3)]
    assert calibrations[0]["comm/calib/bucket/0/elements"] > 0
    tsv = (out / "dawnbench.tsv").read_text().splitlines()
    assert tsv[0] == "epoch\thours\ttop1Accuracy\ttop5Accuracy" and len(tsv) == 3
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "git_commit" in (out / "config.yaml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6


def straight_and_resumed(common: list[str], tmp_path) -> tuple[dict, dict]:
    """The last checkpoints of a 3-epoch run and of the same run stopped after 2 epochs and resumed (12 steps)."""
    main([*common, f"log.dir={tmp_path / 'straight'}", "train.epochs=3", phases(3)])
    main([*common, f"log.dir={tmp_path / 'split'}", "train.epochs=2", phases(2)])
    main([*common, f"log.dir={tmp_path / 'split'}", "train.epochs=3", phases(3), "--resume"])
    straight, _ = latest_checkpoint(tmp_path / "straight")
    split, _ = latest_checkpoint(tmp_path / "split")
    assert straight["trainer"]["step"] == split["trainer"]["step"] == 12
    return straight, split


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, digits_root):
    common = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", "train.max_steps_per_epoch=4",
              "train.target_top1=0", *TINY]
    straight, split = straight_and_resumed(common, tmp_path)
    for name, value in straight["model"].items():
        assert torch.equal(value, split["model"][name]), name


def write_checkpoint(writer: CheckpointWriter, step: int, weights: torch.Tensor) -> None:
    """One rank's checkpoint, as the Trainer writes it: its files, then the manifest."""
    writer.write(step, {MODEL: {"w": weights}, SHARED: {"step": step}, rank_file(0): {"rank": 0}}, "attempt")
    writer.finish(step, "attempt")


def test_torn_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    writer = CheckpointWriter(tmp_path / "checkpoints", 0, 1, keep=3)
    write_checkpoint(writer, 1, torch.ones(4))
    write_checkpoint(writer, 2, torch.full((4,), 2.0))
    newest = tmp_path / "checkpoints" / "step-00000002" / MODEL
    newest.write_bytes(newest.read_bytes()[:-10])  # torn write
    with pytest.warns(UserWarning, match=r"step-00000002/model\.pt: truncated"):
        assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-00000001"]
    assert torch.equal(load_model_state(tmp_path / "checkpoints" / "step-00000001")["w"], torch.ones(4))
    write_checkpoint(writer, 3, torch.full((4,), 3.0))
    flipped = tmp_path / "checkpoints" / "step-00000003" / rank_file(0)
    data = bytearray(flipped.read_bytes())
    data[10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="rank-00000.pt: checksum mismatch"):
        assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-00000001"]
    (tmp_path / "checkpoints" / "step-00000001" / "manifest.json").unlink()  # as if killed before the manifest
    with pytest.warns(UserWarning, match=r"step-00000001: incomplete \(no manifest\.json"):
        assert checkpoint_dirs(tmp_path) == []


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


def _write_past_a_file_size_limit(folder: str) -> None:
    # RLIMIT_FSIZE makes the kernel refuse writes past 1 MB (EFBIG), as a full disk refuses them (ENOSPC)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    writer = CheckpointWriter(folder, 0, 1, keep=2)
    write_checkpoint(writer, 1, torch.ones(4))
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint file .*step-00000002/model\.pt "
                                                   r".*previous checkpoints in .* are intact"):
        write_checkpoint(writer, 2, torch.zeros(1 << 19))  # 2 MB


def test_a_failed_checkpoint_write_leaves_the_previous_one(tmp_path):
    child = multiprocessing.get_context("spawn").Process(target=_write_past_a_file_size_limit,
                                                         args=(str(tmp_path / "checkpoints"),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # no temporary file left behind
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step-00000001"]  # the torn step 2 has no manifest
    assert torch.equal(load_model_state(tmp_path / "checkpoints" / "step-00000001")["w"], torch.ones(4))


@pytest.mark.parametrize("backend", ["dali", "torchvision"])
def test_an_epoch_restarted_mid_way_yields_the_rest_of_the_same_batches(digits_root, backend):
    """A mid-epoch resume (train.checkpoint_every_steps) skips the batches already trained on and sees the
    same pixels and labels for the others: order and augmentation are functions of (seed, epoch, sample)."""
    data = build_image_data(DataConfig(root=str(digits_root), backend=backend, workers=0), 0, 2, seed=3)
    loader = data.train_loader(16, 8, 0.5)
    loader.set_epoch(1)
    full = list(loader)
    loader.set_epoch(1, start_step=5)
    rest = list(loader)
    data.close()
    assert len(rest) == len(full) - 5 > 0
    for (images, labels), (images_, labels_) in zip(full[5:], rest):
        assert torch.equal(images, images_) and torch.equal(labels, labels_)


def test_reliability_keys_are_checked_and_read_yaml_words_as_words(monkeypatch):
    phase = phases(2)
    cfg = load_config(Config, None, ["train.epochs=2", phase, "train.amp=off", "train.loss_scale=off"])
    assert cfg.train.amp == "off" and cfg.train.loss_scale == "off"  # YAML 1.1 reads `off` as false
    with pytest.raises(ConfigError, match=r"train\.max_skipped_steps: must be > 0, got 0"):
        load_config(Config, None, ["train.epochs=2", phase, "train.max_skipped_steps=0"])
    with pytest.raises(ConfigError, match=r"train\.checkpoint_every_steps must be >= 0"):
        load_config(Config, None, ["train.epochs=2", phase, "train.checkpoint_every_steps=-1"])
    auto = load_config(Config, None, ["train.epochs=2", phase]).train
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert auto.resume == "auto" and not auto.should_resume()  # a fresh launch
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert auto.should_resume()  # torchrun restarted the job after a failure
    never = load_config(Config, None, ["train.epochs=2", phase, "train.resume=false"]).train
    assert not never.should_resume()


def test_closing_the_heartbeat_waits_until_its_thread_is_out_of_the_store(tmp_path):
    """A heartbeat left inside a store call at interpreter exit aborts the process (exit -6 after a good run)."""
    import torch.distributed as dist
    liveness = Liveness(dist.FileStore(str(tmp_path / "store"), 1), rank=0)
    assert liveness.silent([0], window_s=0.6) == []  # it beats
    liveness.close()
    assert not liveness._thread.is_alive()


def test_amp_choices_on_the_cpu(monkeypatch):
    """auto measures fp32 and bf16 on the CPU, fp16 needs CUDA, and a pinned bf16 warns where the CPU would only
    emulate it."""
    import warnings
    import trainer.precision as precision
    cpu = torch.device("cpu")
    assert precision.amp_candidates("auto", cpu) == ["off", "bf16"] and precision.amp_candidates("off", cpu) == ["off"]
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        precision.amp_candidates("fp16", cpu)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="emulated"):
        assert precision.amp_candidates("bf16", cpu) == ["bf16"]
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.amp_candidates("bf16", cpu) == ["bf16"]
