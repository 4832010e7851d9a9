"""The time-to-accuracy baseline: image classification trained the way users of torchvision's reference script train.

    torchrun --standalone --nproc_per_node 2 scripts/tta_baseline.py --config configs/tta_baseline_cpu.yaml \
        --output-dir runs/tta_baseline --seed 100 [--lr 0.05 --lr-warmup-epochs 0 ...]

It follows pytorch/vision references/classification/train.py and its presets.py: ImageFolder + DataLoader
(DistributedSampler, worker processes, per-epoch random-resized crops at one fixed size, resize + center-crop
validation), a torchvision model wrapped in DistributedDataParallel (dense gradient allreduce), SGD with
momentum 0.9 and weight decay, and the learning rate set per epoch by linear warm-up then cosine annealing
(`--lr-scheduler steplr` for the step schedule). The reference's tuning flags that apply on a CPU are here with
its names and defaults: `--lr`, `--epochs`, `--lr-warmup-epochs` (0), `--lr-warmup-decay`, `--label-smoothing`
(0), `--norm-weight-decay` (none: batch-norm weights decay like the rest), `--wd` (1e-4), `--model-ema` (off;
`--model-ema-steps` 32, `--model-ema-decay` 0.99998; with it every evaluation is of the EMA weights). Its `--amp`
is CUDA autocast, so its users train in fp32 on a CPU, as this script does.

Memory format: contiguous (NCHW) tensors by default, as the reference, which has no memory-format flag;
`--channels-last` converts the model and every batch to channels-last (NHWC strides). The frozen choices are
in configs/tta_baseline_cpu.yaml (70% top-1) and tta_baseline_cpu_75.yaml.

`--config FILE`: a YAML mapping of this script's options (names as on the command line, without the dashes) that
replaces the defaults; options given on the command line win; `base: OTHER.yaml` (relative to the file) takes
OTHER's options first. The bench's frozen baselines are such files.

Differences from the reference, each to make the comparison with the recipe fair: `--hflip-prob` and
`--min-scale` (the reference hard-codes 0.5 and 0.08) so both sides augment alike; with `--model-ema` only the
average is evaluated (the reference evaluates the model and the average every epoch); validation shards without
padding (the reference's DistributedSampler repeats images); no checkpoints (neither side writes any in the
benchmark); and `--target-top1` with `--target-consecutive N`: the clock stops at the N-th evaluation in a row at
or above the target (and the run with it, unless `--no-stop-at-target`).

It writes what the recipe's trainer writes, so scripts/plot_tta.py and scripts/bench/tta.py read both alike:
`metrics.jsonl` (an "epoch" record with eval/top1, eval/top5 and time/elapsed_s per epoch) and `summary.json`
(time_to_target_s, final_top1, history). The clock starts before the first epoch, after the process group,
the model and the dataset listing exist, as the trainer's does; data loading and evaluation are inside it.
It sits outside scripts/bench/ because `make bench` runs every script there, and this one is not a benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torchvision
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

from trainer.tta_stats import reached_at  # the bench reads the runs by the same rule

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet statistics, as in the reference presets


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="YAML mapping of these options (no dashes) replacing the defaults")
    p.add_argument("--data-path", type=Path, default=Path("datasets/tta_photos"),
                   help="ImageFolder root (train/, val/)")
    p.add_argument("--model", default="resnet18", help="torchvision.models name")
    p.add_argument("--batch-size", type=int, default=32, help="images per process (reference default 32)")
    p.add_argument("--epochs", type=int, default=90, help="schedule length in epochs")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate for the global batch")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1.0e-4, help="weight decay")
    p.add_argument("--norm-weight-decay", type=float, default=None,
                   help="weight decay of normalization layers' parameters (default: --wd)")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--lr-scheduler", choices=["cosineannealinglr", "steplr"], default="cosineannealinglr")
    p.add_argument("--lr-min", type=float, default=0.0, help="cosineannealinglr: the rate it ends at")
    p.add_argument("--lr-warmup-epochs", type=int, default=0, help="linear warm-up epochs (0 = none)")
    p.add_argument("--lr-warmup-decay", type=float, default=0.01, help="warm-up starts at lr x this")
    p.add_argument("--lr-step-size", type=int, default=30, help="steplr: decay every this many epochs")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="steplr: decay factor")
    p.add_argument("--train-crop-size", type=int, default=64, help="fixed training image size (px)")
    p.add_argument("--val-resize-size", type=int, default=73, help="validation: shorter side resized to this")
    p.add_argument("--val-crop-size", type=int, default=64, help="validation: center crop (px)")
    p.add_argument("--min-scale", type=float, default=0.35, help="RandomResizedCrop area lower bound")
    p.add_argument("--hflip-prob", type=float, default=0.5, help="probability of a horizontal flip")
    p.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluate an exponential moving average of the weights (the reference's --model-ema)")
    p.add_argument("--model-ema-steps", type=int, default=32, help="update the EMA every this many steps")
    p.add_argument("--model-ema-decay", type=float, default=0.99998,
                   help="EMA decay, adjusted as the reference does for the batch, world size and epochs")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False,
                   help="channels-last (NHWC) model and batches; default contiguous NCHW, as the reference")
    p.add_argument("--target-top1", type=float, default=0.0, help="time-to-accuracy target (fraction); 0 = none")
    p.add_argument("--target-consecutive", type=int, default=1,
                   help="the target counts as reached at the N-th evaluation in a row at or above it")
    p.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True,
                   help="stop once the target is reached (DAWNBench style)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("runs/tta_baseline"))
    p.add_argument("--print-freq", type=int, default=1, help="print a line every this many epochs (rank 0)")
    return p


def read_config(path: Path, parser: argparse.ArgumentParser, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A --config file's options over those of the file its `base:` names (relative to it), recursively."""
    if not path.is_file():
        parser.error(f"--config {path}: no such file")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of options, got {type(values).__name__}")
    if "base" not in values:
        return values
    base = (path.parent / str(values.pop("base"))).resolve()
    if base in seen:
        parser.error(f"--config {path}: base files form a cycle through {base}")
    return {**read_config(base, parser, (*seen, path.resolve())), **values}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line over --config's values over the defaults; a config key that is no option is an error."""
    parser = get_args_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config is not None:
        values = read_config(first.config, parser)
        types = {a.dest: a.type for a in parser._actions if a.dest not in ("help", "config")}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(k for k in values if k not in types)
        if unknown:
            parser.error(f"--config {first.config}: unknown option(s) {', '.join(unknown)}")
        parser.set_defaults(**{k: v if v is None or types[k] is None else types[k](v) for k, v in values.items()})
    args = parser.parse_args(argv)
    if args.target_consecutive < 1:
        parser.error(f"--target-consecutive must be >= 1, got {args.target_consecutive}")
    if args.model_ema_steps < 1 or not 0.0 <= args.model_ema_decay < 1.0:
        parser.error("--model-ema-steps must be >= 1 and --model-ema-decay in [0, 1)")
    return args


