"""scripts/gpu_check.sh on the CPU: the dry run as is, with optional packages hidden, and the harness's own failures.

A package is hidden by a sitecustomize.py on PYTHONPATH whose meta-path finder raises ModuleNotFoundError for
it, in the parent and in every check's subprocess, as on a machine where it is not installed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import scripts.gpu_check as harness
from scripts.gpu_check import CHECKS, Row, missing_module, missing_packages, resnet50_shapes

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent

HIDE = """import importlib.abc
import importlib.machinery
import sys

HIDDEN = {hidden!r}
AT_IMPORT = {at_import!r}


class Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (hidden by the test)", name=spec.name)

    def exec_module(self, module):
        pass


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            if AT_IMPORT:  # found (without a file), but importing it fails
                return importlib.machinery.ModuleSpec(name, Refuse())
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, Hide())
"""


def gpu_check(tmp_path: Path, *args: str, hidden: tuple[str, ...] = (), env: dict | None = None,
              timeout: float = 600, at_import: bool = False) -> tuple[int, list[dict], str]:
    """Runs scripts/gpu_check.sh with this interpreter; (exit status, rows of the last line's JSON, stderr).
    `at_import`: the hidden packages fail when imported, not when looked up (torch's compiler looks some up,
    tqdm among them, with importlib.util.find_spec, which a missing package answers with None)."""
    paths = [str(ROOT)]
    if hidden:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(HIDE.format(hidden=list(hidden), at_import=at_import))
        paths.insert(0, str(site))
    run_env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=os.pathsep.join(paths), **(env or {}))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=timeout)
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["bench"] == "gpu_check"
    assert {k: last[k] for k in ("pass", "fail", "skip")} == {
        k.lower(): sum(r["result"] == k for r in last["rows"]) for k in ("PASS", "FAIL", "SKIP")}
    return done.returncode, last["rows"], done.stderr


def results(rows: list[dict]) -> dict[str, str]:
    return {r["check"]: r["result"] for r in rows}


def importable(name: str) -> bool:
    return missing_module(name) is None


@pytest.mark.long
def test_the_cpu_dry_run_passes_every_check_it_can_run(tmp_path):
    code, rows, err = gpu_check(tmp_path, "--device", "cpu")
    got = results(rows)
    assert code == 0 and "FAIL" not in got.values(), err[-3000:]
    assert got["preflight versions"] == "PASS" and got["compute capability"] == "SKIP"
    assert {got["comm dense"], got["comm topk"], got["comm hitopk"], got["FusedLARS"]} == {"PASS"}
    assert got["mstopk worker thread"] == "PASS" and got["mstopk host syncs"] == "SKIP"  # CUDA syncs only
    if importable("torchvision"):
        assert got["train resnet18 4 @ 32 px"] == got["train transformer-tiny 128 tokens"] == "PASS"
        # the device-flag step ran (fp32 on the CPU, syncs counted on CUDA only)
        assert got["train resnet18 4 @ 40 px sync-free"] == "PASS"
        assert got["train resnet18 4 @ 40 px throughput floor"] == "SKIP"
        # fit, evaluation, background checkpoints and a resume that trained epoch 1 only and ended where the
        # uninterrupted run did
        assert got["recipe bf16 fit + resume"] == got["recipe deterministic fit + resume"] == "PASS"
    dali = {r["result"] for r in rows if r["group"] == "dali"}
    assert dali == ({"PASS"} if importable("nvidia.dali") and importable("torchvision") else {"SKIP"})
    assert "selftest" not in got  # hidden unless named


def test_without_dali_the_decode_check_is_a_skip(tmp_path):
    # the whole `nvidia` namespace: a dotted name whose parent is missing must not raise
    code, rows, _ = gpu_check(tmp_path, "--device", "cpu", "--only", "dali", hidden=("nvidia",))
    (row,) = rows
    assert code == 0 and row["result"] == "SKIP" and "nvidia.dali is not installed" in row["detail"]


def test_without_torchvision_its_checks_are_skips(tmp_path):
    needing = [c.name for c in CHECKS.values() if "torchvision" in c.requires + c.requires_on.get("cpu", ())]
    assert {"train-resnet50", "train-transformer", "dali", "recipe"} <= set(needing)
    code, rows, _ = gpu_check(tmp_path, "--device", "cpu", "--only", *needing, hidden=("torchvision",))
    assert code == 0 and [r["result"] for r in rows] == ["SKIP"] * len(needing)
    assert all("torchvision" in r["detail"] or "nvidia.dali" in r["detail"] for r in rows)


@pytest.mark.parametrize("mode, args, expected", [
    ("", (), "PASS: a check ran in its own subprocess"),
    ("raise", (), "FAIL: RuntimeError: raised on purpose"),
    ("hang", ("--timeout-s", "3"), "FAIL: timed out after 3 s"),
    ("exit", (), "FAIL: the check's process exited with status 3 without a result"),
    ("", ("--budget-s", "1"), "FAIL: not run: the 1 s budget"),
])
def test_the_harness_turns_errors_timeouts_and_crashes_into_fail_rows(tmp_path, mode, args, expected):
    code, rows, _ = gpu_check(tmp_path, "--device", "cpu", "--only", "selftest", *args,
                              env={"GPU_CHECK_SELFTEST": mode}, timeout=120)
    (row,) = rows
    assert f"{row['result']}: {row['detail']}".startswith(expected)
    assert code == (0 if expected.startswith("PASS") else 1)


def test_a_broken_install_is_not_a_missing_one(tmp_path, monkeypatch):
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "not installed" in missing_module("no_such_package.sub")
    assert missing_module("json") is None
    with pytest.raises(ModuleNotFoundError, match="a_dependency_nobody_installed"):
        missing_module("brokenpkg")


def test_resnet50_shapes_are_torchvisions():
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    assert resnet50_shapes() == [tuple(p.shape) for p in model.parameters()]
    assert len(resnet50_shapes()) == 161


def test_a_python_without_torch_gets_one_line():
    """Every check needs torch: the wrapper says so once instead of printing a table of FAILs."""
    import shutil
    python = shutil.which("python3")
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the system python3 has torch")
    result = subprocess.run(["scripts/gpu_check.sh"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": python})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("gpu_check: torch is not installed in ") and "PYTHON=" in result.stderr


@pytest.mark.long  # three checks' subprocesses: about 15 s
def test_without_pyyaml_and_tqdm_the_trainer_steps_still_run(tmp_path):
    """A cluster's Python may lack PyYAML and tqdm: the trainer imports them only where it reads or writes YAML
    or draws a bar, so the preflight reports the device (`auto`) and the trainer's own steps run."""
    code, rows, err = gpu_check(tmp_path, "--only", "preflight", "train-resnet50", "train-transformer",
                                hidden=("yaml", "tqdm"), at_import=True)
    got = results(rows)
    assert code == 0 and "FAIL" not in got.values(), err[-3000:]
    assert got["preflight versions"] == "PASS"
    if importable("torchvision"):
        assert got["train resnet18 4 @ 32 px"] == got["train transformer-tiny 128 tokens"] == "PASS"


@pytest.mark.unit
def test_the_preflight_names_the_packages_our_imports_miss(tmp_path, monkeypatch):
    (tmp_path / "needs_a_package").mkdir()
    (tmp_path / "needs_a_package" / "__init__.py").write_text("import json\nimport a_package_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_packages(["json", "needs_a_package"]) == ["a_package_nobody_installed"]
    assert missing_packages(harness.REPOSITORY_MODULES) == []  # the test's Python has them all


@pytest.mark.unit
def test_a_package_the_preflight_finds_missing_stops_the_run_in_one_line(monkeypatch, capsys):
    """No check runs after it (each would fail on the same import, or run as a CPU dry run): one line naming
    the packages, nothing on stdout, exit status 2."""
    ran = []

    def child(name: str, device: str, timeout_s: float) -> tuple[list[Row], dict, float]:
        ran.append((name, device))
        return ([Row("preflight versions", "FAIL", "not installed in this Python: tqdm, yaml")],
                {"device": "cuda", "missing": ["tqdm", "yaml"]}, 0.5)

    monkeypatch.setattr(harness, "run_child", child)
    assert harness.main(["--only", "lars"]) == 2
    out, err = capsys.readouterr()
    assert ran == [("preflight", "auto")] and out == ""
    assert err.splitlines()[-1].startswith("gpu_check: tqdm, yaml not installed in ")
    assert sum(line.startswith("gpu_check:") for line in err.splitlines()) == 1


@pytest.mark.unit
def test_a_preflight_that_died_without_a_report_is_no_cpu_dry_run(monkeypatch, capsys):
    """--device auto where the preflight's process died before it reported the device (here on a GPU machine):
    the next check resolves `auto` itself, in its own process; the parent never assumes the CPU."""
    ran = []

    def child(name: str, device: str, timeout_s: float) -> tuple[list[Row], dict, float]:
        ran.append((name, device))
        if name == "preflight":
            return [Row("preflight", "FAIL", "the check's process exited with status 1 without a result")], {}, 0.5
        return [Row("FusedLARS", "PASS", "161 tensors on cuda:0")], {"device": "cuda"}, 0.5

    monkeypatch.setattr(harness, "run_child", child)
    assert harness.main(["--only", "lars"]) == 1  # the preflight's FAIL
    out = capsys.readouterr().out
    assert ran == [("preflight", "auto"), ("lars", "auto")]
    assert "GPU check on CUDA" in out and "dry run" not in out
    assert json.loads(out.splitlines()[-1])["machine"]["device"] == "cuda"


@pytest.mark.unit
def test_a_nan_loss_leaves_the_last_line_strict_json(monkeypatch, capsys):
    """A check whose values hold NaN or infinity (a diverged loss) still ends the run in JSON a strict parser
    reads, the values written as strings."""
    def child(name: str, device: str, timeout_s: float) -> tuple[list[Row], dict, float]:
        if name == "preflight":
            return [Row("preflight versions", "PASS", "ok")], {"device": "cpu"}, 0.1
        return [Row("train", "FAIL", "loss nan", {"loss": float("nan"), "per_s": float("inf"),
                                                  "curve": [1.0, float("-inf")]})], {}, 0.1

    monkeypatch.setattr(harness, "run_child", child)
    assert harness.main(["--only", "lars"]) == 1

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")
    last = json.loads(capsys.readouterr().out.splitlines()[-1], parse_constant=refuse)
    assert last["rows"][-1]["values"] == {"loss": "nan", "per_s": "inf", "curve": [1.0, "-inf"]}


@pytest.mark.unit
def test_the_throughput_floor_holds_for_the_h100_h200_class_scaled_by_pixels_and_is_unset_elsewhere():
    assert harness.throughput_floor("NVIDIA H200", 224) == harness.THROUGHPUT_FLOOR == 5000.0
    assert harness.throughput_floor("NVIDIA H100 80GB HBM3", 112) == pytest.approx(20000.0)  # a quarter the pixels
    assert harness.throughput_floor("NVIDIA A100-SXM4-80GB", 224) is None
    assert harness.throughput_floor("Tesla V100-SXM2-32GB", 224) is None


def test_a_sync_site_names_our_innermost_frame_and_the_synchronising_file():
    import traceback

    def ours():
        return traceback.extract_stack()

    site = harness.sync_site(ours(), "/venv/site-packages/torch/cuda/__init__.py", 1270)
    assert site.startswith("test_gpu_check.py:") and site.endswith(" ours > cuda/__init__.py:1270")
    outside_repo = [f for f in ours() if not Path(f.filename).resolve().is_relative_to(ROOT)]
    assert harness.sync_site(outside_repo, "/x/torch/amp/grad_scaler.py", 3) == "amp/grad_scaler.py:3"


def test_outside_counts_the_elements_beyond_allclose_and_names_the_worst():
    ref = [torch.tensor([1.0, 2.0, 0.0]), torch.tensor([4.0])]
    ours = [torch.tensor([1.0, 2.0 + 1e-5, 1e-9]), torch.tensor([4.0 + 8e-6])]  # 1e-9: inside atol
    assert not harness.all_close(ours, ref)
    assert harness.outside(ours, ref) == "2 element(s) outside, the worst |diff| 1.0e-05 at |ref| 2.0e+00"


def test_beyond_spread_allows_ours_only_as_far_as_torchs_two_paths_differ_there():
    fused = [torch.tensor([1.0, 1.0, 1.0])]
    single = [torch.tensor([1.0, 1.0 + 1e-4, 1.0])]  # torch's paths differ at the middle element only
    assert harness.beyond_spread([torch.tensor([1.0, 1.0 + 1e-4, 1.0])], fused, single) == 0
    assert harness.beyond_spread([torch.tensor([1.0, 1.0 - 1e-4, 1.0])], fused, single) == 0  # as far, either side
    assert harness.beyond_spread([torch.tensor([1.0, 1.0 + 2e-4, 1.0])], fused, single) == 1  # farther
    assert harness.beyond_spread([torch.tensor([1.0 + 1e-4, 1.0, 1.0])], fused, single) == 1  # where torch agrees
    assert harness.beyond_spread([torch.tensor([1.0 + 5e-7, 1.0, 1.0])], fused, single) == 0  # within rtol 1e-6
