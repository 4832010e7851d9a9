"""Run by tests/test_optim_triton.py under TRITON_INTERPRET=1: the Triton LARS and Adam kernels on CPU tensors.

Each check raises on a wrong result; the last line printed is a JSON object {check name: "ok" or the error}.
lars_cpu.cpp is switched off, so FusedLARS's float32 tensors take the Triton path as on CUDA.
"""

from __future__ import annotations

import copy
import json
import os
import time
import traceback
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

import kernels.lars as lars_module
from kernels import FusedLARS, optim_triton
from kernels.adam import TritonAdam
from kernels.lars import LARSReference
from tests.test_kernels import TRUST_RANGES, clipped_shares, kernel_lars_problem, lars_problem, run_lars

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
lars_module.native_library = lambda: None  # type: ignore[assignment]  # CPU float32 -> the Triton path
RTOL, ATOL = 1e-6, 1e-8
BLOCK, REDUCE = optim_triton.BLOCK, optim_triton.REDUCE
STEPS = 3

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


class Launches(TorchDispatchMode):
    """Counts Triton launches (InterpretedFunction.run) and the torch ops issued outside them (on CUDA each
    one a kernel or a copy; the interpreter's own tensor handling inside a launch is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.triton = 0
        self.torch: list[str] = []
        self._inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not self._inside:
            self.torch.append(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "Launches":
        self._run = InterpretedFunction.run

        def counted(fn: InterpretedFunction, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.triton += 1
            self._inside = True
            try:
                return self._run(fn, *args, **kwargs)
            finally:
                self._inside = False

        InterpretedFunction.run = counted  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        InterpretedFunction.run = self._run  # type: ignore[method-assign]
        super().__exit__(*exc)


def model(tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """float32 weights of assorted shapes, one channels_last conv weight and one empty tensor among them."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 4, 3, 3), (300,), (17, 5), (0,), (2500,)]
    weights = [torch.randn(shapes[i % len(shapes)], generator=gen) for i in range(tensors)]
    weights[0] = weights[0].contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(w) for w in weights]


