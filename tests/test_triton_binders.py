"""Every Triton kernel of kernels/ can be bound by Triton's launcher.

The interpreter tests (TRITON_INTERPRET=1) never build the launcher's argument binder, which a compiled
launch builds first: a kernel parameter that clashes with the binder's own names (`options`) raises a
SyntaxError there, on the GPU only. Building each binder here catches that on the CPU.
"""

from __future__ import annotations

import importlib

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed")
jit = pytest.importorskip("triton.runtime.jit")

pytestmark = pytest.mark.unit

MODULES = ["kernels.optim_triton", "kernels.mstopk_triton"]


def kernels_of(module_name: str) -> list:
    module = importlib.import_module(module_name)
    return [value for value in vars(module).values() if isinstance(value, jit.JITFunction)]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_kernel_gets_a_launch_binder(module_name: str) -> None:
    kernels = kernels_of(module_name)
    assert len(kernels) >= 4  # the module's launched kernels and their helpers were found
    for kernel in kernels:
        # the launcher's own step (JITFunction.create_binder), without the device target it also looks up
        jit.create_function_from_signature(kernel.signature, kernel.params, None)


def test_a_clashing_parameter_name_is_caught() -> None:
    @triton.jit
    def clashing(x_ptr, options):
        pass

    with pytest.raises(SyntaxError, match="options"):
        jit.create_function_from_signature(clashing.signature, clashing.params, None)
