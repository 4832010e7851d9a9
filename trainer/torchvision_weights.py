"""Weights between our ResNets and torchvision's: check a state dict against `torchvision.models.<arch>`, and
start a model from torchvision's pretrained weights found on this machine (nothing is downloaded).

The ResNet recipe's model *is* torchvision's model: `kernels.use_gemm_for_small_maps` and
`kernels.use_channels_last_max_pool` change only the class of its convolutions and of its max pool, and
channels-last only the memory layout, so the state-dict keys are torchvision's own and no renaming is needed.
A checkpoint's tensors may be channels-last or on a GPU: they are made contiguous CPU tensors here, so the
exported file is a plain torchvision state dict.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torchvision
from torch import nn

from trainer.config import ConfigError, require

CLASSIFIER = ("fc.weight", "fc.bias")
"""The ResNet's last layer, whose shape depends on the number of classes."""


class WeightsMismatchError(ValueError):
    """A state dict that does not fit the architecture it is loaded into."""


def torchvision_model(arch: str, num_classes: int) -> nn.Module:
    """A plain `torchvision.models.<arch>` (no weights) with `num_classes` outputs."""
    try:
        return torchvision.models.get_model(arch, num_classes=num_classes)
    except ValueError:
        raise WeightsMismatchError(f"unknown torchvision architecture {arch!r} (e.g. resnet18, resnet50)") from None


def num_classes_of(state: dict[str, torch.Tensor]) -> int:
    """The number of outputs of a ResNet state dict (rows of its last layer)."""
    if CLASSIFIER[0] not in state:
        raise WeightsMismatchError(f"not a ResNet state dict: no {CLASSIFIER[0]} among its {len(state)} entries")
    return int(state[CLASSIFIER[0]].shape[0])


def mismatch(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
             ignore: tuple[str, ...] = ()) -> str:
    """'' when `state` has exactly `reference`'s keys and shapes (except `ignore`), else what differs."""
    missing = [k for k in reference if k not in state and k not in ignore]
    unexpected = [k for k in state if k not in reference and k not in ignore]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(reference[k].shape)}" for k in reference
              if k in state and k not in ignore and state[k].shape != reference[k].shape]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = [f"{what} {some(names)}" for what, names in (("missing", missing), ("unexpected", unexpected),
                                                         ("shapes differ:", shapes)) if names]
    return "; ".join(parts)


def to_torchvision(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Our ResNet's state dict as a plain state dict that `torchvision.models.<arch>()` (with as many classes)
    loads with strict=True: contiguous CPU tensors, checked key by key and shape by shape."""
    reference = torchvision_model(arch, num_classes_of(state)).state_dict()
    problem = mismatch(state, reference)
    if problem:
        raise WeightsMismatchError(f"the weights do not fit torchvision's {arch}: {problem}")
    return {k: state[k].detach().to("cpu").contiguous() for k in reference}


def local_weights(arch: str, path: str = "") -> Path:
    """The file of torchvision's pretrained `arch` weights on this machine: `path` if given, else the first of
    the architecture's published weights (its default first) in torch hub's cache (`$TORCH_HOME/hub/checkpoints`,
    where `torchvision.models.<arch>(weights=...)` keeps its downloads)."""
    if path:
        found = Path(path).expanduser()
        if not found.is_file():
            raise FileNotFoundError(f"model.init_weights: {found} not found")
        return found
    try:
        published = torchvision.models.get_model_weights(arch)
    except ValueError:
        raise WeightsMismatchError(f"torchvision publishes no weights for {arch!r}") from None
    ordered = [published.DEFAULT] + [w for w in published if w is not published.DEFAULT]
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    names = [os.path.basename(w.url) for w in ordered]
    for name in names:
        if (cache / name).is_file():
            return cache / name
    raise FileNotFoundError(
        f"model.init=torchvision: no {arch} weights on this machine (looked for {' or '.join(names)} in {cache}); "
        "nothing is downloaded during a run: copy the file there (or set TORCH_HOME), or name it with "
        "model.init_weights=PATH")


def load_pretrained(model: nn.Module, arch: str, path: str = "") -> str:
    """Load torchvision's pretrained `arch` weights (`local_weights`) into `model`, a torchvision `arch`. The
    classifier is kept as initialised when the number of classes differs (fine-tuning on another dataset).
    Returns a line that says what was loaded."""
    file = local_weights(arch, path)
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsMismatchError(f"{file}: not a state dict of tensors (as torchvision's weight files are)")
    own = model.state_dict()
    same_classes = all(k in state and state[k].shape == own[k].shape for k in CLASSIFIER)
    problem = mismatch(state, own, ignore=() if same_classes else CLASSIFIER)
    if problem:
        raise WeightsMismatchError(f"{file} does not hold {arch} weights: {problem}")
    if same_classes:
        model.load_state_dict(state, strict=True)
        return f"model.init=torchvision: started from {file}"
    theirs = num_classes_of(state)
    model.load_state_dict({k: v for k, v in state.items() if k not in CLASSIFIER}, strict=False)
    return (f"model.init=torchvision: started from {file}; the classifier stays newly initialised "
            f"({num_classes_of(own)} classes, the weights have {theirs})")


def check_init(init: str, arch: str, path: str) -> None:
    """model.init and model.init_weights, before any work: a weights file is named only with init=torchvision,
    and with it torchvision's `arch` weights must be on this machine (`local_weights`); a ConfigError if not."""
    require(init == "torchvision" or not path, "model.init_weights: only read with model.init=torchvision")
    if init == "torchvision":
        try:
            local_weights(arch, path)
        except (FileNotFoundError, WeightsMismatchError) as e:
            raise ConfigError(str(e)) from None


def maybe_init_from_torchvision(model: nn.Module, init: str, arch: str, path: str, verbose: bool = False) -> nn.Module:
    """`model` (a torchvision `arch`) started from torchvision's pretrained weights when `init` is torchvision
    (`load_pretrained`; weights that do not fit are a ConfigError), else as it is; `verbose` prints what was
    loaded."""
    if init != "torchvision":
        return model
    try:
        loaded = load_pretrained(model, arch, path)
    except WeightsMismatchError as e:
        raise ConfigError(str(e)) from None
    if verbose:
        print(loaded)
    return model