def gradients(weights: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for w in weights:
        if w.grad is None:
            w.grad = torch.empty_like(w)  # w's memory format
        # In place, as CUDA's caching allocator gives a step's new gradients the last step's addresses.
        w.grad.copy_(torch.randn(w.shape, generator=gen) * 0.01)


def lars_against_reference(small_blocks: bool, configurations: list[tuple[bool, bool, dict]]) -> None:
    """FusedLARS against LARSReference, both float32, on tests/test_kernels.py's problem with its edge cases
    (a zero weight, a zero gradient, excluded tensors, tensors of several blocks). With small blocks, tensors
    of a few blocks and ratio programs that loop over their partial sums several times."""
    if small_blocks:
        optim_triton.BLOCK, optim_triton.REDUCE = 64, 4
        params, grads = lars_problem(seed=3)
        params, grads = [p.float() for p in params], [[g.float() for g in s] for s in grads]
        excluded = [False, False, True, True, False]
    else:
        params, grads, excluded = kernel_lars_problem()  # 2^18 elements: more blocks than REDUCE
    lrs = [0.5 * (1 + s) / STEPS for s in range(STEPS)]
    momenta = [0.9 + 0.004 * s for s in range(STEPS)]
    try:
        for nesterov, trust_clip, trust_range in configurations:
            options = dict(weight_decay=5e-2, trust_coefficient=0.02, eps=1e-8, nesterov=nesterov,
                           trust_clip=trust_clip, **trust_range)
            weights, opt = run_lars(FusedLARS, params, grads[:STEPS], excluded, lrs, momenta, **options)
            expected, reference = run_lars(LARSReference, params, grads[:STEPS], excluded, lrs, momenta, **options)
            assert opt._tables, "FusedLARS did not take the Triton path"
            assert clipped_shares(opt) == clipped_shares(reference), options
            for w, e, p in zip(weights, expected, params):
                torch.testing.assert_close(w.detach(), e.detach(), rtol=RTOL, atol=ATOL)
                assert (w - p).abs().max() > 1e-4  # every tensor moved
                torch.testing.assert_close(opt.state[w]["momentum_buffer"], reference.state[e]["momentum_buffer"],
                                           rtol=RTOL, atol=ATOL)
    finally:
        optim_triton.BLOCK, optim_triton.REDUCE = BLOCK, REDUCE


@check
def lars_matches_reference_in_every_configuration() -> None:
    lars_against_reference(True, [(nesterov, trust_clip, trust_range) for nesterov in (False, True)
                                  for trust_clip in (False, True) for trust_range in TRUST_RANGES])


@check
def lars_matches_reference_with_the_real_block_size() -> None:
    lars_against_reference(False, [(True, False, TRUST_RANGES[1])])


def adam_pair(decoupled: bool, weight_decay: float, tensors: int = 5
              ) -> tuple[list[torch.nn.Parameter], TritonAdam, list[torch.nn.Parameter], torch.optim.Optimizer]:
    weights = model(tensors)
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    options = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    reference_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return (weights, TritonAdam(weights, decoupled_weight_decay=decoupled, **options),
            copies, reference_cls(copies, foreach=False, **options))


@check
def adam_matches_torch() -> None:
    for decoupled in (False, True):
        for weight_decay in (0.0, 0.1):
            weights, opt, copies, reference = adam_pair(decoupled, weight_decay)
            start = [w.detach().clone() for w in weights]
            for step in range(STEPS):
                gradients(weights, step)
                gradients(copies, step)
                opt.step()
                reference.step()
            assert opt._tables, "TritonAdam did not take the Triton path"
            for w, c in zip(weights, copies):
                torch.testing.assert_close(w, c, rtol=RTOL, atol=ATOL)
                mine, theirs = opt.state[w], reference.state[c]
                assert mine["step"].item() == theirs["step"].item() == STEPS
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(mine[key], theirs[key], rtol=RTOL, atol=ATOL)
            assert all((w - s).abs().max() > 1e-3 for w, s in zip(weights, start) if w.numel())


@check
def options_given_as_tensors_are_read_on_the_device() -> None:
    """A schedule may set lr and momentum as 0-d tensors: the same result as the same values as floats."""
    for make in (lambda w: FusedLARS(w, lr=0.1, momentum=0.9, weight_decay=1e-4),
                 lambda w: TritonAdam(w, lr=1e-2, weight_decay=0.1)):
        floats, tensors = model(5), model(5)
        a, b = make(floats), make(tensors)
        for step in range(2):
            for group in b.param_groups:
                group["lr"] = torch.tensor(group["lr"] * (step + 1))
                if "momentum" in group:
                    group["momentum"] = torch.tensor(0.8)
            for group in a.param_groups:
                group["lr"] = a.defaults["lr"] * (step + 1)
                if "momentum" in group:
                    group["momentum"] = 0.8
            gradients(floats, step)
            gradients(tensors, step)
            a.step()
            b.step()
        for x, y in zip(floats, tensors):
            assert torch.equal(x, y), type(a).__name__


@check
def adam_state_dict_is_torch_fused_adams() -> None:
    """A TritonAdam checkpoint loads into torch's fused Adam, which then steps as TritonAdam does."""
    weights, opt, copies, _ = adam_pair(False, 0.1)
    for step in range(2):
        gradients(weights, step)
        opt.step()
    fused = torch.optim.Adam([torch.nn.Parameter(w.detach().clone()) for w in weights], lr=1e-2,
                             weight_decay=0.1, fused=True)
    fused.load_state_dict(copy.deepcopy(opt.state_dict()))  # as through a checkpoint file: no shared tensors
    twin = fused.param_groups[0]["params"]
    gradients(weights, 2)
    gradients(twin, 2)
    opt.step()
    fused.step()
    for w, t in zip(weights, twin):
        torch.testing.assert_close(w, t, rtol=RTOL, atol=ATOL)


@check
def adam_honours_grad_scale() -> None:
    """Gradients scaled by S with grad_scale S give the unscaled gradients' result."""
    weights, opt, copies, reference = adam_pair(False, 0.0)
    for step in range(2):
        gradients(weights, step)
        gradients(copies, step)
        for w in weights:
            w.grad *= 1024.0
        opt.grad_scale = torch.tensor(1024.0)  # type: ignore[attr-defined]
        opt.step()
        reference.step()
    for w, c in zip(weights, copies):
        torch.testing.assert_close(w, c, rtol=RTOL, atol=ATOL)


@check
def found_inf_leaves_everything_as_it_was() -> None:
    """found_inf = 1: no weight, momentum, moment or step count changes, though the gradient is NaN; then
    found_inf = 0 updates again."""
    lars_weights = model(6)
    lars = FusedLARS([{"params": lars_weights[:3]}, {"params": lars_weights[3:], "lars_exclude": True}], lr=0.1,
                     weight_decay=1e-4, momentum=0.9)
    adam_weights = model(6)
    adam = TritonAdam(adam_weights, lr=1e-2)
    for weights, opt in ((lars_weights, lars), (adam_weights, adam)):
        gradients(weights, 0)
        opt.step()
        before = [w.detach().clone() for w in weights]
        state = [{k: v.clone() for k, v in opt.state[w].items()} for w in weights]
        gradients(weights, 1)
        weights[1].grad[0] = float("nan")
        opt.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
        opt.step()
        for w, b, s in zip(weights, before, state):
            assert torch.equal(w.detach(), b), type(opt).__name__
            for key, value in s.items():
                assert torch.equal(opt.state[w][key], value), (type(opt).__name__, key)
        gradients(weights, 1)
        opt.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
        opt.step()
        assert all(not torch.equal(w.detach(), b) for w, b in zip(weights, before) if w.numel())


def steady_step_launches(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], tensors: int
                         ) -> tuple[int, list[str]]:
    weights = model(tensors)
    opt = make(weights)
    gradients(weights, 0)
    opt.step()  # builds the state and the pointer table
    gradients(weights, 1)
    with Launches() as launches:
        opt.step()
    return launches.triton, launches.torch


@check
def launches_do_not_grow_with_the_number_of_tensors() -> None:
    """The same Triton launches and torch ops for 10 and 80 tensors, none of them a host read; with a LARS group and
    an excluded one, 3 + 1 Triton launches; Adam 2."""
    makers = {
        "lars": (lambda w: FusedLARS([{"params": w[::2]}, {"params": w[1::2], "lars_exclude": True}], lr=0.1,
                                     weight_decay=1e-4), 4),
        "adam": (lambda w: TritonAdam(w, lr=1e-3), 2),
        "adamw": (lambda w: TritonAdam(w, lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True), 2),
    }
    for name, (make, expected) in makers.items():
        few, few_ops = steady_step_launches(make, 10)
        many, many_ops = steady_step_launches(make, 80)
        assert few == many == expected, (name, few, many)
        assert few_ops == many_ops, (name, few_ops, many_ops)
        assert not any("_local_scalar_dense" in op or "item" in op for op in few_ops), (name, few_ops)  # host reads
        assert len(few_ops) <= 12, (name, few_ops)


def main() -> None:
    results = {}
    for name, fn in CHECKS.items():
        try:
            start = time.perf_counter()
            fn()
            results[name] = "ok"
            print(f"{name}: {time.perf_counter() - start:.1f} s")
        except Exception:  # noqa: BLE001  # every check reports, one failure does not hide the others
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
