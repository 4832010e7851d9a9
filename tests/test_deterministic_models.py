"""train.deterministic on CUDA: the recipes' models hold no module whose CUDA kernels torch rejects under
torch.use_deterministic_algorithms(True), and the ResNet's global pool computes what nn.AdaptiveAvgPool2d(1)
does, with the same state-dict keys (checkpoints load either way)."""

import pytest
import torch
import torchvision
from torch import nn

from recipes.resnet50 import GlobalAvgPool, ModelConfig, build_model
from recipes.transformer_model import TransformerConfig, build_transformer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

NONDETERMINISTIC_ON_CUDA = (
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.AvgPool3d, nn.MaxPool3d, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
    nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d, nn.Upsample, nn.UpsamplingBilinear2d,
    nn.EmbeddingBag, nn.CTCLoss)
"""Modules whose CUDA backward (or forward) torch's use_deterministic_algorithms documentation lists as raising
in that mode, or as nondeterministic in older releases. nn.NLLLoss is not here: only its 2-d (image) form
raises, and the tasks' cross-entropy takes (N, classes) logits."""


def offenders(model: nn.Module) -> list[str]:
    return [f"{name}: {type(m).__name__}" for name, m in model.named_modules()
            if isinstance(m, NONDETERMINISTIC_ON_CUDA)]


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_the_resnet_holds_no_module_torch_rejects_on_cuda_in_deterministic_mode(arch):
    with torch.device("meta"):  # the modules, not the weights
        model = build_model(ModelConfig(arch=arch), num_classes=10)
    assert offenders(model) == []
    assert isinstance(model.avgpool, GlobalAvgPool)


def test_the_transformer_holds_no_module_torch_rejects_on_cuda_in_deterministic_mode():
    cfg = TransformerConfig(d_model=32, heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64)
    assert offenders(build_transformer(cfg, vocab_size=50)) == []


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_global_pool_is_adaptive_avg_pool_to_one(memory_format):
    """The same output (shape and values) and the same input gradient, to float32 rounding (1e-6)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 5, 7, generator=gen).to(memory_format=memory_format)
    theirs, ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = nn.AdaptiveAvgPool2d((1, 1))(theirs), GlobalAvgPool()(ours)
    assert got.shape == want.shape == (3, 8, 1, 1)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    upstream = torch.randn(want.shape, generator=gen)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert torch.allclose(ours.grad, theirs.grad, rtol=0, atol=1e-6), (ours.grad - theirs.grad).abs().max()


def test_the_recipes_resnet_keeps_torchvisions_state_dict_and_logits():
    """A checkpoint of either loads into the other with strict=True and gives the same logits."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig(arch="resnet18"), num_classes=10).eval()
    plain = torchvision.models.resnet18(num_classes=10).eval()
    assert list(ours.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(plain.state_dict(), strict=True)
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))  # a 2x2 map at the pool
    with torch.no_grad():
        got, want = ours(images), plain(images)
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