# ------------------------------------------------------------------ setup

def init_distributed() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment, or from a process group that already exists (tests)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------ data

def load_data(args: argparse.Namespace, rank: int, world: int) -> tuple[DataLoader, DataLoader, int]:
    """The reference's ClassificationPresetTrain/Eval on ImageFolder; (train loader, val loader, classes)."""
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.train_crop_size, scale=(args.min_scale, 1.0), antialias=True),
        transforms.RandomHorizontalFlip(args.hflip_prob),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([
        transforms.Resize(args.val_resize_size, antialias=True), transforms.CenterCrop(args.val_crop_size),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train = datasets.ImageFolder(str(args.data_path / "train"), train_tf)
    val = datasets.ImageFolder(str(args.data_path / "val"), val_tf)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    # Persistent workers: re-forking them every epoch would only make the baseline slower on 2 cores.
    persistent = args.workers > 0
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              drop_last=True, persistent_workers=persistent)
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=args.batch_size,
                            num_workers=args.workers, persistent_workers=persistent)
    return train_loader, val_loader, len(train.classes)


# ------------------------------------------------------------------ optimizer and schedule

def param_groups(model: nn.Module, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The reference's --norm-weight-decay: normalization layers' parameters in a group of their own."""
    if args.norm_weight_decay is None:
        return [{"params": list(model.parameters()), "weight_decay": args.wd}]
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
    norm = [p for m in model.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)]
    ids = {id(p) for p in norm}
    return [{"params": [p for p in model.parameters() if id(p) not in ids], "weight_decay": args.wd},
            {"params": norm, "weight_decay": args.norm_weight_decay}]


def build_scheduler(opt: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LRScheduler:
    """The reference's per-epoch schedule: linear warm-up, then cosine annealing to 0 or step decay."""
    main_epochs = args.epochs - args.lr_warmup_epochs
    if args.lr_scheduler == "cosineannealinglr":
        main = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, main_epochs), eta_min=args.lr_min)
    else:
        main = torch.optim.lr_scheduler.StepLR(opt, step_size=args.lr_step_size, gamma=args.lr_gamma)
    if args.lr_warmup_epochs == 0:
        return main
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=args.lr_warmup_decay,
                                               total_iters=args.lr_warmup_epochs)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, main], milestones=[args.lr_warmup_epochs])


