"""2-D convolutions on tiny feature maps as one GEMM, for the CPU.

Progressive resizing starts small: at 32 px ResNet's last stage runs on 1x1 maps, at 48-64 px on 2x2. There
oneDNN's direct convolution kernels do far more work than the arithmetic needs, while from 3x3 maps on they
are as fast as a GEMM or faster (scripts/bench/small_conv.py compares both per layer and per step).

So a convolution whose output has at most `MAX_POSITIONS` positions runs as `F.unfold` (im2col) and one
`F.linear` over all of them; autograd differentiates both. When the output is one position and only one
kernel tap overlaps the (zero-padded) input, as for a padded 3x3 kernel on a 1x1 map, the other taps only
ever multiply padding zeros: the convolution is a linear layer over the input channels with that tap's
weights (the other taps' gradients are zero, as in the direct convolution). Same function and parameters,
another summation order (differences of float rounding only). CUDA tensors, grouped or dilated
convolutions, larger outputs and non-zero padding modes keep `F.conv2d`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels._swap import swap_class

MAX_POSITIONS = 4
"""Largest output (height x width) that takes the GEMM path: 2x2 maps are faster, 3x3 are not."""


def takes_gemm(x: Tensor, weight: Tensor, stride: tuple[int, int], padding: tuple[int, int] | str,
               dilation: tuple[int, int], groups: int) -> bool:
    """Whether `small_map_conv2d` computes this convolution as a GEMM (else it calls F.conv2d)."""
    if x.device.type != "cpu" or x.dim() != 4 or groups != 1 or tuple(dilation) != (1, 1):
        return False
    if isinstance(padding, str):
        return False
    oh, ow = _output_size(x, weight, stride, padding)
    return oh > 0 and ow > 0 and oh * ow <= MAX_POSITIONS  # an empty output is F.conv2d's to report


def _output_size(x: Tensor, weight: Tensor, stride: tuple[int, int], padding: tuple[int, int]) -> tuple[int, int]:
    return ((x.shape[2] + 2 * padding[0] - weight.shape[2]) // stride[0] + 1,
            (x.shape[3] + 2 * padding[1] - weight.shape[3]) // stride[1] + 1)


def small_map_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: tuple[int, int] = (1, 1),
                     padding: tuple[int, int] | str = (0, 0), dilation: tuple[int, int] = (1, 1),
                     groups: int = 1) -> Tensor:
    """`F.conv2d` (integer-pair arguments), as a GEMM when the output has at most `MAX_POSITIONS` positions."""
    if not takes_gemm(x, weight, stride, padding, dilation, groups):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    n, o, (kh, kw) = x.shape[0], weight.shape[0], weight.shape[2:]
    (sh, sw), (ph, pw) = stride, padding
    oh, ow = _output_size(x, weight, stride, padding)
    # The window of output (0, 0) covers input rows [-ph, kh - ph): rows [0, hh) are inside the input.
    hh, ww = min(x.shape[2], kh - ph), min(x.shape[3], kw - pw)
    if oh * ow == 1 and hh == 1 and ww == 1:
        out = F.linear(x[:, :, 0, 0], weight[:, :, ph, pw], bias)
        return out.view(n, o, 1, 1)
    # One 2-D GEMM over every image's positions: a 3-D input would leave the choice to matmul, which takes a
    # slow batched GEMM when the weight does not require grad (a frozen copy, such as the weights' average).
    cols = F.unfold(x, (kh, kw), padding=(ph, pw), stride=(sh, sw)).transpose(1, 2).reshape(n * oh * ow, -1)
    out = F.linear(cols, weight.reshape(o, -1), bias)  # [n x positions, o]
    return out.view(n, oh, ow, o).permute(0, 3, 1, 2).contiguous(memory_format=_memory_format(x))


def _memory_format(x: Tensor) -> torch.memory_format:
    """Keep the caller's layout: channels-last in, channels-last out."""
    if x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return torch.contiguous_format
    return torch.channels_last


class SmallMapConv2d(nn.Conv2d):
    """`nn.Conv2d` whose forward takes the GEMM path on tiny CPU maps; same parameters and state dict."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":
            return super()._conv_forward(input, weight, bias)
        return small_map_conv2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)


def use_gemm_for_small_maps(model: nn.Module) -> int:
    """Switch every plain `nn.Conv2d` in `model` to `SmallMapConv2d` in place; returns how many.

    Only the class changes (parameters, buffers, hooks and state-dict keys stay), so checkpoints load either
    way and the switch can be made before or after `.to(device)`.
    """
    return swap_class(model, nn.Conv2d, SmallMapConv2d)


def use_direct_convs(model: nn.Module) -> int:
    """Undo `use_gemm_for_small_maps`: every `SmallMapConv2d` in `model` back to `nn.Conv2d`; returns how many."""
    return swap_class(model, SmallMapConv2d, nn.Conv2d)
