"""Image classification as a `Task` (trainer/task.py): label-smoothed cross-entropy on images from
data.build_image_data, top-1/top-5 evaluation, the DAWNBench TSV, and the `train` keys the ResNet recipe
adds (targets, channels-last, evaluation of a moving average of the weights and of mirrored images). The data
pipeline and its cache: docs/data-and-cache.md; the evaluation keys: docs/evaluation.md.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from torch import nn

from data import build_image_data
from kernels import use_channels_last_max_pool, use_direct_convs, use_gemm_for_small_maps
from trainer.choices import Probe
from trainer.config import require
from trainer.dist import Topology, all_reduce_sum, broadcast_module
from trainer.ema import build_eval_weights
from trainer.metrics import Writer
from trainer.schedules import Phase
from trainer.task import Task
from trainer.train_config import TrainConfig


@dataclass
class ClassificationTrainConfig(TrainConfig):
    target_top1: float = 0.0
    """Time-to-accuracy target on validation top-1 (fraction, e.g. 0.95); 0 = none."""
    target_top5: float = 0.0
    """Time-to-accuracy target on validation top-5 (fraction, e.g. 0.93); 0 = none."""
    channels_last: bool | Literal["auto"] = "auto"
    """Channels-last memory format for the model and images: true, false, or auto = measured at start-up
    (trainer/choices.py)."""
    ema_decay: float = 0.0
    """Evaluate an exponential moving average of the weights (BatchNorm statistics included), as torchvision's
    reference recipe's --model-ema and timm's ModelEmaV2: after every train.ema_every_steps-th applied optimizer
    step (a step the loss scaler skips is not), ema = decay * ema + (1 - decay) * weights, the first update
    copying them; checkpointed, and what trainer.export writes. 0 = off (the trained weights); e.g. 0.999."""
    ema_every_steps: int = 1
    """With train.ema_decay: update the average at every this many global steps (torchvision's
    --model-ema-steps); train.ema_decay is the decay per update."""
    eval_flip: bool = False
    """Test-time flip, as fast.ai's ImageNet recipes: evaluation averages the softmax of each validation image
    and of its horizontal mirror (two forward passes of the same batch)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("target_top1", "target_top5"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"train.{name}: a fraction in [0, 1] (e.g. 0.93), got {value}")
        require(0 <= self.ema_decay < 1, f"train.ema_decay: must be in [0, 1) (0 = off, e.g. 0.999), got "
                                         f"{self.ema_decay}")
        require(self.ema_every_steps >= 1, f"train.ema_every_steps: must be >= 1, got {self.ema_every_steps}")


class DawnbenchWriter(Writer):
    """The DAWNBench TSV (`epoch hours top1Accuracy top5Accuracy`, accuracies in percent), one row per eval."""

    HEADER = "epoch\thours\ttop1Accuracy\ttop5Accuracy\n"

    def __init__(self, path: Path) -> None:
        fresh = not path.exists()
        self.file = open(path, "a", buffering=1)
        if fresh:
            self.file.write(self.HEADER)

    def write(self, kind: str, step: int, record: dict[str, float]) -> None:
        if kind == "epoch" and "eval/top1" in record:
            self.file.write(f"{int(record['epoch']) + 1}\t{record['time/elapsed_s'] / 3600:.6f}\t"
                            f"{100 * record['eval/top1']:.4f}\t{100 * record['eval/top5']:.4f}\n")

    def close(self) -> None:
        self.file.close()


def build_classification_data(cfg: Any, topo: Topology) -> Any:
    """This rank's share of the ImageNet-layout dataset of a root config `cfg` (its `data` section, train.seed),
    through the multi-level cache, its batches of the element type the model trains at (train.amp)."""
    return build_image_data(cfg.data, topo.rank, topo.world_size, cfg.train.seed, topo.device, amp=cfg.train.amp)


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The numbers of top-1 and top-5 hits (top-k capped at the number of classes), as a 2-element tensor on
    the logits' device: nothing is read back to the host."""
    top = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return torch.stack([(top[:, 0] == labels).sum(), (top == labels[:, None]).any(dim=1).sum()])


