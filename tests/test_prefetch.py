"""The DALI backend's Python source (cache reads and fills, screening, crops) runs on a prefetch thread, ahead of
the training thread, and gives exactly the batches of the sequential callback."""

import logging
import threading

import pytest
import torch

from data import build_image_data
from data.cache import SourceLevel
from data.dali_loader import DaliImageData
from tests.data_helpers import dali_config, write_folder, write_odd_files

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=8, val_per_class=4)


@pytest.fixture
def l0_reads(monkeypatch):
    """Every read of a file from data.root (a cache miss) as (listing index, thread id), in order; `hook`
    runs after each read, on the reading thread."""
    reads, hook = [], []
    original = SourceLevel.get

    def get(self, i):
        data = original(self, i)
        reads.append((self.split.name, i, threading.get_ident()))
        for fn in hook:
            fn(self.split.name, i)
        return data

    monkeypatch.setattr(SourceLevel, "get", get)
    return reads, hook


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dali-source-prefetch" and t.is_alive()]


def test_cache_misses_are_read_off_the_training_thread(folder, tmp_path, l0_reads):
    reads, _ = l0_reads
    data = build_image_data(dali_config(folder, tmp_path), rank=0, world_size=1, seed=0)
    for loader in (data.train_loader(40, 4), data.val_loader(32, 5)):  # encoded files; L3 pixels
        loader.set_epoch(0)
        assert len(list(loader)) == len(loader)
    data.close()
    assert {split for split, _, _ in reads} == {"train", "val"} and len(reads) == 24 + 12
    assert threading.get_ident() not in {ident for _, _, ident in reads}, "no cache miss on the training thread"
    assert not prefetch_threads()


def test_a_slow_source_is_read_ahead_while_the_consumer_works(folder, tmp_path, l0_reads):
    """Each miss of batch j >= 2 is slowed down until the consumer has started on batch j - 2, and the
    consumer's work on batch k lasts until batch k + 2 is read: the reads of batch k + 2 must fall between the
    consumer's start and end of batch k (the sequential callback reads it only when batch k + 1 is asked for,
    after the consumer's work). Checked by the order of events; the waits' timeouts only guard against a hang."""
    reads, hook = l0_reads
    data = build_image_data(dali_config(folder, tmp_path), rank=0, world_size=1, seed=0)
    loader = data.train_loader(40, 4)
    loader.set_epoch(0)
    steps = len(loader)
    step_of = {int(i): k for k, batch in enumerate(loader.source.batches) for i in batch}
    events, lock = [], threading.Lock()
    started = [threading.Event() for _ in range(steps)]
    read_whole = [threading.Event() for _ in range(steps)]
    count = [0] * steps
    hung = threading.Event()  # after one guard timeout (the sequential callback), nothing waits any more

    def slow_miss(split, i):
        j = step_of[i]
        if j >= 2 and not hung.is_set():
            started[j - 2].wait(timeout=5)
        with lock:
            events.append(("read", j))
            count[j] += 1
            if count[j] == 4:
                read_whole[j].set()

    hook.append(slow_miss)
    for k, _ in enumerate(loader):
        with lock:
            events.append(("work", k))
        started[k].set()
        if k + 2 < steps and not hung.is_set() and not read_whole[k + 2].wait(timeout=5):
            hung.set()
        with lock:
            events.append(("done", k))
    data.close()
    assert steps == 6 and count == [4] * steps
    for k in range(steps - 2):
        during = events[events.index(("work", k)):events.index(("done", k))]
        assert during.count(("read", k + 2)) == 4, f"batch {k + 2} was not read while the consumer had batch {k}"
    assert threading.get_ident() not in {ident for _, _, ident in reads}


def epochs_of(data, image_size, batch, plan):
    """(images, labels) of every step of `plan`: (epoch, start_step) pairs, one loader."""
    loader = data.train_loader(image_size, batch)
    out = []
    for epoch, start in plan:
        loader.set_epoch(epoch, start)
        out.append([(images.clone(), labels.clone()) for images, labels in loader])
    return out


@pytest.mark.parametrize("image_size", [32, 40], ids=["lowres", "encoded"])
def test_prefetched_batches_equal_the_sequential_ones(tmp_path, caplog, image_size):
    root = write_folder(tmp_path / "odd", classes=2, per_class=7, val_per_class=2)
    write_odd_files(root / "train" / "c1")  # skipped, transcoded and DALI-rejected files: the recheck path too
    plan = [(0, 0), (1, 2), (1, 0)]  # an epoch, a resume at step 2, the same epoch whole
    runs = {}
    for prefetch in (0, 3):
        (tmp_path / f"p{prefetch}").mkdir()
        cfg = dali_config(root, tmp_path / f"p{prefetch}")
        data = DaliImageData(cfg, rank=0, world_size=1, seed=4, prefetch_batches=prefetch)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            seen = epochs_of(data, image_size, 4, plan)
            val = [(im.clone(), lb.clone()) for im, lb in data.val_loader(image_size, 3)]
        stats = data.stats()
        runs[prefetch] = seen, val, {k: stats[k] for k in ("data/skipped_images", "data/transcoded_images")}, \
            sorted(m for m in caplog.messages if "skipped" in m or "DALI failed" in m)
        data.close()
    (seq, seq_val, seq_stats, seq_log), (par, par_val, par_stats, par_log) = runs[0], runs[3]
    assert [len(e) for e in seq] == [len(e) for e in par] == [5, 3, 5]
    for a, b in zip([b for e in seq for b in e] + seq_val, [b for e in par for b in e] + par_val):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert seq_stats == par_stats and seq_stats["data/skipped_images"] >= 1
    assert seq_log == par_log  # each bad file named once, in either mode
    assert sum(m.startswith("data: DALI failed") for m in par_log) == (image_size == 40)  # the recheck, when DALI decodes


def test_an_abandoned_epoch_and_close_stop_the_prefetch_thread(folder, tmp_path):
    data = build_image_data(dali_config(folder, tmp_path), rank=0, world_size=1, seed=0)
    loader = data.train_loader(40, 2)
    loader.set_epoch(0)
    it = iter(loader)
    next(it)  # train.max_steps_per_epoch stops here
    assert len(prefetch_threads()) == 1
    del it  # the trainer drops its iterator
    assert not prefetch_threads()
    loader.set_epoch(1)
    it = iter(loader)
    next(it)
    data.close()  # an iterator still held (an exception's traceback): close stops its thread before the cache
    assert not prefetch_threads()
