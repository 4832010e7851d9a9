"""The cache levels for real: files on disk, a shared mapping between processes, integrity checks, full disks."""

import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from data import CacheConfig, build_image_data
from data.cache import DiskLevel, LowResLevel, RamLevel, SourceLevel, cache_folder, open_split_cache
from data.images import decode_lowres
from data.layout import list_split
from data.prefill import epoch_samples, node_shard, prepare
from data.reader import SampleReader
from tests.conftest import ROOT
from tests.data_helpers import dali_config, write_folder

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"), classes=2, per_class=5, val_per_class=2)


def source_bytes(split, i):
    return Path(split.url(i)).read_bytes()


def test_each_level_round_trips_bytes_exactly(folder, tmp_path):
    split = list_split(folder, "train")
    (tmp_path / "ram").mkdir()
    disk, ram = DiskLevel(split, tmp_path / "cache"), RamLevel(split, tmp_path / "ram", keep=False)
    lowres = LowResLevel(split, tmp_path / "cache", short_side=20, max_aspect=2.0)
    source = SourceLevel(split)
    for i in range(len(split)):
        data = source.get(i)
        assert data.tobytes() == source_bytes(split, i)
        assert disk.get(i) is None and ram.get(i) is None and lowres.get(i) is None  # misses first
        disk.put(i, data)
        ram.put(i, data)
        pixels = decode_lowres(data, 20, 2.0)
        lowres.put(i, pixels)
        assert disk.get(i).tobytes() == ram.get(i).tobytes() == source_bytes(split, i)
        assert np.array_equal(lowres.get(i), pixels) and min(pixels.shape[:2]) == 20
    # a fresh process's view of the same folders (the manifest and index are read back from disk)
    again_disk, again_low = DiskLevel(split, tmp_path / "cache"), LowResLevel(split, tmp_path / "cache", 20, 2.0)
    assert all(again_disk.get(i).tobytes() == source_bytes(split, i) for i in range(len(split)))
    assert all(np.array_equal(again_low.get(i), decode_lowres(source.get(i), 20, 2.0)) for i in range(len(split)))
    assert (disk.stats.hits, ram.stats.hits, again_disk.stats.hits) == (len(split),) * 3
    assert disk.stats.bytes == ram.stats.bytes == sum(split.sizes)
    for level in (disk, ram, lowres, again_disk, again_low):
        level.close()
    assert not list((tmp_path / "ram").iterdir()), "the RAM level's file is removed unless ram_keep"


def test_chain_fills_the_levels_that_missed(folder, tmp_path):
    cfg = dali_config(folder, tmp_path).cache
    split = list_split(folder, "train")
    cache = open_split_cache(cfg, split, cache_folder(cfg, str(folder)), short_side=20)
    assert [level.name for level in cache.levels()] == ["L0", "L2", "L1", "L3"]
    first = [cache.encoded(i).tobytes() for i in range(len(split))]
    second = [cache.encoded(i).tobytes() for i in range(len(split))]
    assert first == second == [source_bytes(split, i) for i in range(len(split))]
    l0, l2, l1 = (level.stats for level in cache.levels()[:3])
    assert (l0.hits, l2.misses, l1.misses, l2.hits, l1.hits) == (10, 10, 10, 10, 0)
    cache.close()


