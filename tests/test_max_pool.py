"""kernels/max_pool.py: NCHW max pooling through the channels-last kernel gives the stock pool's outputs and
gradients bit for bit (ties included), really runs the channels-last kernel both ways, hands NCHW back, and
the ResNet recipe's task switches its model (and the moving average's copy) on the CPU only when asked."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.max_pool import ChannelsLastMaxPool2d, takes_channels_last, use_channels_last_max_pool
from trainer.classification import ClassificationTask, ClassificationTrainConfig
from trainer.dist import Topology
from trainer.schedules import Phase

pytestmark = pytest.mark.unit


class PoolInputs(TorchDispatchMode):
    """The memory format of every tensor argument reaching ATen's max-pool kernels, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("max_pool2d"):
            self.seen += [(name, a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous())
                          for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
        return func(*args, **(kwargs or {}))


def stock_and_switched(**pool: object) -> tuple[nn.MaxPool2d, nn.MaxPool2d]:
    switched = nn.MaxPool2d(**pool)
    assert use_channels_last_max_pool(switched) == 1 and type(switched) is ChannelsLastMaxPool2d
    return nn.MaxPool2d(**pool), switched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool", [
    dict(kernel_size=3, stride=2, padding=1),                  # ResNet's stem
    dict(kernel_size=2),                                       # stride defaults to the kernel
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),  # a partial last window
    dict(kernel_size=(3, 2), stride=(1, 2), dilation=2),       # uneven, dilated
])
def test_same_outputs_and_gradients_bit_for_bit_with_ties(dtype, pool):
    # Small integers: most windows hold their maximum more than once, so the first-maximum rule decides where
    # each gradient goes.
    torch.manual_seed(0)
    x = torch.randint(0, 3, (4, 8, 13, 11)).to(dtype)
    stock, switched = stock_and_switched(**pool)
    outs, grads = [], []
    for module in (stock, switched):
        leaf = x.clone().requires_grad_()
        inner = leaf * 1  # not a leaf: its gradient is the pool's backward output as returned, strides and all
        inner.register_hook(grads.append)
        out = module(inner)
        torch.manual_seed(1)
        out.backward(torch.randn_like(out))
        outs.append(out)
    assert torch.equal(outs[1], outs[0]) and torch.equal(grads[1], grads[0])
    assert outs[1].is_contiguous() and grads[1].is_contiguous()  # NCHW back to the layers around it
    with torch.no_grad():
        assert torch.equal(switched(x), stock(x)) and switched(x).is_contiguous()


def test_the_channels_last_kernel_runs_forward_and_backward():
    x = torch.randn(2, 16, 12, 12, requires_grad=True)
    stock, switched = stock_and_switched(kernel_size=3, stride=2, padding=1)
    for module, channels_last in ((stock, False), (switched, True)):
        with PoolInputs() as ops:
            module(x).sum().backward()
        names = {name for name, _ in ops.seen}
        assert {"max_pool2d_with_indices", "max_pool2d_with_indices_backward"} <= names
        assert all(cl is channels_last for _, cl in ops.seen), ops.seen
    with torch.no_grad(), PoolInputs() as ops:
        switched(x)
    assert ops.seen and all(cl for _, cl in ops.seen)


def test_what_keeps_the_stock_kernel(monkeypatch):
    x = torch.randn(2, 4, 8, 8)
    assert takes_channels_last(x)
    assert not takes_channels_last(x.contiguous(memory_format=torch.channels_last))  # already vectorized
    assert not takes_channels_last(torch.randn(2, 1, 8, 8))  # one channel: both layouts are the same memory
    assert not takes_channels_last(x[0])  # 3-D
    assert not takes_channels_last(x[..., ::2])  # a strided view
    _, switched = stock_and_switched(kernel_size=2, return_indices=True)
    with PoolInputs() as ops:
        out, indices = switched(x)
    assert ops.seen and not any(cl for _, cl in ops.seen) and indices.shape == out.shape
    switched.return_indices = False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as under dynamo: inductor pools on its own
    with torch.no_grad(), PoolInputs() as ops:
        switched(x)
    assert ops.seen and not any(cl for _, cl in ops.seen)


def test_double_backward_is_right():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64, requires_grad=True)
    _, switched = stock_and_switched(kernel_size=3, stride=2, padding=1)
    assert torch.autograd.gradgradcheck(switched, (x,))


def test_resnet18_training_step_is_unchanged():
    torch.manual_seed(0)
    stock = torchvision.models.resnet18(num_classes=10)
    switched = torchvision.models.resnet18(num_classes=10)
    switched.load_state_dict(stock.state_dict())
    assert use_channels_last_max_pool(switched) == 1
    assert use_channels_last_max_pool(switched) == 0  # already switched
    x = torch.randn(4, 3, 48, 48)
    for model in (stock, switched):
        model(x).logsumexp(dim=1).sum().backward()
    for (name, p), q in zip(stock.named_parameters(), switched.parameters()):
        assert torch.equal(q.grad, p.grad), name


class NoData:
    num_classes, train_size = 10, 8


@pytest.mark.parametrize("asked", [True, False])
def test_the_task_switches_the_model_and_its_average_when_asked(asked):
    model = torchvision.models.resnet18(num_classes=10)
    cfg = ClassificationTrainConfig(channels_last=False, ema_decay=0.9)
    task = ClassificationTask(model, NoData(), Topology(), [Phase(image_size=32, batch_size=8)], cfg,
                              max_pool_channels_last=asked)
    models = task.models()
    assert len(models) == 2  # the trained model and the average's copy
    expected = ChannelsLastMaxPool2d if asked else nn.MaxPool2d
    assert all(type(m.maxpool) is expected for m in models)
