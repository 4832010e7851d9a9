"""Max pooling of NCHW tensors on the CPU through ATen's channels-last kernel.

ATen's CPU max pooling of a contiguous NCHW tensor walks each channel's plane with a scalar loop over the
window; its channels-last kernel vectorizes across channels, and is many times faster on the maps ResNet's
stem pools (scripts/bench/max_pool.py). So on the CPU a contiguous 4-D NCHW input is pooled as a channels-last
copy and the output handed back as NCHW; the backward does the same for the gradient, so the layers around the
pool see NCHW tensors both ways (a channels-last gradient reaching an NCHW ReLU's backward takes a slow path).
Both kernels scan each window in the same order and keep the first maximum, so outputs and gradients are
bit-identical. CUDA tensors, channels-last inputs, `return_indices` and code torch.compile traces (inductor
writes its own pooling kernel) keep `F.max_pool2d`. The backward is made of differentiable ATen ops, so double
backward works as the stock pool's; torch.func's transforms do not apply (a `forward(ctx, ...)` Function).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from kernels._swap import swap_class

_CL = torch.channels_last


class _ChannelsLastMaxPool(torch.autograd.Function):
    """max_pool2d_with_indices on a channels-last copy; output and input gradient contiguous NCHW. Saves the
    NCHW input (which the ReLU before a pool holds anyway), not the copy: the backward makes its own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
                ceil_mode: bool) -> Tensor:
        out, indices = torch.ops.aten.max_pool2d_with_indices(x.contiguous(memory_format=_CL), kernel, stride, padding,
                                                              dilation, ceil_mode)
        ctx.save_for_backward(x, indices)
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, indices = ctx.saved_tensors
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(memory_format=_CL),
                                                                  x.contiguous(memory_format=_CL), *ctx.args, indices)
        return grad_in.contiguous(), None, None, None, None, None


def takes_channels_last(x: Tensor) -> bool:
    """Whether `ChannelsLastMaxPool2d` pools `x` through the channels-last kernel: a contiguous NCHW CPU tensor
    with more than one channel (for one channel both layouts are the same memory)."""
    return x.device.type == "cpu" and x.dim() == 4 and x.shape[1] > 1 and x.is_contiguous()


class ChannelsLastMaxPool2d(nn.MaxPool2d):
    """`nn.MaxPool2d` that pools contiguous NCHW CPU tensors with ATen's channels-last kernel; same results."""

    def forward(self, input: Tensor) -> Tensor:
        if self.return_indices or not takes_channels_last(input) or torch.compiler.is_compiling():
            return super().forward(input)
        args = ([*_pair(self.kernel_size)], [*_pair(self.stride)], [*_pair(self.padding)], [*_pair(self.dilation)],
                self.ceil_mode)
        if torch.is_grad_enabled() and input.requires_grad:
            return _ChannelsLastMaxPool.apply(input, *args)
        return F.max_pool2d(input.contiguous(memory_format=_CL), *args).contiguous()


def use_channels_last_max_pool(model: nn.Module) -> int:
    """Switch every plain `nn.MaxPool2d` in `model` to `ChannelsLastMaxPool2d` in place; returns how many. Only
    the class changes (a max pool has no parameters or buffers)."""
    return swap_class(model, nn.MaxPool2d, ChannelsLastMaxPool2d)
