"""A run's trained weights for serving and for other tools: a torchvision state dict or an ONNX file.

    python -m trainer.export RUN --format torchvision [--out FILE] [--step N] [--average-last N] [--arch ARCH]
                                 [--raw-weights]
    python -m trainer.export RUN --format onnx [--out FILE] [--step N] [--image-size PX] [--raw-weights]

RUN is a run folder (log.dir: config.yaml and checkpoints/). The weights come from its newest complete
checkpoint (or the one of step N; with --average-last N, the mean of N checkpoints ending there, as fairseq's
scripts/average_checkpoints.py). A run with train.ema_decay set exports the moving average of its weights, the
ones its evaluation scored (trainer/ema.py; from the checkpoint's shared state), unless --raw-weights asks for
the trained weights. The torchvision file loads into `torchvision.models.<arch>(num_classes=...)`
with strict=True; the ONNX file takes a float32 NCHW batch `images` of any size, normalized with the run's
data.mean/data.std (also in the file's metadata), and gives `logits`. When onnxruntime is installed the
export is checked against the torch model on a random batch.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from trainer.checkpoint import (MODEL, SHARED, CorruptCheckpointError, load_file, read_manifest,
                                step_dirs, verify_files)
from trainer.ema import averaged_weights
from trainer.torchvision_weights import WeightsMismatchError, num_classes_of, to_torchvision, torchvision_model

FORMATS = ("torchvision", "onnx")
ONNX_ATOL, ONNX_RTOL = 1e-4, 1e-3
"""How far onnxruntime's float32 logits may be from torch's (another summation order, fused operators)."""


class ExportError(ValueError):
    """A run that cannot be exported as asked (no checkpoint, not a ResNet run, a missing package)."""


# ---------------------------------------------------------------- reading a run


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """RUN/config.yaml (the resolved config every run writes) as a plain dict."""
    path = Path(run_dir) / "config.yaml"
    if not Path(run_dir).is_dir():
        raise ExportError(f"{run_dir}: no such folder (RUN is a run's log.dir)")
    if not path.is_file():
        raise ExportError(f"{run_dir}: not a run folder (no config.yaml; a run writes it into its log.dir)")
    return yaml.safe_load(path.read_text()) or {}


def _listed_checkpoints(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoint folders with a valid manifest, newest first (nothing hashed yet); others are skipped with a
    warning, as is a folder a live run prunes while this reads."""
    found = []
    for ckpt_dir in step_dirs(folder):
        try:
            found.append((ckpt_dir, read_manifest(ckpt_dir)))
        except CorruptCheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=3)
    return found


def _model_verified(ckpt_dir: Path, manifest: dict[str, Any], ema: bool = False) -> str | None:
    """None when the folder's model file (with `ema`, its shared state, which holds the average) matches its
    manifest (the rank files, which export never reads, are not hashed); otherwise why not."""
    try:
        verify_files(ckpt_dir, manifest, [SHARED if ema else MODEL])
    except (CorruptCheckpointError, OSError) as e:
        return str(e)
    return None


def select_checkpoints(run_dir: str | Path, step: int | None = None, last: int = 1, ema: bool = False) -> list[Path]:
    """`last` checkpoints of the run whose model file (with `ema`, shared state) is complete, newest first, the
    first being the one of `step` (default: the newest such checkpoint)."""
    if last < 1:
        raise ExportError(f"--average-last must be >= 1, got {last}")
    folder = Path(run_dir) / "checkpoints"
    listed = _listed_checkpoints(folder)
    if not listed:
        raise ExportError(f"{run_dir}: no complete checkpoint in {folder} (a run writes one every "
                          "train.checkpoint_every_epochs and at its end)")
    steps = [int(manifest["step"]) for _, manifest in listed]
    start = 0
    if step is not None:
        if step not in steps:
            raise ExportError(f"{run_dir}: no checkpoint of step {step} (complete ones: steps "
                              f"{', '.join(map(str, sorted(steps)))})")
        start = steps.index(step)
        problem = _model_verified(*listed[start], ema)
        if problem is not None:
            raise ExportError(f"the checkpoint of step {step} cannot be used: {problem}")
    chosen = []
    for ckpt_dir, manifest in listed[start:]:
        if len(chosen) == last:
            break
        problem = _model_verified(ckpt_dir, manifest, ema)
        if problem is None:
            chosen.append(ckpt_dir)
        else:
            warnings.warn(f"skipping checkpoint: {problem}", stacklevel=2)
    if not chosen:
        raise ExportError(f"{run_dir}: no checkpoint in {folder} has a complete {MODEL}")
    if len(chosen) < last:
        raise ExportError(f"{run_dir}: {last} checkpoints asked for, {len(chosen)} there up to step {steps[start]} "
                          "(a run keeps train.keep_checkpoints of them)")
    return chosen


