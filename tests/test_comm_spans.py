"""trainer/comm/spans.py: exchange timings where the work runs. On the CPU, host time reported at once; on CUDA
(a stand-in for torch.cuda.Event here), event pairs read only once the GPU has passed their end, never waited on.
A version that read unfinished events (which raises on CUDA, or waits), or reported a span twice, fails here."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from trainer.comm.spans import DeviceSpans

pytestmark = pytest.mark.unit


class FakeEvent:
    """torch.cuda.Event's surface that DeviceSpans uses: record, query, elapsed_time (ms); the test says when the
    'GPU' has passed an event and at which time."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at_ms: float | None = None
        self.passed = False

    def record(self) -> None:
        self.at_ms = FakeEvent.clock_ms

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.passed and end.passed):
            raise RuntimeError("CUDA error: device not ready")  # what cudaEventElapsedTime says
        return end.at_ms - self.at_ms


def test_cuda_spans_are_read_once_the_gpu_passed_them(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    spans = DeviceSpans(cuda=True)
    events = []
    for key, length in (("wait_s", 30.0), ("select_s", 5.0), ("wait_s", 12.0)):
        with spans.span(key):
            FakeEvent.clock_ms += length
        events.append(spans._pending[-1])
    assert spans.collect() == {}  # nothing finished on the GPU yet: nothing read, no error
    for _, begin, end in events[:2]:
        begin.passed = end.passed = True
    assert spans.collect() == pytest.approx({"wait_s": 0.030, "select_s": 0.005})
    assert spans.collect() == {}  # reported once
    events[2][1].passed = events[2][2].passed = True
    assert spans.collect() == pytest.approx({"wait_s": 0.012})


def test_cpu_spans_are_host_time_from_any_thread() -> None:
    spans = DeviceSpans(cuda=False)

    def select() -> None:
        with spans.span("select_s"):
            time.sleep(0.02)

    thread = threading.Thread(target=select)
    thread.start()
    with spans.span("wait_s"):
        thread.join()
    out = spans.collect()
    assert out["select_s"] >= 0.02 and out["wait_s"] >= 0.015
    assert spans.collect() == {}
