"""Every Triton kernel of kernels/ can be bound by Triton's launcher.

The interpreter tests (TRITON_INTERPRET=1) never build the launcher's argument binder, which a compiled
launch builds first: a kernel parameter that clashes with the binder's own names (`options`) raises a
SyntaxError there, on the GPU only, and one named as another of the binder's names would shadow it without an
error. Building each binder here, and reading each kernel's parameter names, catches both on the CPU.
"""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import ROOT

triton = pytest.importorskip("triton", reason="Triton is not installed")
jit = pytest.importorskip("triton.runtime.jit")

pytestmark = pytest.mark.unit

MODULES = sorted(f"kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py") if "@triton.jit" in p.read_text())
BINDER_NAMES = {"options", "params", "specialization", "specialize_impl", "backend"}
"""The names Triton's generated binder uses for itself (triton/runtime/jit.py, create_function_from_signature)."""


def test_the_kernel_modules_are_found() -> None:
    assert {"kernels.optim_triton", "kernels.mstopk_triton"} <= set(MODULES)


def kernels_of(module_name: str) -> list:
    module = importlib.import_module(module_name)
    return [value for value in vars(module).values() if isinstance(value, jit.JITFunction)]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_kernel_gets_a_launch_binder(module_name: str) -> None:
    kernels = kernels_of(module_name)
    source = (ROOT / (module_name.replace(".", "/") + ".py")).read_text()
    assert len(kernels) == source.count("@triton.jit")  # each kernel and helper of the module, none missed
    for kernel in kernels:
        assert not BINDER_NAMES & set(kernel.arg_names), (kernel.fn.__name__, BINDER_NAMES & set(kernel.arg_names))
        # the launcher's own step (JITFunction.create_binder), without the device target it also looks up
        jit.create_function_from_signature(kernel.signature, kernel.params, None)


def test_a_clashing_parameter_name_is_caught() -> None:
    @triton.jit
    def clashing(x_ptr, options):
        pass

    with pytest.raises(SyntaxError, match="options"):
        jit.create_function_from_signature(clashing.signature, clashing.params, None)
