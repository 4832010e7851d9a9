"""Checkpoints: one folder per checkpoint, one file per writer, and a manifest that makes them one.

    RUN/checkpoints/step-00001234/
        model.pt          rank 0: the model's state dict, plain tensors (opens with torch.load(weights_only=True))
        shared.pt         rank 0: optimizer, loss scaler, task, loop position, history, config
        rank-00000.pt ... each rank its own: communicator state (error-feedback residuals), random generators
        rank-00000.json   each rank: the SHA-256 and size of the files it wrote (what rank 0 puts in the manifest)
        manifest.json     rank 0, last, once every rank's files are on disk: step, world size, created, every
                          file's SHA-256 and size

Each rank writes only its own files and reads only its own rank file and the shared ones back: nothing but the
small per-rank records passes through rank 0 (a shared filesystem is assumed: every rank sees the same
RUN/checkpoints). Every file is written atomically (temporary file, fsync, rename), so a reader sees the old
file or the whole new one. A folder without a valid manifest is incomplete (a run stopped while writing it),
and a file whose digest differs from the manifest's is torn or altered: either way the folder is skipped with
a warning and the previous checkpoint is used. A write that fails (a full disk) leaves no temporary file and
the older checkpoints as they were. Every file opens with torch.load(weights_only=True).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno as errnos
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

FORMAT = 2
"""The layout version in every manifest."""
MODEL, SHARED, MANIFEST = "model.pt", "shared.pt", "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_CHUNK = 1 << 22


class CorruptCheckpointError(ValueError):
    """A checkpoint folder is incomplete (no valid manifest), or one of its files is torn or altered."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous checkpoints are untouched. The
    message is the whole text (no "[Errno N]" prefix); `errno` is the failed call's, where there was one."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class CheckpointFolderError(CheckpointWriteError):
    """The checkpoint folder cannot be written at all (a read-only mount, no permission): found at start-up,
    before any step is trained; the message is one line."""


