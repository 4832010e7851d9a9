"""The multi-level data cache in front of the input pipeline (Shi et al., MLSys 2021; docs/data-and-cache.md).

    L0 source   data.root: a local or mounted path, or any URL fsspec opens (the slow remote storage)
    L1 disk     node-local copies of the encoded files in cache.dir, listed in a manifest (path, size,
                CRC32) that each process checks on its first read of a copy (every read checks the size),
                so a torn or rotted copy is detected and copied again
    L2 RAM      the encoded bytes in one memory-mapped file per node (in /dev/shm: RAM), shared by all
                ranks of the node, handed to DALI through fn.external_source
    L3 low-res  images decoded once and stored resized (shorter side = cache.lowres_max_image_size x
                data.val_resize_ratio) as uint8 in a memory-mapped array, for the early small-image
                phases, which then skip JPEG decoding; every entry carries a CRC32, checked on each
                process's first read of it

Every level is optional (`data.cache.*`) and fills on a miss: whatever a rank reads from a lower level is
written to the levels above it, so the first epoch fills the cache (`scripts/prepare_cache.py` fills L1
and L3 ahead of time instead). Entries are addressed by the split's listing key, so a changed dataset
never reads stale entries. Writes are lock-free: ranks write disjoint entries, and an entry becomes
visible only once complete (rename for L1; a flag or index record written after the data for L2/L3).
A failing write (full disk, quota, permissions) turns that level's writes off with a one-line warning
and the run goes on reading from below.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import shutil
import threading
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from data.layout import Split

log = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    dir: str = ""
    """Node-local folder for L1 (disk copies) and L3 (low-res arrays); a relative path lies inside data.root;
    empty = neither."""
    disk: bool = True
    """L1: copy each encoded file from data.root into cache.dir on first read, checked by size and CRC32."""
    ram: bool = True
    """L2: keep the encoded bytes in one memory-mapped file per node (cache.ram_dir), shared by its ranks."""
    ram_dir: str = "/dev/shm"
    """Folder of the L2 file: a tmpfs such as /dev/shm holds it in RAM; any other folder is a mapped file."""
    ram_keep: bool = False
    """Keep the L2 file after the run, so the next run on the node starts with it filled."""
    lowres: bool = True
    """L3: decode each image once into a low-res uint8 copy for phases of at most lowres_max_image_size."""
    lowres_max_image_size: int = 128
    """Largest phase image size (px) read from L3; copies have a shorter side of this x data.val_resize_ratio."""
    lowres_max_aspect: float = 2.0
    """Longest/shortest side ratio kept in L3 (a center crop beyond it); sets the fixed slot size."""

    def __post_init__(self) -> None:
        if self.lowres_max_image_size <= 0:
            raise ValueError(f"data.cache.lowres_max_image_size: must be > 0, got {self.lowres_max_image_size}")
        if self.lowres_max_aspect < 1:
            raise ValueError(f"data.cache.lowres_max_aspect: must be >= 1, got {self.lowres_max_aspect}")


@dataclass
class LevelStats:
    """Counters of one level: reads served, reads passed down, bytes served, bad entries found and redone."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    repaired: int = 0

    def add(self, other: LevelStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def crc32(data: np.ndarray) -> int:
    return zlib.crc32(memoryview(data).cast("B"))


class Level:
    """One cache level: `get` returns the entry or None (a miss), `put` stores it unless writes are off."""

    name = "level"

    def __init__(self, where: str) -> None:
        self.where, self.stats, self.writable = where, LevelStats(), True

    def get(self, i: int) -> np.ndarray | None:
        raise NotImplementedError

    def put(self, i: int, data: np.ndarray) -> None:
        raise NotImplementedError

    def listed(self) -> np.ndarray:
        """Per entry, whether it is listed as complete: nothing is read or checksummed (a `get` still checks)."""
        raise NotImplementedError

    def write(self, action: Callable[[], object]) -> None:
        """Run a write; on any OSError (ENOSPC, EDQUOT, EFBIG, EACCES) stop writing to this level, with one warning."""
        if not self.writable:
            return
        try:
            action()
        except OSError as err:
            self.writable = False
            log.warning("%s cache at %s: %s; its writes are off for the rest of the run (reading through it still "
                        "works, misses read the level below)", self.name, self.where, err.strerror or err)

    def hit(self, data: np.ndarray) -> np.ndarray:
        self.stats.hits += 1
        self.stats.bytes += data.nbytes
        return data

    def miss(self) -> None:
        self.stats.misses += 1
        return None

    def close(self) -> None:
        pass


def warn_if_short(level: Level, folder: Path, needed: int) -> None:
    """One warning up front when the folder's free space cannot hold what the level may write."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        log.warning("%s cache at %s: %.2f GB free, may need %.2f GB; it caches what fits, then reads from the "
                    "level below", level.name, folder, free / 1e9, needed / 1e9)


# ---------------------------------------------------------------- L0: the source


class SourceLevel(Level):
    """L0: the files under data.root, read with fsspec (a local path, a mount or a remote URL)."""

    name = "L0"

    def __init__(self, split: Split) -> None:
        super().__init__(split.folder)
        self.split = split
        self.fs, self.base = fsspec.core.url_to_fs(split.folder)
        self.local = isinstance(self.fs, LocalFileSystem)

    def get(self, i: int) -> np.ndarray:
        """The file's bytes; raises OSError when it cannot be read (counted as a miss)."""
        path = f"{self.base}/{self.split.files[i]}"
        try:  # local files straight into numpy: fsspec's path handling costs more than the read itself
            data = np.fromfile(path, dtype=np.uint8) if self.local else np.frombuffer(self.fs.cat_file(path), np.uint8)
        except OSError:
            self.miss()
            raise
        return self.hit(data)


# ---------------------------------------------------------------- L1: node-local disk


class DiskLevel(Level):
    """L1: copies under cache.dir/l1/<key>/, each listed in `manifest.tsv` (path, size, CRC32) once complete."""

    name = "L1"

    def __init__(self, split: Split, cache_dir: Path) -> None:
        self.folder = cache_dir / "l1" / f"{split.name}-{split.key}"
        super().__init__(str(self.folder))
        self.split = split
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifest = self.folder / "manifest.tsv"
        self.manifest.touch()
        self.entries: dict[str, tuple[int, int]] = {}
        self.verified = np.zeros(len(split), dtype=bool)  # checksummed once per process (or written by it)
        self._read_upto = 0
        self._lock = threading.Lock()  # scripts/prepare_cache.py fills from several threads
        self.refresh()
        warn_if_short(self, self.folder, int(split.sizes.sum()) - sum(s for s, _ in self.entries.values()))

    def refresh(self) -> None:
        """Read manifest lines appended since the last look (by this rank or by the others of the node)."""
        with self._lock, open(self.manifest, "rb") as f:
            f.seek(self._read_upto)
            chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line cut short by a crash is read once it is whole
            self._read_upto += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                self.entries[parts[0]] = (int(parts[1]), int(parts[2]))

    def listed(self) -> np.ndarray:
        self.refresh()
        return np.array([self.entries.get(rel, (-1, 0))[0] == size for rel, size in zip(self.split.files,
                                                                                        self.split.sizes)], dtype=bool)

    def get(self, i: int) -> np.ndarray | None:
        rel = self.split.files[i]
        if rel not in self.entries:
            self.refresh()
        entry = self.entries.get(rel)
        if entry is None or entry[0] != self.split.sizes[i]:
            return self.miss()
        try:
            data = np.fromfile(self.folder / rel, dtype=np.uint8)
        except OSError:
            data = np.empty(0, dtype=np.uint8)
        if data.size != entry[0] or not (self.verified[i] or crc32(data) == entry[1]):
            self.stats.repaired += 1
            log.warning("L1 cache: %s is torn or corrupt (%d bytes, manifest: %d bytes and a CRC32 that %s); "
                        "copying it again", self.folder / rel, data.size, entry[0],
                        "matches" if data.size == entry[0] and crc32(data) == entry[1] else "does not match")
            del self.entries[rel]
            return self.miss()
        self.verified[i] = True
        return self.hit(data)

    def put(self, i: int, data: np.ndarray) -> None:
        rel = self.split.files[i]
        path = self.folder / rel

        def copy() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(memoryview(data))
                os.replace(tmp, path)  # the copy appears whole or not at all
            finally:
                tmp.unlink(missing_ok=True)
            line = f"{rel}\t{data.size}\t{crc32(data)}\n".encode()
            fd = os.open(self.manifest, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line)  # one O_APPEND write: lines of concurrent ranks do not interleave
            finally:
                os.close(fd)
            self.entries[rel] = (data.size, crc32(data))
            self.verified[i] = True

        self.write(copy)


# ---------------------------------------------------------------- L2: RAM shared by the node's ranks


class RamLevel(Level):
    """L2: one sparse file `<ram_dir>/dawnbench-l2-<split>-<key>.bin`: all entries back to back, then one
    "complete" flag byte per entry. Every rank of the node maps the same file (same name from the same
    listing), so each entry is read from the source once per node. Writes use pwrite, which reports a full
    tmpfs as ENOSPC; writing through the mapping would kill the process with SIGBUS instead."""

    name = "L2"

    def __init__(self, split: Split, ram_dir: Path, keep: bool) -> None:
        self.path = ram_dir / f"dawnbench-l2-{split.name}-{split.key}.bin"
        super().__init__(str(self.path))
        self.split, self.keep = split, keep
        self.offsets = np.concatenate([[0], np.cumsum(split.sizes)]).astype(np.int64)
        self.flags_at = int(self.offsets[-1])
        length = self.flags_at + len(split)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self.fd).st_size < length:
                os.ftruncate(self.fd, length)  # sparse: RAM is used only by what is written
            self.map = mmap.mmap(self.fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            os.close(self.fd)
            raise
        warn_if_short(self, ram_dir, length - os.fstat(self.fd).st_blocks * 512)

    def listed(self) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.uint8, count=len(self.split), offset=self.flags_at) == 1

    def get(self, i: int) -> np.ndarray | None:
        if self.map[self.flags_at + i] != 1:
            return self.miss()
        start = int(self.offsets[i])
        return self.hit(np.frombuffer(self.map, dtype=np.uint8, count=int(self.split.sizes[i]), offset=start))

    def put(self, i: int, data: np.ndarray) -> None:
        if data.size != self.split.sizes[i]:
            return  # the file changed since it was listed; its slot has the listed size
        start = int(self.offsets[i])
        self.write(lambda: (os.pwrite(self.fd, memoryview(data), start),
                            os.pwrite(self.fd, b"\x01", self.flags_at + i)))

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a batch still holds a view; the mapping goes with it
            pass
        os.close(self.fd)
        if not self.keep:
            self.path.unlink(missing_ok=True)  # ranks that still map it keep their pages until they close


