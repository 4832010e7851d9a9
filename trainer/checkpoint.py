"""Checkpoints: atomic (temp file, fsync, rename) and self-checking (a SHA-256 trailer).

A file is `torch.save` bytes followed by a trailer `MAGIC + sha256(payload)`. A torn write (no trailer)
or flipped bits (digest mismatch) is detected on load, and the newest *valid* checkpoint is used instead.
A write that fails (a full disk) removes its temporary file and leaves the older checkpoints as they were.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

MAGIC = b"\nDAWNCKPT1:"
_TRAILER = len(MAGIC) + 64
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


class CorruptCheckpointError(ValueError):
    """The file is truncated or its checksum does not match."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous checkpoints are untouched."""


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` so that readers see either the old file or the complete new one."""
    buf = io.BytesIO()
    torch.save(state, buf)  # in memory first: a full disk fails below, never half-way through pickling
    payload = buf.getvalue()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())  # ENOSPC may only surface here (delayed allocation)
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointWriteError(e.errno, f"could not write checkpoint {path} ({len(payload) / 1e6:.1f} MB): "
                                            f"{e.strerror or e}; the previous checkpoints in {path.parent} are "
                                            "intact") from e
    finally:
        tmp.unlink(missing_ok=True)


def load_verified(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by `save_atomic`, raising CorruptCheckpointError if it is torn or altered."""
    data = path.read_bytes()
    payload, trailer = data[:-_TRAILER], data[-_TRAILER:]
    if len(data) < _TRAILER or not trailer.startswith(MAGIC):
        raise CorruptCheckpointError(f"{path}: truncated (no checksum trailer)")
    if hashlib.sha256(payload).hexdigest().encode() != trailer[len(MAGIC):]:
        raise CorruptCheckpointError(f"{path}: checksum mismatch")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def to_host(obj: Any) -> Any:
    """A copy of `obj` (nested dicts, lists, tuples) whose tensors are host-memory copies: later training
    steps cannot change it while it is being written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class Checkpointer:
    """Numbered checkpoints in one folder; keeps the newest `keep`."""

    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def save_in_background(self, state: dict[str, Any], step: int) -> None:
        """Snapshot `state` into host memory now and write it on a background thread, so training goes on
        while the file is pickled, hashed and synced. One write at a time: this first waits for the previous
        one and raises its CheckpointWriteError, if it failed."""
        self.wait()
        snapshot = to_host(state)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending = self._writer.submit(self.save, snapshot, step)

    def wait(self) -> None:
        """Wait for a background write; raise its error, if any, as a CheckpointWriteError (the caller stops
        every rank on it, whatever went wrong in the writer)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointWriteError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a pickling error or MemoryError in the writer thread
            raise CheckpointWriteError(0, f"the background checkpoint write failed: {type(e).__name__}: {e}; the "
                                          f"previous checkpoints in {self.folder} are intact") from e

    def paths(self) -> list[Path]:
        """Existing checkpoints, newest first."""
        if not self.folder.is_dir():
            return []
        found = [p for p in self.folder.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)

    def save(self, state: dict[str, Any], step: int) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".ckpt-*.tmp*"):  # left by a writer that was killed mid-write
            stale.unlink(missing_ok=True)
        path = self.folder / f"ckpt-{step:08d}.pt"
        save_atomic(state, path)
        for old in self.paths()[self.keep:]:
            old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that verifies; corrupt ones are reported and skipped."""
        for path in self.paths():
            try:
                return load_verified(path), path
            except CorruptCheckpointError as e:
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
        return None
