"""LARS with its per-tensor work batched over the whole parameter list.

The paper's "parallel tensor operator": the ~161 ResNet-50 tensors get their norms, trust ratios
and updates in a few calls instead of ~10 small kernels each. Three paths, the same formula:

- CPU, float32, dense (contiguous or channels_last): kernels/csrc/lars_cpu.cpp, one ctypes call per
  param group. The step is memory-bound and the kernel passes over each tensor twice (both norms,
  then decay + trust ratio + momentum + update fused), where the torch ops below take five or six.
- CUDA, float32, dense: kernels/optim_triton.py, three Triton launches per param group whatever the
  number of tensors (norms, trust ratios, fused update), lr and momentum read on the device; where
  Triton cannot be imported, the path below.
- Everything else (other dtypes or layouts, or no C++ compiler on the CPU): torch._foreach_* calls.
  The trust ratios stay on the device as 0-d tensors, so a step never syncs with the host; on CUDA
  the products with per-tensor 0-d ratios take torch's per-tensor path (a launch per tensor).

`LARSReference` is the same update written plainly, one tensor at a time: the check every path is
tested against.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from kernels import _native
from kernels._triton import optim_kernels, runs_on

# ---------------------------------------------------------------- compiled CPU path


class _Options(ctypes.Structure):
    """`Options` in kernels/csrc/lars_cpu.cpp, field for field."""

    _fields_ = [("lr", ctypes.c_double), ("momentum", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("trust_coefficient", ctypes.c_double),
                ("eps", ctypes.c_double), ("min_trust_ratio", ctypes.c_double),
                ("max_trust_ratio", ctypes.c_double), ("lars", ctypes.c_int32),
                ("nesterov", ctypes.c_int32), ("trust_clip", ctypes.c_int32)]


def native_library() -> ctypes.CDLL | None:
    """The compiled CPU kernel, or None (after one warning) where it cannot be built."""
    lib = _native.load("lars_cpu")
    if lib is not None and lib.lars_step.argtypes is None:
        ptr = ctypes.c_void_p
        lib.lars_step.argtypes = [ctypes.c_int64, ptr, ptr, ptr, ptr, ctypes.POINTER(_Options),
                                  ptr, ctypes.c_int]
        lib.lars_step.restype = None
    return lib


def _kernel_takes(p: Tensor, g: Tensor, m: Tensor) -> bool:
    """lars_cpu.cpp updates w, g and m element by element in memory order, so they must be float32
    CPU tensors laid out alike and densely (contiguous, or channels_last as the trainer's convs)."""
    return (p.device.type == "cpu" and p.dtype == g.dtype == m.dtype == torch.float32
            and p.stride() == g.stride() == m.stride()
            and (p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last)))


def _kernel_step(lib: ctypes.CDLL, group: dict[str, Any], params: list[Tensor],
                 grads: list[Tensor], bufs: list[Tensor]) -> list[Tensor]:
    """One step of `group` over tensors that `_kernel_takes`, in one call into lars_cpu.cpp.

    Returns the tensors' trust ratios before the [min, max] clip (float64), none for an excluded
    group."""
    n = len(params)

    def pointers(tensors: list[Tensor]) -> ctypes.Array:
        return (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors])

    # float(): a schedule may store lr or momentum as a 0-d tensor.
    lo, hi = _trust_range(group)
    options = _Options(float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]),
                       float(group["trust_coefficient"]), float(group["eps"]), lo,
                       math.inf if hi is None else hi, not group["lars_exclude"],
                       group["nesterov"], group["trust_clip"])
    unclipped = None if group["lars_exclude"] else torch.empty(n, dtype=torch.float64)
    lib.lars_step(n, pointers(params), pointers(grads), pointers(bufs),
                  (ctypes.c_int64 * n)(*[p.numel() for p in params]), ctypes.byref(options),
                  None if unclipped is None else unclipped.data_ptr(), torch.get_num_threads())
    # The kernel writes through raw pointers, which autograd cannot see. Bump the version counters
    # as an in-place torch op would, so a graph that saved an old weight still raises on backward
    # instead of computing a wrong gradient.
    torch.autograd.graph.increment_version(params)
    return [] if unclipped is None else [unclipped]


def _trust_range(group: dict[str, Any]) -> tuple[float, float | None]:
    """The group's (min_trust_ratio, max_trust_ratio) as floats; None = no upper bound."""
    hi = group["max_trust_ratio"]
    return float(group["min_trust_ratio"]), None if hi is None else float(hi)


