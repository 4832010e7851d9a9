"""Export and interop for real: a ResNet-18 trained by the recipe on the digits (started from a torchvision
weights file in a torch hub cache of the test's own), exported to a torchvision state dict that loads with
strict=True and gives the trained model's logits, and to ONNX that onnxruntime runs to the same logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torchvision

from recipes.resnet50 import Config, build_model
from trainer.checkpoint import MODEL, checkpoint_dirs, load_model_state, rank_file
from trainer.config import ConfigError, load_config
from trainer.export import (ExportError, _load_model, export_onnx, main, onnx_max_error, resnet_weights,
                            select_checkpoints)

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_cpu.yaml"
HUB_FILE = "resnet18-f37072fd.pth"  # the name torchvision gives ResNet18_Weights.IMAGENET1K_V1's download

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A torch hub cache holding a 'pretrained' ResNet-18 (torchvision's model, 1,000 classes, seeded weights:
    nothing can be downloaded here, and the test only needs a file of the right layout)."""
    home = tmp_path_factory.mktemp("torch_home")
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(123)
    torch.save(torchvision.models.resnet18().state_dict(), home / "hub" / "checkpoints" / HUB_FILE)
    return home


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, digits_root, pretrained) -> Path:
    """The recipe, one process, channels-last, started from the hub file (model.init=torchvision): 3 steps."""
    from recipes.resnet50 import main as train
    run = tmp_path_factory.mktemp("export") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_HOME", str(pretrained))
        train(["--config", str(CONFIG), f"data.root={digits_root}", f"log.dir={run}", "model.arch=resnet18",
               "model.init=torchvision", "train.epochs=1", "train.max_steps_per_epoch=3",
               "schedule.phases=[{start_epoch: 0, end_epoch: 1, image_size: 16, batch_size: 32}]",
               "comm.kind=dense", "data.workers=0", "train.threads=1", "train.channels_last=true", "train.amp=off", "model.small_map_gemm=true",
               "train.target_top1=0", "log.progress=false", "log.tensorboard=false"])
    return run


def trained_model(run: Path) -> torch.nn.Module:
    """The recipe's own model (small-map GEMM convolutions, channels-last) with the run's newest weights."""
    cfg = load_config(Config, CONFIG, [f"data.root={run}", "model.arch=resnet18"])
    model = build_model(cfg.model, num_classes=10).to(memory_format=torch.channels_last)
    model.load_state_dict(load_model_state(checkpoint_dirs(run)[0]))
    return model.eval()


def test_model_init_torchvision_starts_from_the_local_weights(trained_run, pretrained):
    hub = torch.load(pretrained / "hub" / "checkpoints" / HUB_FILE, weights_only=True)
    first = torch.load(trained_run / "checkpoints" / "step-00000003" / "model.pt", weights_only=True)
    # after 3 steps the backbone is still close to the file's weights; a random start would not be
    assert torch.allclose(first["conv1.weight"], hub["conv1.weight"], atol=0.05)
    assert first["fc.weight"].shape == (10, 512)  # the 1,000-class head was not loaded: a new 10-class one

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_HOME", str(pretrained / "nowhere"))
        with pytest.raises(ConfigError, match=rf"no resnet18 weights on this machine \(looked for {HUB_FILE} in "):
            load_config(Config, CONFIG, ["model.arch=resnet18", "model.init=torchvision"])
    with pytest.raises(ConfigError, match="model.init_weights: only read with model.init=torchvision"):
        load_config(Config, CONFIG, ["model.init_weights=/x.pth"])
    # a file of another architecture: the error names it and what does not fit
    cfg = load_config(Config, CONFIG, ["model.arch=resnet34", "model.init=torchvision",
                                       f"model.init_weights={pretrained / 'hub' / 'checkpoints' / HUB_FILE}"])
    with pytest.raises(ConfigError, match=rf"{HUB_FILE} does not hold resnet34 weights: missing layer1\.2\."):
        build_model(cfg.model, num_classes=10)
    # the same number of classes: every tensor comes from the file
    cfg = load_config(Config, CONFIG, ["model.arch=resnet18", "model.init=torchvision",
                                       f"model.init_weights={pretrained / 'hub' / 'checkpoints' / HUB_FILE}"])
    model = build_model(cfg.model, num_classes=1000)
    assert all(torch.equal(t, hub[k]) for k, t in model.state_dict().items())


