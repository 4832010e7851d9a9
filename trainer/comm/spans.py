"""Time spent in parts of a gradient exchange, measured where the work runs: on the GPU's streams for CUDA.

On CUDA, the host only enqueues kernels and collectives, so host time around them is near zero; a span records
a pair of CUDA events on the current stream instead, and its seconds are read once the GPU has passed the end
event (`Event.query`, which never waits): a step's seconds usually arrive with the next step's stats. Elsewhere
a span is host wall-clock time, reported with the step that ran it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import torch


class DeviceSpans:
    """Seconds per key over spans that may run on several threads (the exchange thread selects, the training
    thread waits)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._pending: list[tuple[str, Any, Any]] = []
        self._done: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self, key: str) -> Iterator[None]:
        """Time the body: the work it enqueues on the current CUDA stream, or its host time without CUDA."""
        if not self.cuda:
            start = time.perf_counter()
            try:
                yield
            finally:
                with self._lock:
                    self._done[key] = self._done.get(key, 0.0) + time.perf_counter() - start
            return
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._pending.append((key, begin, end))

    def collect(self) -> dict[str, float]:
        """Seconds per key of the spans finished since the last call (on CUDA: those the GPU has passed)."""
        with self._lock:
            out, self._done = self._done, {}
            waiting = []
            for key, begin, end in self._pending:
                if end.query():
                    out[key] = out.get(key, 0.0) + begin.elapsed_time(end) / 1e3
                else:
                    waiting.append((key, begin, end))
            self._pending = waiting
        return out
