"""Whether this machine can run what a config asks of the GPU, decided before any work starts.

A config that asks for CUDA (NCCL, fp16 autocast, DALI's GPU decoding) on a machine where CUDA is not usable
stops with one line that says why, instead of quietly training 128 ranks on gloo and the CPU.

The pinned stack (torch 2.14.1 built for CUDA 13, nvidia-dali-cuda130) runs on compute capability 7.5 and
newer (Turing T4, Ampere A100/A10, Ada L4/L40S, Hopper H100/H200, Blackwell) with an NVIDIA driver of the
R580 series or newer. Volta (V100, sm_70) needs torch's CUDA 12.6 build instead: see README "GPUs".
"""

from __future__ import annotations

import torch

from trainer.config import ConfigError

VOLTA_HINT = ("V100 and other sm_70 GPUs need a CUDA 12.6 build of torch and torchvision (PyTorch's cu126 wheel "
              "index) and nvidia-dali-cuda120: see README \"GPUs and drivers\"")


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a GPU of `capability` can run this torch build: code for its major architecture and an equal
    or older minor one (sm_86 code runs on an sm_89 GPU), or PTX of an equal or older architecture
    (compute_XY) that the driver compiles for it."""
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = "".join(ch for ch in number if ch.isdigit())
        if len(digits) < 2:
            continue
        arch_major, arch_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def cuda_problem() -> str | None:
    """Why CUDA cannot be used on this machine, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return (f"torch.cuda.is_available() is False: no usable NVIDIA driver or GPU is visible to torch "
                f"{torch.__version__} (built for CUDA {torch.version.cuda}, which needs driver R580 or newer; "
                "check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    archs = torch.cuda.get_arch_list()
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if not arch_supported(capability, archs):
            name = torch.cuda.get_device_name(index)
            hint = f"; {VOLTA_HINT}" if capability == (7, 0) else ""
            return (f"GPU {index} ({name}) has compute capability {capability[0]}.{capability[1]}, which torch "
                    f"{torch.__version__} was not built for (its architectures: {' '.join(archs)}){hint}")
    return None


def require_cuda_for(requests: list[str]) -> None:
    """Raise ConfigError naming `requests` (e.g. ["dist.backend: nccl"]) when CUDA is not usable here."""
    if not requests:
        return
    problem = cuda_problem()
    if problem is not None:
        raise ConfigError(f"{', '.join(requests)} need a usable CUDA GPU, and {problem}. Use the CPU settings "
                          "(dist.backend=gloo, train.amp=off) to run on this machine")


def gpu_requests(backend: str, amp: str) -> list[str]:
    """The settings among these that only a GPU can serve (DALI decodes on the GPU exactly when the run
    trains on one, i.e. with NCCL)."""
    asked = []
    if backend == "nccl":
        asked.append("dist.backend: nccl")
    if amp == "fp16":
        asked.append("train.amp: fp16")
    return asked