def _columns(triples: list[tuple[Tensor, Tensor, Tensor]]
             ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """[(w, g, m), ...] -> ([w, ...], [g, ...], [m, ...])."""
    params, grads, bufs = zip(*triples)
    return list(params), list(grads), list(bufs)


# ---------------------------------------------------------------- torch foreach path

# On the CPU each foreach call streams its whole list through memory, so five calls over 100 MB of
# ResNet-50 weights read DRAM five times. Running them on blocks of tensors small enough that w, g
# and m stay in cache makes later calls hit cache. On CUDA one launch over the whole list is what
# counts, so there is a single block.
CPU_BLOCK_ELEMENTS = 1 << 17


def _cache_blocks(params: list[Tensor]) -> list[slice]:
    """Consecutive runs of tensors of at most CPU_BLOCK_ELEMENTS in all (a larger tensor alone)."""
    if params[0].device.type != "cpu":
        return [slice(0, len(params))]
    blocks, start, size = [], 0, 0
    for i, p in enumerate(params):
        if i > start and size + p.numel() > CPU_BLOCK_ELEMENTS:
            blocks.append(slice(start, i))
            start, size = i, 0
        size += p.numel()
    blocks.append(slice(start, len(params)))
    return blocks


class FusedLARS(Optimizer):
    r"""Layer-wise adaptive rate scaling (You et al. 2017) with SGD momentum, batched over tensors.

    For each tensor w with gradient g in a group that is not excluded::

        ratio = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
        ratio = 1                                  if ||w|| == 0 or ||g|| == 0
        ratio = min(ratio / lr, 1)                 if trust_clip (NVIDIA LARC "clip" mode, MLPerf)
        ratio = clip(ratio, min_trust_ratio, max_trust_ratio)
        d = (g + weight_decay * w) * ratio
        m = momentum * m + d                       (m starts at 0, so the first m is d)
        w = w - lr * (d + momentum * m  if nesterov else  m)

    Param groups with ``lars_exclude: True`` (BN weights, biases) take plain SGD momentum on g:
    no trust ratio and no weight decay, whatever their ``weight_decay``. ``lr`` and ``momentum`` are
    read from each group at every step, so schedules set them through ``param_groups``. Momentum
    buffers live in ``state[p]["momentum_buffer"]`` and travel with ``state_dict``.

    The trust range gives the local rate lr * clip(ratio, min, max), as in LARS "with rectified
    adaptive lr" of Alibaba's DAWNBench entry, whose warm-up and decay of lr act on every layer;
    trust_clip instead bounds lr * ratio by lr, which at a large lr binds for nearly every layer and
    leaves lr without effect. `step_metrics` says which share of the layers each bound clipped.

    Given a ``found_inf`` attribute (a 0-d float tensor on the parameters' device, set around
    ``step`` as torch's GradScaler sets it on fused optimizers), the step leaves the weights and
    momentum buffers as they were where it is nonzero, without reading it on the host: the Triton
    kernels mask their stores with it; on the foreach path (any device) each tensor's new value is
    taken by ``torch.where`` from a copy made before the update (two copies and a ``where`` per
    tensor every step the flag is given, set or not); the C++ kernel, which runs on the CPU only,
    reads the flag from host memory.

    Args:
        params: parameters or param-group dicts (a group may set any option below and
            ``lars_exclude``).
        lr: learning rate.
        momentum: momentum factor mu (no dampening).
        weight_decay: L2 penalty added to the gradient before the trust ratio.
        trust_coefficient: LARS coefficient eta.
        eps: added to the ratio's denominator.
        nesterov: Nesterov momentum.
        trust_clip: clip the ratio to lr, as above.
        min_trust_ratio: lower bound of the ratio (0: none).
        max_trust_ratio: upper bound of the ratio (None: none).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float,
                 momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, nesterov: bool = False,
                 trust_clip: bool = False, min_trust_ratio: float = 0.0,
                 max_trust_ratio: float | None = None) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                            ("eps", eps)):
            if value < 0:
                raise ValueError(f"FusedLARS: {name} must be >= 0, got {value}")
        if trust_coefficient <= 0:
            raise ValueError(f"FusedLARS: trust_coefficient must be > 0, got {trust_coefficient}")
        if min_trust_ratio < 0:
            raise ValueError(f"FusedLARS: min_trust_ratio must be >= 0, got {min_trust_ratio}")
        if max_trust_ratio is not None and not (0 < max_trust_ratio
                                                and min_trust_ratio <= max_trust_ratio):
            raise ValueError(f"FusedLARS: max_trust_ratio must be None, or > 0 and >= "
                             f"min_trust_ratio ({min_trust_ratio}), got {max_trust_ratio}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        trust_clip=trust_clip, min_trust_ratio=min_trust_ratio,
                        max_trust_ratio=max_trust_ratio, lars_exclude=False)
        super().__init__(params, defaults)
        # The last step's trust ratios before the range clip, with the group's (min, max): read
        # only by step_metrics, so a step adds no work for the metric and no host sync.
        self._unclipped: list[tuple[Tensor, float, float | None]] = []
        self._tables: dict[int, Any] = {}  # per param group: the Triton path's TensorTable

    takes_found_inf = True
    """`step` skips its update on the device where ``found_inf`` is set (trainer/nonfinite.py)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_unclipped", [])
        self.__dict__.setdefault("_tables", {})
        for group in self.param_groups:  # groups saved before the trust range existed
            group.setdefault("min_trust_ratio", 0.0)
            group.setdefault("max_trust_ratio", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._unclipped = []
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        for slot, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("FusedLARS: sparse gradients are not supported")
            triples = [(p, p.grad, self._momentum_buffer(p)) for p in params]
            # Each tensor's update is independent of the others', so each kernel takes the tensors
            # it can and the foreach path the rest: one float64 or strided tensor slows only itself.
            takes = [_kernel_takes(*t) for t in triples]
            lib = native_library() if any(takes) else None
            unclipped = []
            if lib is not None:
                kernel = [t for t, k in zip(triples, takes) if k]
                if found_inf is None or not found_inf.item():  # CPU tensors: host memory, no device wait
                    unclipped += _kernel_step(lib, group, *_columns(kernel))
                triples = [t for t, k in zip(triples, takes) if not k]
            takes = [runs_on(t[0].device) for t in triples]
            kernels = optim_kernels() if any(takes) else None
            if kernels is not None:
                takes = [k and kernels.dense_alike(*t) for t, k in zip(triples, takes)]
                if any(takes):
                    part = [t for t, k in zip(triples, takes) if k]
                    table = kernels.cached_table(self._tables, slot, _columns(part))
                    ratios = kernels.lars_step(table, group, found_inf)
                    unclipped += [] if ratios is None else [ratios]
                    triples = [t for t, k in zip(triples, takes) if not k]
            if triples:
                unclipped += self._foreach_step(group, *_columns(triples), found_inf=found_inf)
            self._unclipped += [(ratios, *_trust_range(group)) for ratios in unclipped]
        return loss

    def step_metrics(self) -> dict[str, Tensor]:
        """Shares of the LARS layers (tensors outside lars_exclude groups) whose trust ratio the
        last step clipped to max_trust_ratio and to min_trust_ratio: 0-d float tensors on the
        parameters' device, computed there without waiting for it (0 before the first step)."""
        above, below, layers = [], [], 0
        for ratios, lo, hi in self._unclipped:
            layers += ratios.numel()
            below.append((ratios < lo).sum())
            if hi is not None:
                above.append((ratios > hi).sum())
        device = (self._unclipped[0][0].device if self._unclipped
                  else self.param_groups[0]["params"][0].device)

        def fraction(counts: list[Tensor]) -> Tensor:
            total = sum((c.to(device) for c in counts), torch.zeros((), device=device))
            return total / max(layers, 1)

        return {"optim/lars_clipped_max_fraction": fraction(above),
                "optim/lars_clipped_min_fraction": fraction(below)}

    @classmethod
    def _foreach_step(cls, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      bufs: list[Tensor], found_inf: Tensor | None = None) -> list[Tensor]:
        """One step of `group` over its tensors with torch ops; returns the trust ratios before
        the [min, max] clip (one tensor per cache block), none for an excluded group. Where
        `found_inf` is 1, every tensor keeps its old value (chosen by torch.where: a NaN update
        times zero would still be NaN)."""
        unclipped = []
        skip = None if found_inf is None else found_inf.to(device=params[0].device, dtype=torch.bool)
        for block in _cache_blocks(params):
            p, g, m = params[block], grads[block], bufs[block]
            old = None if skip is None else (torch._foreach_mul(p, 1.0), torch._foreach_mul(m, 1.0))
            if group["lars_exclude"]:
                cls._sgd_momentum(group, p, g, m)
            else:
                unclipped.append(cls._lars(group, p, g, m))
            if old is not None:
                for new, before in zip(p + m, old[0] + old[1]):
                    new.copy_(torch.where(skip, before, new))
        return unclipped

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    @staticmethod
    def _sgd_momentum(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      bufs: list[Tensor]) -> None:
        lr, mu = group["lr"], group["momentum"]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        if group["nesterov"]:
            torch._foreach_add_(params, grads, alpha=-lr)
            torch._foreach_add_(params, bufs, alpha=-lr * mu)
        else:
            torch._foreach_add_(params, bufs, alpha=-lr)

    @staticmethod
    def _lars(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
              bufs: list[Tensor]) -> Tensor:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        norms = torch.stack(torch._foreach_norm(params + grads))
        w_norm, g_norm = norms[:len(params)], norms[len(params):]
        ratio = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
        ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
        if group["trust_clip"]:
            ratio = torch.clamp(ratio / lr, max=1.0)
        unclipped, (lo, hi) = ratio, _trust_range(group)
        if lo > 0 or hi is not None:
            ratio = torch.clamp(ratio, min=lo, max=hi)
        # d = ratio * (g + wd * w) is never materialised: it enters m and w as scaled sums
        # (addcmul with 0-d ratios), which saves an allocation and a pass per tensor.
        torch._foreach_mul_(bufs, mu)
        torch._foreach_addcmul_(bufs, grads, list(ratio.unbind()))
        if wd:
            torch._foreach_addcmul_(bufs, params, list((ratio * wd).unbind()))
        if group["nesterov"]:
            # w - lr * (d + mu * m), with w's share of d applied first while w is still the old w.
            if wd:
                torch._foreach_mul_(params, list((1 - lr * wd * ratio).unbind()))
            torch._foreach_addcmul_(params, grads, list((-lr * ratio).unbind()))
            torch._foreach_add_(params, bufs, alpha=-lr * mu)
        else:
            torch._foreach_add_(params, bufs, alpha=-lr)
        return unclipped


# ---------------------------------------------------------------- reference


class LARSReference(Optimizer):
    r"""FusedLARS's update written plainly, one tensor at a time: the independent check of it.

    The same formula, options, param groups (``lars_exclude``), ``state[p]["momentum_buffer"]`` and
    `step_metrics` as FusedLARS (see its docstring), with each line of the formula one torch op on
    one tensor: nothing batched, fused or blocked. Tests, the optimizer benchmark (as its per-tensor
    baseline, the way timm.optim.Lars is written) and the GPU check compare FusedLARS with it. It
    reads no value back to the host during a step; `step_metrics` does.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float,
                 momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, nesterov: bool = False,
                 trust_clip: bool = False, min_trust_ratio: float = 0.0,
                 max_trust_ratio: float | None = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps,
                                      nesterov=nesterov, trust_clip=trust_clip,
                                      min_trust_ratio=min_trust_ratio,
                                      max_trust_ratio=max_trust_ratio, lars_exclude=False))
        # The last step's trust ratios before the [min, max] clip, each with its group's bounds.
        self._ratios: list[tuple[Tensor, float, float | None]] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; `closure` (run with grad enabled)
        gives the loss."""
        loss = None if closure is None else torch.enable_grad()(closure)()
        self._ratios = []
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                state = self.state[w]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(w)
                self._update(group, w, w.grad, state["momentum_buffer"])
        return loss

    def _update(self, group: dict[str, Any], w: Tensor, g: Tensor, m: Tensor) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if group["lars_exclude"]:
            d = g
        else:
            w_norm, g_norm = w.norm(), g.norm()
            ratio = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
            if group["trust_clip"]:
                ratio = torch.clamp(ratio / lr, max=1.0)
            lo, hi = group["min_trust_ratio"], group["max_trust_ratio"]
            self._ratios.append((ratio, lo, hi))
            ratio = torch.clamp(ratio, min=lo, max=hi)
            d = (g + wd * w) * ratio
        m.mul_(mu).add_(d)
        w.sub_(lr * (d + mu * m if group["nesterov"] else m))

    def step_metrics(self) -> dict[str, Tensor]:
        """FusedLARS.step_metrics, counted one ratio at a time on the host."""
        layers = len(self._ratios)
        above = sum(hi is not None and ratio.item() > hi for ratio, _, hi in self._ratios)
        below = sum(ratio.item() < lo for ratio, lo, _ in self._ratios)
        device = self.param_groups[0]["params"][0].device

        def fraction(count: int) -> Tensor:
            return torch.tensor(count / max(layers, 1), device=device)

        return {"optim/lars_clipped_max_fraction": fraction(above),
                "optim/lars_clipped_min_fraction": fraction(below)}