def flip_averaged_log_probs(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """log((softmax(model(images)) + softmax(model(mirrored images))) / 2): as logits, their cross-entropy is
    that of the averaged probabilities and their top-k that of the average."""
    plain = torch.log_softmax(model(images).float(), dim=1)
    mirrored = torch.log_softmax(model(images.flip(-1)).float(), dim=1)
    return torch.logaddexp(plain, mirrored) - math.log(2)


class ClassificationTask(Task):
    """A model and an image data source (`data.build_image_data`); phases set image and global batch size.
    Two measured choices are the task's: the memory layout of the model and every batch (`train.channels_last`)
    and, on the CPU, convolutions on tiny maps as GEMMs (`small_map_gemm`, kernels/small_conv.py); a pinned
    value is applied at once, `auto` when the Trainer has measured (`apply_choices`). On the CPU, max pooling
    of NCHW activations may take the channels-last kernel (`max_pool_channels_last`, kernels/max_pool.py:
    the same results, so not a choice to measure). Evaluation runs the
    weights' moving average (`train.ema_decay`, trainer/ema.py) or the model itself, on each image or also on
    its mirror (`train.eval_flip`)."""

    unit = "images"

    def __init__(self, model: nn.Module, data: Any, topo: Topology, phases: list[Phase],
                 train: ClassificationTrainConfig, label_smoothing: float = 0.0,
                 small_map_gemm: bool | str = False, max_pool_channels_last: bool = False) -> None:
        for p in phases:
            require(p.batch_size % topo.world_size == 0,
                    f"schedule.phases: batch_size {p.batch_size} (global) is not divisible by the world size "
                    f"{topo.world_size}")
        self.model, self.data, self.topo = model, data, topo
        if max_pool_channels_last and topo.device.type == "cpu":
            use_channels_last_max_pool(model)  # before the average copies the model: both pool alike
        gemm = small_map_gemm if topo.device.type == "cpu" else False  # no effect on CUDA: nothing to measure
        self.space = {"channels_last": [False, True] if train.channels_last == "auto" else [train.channels_last],
                      "small_map_gemm": [False, True] if gemm == "auto" else [bool(gemm)]}
        self.memory_format = torch.contiguous_format
        self.eval_weights = build_eval_weights(model, train.ema_decay, train.ema_every_steps)
        self.eval_flip = train.eval_flip
        self.apply_choices({name: values[0] for name, values in self.space.items()})
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.targets = {"top1": train.target_top1, "top5": train.target_top5}
        self._loader_phase: Phase | None = None
        self._loader = None

    # ------------------------------------------------------------ data

    def per_rank_batch(self, phase: Phase) -> int:
        return phase.batch_size // self.topo.world_size

    def steps_per_epoch(self, phase: Phase) -> int:
        return self.data.train_size // self.topo.world_size // self.per_rank_batch(phase)

    def loader_for(self, phase: Phase) -> Any:
        """The phase's training loader, rebuilt only when the phase changes."""
        if phase is not self._loader_phase:
            self._loader = self.data.train_loader(phase.image_size, self.per_rank_batch(phase), phase.min_scale)
            self._loader_phase = phase
        return self._loader

    # ------------------------------------------------------------ measured choices

    def choice_space(self) -> dict[str, list[Any]]:
        return self.space

    def apply_choices(self, choice: dict[str, Any]) -> None:
        self.memory_format = torch.channels_last if choice["channels_last"] else torch.contiguous_format
        for model in self.models():
            model.to(memory_format=self.memory_format)
            (use_gemm_for_small_maps if choice["small_map_gemm"] else use_direct_convs)(model)

    def probes(self, phases: list[tuple[Phase, int, int]]) -> list[Probe]:
        """Random images, in the layout and element type the loader delivers (`batch_format`, else NCHW fp32),
        and labels, from a fixed generator (the run's generators are not touched): one training batch per
        distinct (per-rank batch, image size) with the run's steps at it, and one evaluation batch per distinct
        (batch, validation size) with the evaluations' batches at it (square crops stand in for rectangular
        validation), whose warm-up step runs in the first measured round (a candidate cut before it skips it)."""
        layout, dtype = getattr(self.data, "batch_format", (torch.contiguous_format, torch.float32))
        val_size = getattr(self.data, "val_size", 0)
        steps: dict[tuple[bool, int, int], float] = {}
        for phase, train_steps, evaluations in phases:
            b = self.per_rank_batch(phase)
            steps[True, b, phase.image_size] = steps.get((True, b, phase.image_size), 0) + train_steps
            eval_steps = evaluations * math.ceil(val_size / self.topo.world_size / max(1, b))
            if eval_steps:
                size = phase.val_image_size or phase.image_size
                steps[False, b, size] = steps.get((False, b, size), 0) + eval_steps
        gen = torch.Generator().manual_seed(0)
        return [Probe((torch.randn(b, 3, size, size, generator=gen).to(dtype).contiguous(memory_format=layout),
                       torch.randint(0, self.data.num_classes, (b,), generator=gen)), n,
                      f"{'train' if train else 'eval'} {b}x{size}px {str(dtype)[6:]}", train, warm=train)
                for (train, b, size), n in steps.items()]

    def prepare_probe(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.to_device(*batch)  # as every training batch: on the device, in the model's layout

    def input_candidates(self, cores: int) -> list[int]:
        candidates = getattr(self.data, "worker_candidates", None)  # synthetic data has no loader threads
        return candidates(cores) if candidates is not None else []

    def input_batches(self, phase: Phase, workers: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = self.data.train_loader(phase.image_size, self.per_rank_batch(phase), phase.min_scale, workers=workers)
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            yield from loader

    def use_workers(self, workers: int) -> None:
        self.data.workers = workers
        self._loader_phase = None  # the next phase's loader is built with them

    # ------------------------------------------------------------ data (continued)

    def to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.topo.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        return images, labels.to(self.topo.device, non_blocking=True)

    def train_batches(self, phase: Phase, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = self.loader_for(phase)
        loader.set_epoch(epoch, start_step)  # both backends compute any step's batch and crops directly
        for images, labels in loader:
            yield self.to_device(images, labels)

    # ------------------------------------------------------------ model

    def models(self) -> list[nn.Module]:
        """The trained model, and the moving average's copy evaluation runs when there is one."""
        evaluated = self.eval_weights.module
        return [self.model] if evaluated is self.model else [self.model, evaluated]

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        images, labels = batch
        return self.loss_fn(self.model(images), labels), len(labels)

    def after_step(self, step: int) -> None:
        self.eval_weights.maybe_update(step)

    @torch.no_grad()
    def evaluate(self, phase: Phase) -> dict[str, float]:
        """Top-1/top-5 and loss over the whole validation set, each image counted once across ranks, of the
        weights' moving average when train.ema_decay is set (the record says `eval/ema`), on each image and its
        mirror when train.eval_flip is (`eval/flip`)."""
        for module in self.models():  # rank 0's BatchNorm statistics everywhere
            broadcast_module(module, self.topo, buffers_only=True)
        model = self.eval_weights.module
        model.eval()
        size = phase.val_image_size or phase.image_size
        loader = self.data.val_loader(size, max(1, self.per_rank_batch(phase)))
        # top-1 hits, top-5 hits, summed loss: accumulated on the device and read back once, after the
        # reduction (a host read per batch would stall a GPU's queue every batch); the image count is the host's
        sums, count = torch.zeros(4, dtype=torch.float64, device=self.topo.device), 0
        for images, labels in loader:
            images, labels = self.to_device(images, labels)
            logits = flip_averaged_log_probs(model, images) if self.eval_flip else model(images)
            sums[:2] += accuracy_counts(logits, labels)
            sums[2] += nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
            count += len(labels)
        sums[3] = count
        hits1, hits5, loss_sum, count = all_reduce_sum(sums, self.topo)
        flip = {"eval/flip": 1.0} if self.eval_flip else {}
        return {"eval/top1": hits1 / count, "eval/top5": hits5 / count, "eval/loss": loss_sum / count,
                "eval/images": count, **self.eval_weights.metrics(), **flip}

    def target_reached(self, record: dict[str, float]) -> bool:
        if not any(self.targets.values()):
            return False
        return all(record[f"eval/{name}"] >= target for name, target in self.targets.items())

    # ------------------------------------------------------------ reporting

    def describe(self, phase: Phase) -> str:
        return (f"{phase.image_size:>4} px  global batch {phase.batch_size} ({self.per_rank_batch(phase)}/rank), "
                f"{self.data.train_size} training images")

    def report(self, summary: dict[str, Any]) -> list[str]:
        if summary["final_top1"] is None:
            return []
        return [f"final top-1 {summary['final_top1']:.4f}  top-5 {summary['final_top5']:.4f}"]

    def writers(self, run_dir: Path) -> list[Writer]:
        return [DawnbenchWriter(run_dir / "dawnbench.tsv")]

    def stats(self) -> dict[str, float]:
        """The current phase's sizes, and the data source's counters (cache levels, skipped images; this rank)."""
        phase = {} if self._loader_phase is None else {"phase/image_size": self._loader_phase.image_size,
                                                       "phase/batch_size": self._loader_phase.batch_size}
        return {**phase, **self.data.stats()}

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The weights' moving average, when there is one (train.ema_decay)."""
        ema = self.eval_weights.state_dict()
        return {"ema": ema} if ema else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.eval_weights.load_state_dict(state.get("ema", {}))
