"""Time to accuracy, DAWNBench's measure: a finished run's summary.json, read one way, and the published
ResNet-50 ImageNet entries to compare with.

`read_summary(run_dir)` is the one reader of the summary.json that the trainer (and scripts/tta_baseline.py,
in the same format) write at the end of a run; the DAWNBench report, the time-to-accuracy bench and the plot
read runs through it, so "time to target" and "epochs to target" mean one thing everywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# ------------------------------------------------------------ a run's summary.json

SUMMARY_KEYS = ("epochs_run", "elapsed_s", "time_to_target_s", "world_size", "history")
"""Keys every summary.json has (the trainer's and tta_baseline.py's)."""


class SummaryError(ValueError):
    """summary.json is not valid JSON, not an object, or lacks a key; the message is one line."""


@dataclass(frozen=True)
class RunSummary:
    """A run's summary.json: `summary["key"]` reads its fields; the properties below interpret them."""

    path: Path
    data: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def history(self) -> list[dict[str, float]]:
        """One record per evaluated epoch: epoch (0-based), eval/<metric> ..., time/elapsed_s."""
        return self.data["history"]

    @property
    def targets(self) -> dict[str, float]:
        """The targets that were set, by metric (`target_top5: 0.93` -> {"top5": 0.93}); 0 or null is unset."""
        return {key[len("target_"):]: value for key, value in self.data.items()
                if key.startswith("target_") and value}

    @property
    def time_to_target_s(self) -> float | None:
        """Seconds from the start of the first epoch to the end of the evaluation that first met every target;
        None when no evaluation did (or none was set)."""
        return self.data["time_to_target_s"]

    @property
    def reached(self) -> bool:
        return self.time_to_target_s is not None

    @property
    def epochs_to_target(self) -> int | None:
        """The number of epochs trained when the target was first met: the 1-based epoch of the first evaluation
        whose every set metric is at or above its target (the trainer's test when it stamps time_to_target_s);
        None when the run never met it."""
        if not self.reached:
            return None
        targets = self.targets
        return next((int(h["epoch"]) + 1 for h in self.history
                     if targets and all(h.get(f"eval/{name}", -math.inf) >= value
                                        for name, value in targets.items())), None)

    def best(self, metric: str) -> float:
        """The highest eval/<metric> of the history."""
        return max(h[f"eval/{metric}"] for h in self.history)


def read_summary(run_dir: Path, required: Sequence[str] = ()) -> RunSummary:
    """`run_dir/summary.json`, checked for SUMMARY_KEYS and the `required` ones.

    Raises FileNotFoundError without the file and SummaryError when it is not a JSON object or lacks a key.
    """
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a finished run's folder?)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SummaryError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SummaryError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in dict.fromkeys((*SUMMARY_KEYS, *required)) if k not in doc]
    if missing:
        raise SummaryError(f"{path}: missing {', '.join(missing)} (not a summary the trainer wrote)")
    return RunSummary(path, doc)


# ------------------------------------------------------------ published ImageNet entries (cited constants)

LEADERBOARD = "https://dawn.cs.stanford.edu/benchmark/"
ENTRIES = "https://github.com/stanford-futuredata/dawn-bench-entries/blob/master/ImageNet/train/"
PUBLISHED_TARGET = "93% top-5, ImageNet"


@dataclass(frozen=True)
class PublishedEntry:
    """A published ResNet-50 ImageNet result: time to 93% top-5 validation accuracy, as its sources state it."""

    name: str
    hardware: str
    time_s: int
    """Time to 93% top-5, seconds (the published h:mm:ss)."""
    cost_usd: float | None
    """Published training cost; None where the sources give none."""
    sources: tuple[str, ...]


ALIBABA_128_V100 = PublishedEntry(
    "Alibaba Cloud AIACC, ResNet50-v1.5 (DAWNBench #1 time, Mar 2020)",
    "16 × ecs.gn6e-c12g1.24xlarge = 128 V100-32G, 32 Gbps VPC", 2 * 60 + 38, None,
    (LEADERBOARD, ENTRIES + "alibabacloud_resnet50_gn6e_16_machine_tensorflow.json"))
SHI_ET_AL_128_V100 = PublishedEntry(
    "Shi et al., MLSys 2021 (the system this repository implements)",
    "16 Tencent Cloud nodes × 8 = 128 V100, 25 Gbit/s Ethernet", 2 * 60 + 31, None,
    ("https://arxiv.org/abs/2010.10458",))
FASTAI_IMAGENET18 = PublishedEntry(
    "fast.ai/DIUx imagenet18, ResNet-50 (Sep 2018)",
    "16 × AWS p3.16xlarge = 128 V100", 18 * 60 + 6, None,
    (LEADERBOARD, ENTRIES + "fastai_resnet50_p3_16_machine_pytorch.json", "https://github.com/diux-dev/imagenet18"))
ALIBABA_1_NODE = PublishedEntry(
    "Alibaba Cloud AIACC, ResNet50-v1.5, single node (DAWNBench #1 cost, Mar 2020)",
    "1 × ecs.gn6e-c12g1.24xlarge = 8 V100-32G", 21 * 60 + 37, 7.43,
    (LEADERBOARD, ENTRIES + "alibabacloud_resnet50_gn6e_1_machine_tensorflow.json"))
PUBLISHED = (ALIBABA_128_V100, SHI_ET_AL_128_V100, FASTAI_IMAGENET18, ALIBABA_1_NODE)