# ---------------------------------------------------------------- L3: pre-decoded low resolution


ENTRY = np.dtype([("h", "<u4"), ("w", "<u4"), ("crc", "<u4"), ("magic", "<u4")])
MAGIC = 0x4C335631  # "L3V1": the index record is complete


class LowResLevel(Level):
    """L3: decoded HWC uint8 images in fixed-size slots of `data.bin` (sparse: a slot uses only what its
    image needs) plus `index.bin`, one (h, w, CRC32, magic) record per entry, written after the pixels."""

    name = "L3"

    def __init__(self, split: Split, cache_dir: Path, short_side: int, max_aspect: float) -> None:
        self.folder = cache_dir / "l3" / f"{split.name}-{short_side}px-{split.key}"
        super().__init__(str(self.folder))
        self.short_side, self.max_aspect = short_side, max_aspect
        self.slot = short_side * int(short_side * max_aspect) * 3
        self.verified = np.zeros(len(split), dtype=bool)  # checksummed once per process (or written by it)
        self.folder.mkdir(parents=True, exist_ok=True)
        n = len(split)
        self.data_fd = os.open(self.folder / "data.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self.index_fd = os.open(self.folder / "index.bin", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for fd, length in ((self.data_fd, n * self.slot), (self.index_fd, n * ENTRY.itemsize)):
                if os.fstat(fd).st_size < length:
                    os.ftruncate(fd, length)
            self.data = mmap.mmap(self.data_fd, n * self.slot, mmap.MAP_SHARED, mmap.PROT_READ)
            self.index = np.memmap(self.folder / "index.bin", dtype=ENTRY, mode="r", shape=(n,))
        except OSError:
            self.close()
            raise
        filled = int((self.index["magic"] == MAGIC).sum())
        warn_if_short(self, self.folder, int((n - filled) * short_side * short_side * 1.33 * 3))

    def listed(self) -> np.ndarray:
        return np.asarray(self.index["magic"] == MAGIC)

    def get(self, i: int) -> np.ndarray | None:
        rec = self.index[i]
        if rec["magic"] != MAGIC:
            return self.miss()
        h, w = int(rec["h"]), int(rec["w"])
        pixels = np.frombuffer(self.data, dtype=np.uint8, count=h * w * 3, offset=i * self.slot)
        if h * w * 3 > self.slot or not (self.verified[i] or crc32(pixels) == rec["crc"]):
            self.stats.repaired += 1
            log.warning("L3 cache: entry %d in %s fails its checksum; decoding it again", i, self.folder)
            return self.miss()
        self.verified[i] = True
        return self.hit(pixels.reshape(h, w, 3))

    def put(self, i: int, pixels: np.ndarray) -> None:
        h, w, _ = pixels.shape
        record = np.array([(h, w, crc32(pixels), MAGIC)], dtype=ENTRY)

        def store() -> None:
            os.pwrite(self.data_fd, memoryview(np.ascontiguousarray(pixels)).cast("B"), i * self.slot)
            os.pwrite(self.index_fd, record.tobytes(), i * ENTRY.itemsize)
            self.verified[i] = True

        self.write(store)

    def close(self) -> None:
        self.index = None  # np.memmap unmaps when its last view goes
        try:
            if hasattr(self, "data"):
                self.data.close()
        except BufferError:  # a batch still holds a view; the mapping goes with it
            pass
        for fd in (self.data_fd, self.index_fd):
            os.close(fd)


# ---------------------------------------------------------------- the chain


@dataclass
class SplitCache:
    """The levels of one split: `encoded(i)` walks L2 → L1 → L0 and fills the levels that missed."""

    source: SourceLevel
    upper: list[Level] = field(default_factory=list)
    lowres: LowResLevel | None = None

    def encoded(self, i: int) -> np.ndarray:
        """The file's exact bytes; raises OSError if the source cannot be read."""
        missed = []
        for level in self.upper:
            data = level.get(i)
            if data is not None:
                break
            missed.append(level)
        else:
            data = self.source.get(i)
        for level in missed:
            level.put(i, data)
        return data

    def levels(self) -> list[Level]:
        return [self.source, *self.upper] + ([self.lowres] if self.lowres else [])

    def close(self) -> None:
        for level in self.levels():
            level.close()


def lowres_short_side(cfg: CacheConfig, val_resize_ratio: float) -> int:
    """Shorter side of the L3 copies: validation of the largest L3 phase resizes to exactly this."""
    return math.ceil(cfg.lowres_max_image_size * val_resize_ratio)


def cache_folder(cfg: CacheConfig, data_root: str) -> Path | None:
    """The folder of L1 and L3: cache.dir, a relative one inside data.root (the dataset's own cache)."""
    if not cfg.dir:
        return None
    return Path(cfg.dir) if Path(cfg.dir).is_absolute() else Path(data_root) / cfg.dir


def open_split_cache(cfg: CacheConfig, split: Split, folder: Path | None, short_side: int) -> SplitCache:
    """The configured levels for `split`; a level that cannot be opened is left out with a one-line warning."""
    cache = SplitCache(SourceLevel(split))
    wanted: list[tuple[str, Callable[[], Level]]] = []
    if cfg.ram:
        wanted.append(("L2", lambda: RamLevel(split, Path(cfg.ram_dir), cfg.ram_keep)))
    if folder is not None and cfg.disk:
        wanted.append(("L1", lambda: DiskLevel(split, folder)))
    if folder is not None and cfg.lowres:
        wanted.append(("L3", lambda: LowResLevel(split, folder, short_side, cfg.lowres_max_aspect)))
    for name, open_level in wanted:
        try:
            level = open_level()
        except OSError as err:
            log.warning("%s cache for %s cannot be opened (%s); running without it", name, split.folder, err)
            continue
        if isinstance(level, LowResLevel):
            cache.lowres = level
        else:
            cache.upper.append(level)
    return cache


def stats_dict(caches: list[SplitCache]) -> dict[str, float]:
    """Counters per level summed over the splits: `cache/l1_hits`, `cache/l1_bytes`, ... (this rank's reads)."""
    totals: dict[str, LevelStats] = {name: LevelStats() for name in ("L0", "L1", "L2", "L3")}
    for cache in caches:
        for level in cache.levels():
            totals[level.name].add(level.stats)
    return {f"cache/{name.lower()}_{f.name}": float(getattr(s, f.name))
            for name, s in totals.items() for f in fields(s)}