def test_torchvision_export_loads_strictly_and_gives_the_trained_logits(trained_run, tmp_path, capsys):
    out = main([str(trained_run), "--format", "torchvision", "--out", str(tmp_path / "r18.pth")])
    assert "wrote" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)  # a plain state dict of tensors
    plain = torchvision.models.resnet18(num_classes=10)
    plain.load_state_dict(state, strict=True)
    assert all(t.is_contiguous() for t in state.values())
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained_model(trained_run)(images.to(memory_format=torch.channels_last))
        got = plain.eval()(images)
    # the recipe's 1x1-map convolutions are GEMMs: the same function, another summation order
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert got.argmax(1).tolist() == want.argmax(1).tolist()
    # the default file name says the architecture and the checkpoint
    assert main([str(trained_run), "--format", "torchvision"]) == trained_run / "export" / \
        "resnet18-step-00000003.pth"


@pytest.mark.long
def test_onnx_export_gives_the_same_logits_in_onnxruntime(trained_run, tmp_path):
    pytest.importorskip("onnxscript", reason="torch.onnx's exporter needs onnxscript (requirements.txt)")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements.txt)")
    weights = resnet_weights(trained_run)
    path = export_onnx(weights, tmp_path / "r18.onnx", image_size=16)
    assert onnx_max_error(path, weights, image_size=16) < 1e-4
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["arch"] == "resnet18" and meta["checkpoints"] == "step-00000003" and "0.485" in meta["mean"]
    model = trained_model(trained_run)
    for shape in [(3, 3, 16, 16), (1, 3, 40, 24)]:  # another batch size and another (non-square) image size
        images = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        got = torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])
        with torch.no_grad():
            want = model(images)
        assert got.shape == (shape[0], 10)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3), (got - want).abs().max()


def test_export_errors_are_one_clear_line(trained_run, tmp_path, capsys):
    with pytest.raises(ExportError, match=r"trained model.arch=resnet18: the weights do not fit torchvision's "
                                          r"resnet50: missing layer1\.0\.conv3\.weight"):
        main([str(trained_run), "--format", "torchvision", "--arch", "resnet50"])
    with pytest.raises(SystemExit) as stop:
        main([str(trained_run), "--format", "tflite"])
    assert stop.value.code == 2
    assert "argument --format: invalid choice: 'tflite' (choose from torchvision, onnx)" in \
        capsys.readouterr().err.replace("'torchvision', 'onnx'", "torchvision, onnx")
    with pytest.raises(ExportError, match="no such folder"):
        main([str(tmp_path / "nowhere"), "--format", "onnx"])
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    with pytest.raises(ExportError, match=r"no complete checkpoint in .*empty/checkpoints"):
        main([str(empty), "--format", "torchvision"])
    with pytest.raises(ExportError, match=r"no checkpoint of step 7 \(complete ones: steps 3\)"):
        main([str(trained_run), "--format", "torchvision", "--step", "7"])
    translation = tmp_path / "transformer"
    translation.mkdir()
    (translation / "config.yaml").write_text("model:\n  d_model: 64\n")
    with pytest.raises(ExportError, match="not a run of the ResNet recipe"):
        main([str(translation), "--format", "onnx"])


def test_only_the_model_file_is_verified_and_a_vanished_checkpoint_is_one_line(trained_run, tmp_path):
    """Export reads model.pt alone: a torn rank file does not hide a good model, a torn model.pt is named, and a
    folder removed between choosing and loading (a live run pruning) is an ExportError, not a traceback."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = checkpoint_dirs(run)[0]
    with open(newest / rank_file(0), "ab") as f:
        f.write(b"torn")
    path = main([str(run), "--format", "torchvision", "--out", str(tmp_path / "w.pth")])
    assert torch.load(path, weights_only=True).keys() == load_model_state(checkpoint_dirs(trained_run)[0]).keys()
    with open(newest / MODEL, "ab") as f:
        f.write(b"torn")
    step = int(newest.name.split("-")[1])
    with pytest.raises(ExportError, match=rf"checkpoint of step {step} cannot be used: .*model\.pt: truncated"):
        main([str(run), "--format", "torchvision", "--step", str(step)])
    with pytest.warns(UserWarning, match="skipping checkpoint"), \
            pytest.raises(ExportError, match=r"no checkpoint in .* has a complete model\.pt"):
        main([str(run), "--format", "torchvision"])
    shutil.rmtree(run)
    shutil.copytree(trained_run, run)
    chosen = select_checkpoints(run)
    shutil.rmtree(chosen[0])
    with pytest.raises(ExportError, match=r"model\.pt: gone or changed while being read .*run the export again"):
        _load_model(chosen[0])
