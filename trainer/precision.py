"""Mixed precision: the autocast dtype `train.amp` resolves to on this machine, and the loss scaler.

bf16 pays on CPUs that compute it in hardware (AVX512-BF16 or AMX) only; elsewhere oneDNN emulates it.
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


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.amp` on `device`, or None for full precision."""
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp: fp16 needs CUDA; use bf16 or off on the CPU")
    if amp == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        # emulated bf16 makes every convolution many times slower than fp32; hardware bf16 makes it faster
        warnings.warn("train.amp: bf16 on a CPU without AVX512-BF16 or AMX is emulated and far slower than "
                      "fp32 here; train.amp=off is the fast choice on this machine", stacklevel=2)
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`; a null context for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def build_grad_scaler(loss_scale: str, dtype: torch.dtype | None, device: torch.device) -> torch.amp.GradScaler:
    """The dynamic loss scaler for `train.loss_scale` (auto = on with fp16); a disabled one when off."""
    enabled = loss_scale == "dynamic" or (loss_scale == "auto" and dtype == torch.float16)
    return torch.amp.GradScaler(device.type, enabled=enabled)
