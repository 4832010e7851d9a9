
import pytest

from recipes.resnet50 import Config
from trainer.cli import parse_config
from trainer.config import ConfigError, field_docs, load_config, reference

pytestmark = pytest.mark.unit

PHASE = "schedule.phases=[{start_epoch: 0, end_epoch: 2, image_size: 32, batch_size: 8}]"

def write(path, text):
    path.write_text(text)
    return path

def test_shipped_configs_load():
    for name in ("resnet50_dawnbench", "resnet50_1node", "quickstart_cpu"):
        cfg = load_config(Config, f"configs/{name}.yaml")
        assert cfg.schedule.phases[-1].end_epoch == cfg.train.epochs
    dawn = load_config(Config, "configs/resnet50_dawnbench.yaml")
    assert [p.image_size for p in dawn.schedule.phases] == [96, 128, 224, 288]
    assert dawn.optim.name == "lars" and dawn.train.target_top5 == 0.93 and dawn.optim.weight_decay == 1e-4

def test_flagship_is_the_dawnbench_entry_recipe():
    """The values of alibabacloud_resnet50_gn6e_16_machine_tensorflow.json (and its 1-machine sibling)."""
    dawn = load_config(Config, "configs/resnet50_dawnbench.yaml")
    o, s = dawn.optim, dawn.schedule
    assert (o.name, o.nesterov, o.trust_coefficient, o.trust_clip) == ("lars", True, 0.0008, False)
    assert (o.min_trust_ratio, o.max_trust_ratio) == (1e-5, 1.0)
    assert (o.lr, s.warmup_epochs, s.decay, s.final_lr) == (25.0, 14, "linear", 0.2)
    assert (o.momentum, s.momentum_min, dawn.model.label_smoothing) == (0.98, 0.9, 0.1)
    epochs = [(p.image_size, p.batch_size, p.min_scale or dawn.data.min_scale, p.val_image_size or p.image_size)
              for p in s.phases for _ in range(p.start_epoch, p.end_epoch)]
    assert epochs == ([(96, 32768, 0.11, 96)] * 13 + [(128, 32768, 0.11, 128)] * 11 + [(224, 32768, 0.11, 224)] * 3
                      + [(288, 16384, 0.5, 288)])
    one = load_config(Config, "configs/resnet50_1node.yaml")
    o, s = one.optim, one.schedule
    assert (o.name, o.nesterov, o.lr, o.momentum, s.momentum_min, s.warmup_epochs, s.final_lr) == (
        "sgd", True, 1.2, 0.96, 0.9, 5, 1e-4)
    assert [(p.image_size, p.batch_size, p.end_epoch - p.start_epoch) for p in s.phases] == [
        (96, 2048, 12), (128, 2048, 6), (224, 2048, 2), (288, 1024, 1)]
    assert one.data.min_scale == 0.08 and s.phases[-1].min_scale == 0.5 and one.train.epochs == 21

def test_base_inheritance_and_precedence(tmp_path):
    write(tmp_path / "a.yaml", "optim: {lr: 0.5, momentum: 0.8}\ntrain: {epochs: 2}\n"
          "schedule: {phases: [{start_epoch: 0, end_epoch: 2, image_size: 32, batch_size: 8}]}\n")
    write(tmp_path / "b.yaml", "base: a.yaml\noptim: {lr: 1e-3}\n")  # YAML reads 1e-3 as a string
    cfg = load_config(Config, tmp_path / "b.yaml", ["optim.momentum=0.7", "train.seed=3"])
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.momentum == 0.7 and cfg.train.seed == 3 and cfg.train.epochs == 2
    assert cfg.data.workers == "auto"  # dataclass default survives

def test_unknown_key_names_file_key_and_nearest(tmp_path):
    path = write(tmp_path / "x.yaml", "optim: {lrr: 0.1}\n")
    with pytest.raises(ConfigError, match=r"x\.yaml: optim\.lrr: unknown key \(did you mean optim\.lr\?\)"):
        load_config(Config, path, [PHASE])
    with pytest.raises(ConfigError, match=r"command line: trian: unknown key \(did you mean train\?\)"):
        load_config(Config, None, ["trian.epochs=3"])

def test_wrong_type_and_impossible_values():
    with pytest.raises(ConfigError, match=r"train\.epochs: expected an integer, got 'three'"):
        load_config(Config, None, ["train.epochs=three", PHASE])
    with pytest.raises(ConfigError, match=r"train\.channels_last: expected true or false, got 1"):
        load_config(Config, None, ["train.channels_last=1", PHASE])
    with pytest.raises(ConfigError, match=r"optim\.name: 'larss' is not one of sgd, lars, adam, adamw \(did you mean lars\?\)"):
        load_config(Config, None, ["optim.name=larss", PHASE])
    with pytest.raises(ConfigError, match=r"optim\.lr: must be > 0"):
        load_config(Config, None, ["optim.lr=-1", PHASE])
    with pytest.raises(ConfigError, match=r"last phase ends at epoch 2 but train\.epochs is 5"):
        load_config(Config, None, ["train.epochs=5", PHASE])
    with pytest.raises(ConfigError, match=r"schedule\.phases: the ResNet-50 recipe needs at least one phase"):
        load_config(Config, None, [])
    with pytest.raises(ConfigError, match=r"data\.min_scale: must be in \(0, 1\]"):
        load_config(Config, None, ["data.min_scale=0", PHASE])

@pytest.mark.parametrize("overrides, match", [
    (["optim.min_trust_ratio=-1"], r"optim\.min_trust_ratio: must be >= 0, got -1\.0"),
    (["optim.max_trust_ratio=0"], r"optim\.max_trust_ratio: must be > 0 \(or null for no bound\), got 0\.0"),
    (["optim.min_trust_ratio=0.5", "optim.max_trust_ratio=0.1"],
     r"optim\.min_trust_ratio: 0\.5 is above optim\.max_trust_ratio 0\.1; the range must be min <= max"),
    (["optim.trust_clip=true", "optim.max_trust_ratio=1"],
     r"optim\.trust_clip: cannot be combined with optim\.min_trust_ratio / optim\.max_trust_ratio .*"
     r"set optim\.trust_clip=false to use the range"),
])
def test_impossible_trust_ranges(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Config, None, [*overrides, PHASE])
    cfg = load_config(Config, None, ["optim.max_trust_ratio=null", "train.epochs=2", PHASE])  # default: no bound
    assert cfg.optim.max_trust_ratio is None and cfg.optim.min_trust_ratio == 0.0

def test_corrupt_yaml_and_cycles(tmp_path):
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(Config, write(tmp_path / "bad.yaml", "optim: {lr: [1,\n"))
    write(tmp_path / "p.yaml", "base: q.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(Config, write(tmp_path / "q.yaml", "base: p.yaml\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Config, tmp_path / "missing.yaml")

def test_cli_exits_with_one_message(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(Config, ["--config", "configs/quickstart_cpu.yaml", "optim.lrr=1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["config error: command line: optim.lrr: unknown key (did you mean optim.lr?)"]

def test_every_field_is_documented():
    undocumented = [key for key, _, _, doc in reference(Config) if not doc]
    assert undocumented == []
    # the docs come from the source: spot-check one
    from trainer.optim import OptimConfig
    assert "Peak learning rate" in field_docs(OptimConfig)["lr"]
    assert len(reference(Config)) > 40
