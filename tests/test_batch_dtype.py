"""DALI's element type follows the precision the model trains at (data.dtype auto), and float16 batches for an
fp32 model are a config error before any work; no GPU needed (the decision is a pure function, and the loader
is built for a CUDA device it never touches)."""

import pytest
import torch

from data import DataConfigError, batch_dtype, build_image_data
from recipes.resnet50 import Config
from tests.data_helpers import dali_config, write_folder
from trainer.config import ConfigError, load_config

pytestmark = pytest.mark.unit

PHASE = "schedule.phases=[{start_epoch: 0, end_epoch: 2, image_size: 32, batch_size: 8}]"


@pytest.mark.parametrize("gpu, amp, expected", [
    (True, "off", "float32"),  # an fp32 model: float16 batches would fail its first convolution
    (True, "bf16", "float32"),  # DALI emits no bfloat16
    (True, "fp16", "float16"),
    (True, "auto", "float16"),  # CUDA's candidates (bf16, fp16) both autocast, which casts the batch
    (False, "off", "float32"),
    (False, "bf16", "float32"),
    (False, "auto", "float32"),
])
def test_auto_follows_the_precision_the_model_trains_at(gpu, amp, expected):
    assert batch_dtype("auto", amp, gpu) == expected
    assert batch_dtype("float32", amp, gpu) == "float32"


def test_float16_batches_for_an_fp32_model_are_a_config_error():
    for gpu in (True, False):  # an fp32 model rejects float16 inputs on any device
        with pytest.raises(DataConfigError, match=r"data\.dtype: float16 batches need train\.amp fp16, bf16 or auto"):
            batch_dtype("float16", "off", gpu)
    assert batch_dtype("float16", "fp16", gpu=True) == batch_dtype("float16", "bf16", gpu=True) == "float16"
    # at config load, before any process group, dataset or model
    with pytest.raises(ConfigError, match=r"data\.dtype: float16 batches need train\.amp"):
        load_config(Config, None, ["data.dtype=float16", "train.amp=off", "train.epochs=2", PHASE])
    cfg = load_config(Config, None, ["data.dtype=float16", "train.amp=fp16", "train.epochs=2", PHASE])
    assert cfg.data.dtype == "float16"


@pytest.mark.parametrize("amp, expected", [("off", torch.float32), ("fp16", torch.float16)])
def test_the_dali_loader_on_a_gpu_gives_the_models_element_type(tmp_path, monkeypatch, amp, expected):
    pytest.importorskip("nvidia.dali")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the loader's only CUDA call before a batch
    root = write_folder(tmp_path / "photos", classes=2, per_class=2, val_per_class=1)
    data = build_image_data(dali_config(root, tmp_path), 0, 1, seed=0, device=torch.device("cuda"), amp=amp)
    try:
        assert data.batch_format[1] == expected
        assert data.spec(True, "encoded", 32, 4).float16 == (expected == torch.float16)
    finally:
        data.close()