def require_writable(folder: str | Path) -> None:
    """Raise CheckpointFolderError unless a file can be created in `folder` (RUN/checkpoints), or, while it does
    not exist yet, in its nearest existing parent (it is not created here: a fresh run's archiving of an earlier
    run's outputs must not find an empty one). A probe file is created and removed: permission bits alone say
    nothing for root, and a read-only mount refuses root too."""
    folder = Path(folder).absolute()
    probe_in = next((p for p in (folder, *folder.parents) if p.is_dir()), None)
    try:
        if probe_in is None:
            raise FileNotFoundError(errnos.ENOENT, "no existing parent folder")
        fd, name = tempfile.mkstemp(prefix=".writable-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        where = "" if probe_in == folder else f" (its parent {probe_in})"
        raise CheckpointFolderError(f"{folder}{where} is not writable ({e.strerror or e}): no checkpoint could be "
                                    "saved; point log.dir at a writable folder", e.errno) from None


def step_dir_name(step: int) -> str:
    """The folder of the checkpoint taken after global step `step`."""
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """Rank `rank`'s own state file in a checkpoint folder."""
    return f"rank-{rank:05d}.pt"


def _rank_record(rank: int) -> str:
    return f"rank-{rank:05d}.json"


# ---------------------------------------------------------------- files


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe_os_error(error: OSError) -> str:
    """`No space left on device (ENOSPC)`: the system's words and the errno's name, which is what people search
    for and what a full disk is recognized by in logs."""
    name = errnos.errorcode.get(error.errno) if error.errno is not None else None
    return f"{error.strerror or error} ({name})" if name else str(error.strerror or error)


def write_atomic(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` so that readers see either the old file or the complete new one; on failure
    (a full disk) the temporary file is removed and a CheckpointWriteError says what was kept."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())  # ENOSPC may only surface here (delayed allocation)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise CheckpointWriteError(f"could not write checkpoint file {path} ({len(payload) / 1e6:.1f} MB): "
                                   f"{describe_os_error(e)}; the previous checkpoints in {path.parent.parent} are "
                                   "intact", e.errno) from e
    finally:
        tmp.unlink(missing_ok=True)


def save_file(obj: Any, path: Path) -> dict[str, Any]:
    """`torch.save` `obj` to `path` atomically; its manifest entry (SHA-256 and size)."""
    buf = io.BytesIO()
    torch.save(obj, buf)  # in memory first: a full disk fails in write_atomic, never half-way through pickling
    payload = buf.getvalue()
    write_atomic(path, payload)
    return {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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


# ---------------------------------------------------------------- reading


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The folder's manifest; CorruptCheckpointError when it is missing (an incomplete checkpoint) or unreadable."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{ckpt_dir}: incomplete (no {MANIFEST}: the run stopped while writing it)") \
            from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CorruptCheckpointError(f"{path}: not a checkpoint manifest of format {FORMAT}")
    return manifest


def verify_files(ckpt_dir: Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Check `names` (default: every file in the manifest) against their size and SHA-256 in the manifest."""
    files = manifest["files"]
    for name in files if names is None else names:
        if name not in files:
            raise CorruptCheckpointError(f"{ckpt_dir}: {name} is not in its manifest")
        path = Path(ckpt_dir) / name
        if not path.is_file():
            raise CorruptCheckpointError(f"{path}: missing")
        if path.stat().st_size != files[name]["bytes"]:
            raise CorruptCheckpointError(f"{path}: truncated or altered (size {path.stat().st_size}, the manifest "
                                         f"says {files[name]['bytes']})")
        if file_sha256(path) != files[name]["sha256"]:
            raise CorruptCheckpointError(f"{path}: checksum mismatch")


def step_dirs(folder: Path) -> list[Path]:
    """Checkpoint folders in `folder` (RUN/checkpoints), newest first, complete or not, unverified."""
    if not Path(folder).is_dir():
        return []
    found = [p for p in Path(folder).iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete, verified checkpoints of a run (RUN/checkpoints/step-*), newest first. A folder without a
    valid manifest, or with a file whose size or digest differs from the manifest's, is skipped with a warning."""
    folder = Path(run_dir) / "checkpoints"
    good = []
    for ckpt_dir in step_dirs(folder):
        try:
            verify_files(ckpt_dir, read_manifest(ckpt_dir))
            good.append(ckpt_dir)
        except CorruptCheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return good


def load_file(ckpt_dir: Path, name: str, manifest: dict[str, Any] | None = None, verify: bool = True) -> Any:
    """One file of a checkpoint, checked against the manifest first (unless `verify` is False: the caller has
    checked it), loaded on the CPU with torch.load(weights_only=True)."""
    if verify:
        verify_files(ckpt_dir, manifest if manifest is not None else read_manifest(ckpt_dir), [name])
    return torch.load(Path(ckpt_dir) / name, map_location="cpu", weights_only=True)


def load_model_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The model's state dict of a checkpoint folder (checked against its manifest), via
    torch.load(weights_only=True)."""
    return load_file(Path(ckpt_dir), MODEL)


def read_checkpoint(ckpt_dir: Path) -> dict[str, Any]:
    """A whole checkpoint in one dict, for tools and tests (a resuming rank reads only its own part): the
    shared state's keys, `model`, `ranks` (every rank file's state, by rank) and `manifest`."""
    manifest = read_manifest(ckpt_dir)
    verify_files(ckpt_dir, manifest)
    state = load_file(ckpt_dir, SHARED, manifest, verify=False)
    state["model"] = load_file(ckpt_dir, MODEL, manifest, verify=False)
    state["ranks"] = [load_file(ckpt_dir, rank_file(r), manifest, verify=False) for r in range(manifest["world_size"])]
    state["manifest"] = manifest
    return state


def latest_checkpoint(run_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """`read_checkpoint` of the run's newest verified checkpoint, with its folder; None when it has none."""
    found = checkpoint_dirs(run_dir)
    return (read_checkpoint(found[0]), found[0]) if found else None


# ---------------------------------------------------------------- writing


def write_rank_files(ckpt_dir: Path, files: dict[str, Any], rank: int, token: str) -> None:
    """This rank's files of one checkpoint, then its record of them (rank-NNNNN.json: digests and sizes, and
    the writing attempt's `token`, so a record a killed attempt left in the same folder is never mistaken
    for this one's). A failure is recorded too, so that rank 0 stops waiting, and raised."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    try:
        entries = {name: save_file(obj, ckpt_dir / name) for name, obj in files.items()}
    except CheckpointWriteError as e:
        with_error = {"rank": rank, "token": token, "error": str(e)}
        try:
            write_atomic(ckpt_dir / _rank_record(rank), json.dumps(with_error).encode())
        except CheckpointWriteError:
            pass  # the disk is full: rank 0 times out instead
        raise
    write_atomic(ckpt_dir / _rank_record(rank), json.dumps({"rank": rank, "token": token, "files": entries}).encode())


def collect_rank_records(ckpt_dir: Path, world_size: int, token: str, timeout_s: float,
                         stop: threading.Event | None = None) -> dict[str, Any]:
    """Every rank's file entries for the manifest, waiting up to `timeout_s` for ranks still writing, or until
    `stop` is set (the ranks learnt that one of them failed: a rank whose disk is full cannot record that)."""
    files: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    for rank in range(world_size):
        path = ckpt_dir / _rank_record(rank)
        while True:
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                record = None
            if record is not None and record.get("token") == token:
                break
            if stop is not None and stop.is_set():
                raise CheckpointWriteError(f"stopped waiting for rank {rank}'s part of {ckpt_dir}: a rank could "
                                           "not write its part; the previous checkpoints are intact")
            if time.monotonic() > deadline:
                raise CheckpointWriteError(f"rank {rank} did not finish writing its part of {ckpt_dir} within "
                                           f"{timeout_s:.0f}s; the previous checkpoints are intact")
            time.sleep(0.05)
        if "error" in record:
            raise CheckpointWriteError(f"rank {rank} could not write its part of {ckpt_dir}: {record['error']}")
        files.update(record["files"])
    return files


def write_manifest(ckpt_dir: Path, step: int, world_size: int, files: dict[str, Any]) -> None:
    """The manifest, written last: from here on the folder is a checkpoint."""
    manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": files}
    write_atomic(ckpt_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def is_complete(ckpt_dir: Path) -> bool:
    """Whether a folder has a valid manifest and every file it names, at its size (digests are not read: a
    resume checks those)."""
    try:
        manifest = read_manifest(ckpt_dir)
    except CorruptCheckpointError:
        return False
    return all((ckpt_dir / name).is_file() and (ckpt_dir / name).stat().st_size == entry["bytes"]
               for name, entry in manifest["files"].items())


def prune(folder: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints (`is_complete`); remove every other step folder (older ones,
    torn ones, and incomplete or newer ones a stopped attempt left: the run writes its steps in order) and
    temporary files."""
    complete = [d for d in step_dirs(folder) if is_complete(d)]
    kept = set(complete[:keep])
    for d in step_dirs(folder):
        if d not in kept:
            shutil.rmtree(d, ignore_errors=True)


_WRITERS: weakref.WeakSet[CheckpointWriter] = weakref.WeakSet()
_EXIT_WAIT_S = 60.0


@atexit.register
def _stop_background_writes() -> None:
    # Before the interpreter finalizes: a daemon writer thread still inside torch's C++ (a save releases the
    # GIL) when finalization takes the GIL away is unwound through a noexcept frame, and the process aborts
    # (SIGABRT) instead of leaving with its error. Let each thread finish its own files, but not wait for the
    # other ranks' records.
    for writer in list(_WRITERS):
        writer.abort(timeout_s=_EXIT_WAIT_S)


class CheckpointWriter:
    """Writes this rank's part of checkpoints into RUN/checkpoints, now or on a background thread; rank 0 also
    writes the manifest once every rank's record is there, and prunes to the newest `keep`."""

    def __init__(self, folder: str | Path, rank: int, world_size: int, keep: int = 2,
                 wait_timeout_s: float = 600.0) -> None:
        self.folder = Path(folder)
        require_writable(self.folder)  # at setup, not at the first checkpoint: a run that could save none stops
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.wait_timeout_s = wait_timeout_s
        self.pending_step: int | None = None
        """The step of the background write not yet waited for (None: none)."""
        self._written: Future | None = None  # this rank's own files and record
        self._pending: Future | None = None  # all of it: on rank 0 also the manifest and pruning
        self._stop = threading.Event()
        _WRITERS.add(self)

    def write(self, step: int, files: dict[str, Any], token: str) -> Path:
        """This rank's `files` of checkpoint `step` (file name → object); returns the folder. The folder becomes
        a checkpoint only when `finish` (rank 0) writes its manifest."""
        ckpt_dir = self.folder / step_dir_name(step)
        write_rank_files(ckpt_dir, files, self.rank, token)
        return ckpt_dir

    def finish(self, step: int, token: str) -> Path:
        """Rank 0, once every rank wrote its part (or while they do: it waits for their records, or until
        `abort`): the manifest, then pruning."""
        ckpt_dir = self.folder / step_dir_name(step)
        files = collect_rank_records(ckpt_dir, self.world_size, token, self.wait_timeout_s, self._stop)
        write_manifest(ckpt_dir, step, self.world_size, files)
        prune(self.folder, self.keep)
        return ckpt_dir

    def write_in_background(self, step: int, files: dict[str, Any], token: str,
                            copied: tuple[str, ...] = ()) -> None:
        """Snapshot `files` into host memory now (but those named in `copied`: the caller made them of copies
        in host memory already) and write them (and, on rank 0, the manifest once every rank's record is there)
        on a background thread. One write at a time: this first waits for the previous one and raises its
        CheckpointWriteError, if it failed."""
        self.wait()
        snapshot = {name: obj if name in copied else to_host(obj) for name, obj in files.items()}
        written, pending = Future(), Future()
        self._stop.clear()
        # A daemon thread: a process leaving on an error does not wait for rank 0's wait for the other ranks'
        # records (it can last wait_timeout_s; `_stop_background_writes` stops it at exit); the files are
        # atomic, so a write cut short leaves no torn one. The run waits for its writes on the normal path.
        threading.Thread(target=self._write_and_finish, args=(written, pending, step, snapshot, token),
                         name="checkpoint-writer", daemon=True).start()
        self._written, self._pending, self.pending_step = written, pending, step

    def _write_and_finish(self, written: Future, pending: Future, step: int, files: dict[str, Any],
                          token: str) -> None:
        written.set_running_or_notify_cancel()
        pending.set_running_or_notify_cancel()
        start = time.perf_counter()
        try:
            self.write(step, files, token)
        except BaseException as e:  # noqa: BLE001 - handed to `wait`, which raises it on the training thread
            written.set_exception(e)
            pending.set_exception(e)
            return
        written.set_result(time.perf_counter() - start)
        try:
            if self.rank == 0:
                self.finish(step, token)
        except BaseException as e:  # noqa: BLE001
            pending.set_exception(e)
        else:
            pending.set_result(time.perf_counter() - start)

    def wait_written(self) -> None:
        """Wait for this rank's own part of a background write (its files and record; not rank 0's manifest)
        and raise its error as a CheckpointWriteError, if it failed. Every rank can wait for this without
        waiting for the others."""
        if self._written is not None:
            self._result(self._written)

    def abort(self, timeout_s: float | None = None) -> None:
        """Give up the background write after a rank failed: rank 0's thread stops waiting for records that
        will not come; returns once the thread is done, or after `timeout_s` (whatever it raised is dropped: the
        caller reports the failure)."""
        pending, self._written, self._pending, self.pending_step = self._pending, None, None, None
        self._stop.set()
        if pending is not None:
            try:
                pending.exception(timeout=timeout_s)  # waits for the thread, without raising what it raised
            except concurrent.futures.TimeoutError:  # the builtin TimeoutError only from Python 3.11
                pass  # a stuck file system: leave rather than hang

    def wait(self) -> float | None:
        """Wait for a background write; return the seconds its thread took (None when none was pending), or
        raise its error as a CheckpointWriteError (the caller stops every rank on it, whatever went wrong in the
        writer)."""
        pending, self._written, self._pending, self.pending_step = self._pending, None, None, None
        if pending is None:
            return None
        return self._result(pending)

    def _result(self, future: Future) -> float:
        try:
            return future.result()
        except CheckpointWriteError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a pickling error or MemoryError in the writer thread
            raise CheckpointWriteError(f"the background checkpoint write failed: {type(e).__name__}: {e}; the "
                                       f"previous checkpoints in {self.folder} are intact") from e
