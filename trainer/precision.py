"""Mixed precision: the candidates `train.amp` allows on this machine, the autocast dtype of each, and the
loss scaler.

Which precision is fastest depends on the machine (bf16 autocast is faster than fp32 on some CPUs and several
times slower on others, with or without AVX512-BF16): `auto` leaves it to the start-up measurement
(trainer/choices.py); a pinned precision the device cannot run is a config error.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from trainer.config import ConfigError


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX); elsewhere oneDNN emulates it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence the getattr
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


AMP_DTYPES: dict[str, torch.dtype | None] = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each train.amp value (None = full precision)."""


def amp_candidates(amp: str, device: torch.device) -> list[str]:
    """The precisions `train.amp` leaves to measure on `device`: auto = fp32 and bf16 on the CPU, bf16 (where
    the GPU computes it natively) and fp16 on CUDA; a pinned value alone, after checking that the device runs
    it."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if amp == "auto":
        return ["off", "bf16"] if device.type != "cuda" else (["bf16", "fp16"] if cuda_bf16 else ["fp16"])
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp: fp16 needs CUDA; use bf16, off or auto on the CPU")
    if amp == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise ConfigError("train.amp: bf16 is not supported by this GPU (torch.cuda.is_bf16_supported() is False); "
                          "use fp16 (with loss scaling) or auto")
    if amp == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        warnings.warn("train.amp: bf16 on a CPU without AVX512-BF16 or AMX is emulated, usually far slower than "
                      "fp32; train.amp=auto measures which is faster here", stacklevel=2)
    return [amp]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`; a null context for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_grad_scaler(loss_scale: str, dtype: torch.dtype | None, device: torch.device) -> torch.amp.GradScaler:
    """The dynamic loss scaler for `train.loss_scale` (auto = on with fp16); a disabled one when off."""
    enabled = loss_scale == "dynamic" or (loss_scale == "auto" and dtype == torch.float16)
    return torch.amp.GradScaler(device.type, enabled=enabled)