def _load_model(ckpt_dir: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The model state of a verified folder (with `ema`, the moving average of the weights in its shared
    state); ExportError when a live run removed it (pruning) meanwhile, or it holds no average."""
    name = SHARED if ema else MODEL
    try:
        state = load_file(ckpt_dir, name, verify=False)
    except (OSError, RuntimeError, EOFError, CorruptCheckpointError) as e:
        raise ExportError(f"{ckpt_dir / name}: gone or changed while being read ({e}); a live run prunes old "
                          "checkpoints (train.keep_checkpoints): run the export again") from None
    if not ema:
        return state
    averaged = averaged_weights(state.get("task", {}).get("ema", {}))
    if averaged is None:
        raise ExportError(f"{ckpt_dir}: holds no moving average of the weights (written before train.ema_decay "
                          "was set); --raw-weights exports the trained weights")
    return averaged


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of state dicts with the same keys and shapes (summed in float64, so N copies of
    one state average to it exactly); integer entries (BatchNorm's batch counters) are the first state's."""
    if not states:
        raise ExportError("no state dicts to average")
    first = states[0]
    for other in states[1:]:
        if other.keys() != first.keys() or any(other[k].shape != first[k].shape for k in first):
            raise ExportError("the checkpoints to average hold different models (keys or shapes differ)")
    out = {}
    for key, tensor in first.items():
        if not tensor.is_floating_point():
            out[key] = tensor.clone()
            continue
        total = torch.zeros(tensor.shape, dtype=torch.float64)
        for state in states:
            total += state[key].to("cpu", torch.float64)
        out[key] = (total / len(states)).to(tensor.dtype)
    return out


def load_weights(run_dir: str | Path, step: int | None = None, average_last: int = 1, ema: bool = False
                 ) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """The run's model weights (one checkpoint's, or the mean of `average_last`; with `ema`, of the weights'
    moving average) and the checkpoints read."""
    chosen = select_checkpoints(run_dir, step, average_last, ema)
    states = [_load_model(d, ema) for d in chosen]
    return (states[0] if len(states) == 1 else average_states(states)), chosen


@dataclass
class RunWeights:
    """A ResNet run's weights as a torchvision state dict, with where they came from."""

    state: dict[str, torch.Tensor]
    arch: str
    checkpoints: list[Path]
    config: dict[str, Any]
    ema: bool = False
    """Whether these are the moving average of the weights (train.ema_decay), not the trained ones."""

    def model(self) -> torch.nn.Module:
        """`torchvision.models.<arch>` with these weights, in eval mode."""
        model = torchvision_model(self.arch, num_classes_of(self.state))
        model.load_state_dict(self.state, strict=True)
        return model.eval()


def uses_ema(config: dict[str, Any]) -> bool:
    """Whether a run's resolved config evaluated a moving average of its weights (train.ema_decay > 0)."""
    return float((config.get("train") or {}).get("ema_decay") or 0) > 0


def resnet_weights(run_dir: str | Path, step: int | None = None, average_last: int = 1,
                   arch: str | None = None, raw: bool = False) -> RunWeights:
    """The run's weights for torchvision's `arch` (default: the run's model.arch), checked key by key: the
    moving average of the weights when the run kept one (train.ema_decay), unless `raw`."""
    config = read_run_config(run_dir)
    trained = (config.get("model") or {}).get("arch")
    if trained is None:
        raise ExportError(f"{run_dir}: its model has no model.arch (not a run of the ResNet recipe); --format "
                          f"{' and '.join(FORMATS)} export torchvision ResNets")
    ema = uses_ema(config) and not raw
    state, chosen = load_weights(run_dir, step, average_last, ema)
    try:
        return RunWeights(to_torchvision(state, arch or trained), arch or trained, chosen, config, ema)
    except WeightsMismatchError as e:
        raise ExportError(f"{run_dir} trained model.arch={trained}: {e}") from None


def default_path(run_dir: str | Path, weights: RunWeights, suffix: str) -> Path:
    return Path(run_dir) / "export" / f"{weights.arch}-{weights.checkpoints[0].name}.{suffix}"


# ---------------------------------------------------------------- exports


def export_torchvision(weights: RunWeights, path: str | Path) -> Path:
    """Write the weights as a plain state dict (torch.save) for `torchvision.models.<arch>`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights.state, path)
    return path


def export_onnx(weights: RunWeights, path: str | Path, image_size: int) -> Path:
    """Write the model as ONNX (torch.onnx's exporter), dynamic in batch, height and width, with the input
    normalization in its metadata."""
    try:
        import onnx  # noqa: F401 - torch.onnx.export needs onnx and onnxscript
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ExportError(f"--format onnx needs the onnx and onnxscript packages ({e.name} is missing: pip install "
                          "-r requirements.txt)") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dim = torch.export.Dim
    torch.onnx.export(weights.model(), (torch.randn(2, 3, image_size, image_size),), str(path), dynamo=True,
                      external_data=False, input_names=["images"], output_names=["logits"], verbose=False,
                      dynamic_shapes=({0: dim("batch"), 2: dim("height", min=16), 3: dim("width", min=16)},))
    data = weights.config.get("data") or {}
    write_metadata(path, {"arch": weights.arch, "checkpoints": ",".join(d.name for d in weights.checkpoints),
                          "weights": "moving average (train.ema_decay)" if weights.ema else "trained",
                          "mean": str(data.get("mean", "")), "std": str(data.get("std", "")),
                          "input": "float32 NCHW RGB in [0, 1], then (x - mean) / std per channel"})
    return path


def last_image_size(config: dict[str, Any]) -> int:
    """The resolution of the run's last training phase (the example input; the file takes any size)."""
    phases = (config.get("schedule") or {}).get("phases") or []
    return int(phases[-1]["image_size"]) if phases else 224


def write_metadata(path: Path, props: dict[str, str]) -> None:
    import onnx
    proto = onnx.load(str(path))
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def onnx_max_error(path: str | Path, weights: RunWeights, image_size: int, batch: int = 2) -> float | None:
    """Largest |onnxruntime logits - torch logits| on a random batch; raises ExportError beyond
    ONNX_ATOL + ONNX_RTOL x |logits|; None when onnxruntime is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    images = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = weights.model()(images)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])
    error = float((got - want).abs().max())
    if not torch.allclose(got, want, atol=ONNX_ATOL, rtol=ONNX_RTOL):
        raise ExportError(f"{path}: onnxruntime's logits differ from torch's by up to {error:.3g}")
    return error


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", help="run folder (the run's log.dir)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="torchvision state dict or ONNX")
    parser.add_argument("--out", help="output file (default RUN/export/ARCH-step-NNNNNNNN.pth or .onnx)")
    parser.add_argument("--step", type=int, help="the checkpoint of this global step (default: the newest)")
    parser.add_argument("--average-last", type=int, default=1, metavar="N",
                        help="average the weights of N checkpoints ending at --step (default 1: no averaging)")
    parser.add_argument("--arch", help="torchvision architecture (default: the run's model.arch)")
    parser.add_argument("--image-size", type=int, help="ONNX example input size (default: the last phase's)")
    parser.add_argument("--raw-weights", action="store_true",
                        help="the trained weights, not their moving average (runs with train.ema_decay)")
    args = parser.parse_args(argv)
    try:
        weights = resnet_weights(args.run, args.step, args.average_last, args.arch, args.raw_weights)
        if args.format == "torchvision":
            path = export_torchvision(weights, args.out or default_path(args.run, weights, "pth"))
            which = " (the moving average of the weights)" if weights.ema else ""
            print(f"wrote {path}{which}: torchvision.models.get_model({weights.arch!r}, num_classes="
                  f"{num_classes_of(weights.state)}).load_state_dict(torch.load({str(path)!r}, weights_only=True))")
            return path
        size = args.image_size or last_image_size(weights.config)
        path = export_onnx(weights, args.out or default_path(args.run, weights, "onnx"), size)
        error = onnx_max_error(path, weights, size)
        print(f"wrote {path} (" + ("onnxruntime not installed: not checked" if error is None else
                                   f"onnxruntime's logits match torch's: max |diff| {error:.2g}") + ")")
        return path
    except ExportError as e:
        if argv is not None:
            raise
        print(f"export error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
