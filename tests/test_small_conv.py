"""kernels/small_conv.py: the GEMM path equals F.conv2d (outputs and every gradient), and takes only what it can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from kernels.small_conv import MAX_POSITIONS, SmallMapConv2d, small_map_conv2d, takes_gemm, use_gemm_for_small_maps

pytestmark = pytest.mark.unit


def _both(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, **kw):
    """Output and input/weight/bias gradients of F.conv2d and of small_map_conv2d, for one upstream gradient."""
    results = []
    for fn in (F.conv2d, small_map_conv2d):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
        out = fn(leaves[0], leaves[1], leaves[2] if b is not None else None, **kw)
        torch.manual_seed(1)
        out.backward(torch.randn_like(out))
        results.append((out.detach(), [t.grad for t in leaves]))
    return results


@pytest.mark.parametrize("size,k,stride,pad,cin,cout,bias", [
    (1, 3, (1, 1), (1, 1), 16, 8, False),   # ResNet's 3x3 on a 1x1 map: one valid tap
    (2, 3, (2, 2), (1, 1), 16, 8, False),   # stride 2 down to 1x1: four valid taps, im2col
    (2, 3, (1, 1), (1, 1), 8, 16, True),    # 2x2 -> 2x2
    (4, 3, (2, 2), (1, 1), 8, 16, False),   # 4x4 -> 2x2
    (2, 1, (2, 2), (0, 0), 8, 16, True),    # the downsample 1x1 convolution, one valid tap
    (3, 2, (1, 2), (0, 1), 4, 6, True),     # uneven stride, padding and kernel: 2x2 output
    (5, 5, (1, 1), (0, 0), 3, 4, True),     # a 5x5 kernel covering the whole map
])
def test_gemm_path_equals_conv2d_with_gradients(size, k, stride, pad, cin, cout, bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, cin, size, size), torch.randn(cout, cin, k, k)
    b = torch.randn(cout) if bias else None
    assert takes_gemm(x, w, stride, pad, (1, 1), 1)
    (ref, ref_grads), (got, got_grads) = _both(x, w, b, stride=stride, padding=pad)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for g_ref, g_got in zip(ref_grads, got_grads):
        torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-4)


def test_taps_that_only_see_padding_get_zero_gradient():
    x, w = torch.randn(2, 4, 1, 1), torch.randn(3, 4, 3, 3, requires_grad=True)
    small_map_conv2d(x, w, None, (1, 1), (1, 1)).sum().backward()
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1, 1] = False
    assert bool((w.grad[:, :, mask] == 0).all()) and bool((w.grad[:, :, 1, 1] != 0).any())


@pytest.mark.parametrize("shape,groups,dilation,padding,why", [
    ((2, 4, 3, 3), 1, (1, 1), (1, 1), "3x3 output: oneDNN is faster"),
    ((2, 4, 2, 2), 2, (1, 1), (1, 1), "grouped"),
    ((2, 4, 2, 2), 1, (2, 2), (2, 2), "dilated"),
    ((2, 4, 2, 2), 1, (1, 1), "same", "string padding"),
    ((2, 4, 1, 1), 1, (1, 1), (0, 0), "empty output: F.conv2d reports it"),
])
def test_other_convolutions_keep_conv2d(shape, groups, dilation, padding, why):
    x, w = torch.randn(*shape), torch.randn(4, 4 // groups, 3, 3)
    assert not takes_gemm(x, w, (1, 1), padding, dilation, groups), why


def test_max_positions_is_the_boundary():
    w = torch.randn(4, 4, 1, 1)
    assert takes_gemm(torch.randn(1, 4, 1, MAX_POSITIONS), w, (1, 1), (0, 0), (1, 1), 1)
    assert not takes_gemm(torch.randn(1, 4, 1, MAX_POSITIONS + 1), w, (1, 1), (0, 0), (1, 1), 1)


def test_channels_last_in_channels_last_out():
    x = torch.randn(2, 8, 2, 2).contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 8, 3, 3)
    out = small_map_conv2d(x, w, None, (1, 1), (1, 1))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, F.conv2d(x, w, None, 1, 1), rtol=1e-4, atol=1e-4)


def test_bf16_autocast_runs_and_stays_close():
    x, w = torch.randn(4, 16, 1, 1), torch.randn(8, 16, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = small_map_conv2d(x, w, None, (1, 1), (1, 1))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.conv2d(x, w, None, 1, 1), rtol=3e-2, atol=3e-2)


def test_resnet18_switch_keeps_parameters_and_matches_at_32_and_64_px():
    torch.manual_seed(0)
    stock = torchvision.models.resnet18(num_classes=10)
    fast = torchvision.models.resnet18(num_classes=10)
    fast.load_state_dict(stock.state_dict())
    assert use_gemm_for_small_maps(fast) == 20  # every convolution of ResNet-18
    assert all(type(m) is SmallMapConv2d for m in fast.modules() if isinstance(m, nn.Conv2d))
    assert list(fast.state_dict()) == list(stock.state_dict())
    for size in (32, 64):  # 1x1 and 2x2 maps in the last stage
        x = torch.randn(16, 3, size, size)
        outs = []
        for model in (stock, fast):
            model.zero_grad(set_to_none=True)
            outs.append(model(x))
            outs[-1].logsumexp(dim=1).sum().backward()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(stock.named_parameters(), fast.parameters()):
            # Training-mode BatchNorm over 16 values per channel amplifies rounding: compare as vectors.
            assert float((q.grad - p.grad).norm() / p.grad.norm()) < 1e-3, name
    assert use_gemm_for_small_maps(fast) == 0  # already switched


@pytest.mark.parametrize("requires_grad", [True, False])
def test_the_gemm_is_one_2d_matrix_product_with_or_without_weight_gradients(requires_grad):
    """Frozen weights (the weights' moving average, an exported model) take the same one 2-D GEMM as trained
    ones, never a batched matmul (a 3-D input leaves that choice to matmul, whose batched path runs many times
    slower on the CPU), and give the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8, 3, 3), torch.randn(6, 8, 3, 3, requires_grad=requires_grad), torch.randn(6)
    with torch.no_grad(), Ops() as ops:
        got = small_map_conv2d(x, w, b, (2, 2), (1, 1))  # 2x2 output: the unfold + GEMM path
    assert not any(name.startswith("bmm") for name in ops.names), ops.names
    assert sum(name.startswith(("addmm", "mm")) for name in ops.names) == 1, ops.names
    torch.testing.assert_close(got, F.conv2d(x, w.detach(), b, 2, 1), rtol=1e-5, atol=1e-5)