# ------------------------------------------------------------------ train and evaluate

def build_ema(model: nn.Module, args: argparse.Namespace, world: int) -> AveragedModel | None:
    """The reference's --model-ema: an EMA of the weights and buffers (torch's AveragedModel, as the reference's
    ExponentialMovingAverage), updated every --model-ema-steps steps, its decay adjusted for the world size,
    batch and epochs as the reference's train.py does, and reset to the weights during the lr warm-up."""
    if not args.model_ema:
        return None
    adjust = world * args.batch_size * args.model_ema_steps / args.epochs
    alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(1.0 - alpha), use_buffers=True)


def train_one_epoch(model: nn.Module, criterion: nn.Module, opt: torch.optim.Optimizer, loader: DataLoader,
                    memory_format: torch.memory_format, ema: AveragedModel | None = None, ema_steps: int = 1,
                    warming_up: bool = False) -> float:
    model.train()
    loss_sum, steps = torch.zeros(()), 0
    for images, labels in loader:
        loss = criterion(model(images.contiguous(memory_format=memory_format)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP allreduces every gradient bucket here
        opt.step()
        loss_sum += loss.detach()
        if ema is not None and steps % ema_steps == 0:  # the reference's `i % args.model_ema_steps == 0`
            ema.update_parameters(model)
            if warming_up:  # the reference resets the EMA to the weights during the lr warm-up
                ema.n_averaged.fill_(0)
        steps += 1
    return float(loss_sum) / max(1, steps)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, memory_format: torch.memory_format) -> dict[str, float]:
    """Top-1/top-5 over the whole validation split (each rank holds a disjoint shard; counts are summed)."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64)  # top-1 hits, top-5 hits, images
    for images, labels in loader:
        logits = model(images.contiguous(memory_format=memory_format))
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        counts += torch.tensor([(top[:, 0] == labels).sum(), (top == labels[:, None]).any(1).sum(), len(labels)],
                               dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return {"eval/top1": float(counts[0] / counts[2]), "eval/top5": float(counts[1] / counts[2]),
            "eval/images": int(counts[2])}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rank, world = init_distributed()
    seed_all(args.seed)
    train_loader, val_loader, num_classes = load_data(args, rank, world)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = getattr(torchvision.models, args.model)(num_classes=num_classes).to(memory_format=memory_format)
    if world > 1:
        model = DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    opt = torch.optim.SGD(param_groups(model, args), lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    scheduler = build_scheduler(opt, args)
    ema = build_ema(model.module if world > 1 else model, args, world)
    out = args.output_dir
    log = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "metrics.jsonl", "w", buffering=1)
        (out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=2) + "\n")
    history: list[dict[str, float]] = []
    time_to_target: float | None = None
    clock = time.perf_counter()
    epoch = 0
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        lr = opt.param_groups[0]["lr"]
        loss = train_one_epoch(model, criterion, opt, train_loader, memory_format, ema, args.model_ema_steps,
                               epoch < args.lr_warmup_epochs)
        scheduler.step()
        record = {"epoch": epoch, "loss/train_epoch": loss, "schedule/lr": lr,
                  **evaluate(model if ema is None else ema, val_loader, memory_format)}
        record["time/elapsed_s"] = time.perf_counter() - clock
        history.append({k: record[k] for k in ("epoch", "eval/top1", "eval/top5", "time/elapsed_s")})
        if log is not None:
            log.write(json.dumps({"kind": "epoch", "step": (epoch + 1) * len(train_loader), **record}) + "\n")
            if epoch % args.print_freq == 0 or epoch + 1 == args.epochs:
                print(f"epoch {epoch:>3}  lr {lr:.4g}  loss {loss:.4f}  top-1 {record['eval/top1']:.4f}  "
                      f"{record['time/elapsed_s']:.1f} s", flush=True)
        # all-reduced accuracies: every rank takes the same decision
        reached = bool(args.target_top1) and reached_at([h["eval/top1"] for h in history], args.target_top1,
                                                               args.target_consecutive) is not None
        if reached and time_to_target is None:
            time_to_target = record["time/elapsed_s"]
        if reached and args.stop_at_target:
            break
    last = history[-1]
    summary = {"epochs_run": epoch + 1, "elapsed_s": last["time/elapsed_s"], "time_to_target_s": time_to_target,
               "target_top1": args.target_top1, "target_consecutive": args.target_consecutive, "target_top5": 0.0,
               "final_top1": last["eval/top1"],
               "final_top5": last["eval/top5"], "world_size": world, "history": history}
    if log is not None:
        log.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