def test_torn_l1_copy_is_detected_and_copied_again(folder, tmp_path, caplog):
    split = list_split(folder, "train")
    cfg = CacheConfig(dir=str(tmp_path / "cache"), ram=False, lowres=False)
    cache = open_split_cache(cfg, split, Path(cfg.dir), 0)
    for i in range(len(split)):
        cache.encoded(i)
    disk = cache.upper[0]
    torn, rotted = disk.folder / split.files[0], disk.folder / split.files[1]
    torn.write_bytes(torn.read_bytes()[:100])  # a copy cut short (crash, full disk)
    data = bytearray(rotted.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size, one bit flipped
    rotted.write_bytes(bytes(data))
    cache = open_split_cache(cfg, split, Path(cfg.dir), 0)
    with caplog.at_level(logging.WARNING):
        assert [cache.encoded(i).tobytes() for i in (0, 1)] == [source_bytes(split, 0), source_bytes(split, 1)]
    assert sum("is torn or corrupt" in m for m in caplog.messages) == 2
    assert torn.read_bytes() == source_bytes(split, 0) and rotted.read_bytes() == source_bytes(split, 1)
    stats = cache.upper[0].stats
    assert (stats.repaired, stats.misses) == (2, 2)
    cache = open_split_cache(cfg, split, Path(cfg.dir), 0)
    assert cache.upper[0].get(0) is not None and cache.upper[0].get(1) is not None  # redone copies verify


def test_corrupt_l3_entry_is_detected_and_rebuilt(folder, tmp_path, caplog):
    split = list_split(folder, "train")
    cfg = CacheConfig(dir=str(tmp_path / "cache"), ram=False, disk=False)
    reader = SampleReader(split, open_split_cache(cfg, split, Path(cfg.dir), 24), 24, 2.0)
    original = [reader.lowres(i).copy() for i in range(len(split))]
    level = reader.cache.lowres
    with open(level.folder / "data.bin", "r+b") as f:  # flip one pixel byte of entry 3
        f.seek(3 * level.slot + 10)
        byte = f.read(1)
        f.seek(3 * level.slot + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = SampleReader(split, open_split_cache(cfg, split, Path(cfg.dir), 24), 24, 2.0)
    with caplog.at_level(logging.WARNING):
        again = [fresh.lowres(i) for i in range(len(split))]
    assert all(np.array_equal(a, b) for a, b in zip(original, again))
    assert any("entry 3" in m and "fails its checksum" in m for m in caplog.messages)
    stats = fresh.cache.lowres.stats
    assert (stats.repaired, stats.misses, stats.hits) == (1, 1, len(split) - 1)
    assert fresh.cache.lowres.get(3) is not None  # rewritten


READ_RAM_LEVEL = textwrap.dedent("""
    from pathlib import Path
    from data.cache import RamLevel
    from data.layout import list_split
    split = list_split({folder!r}, "train")
    level = RamLevel(split, Path({ram!r}), keep=True)
    print(all(level.get(i).tobytes() == Path(split.url(i)).read_bytes() for i in range(len(split))), level.stats.hits)
""")


@pytest.mark.e2e
def test_ram_level_is_shared_between_the_processes_of_a_node(folder, tmp_path):
    (tmp_path / "shm").mkdir()
    split = list_split(folder, "train")
    level = RamLevel(split, tmp_path / "shm", keep=False)
    for i in range(len(split)):
        level.put(i, SourceLevel(split).get(i))
    script = READ_RAM_LEVEL.format(folder=str(folder), ram=str(tmp_path / "shm"))
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert other.stdout.split() == ["True", str(len(split))], other.stderr  # read, not re-filled, by another process
    level.close()


FULL_DISK = textwrap.dedent("""
    import logging, resource, signal
    from data import build_image_data
    from tests.data_helpers import dali_config
    from pathlib import Path
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))
    data = build_image_data(dali_config(Path({folder!r}), Path({tmp!r}), lowres=False), 0, 1, seed=0)
    # L2 needs more than the limit at once: not opened; L1 copies one file at a time: writes fail, then stop
    loader = data.train_loader(32, 5)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        assert [tuple(x.shape) for x, _ in loader] == [(5, 3, 32, 32)] * 2
    s = data.stats()
    print("reads", s["cache/l0_hits"], s["cache/l1_hits"], s["cache/l2_hits"])
""")


@pytest.mark.e2e
def test_full_disk_turns_a_level_off_with_one_warning(tmp_path):
    folder = write_folder(tmp_path / "big", classes=2, per_class=5, val_per_class=2, sizes=(120, 160))
    assert min(f.stat().st_size for f in folder.rglob("*.JPEG")) > 3000
    script = FULL_DISK.format(folder=str(folder), tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    off = [line for line in lines if "writes are off" in line]
    assert len(off) == 1 and off[0].startswith("L1 cache at ") and "File too large" in off[0], out.stderr
    assert sum(line.startswith("L2 cache for ") and "cannot be opened" in line for line in lines) == 2  # train, val
    assert out.stdout.split() == ["reads", "20.0", "0.0", "0.0"]  # the run went on reading the files


def test_prepare_cache_fills_l1_and_l3_ahead_of_the_run(folder, tmp_path):
    cfg = dali_config(folder, tmp_path, ram=False)
    stats = prepare(cfg, threads=2)
    assert stats["cache/l1_misses"] == stats["cache/l3_misses"] == 14 and stats["data/skipped_images"] == 0
    again = prepare(cfg, threads=2)  # a rerun reads nothing: the manifest and the L3 index list every entry
    assert again["prepare/already_cached"] == 28 and again["cache/l1_hits"] == again["cache/l3_hits"] == 0
    assert again["cache/l0_hits"] == again["cache/l1_misses"] == again["cache/l3_misses"] == 0
    assert prepare(cfg, threads=2, verify=True)["cache/l3_hits"] == 14  # --verify reads and checksums them
    data = build_image_data(cfg, 0, 1, seed=0)
    for size in (32, 40):  # 32: L3; 40: decoded from the L1 copies
        loader = data.train_loader(size, 5)
        loader.set_epoch(0)
        assert len(list(loader)) == 2
    stats = data.stats()
    assert stats["cache/l0_hits"] == 0 and stats["cache/l3_misses"] == 0 and stats["cache/l1_hits"] == 10
    data.close()


def test_relative_cache_dir_lies_inside_the_dataset():
    assert cache_folder(CacheConfig(dir=".cache"), "datasets/digits") == Path("datasets/digits/.cache")
    assert cache_folder(CacheConfig(dir="/ssd/c"), "datasets/digits") == Path("/ssd/c")
    assert cache_folder(CacheConfig(dir=""), "x") is None


def fill_node(run, node_rank: int, nnodes: int = 2) -> dict[str, float]:
    """prepare() of one node's shard of `run` (1 rank per node)."""
    from trainer.schedules import get_phase

    sizes = {name: len(list_split(run.data.root, name)) for name in ("train", "val")}
    phases = [get_phase(run.schedule.phases, epoch) for epoch in range(run.train.epochs)]
    shard = node_shard(run.data.cache, sizes, phases, run.train.seed, run.train.max_steps_per_epoch, nnodes,
                       node_rank, 1)
    return prepare(run.data, threads=2, shard=shard)


@pytest.mark.e2e
def test_prepare_cache_fills_only_this_nodes_shard_and_a_warm_rerun_reads_nothing(tmp_path):
    from recipes.resnet50 import Config
    from trainer.config import load_config
    from trainer.schedules import get_phase

    root = write_folder(tmp_path / "ds", classes=2, per_class=12, val_per_class=3)
    (tmp_path / "ram").mkdir()
    config = tmp_path / "run.yaml"  # 2 nodes x 1 rank; epoch 0 reads L3 (24 px), epoch 1 the L1 copies (40 px)
    config.write_text(f"""base: {ROOT}/configs/quickstart_cpu.yaml
data: {{root: {root}, cache: {{dir: {tmp_path}/cache, ram_dir: {tmp_path}/ram}}}}
schedule:
  phases:
    - {{start_epoch: 0, end_epoch: 1, image_size: 24, batch_size: 4}}
    - {{start_epoch: 1, end_epoch: 2, image_size: 40, batch_size: 4}}
train: {{epochs: 2, seed: 5}}
""")
    argv = ["--config", str(config), "--nnodes", "2", "--node-rank", "1", "--ranks-per-node", "1", "--threads", "2"]
    cli = subprocess.run([sys.executable, "scripts/prepare_cache.py", *argv], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    wanted, total = map(int, re.search(r"node 1 of 2 \(1 ranks\): (\d+) of (\d+) files", cli.stdout).groups())
    assert 0 < wanted < total == 24 + 6
    copied, decoded, cached, skipped = map(int, re.search(
        r"L1: (\d+) files copied now .* L3: (\d+) images decoded now .* (\d+) entries already cached; (\d+) bad",
        cli.stdout).groups())
    assert copied == wanted and 0 < decoded < wanted and cached == skipped == 0, cli.stdout  # L3 reads through L1
    # the run of node 1 (rank 1 of 2) then reads every sample from the cache, none from the files
    cfg = load_config(Config, str(config), [])
    data = build_image_data(cfg.data, rank=1, world_size=2, seed=cfg.train.seed)
    for epoch in range(cfg.train.epochs):
        phase = get_phase(cfg.schedule.phases, epoch)
        loader = data.train_loader(phase.image_size, phase.batch_size // 2)
        loader.set_epoch(epoch)
        assert len(list(loader)) == 6
        assert len(list(data.val_loader(phase.image_size, 2))) == 2
    run = data.stats()
    data.close()
    assert run["cache/l0_hits"] == 0 and run["cache/l3_misses"] == 0 and run["cache/l3_hits"] > 0
    assert run["cache/l1_hits"] == run["cache/l2_misses"] > 0  # the 40 px epoch: L2 (RAM) misses, L1 hits
    again = fill_node(cfg, node_rank=1)
    assert again["prepare/already_cached"] > copied  # L1 and L3 entries
    assert sum(v for k, v in again.items() if k.startswith("cache/")) == 0, "a warm rerun reads nothing"
    other = fill_node(cfg, node_rank=0)  # node 0: its own shard, partly new
    assert other["cache/l1_misses"] > 0 and other["prepare/already_cached"] > 0


@pytest.mark.parametrize("n, world, batch", [(40, 4, 3), (43, 4, 2), (43, 3, 5), (7, 8, 1)])
def test_node_shard_samples_are_the_loaders_samples(n, world, batch):
    from data.sampling import train_batches
    for epoch in (0, 3):
        ranks = range(1, world)
        read = epoch_samples(n, world, ranks, batch, seed=11, epoch=epoch)
        assert read.shape[0] == len(ranks)
        for row, rank in zip(read, ranks):
            assert np.array_equal(row, train_batches(n, world, rank, batch, 11, epoch).ravel())
