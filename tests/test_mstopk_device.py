"""kernels/mstopk_device.py and kernels/mstopk_triton.py: MSTopK's device path, without a GPU.

The sync-free algorithm runs on CPU tensors through the same torch ops it uses on CUDA and must give
mstopk_reference's result bit for bit; on meta tensors (no data) and with every host-reading call
patched to raise, it must still run, which is what "no host sync" means for code that cannot reach
a GPU here. The Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import mstopk_device_ops, mstopk_reference, mstopk_warm_up
from kernels.mstopk_device import LANE_BITS, split_bits
from kernels.testing import gradient_like

pytestmark = pytest.mark.unit

mstopk_module = importlib.import_module("kernels.mstopk")  # kernels.mstopk is also the function

REPO = Path(__file__).resolve().parents[1]


def small_integers(n: int, seed: int = 0) -> torch.Tensor:
    """Values in -3 .. 3: every threshold band is full of ties."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n,), generator=gen).float()


def cases() -> list[tuple[str, torch.Tensor, int, int]]:
    """(id, x, k, iters): sizes, k from 1 to numel - 1 (the fallback beyond count(0)), dtypes, ties."""
    out = []
    for n in (2, 7, 100, 4_097, 20_000):
        x = gradient_like(n, seed=n)
        for k in sorted({1, max(1, n // 100), max(1, n // 10), max(1, n // 3), max(1, n // 2), n - 1}):
            if k < n:
                out.append((f"n{n}-k{k}", x, k, 20))
    for iters in (1, 3, 7, 32):
        out.append((f"iters{iters}", gradient_like(5_000, seed=iters), 50, iters))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = gradient_like(8_000, seed=7).to(dtype)
        out += [(f"{dtype}-k80", x, 80, 20), (f"{dtype}-fallback", x, 5_000, 20)]
    ties = small_integers(9_000, seed=1)
    out += [(f"ties-k{k}", ties, k, iters) for k in (1, 100, 1_300, 2_600, 7_000) for iters in (3, 20)]
    out += [
        ("ties-at-max", torch.tensor([1.0, -5.0, 0.5, 5.0, 5.0, 2.0, -5.0]), 2, 20),
        ("all-zero", torch.zeros(5_000), 37, 20),
        ("all-equal", torch.full((5_000,), -2.5), 37, 20),
        ("all-equal-k1", torch.full((300,), 4.0), 1, 20),
        ("one-nonzero", torch.zeros(1_000).index_fill_(0, torch.tensor([500]), -3.0), 10, 20),
        ("signed-zeros", torch.tensor([0.0, -0.0, 1.0, -0.0, 0.0, -1.0] * 50), 120, 20),
        ("denormals", gradient_like(3_000, seed=3) * 1e-40, 2_000, 20),
        ("huge", gradient_like(3_000, seed=4) * 1e36, 30, 20),
        ("2d", gradient_like(6_000, seed=5).view(60, 100), 60, 20),
        ("3d", gradient_like(6_000, seed=6).view(10, 20, 30), 600, 9),
    ]
    return out


CASES = cases()


def assert_same(result: tuple[torch.Tensor, torch.Tensor],
                expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert result[1].dtype == torch.int64 and result[0].dtype == expected[0].dtype
    assert torch.equal(result[1], expected[1])
    assert torch.equal(result[0], expected[0])


# ---------------------------------------------------------------- same result as the reference


@pytest.mark.parametrize("x, k, iters", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_device_ops_match_reference(x: torch.Tensor, k: int, iters: int) -> None:
    assert_same(mstopk_device_ops(x, k, iters), mstopk_reference(x, k, iters))


@pytest.mark.parametrize("k", [100, 101])
def test_k_at_least_numel_returns_everything(k: int) -> None:
    x = gradient_like(100)
    values, indices = mstopk_device_ops(x.view(10, 10), k)
    assert torch.equal(indices, torch.arange(100)) and torch.equal(values, x)


def test_fallback_takes_ties_at_the_kth_value_by_index() -> None:
    x = torch.tensor([1.0, 4.0, -1.0, 0.0, 1.0, -4.0, 1.0, 0.0])  # mean 1.5: count(0) = 2 <= k
    values, indices = mstopk_device_ops(x, 4)  # the 4th largest |x| is 1, four elements tie there
    assert indices.tolist() == [0, 1, 2, 5] and torch.equal(values, x[indices])
    assert_same((values, indices), mstopk_reference(x, 4))


@pytest.mark.parametrize("x, k, iters, match", [
    (torch.ones(10), 0, 20, "k must be positive, got k=0"),
    (torch.ones(10), 2.0, 20, "k must be an int, got float"),
    (torch.ones(10), 2, 33, r"iters must be in \[1, 32\], got 33"),
    (torch.ones(10), 2, 20.0, "iters must be an int, got float"),
    (torch.arange(10), 2, 20, "x must be a floating-point tensor, got torch.int64"),
])
def test_bad_arguments_raise(x: torch.Tensor, k, iters, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mstopk_device_ops(x, k, iters)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_finite_input_gives_nan_values_instead_of_raising(bad: float, dtype) -> None:
    x = gradient_like(5_000, seed=8).to(dtype)
    x[1234] = bad
    values, indices = mstopk_device_ops(x, 50)
    assert values.dtype == dtype and values.isnan().all()
    assert torch.equal(indices, torch.arange(50))
    with pytest.raises(ValueError, match="NaN or inf"):  # the CPU paths raise
        mstopk_reference(x, 50)


# ---------------------------------------------------------------- no host sync


SYNC_CASES = [(gradient_like(20_000, seed=9), 200), (gradient_like(20_000, seed=9), 15_000),
              (small_integers(5_000), 1_000), (torch.tensor([1.0, float("nan"), 2.0]), 2)]


def test_runs_on_meta_tensors() -> None:
    """Meta tensors have no data: any host read or data-sized output would raise."""
    for n, k, iters in [(20_000, 200, 20), (9_000, 6_000, 7), (100, 99, 32)]:
        values, indices = mstopk_device_ops(torch.empty(n, device="meta"), k, iters)
        assert values.shape == indices.shape == (k,) and indices.dtype == torch.int64
    with pytest.raises((RuntimeError, NotImplementedError)):  # the reference reads the mean back
        mstopk_reference(torch.empty(100, device="meta"), 3)


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"host read: {name}")
    return refuse


def test_calls_nothing_that_reads_the_device(monkeypatch) -> None:
    expected = [mstopk_reference(x, k) if x.isfinite().all() else None for x, k in SYNC_CASES]
    getitem = torch.Tensor.__getitem__

    def index_without_masks(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise AssertionError("host read: boolean-mask indexing")
        return getitem(self, index)

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique",
                     "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
        for name in ("nonzero", "masked_select", "unique", "argwhere"):
            patch.setattr(torch, name, _refuse(f"torch.{name}"))
        patch.setattr(torch.Tensor, "__getitem__", index_without_masks)
        results = [mstopk_device_ops(x, k) for x, k in SYNC_CASES]
    for result, want in zip(results, expected):
        if want is None:
            assert result[0].isnan().all()
        else:
            assert_same(result, want)


# ---------------------------------------------------------------- pieces and structure


@pytest.mark.parametrize("bits", [2, 5, 6, 21, 31, 33])
def test_split_bits_covers_the_key_in_passes_of_at_most_lane_bits(bits: int) -> None:
    plan = split_bits(bits)
    assert sum(plan) == bits and max(plan) <= LANE_BITS and len(plan) == -(-bits // LANE_BITS)


def test_mstopk_modules_import_without_a_cycle() -> None:
    """mstopk_device imports no other mstopk module; mstopk_triton only mstopk_device."""
    imported = {}
    for name in ("mstopk", "mstopk_device", "mstopk_triton"):
        tree = ast.parse((REPO / "kernels" / f"{name}.py").read_text())
        imported[name] = {node.module.split(".")[-1] for node in ast.walk(tree)
                          if isinstance(node, ast.ImportFrom) and node.module
                          and node.module.startswith("kernels.mstopk")}
    assert imported["mstopk_device"] == set()
    assert imported["mstopk_triton"] == {"mstopk_device"}
    assert imported["mstopk"] == {"mstopk_device", "mstopk_triton"}  # mstopk_triton: lazily


def test_cuda_path_falls_back_to_torch_ops_without_triton(monkeypatch) -> None:
    mstopk_module.device_path.cache_clear()
    monkeypatch.setitem(sys.modules, "kernels.mstopk_triton", None)  # the import fails
    with pytest.warns(RuntimeWarning, match="Triton unavailable"):
        assert mstopk_module.device_path() is mstopk_device_ops
    mstopk_module.device_path.cache_clear()


def test_warm_up_on_the_cpu_loads_the_compiled_kernels(monkeypatch) -> None:
    loaded = []
    monkeypatch.setattr(mstopk_module, "native_library", lambda: loaded.append(True))
    mstopk_warm_up("cpu", [(1_000, 10)])
    assert loaded == [True]


# ---------------------------------------------------------------- Triton kernels (interpreter)

TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from kernels.mstopk import mstopk_reference
    from kernels.mstopk_triton import BLOCK, mstopk_triton
    from tests.test_mstopk_device import gradient_like, small_integers

    cases = [(gradient_like(9_000, 0), 90, 20), (gradient_like(5_000, 1), 3_500, 20),
             (small_integers(2 * BLOCK + 5, 2), 1_000, 20), (small_integers(BLOCK + 3, 3), 3_000, 5),
             (gradient_like(5_000, 4).bfloat16(), 50, 32), (gradient_like(5_000, 5).double(), 4, 1),
             (torch.full((300,), -2.5), 7, 20), (torch.tensor([1.0, -5.0, 0.5, 5.0, 5.0]), 2, 20),
             (gradient_like(3_000, 6) * 1e-40, 2_000, 20)]
    for x, k, iters in cases:
        values, indices = mstopk_triton(x, k, iters)
        expected_values, expected_indices = mstopk_reference(x, k, iters)
        assert torch.equal(indices, expected_indices), (x.numel(), k, iters)
        assert torch.equal(values, expected_values), (x.numel(), k, iters)
    for bad in (float("nan"), float("inf")):
        values, indices = mstopk_triton(torch.tensor([1.0, bad, 2.0, 0.5]).half(), 2, 20)
        assert values.dtype == torch.half and values.isnan().all(), values
        assert indices.tolist() == [0, 1], indices
    print("triton interpreter ok")
""")


@pytest.mark.long
def test_triton_kernels_match_reference_in_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton interpreter ok" in proc.stdout
