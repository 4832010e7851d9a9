"""LARS and Adam updates with Triton: a fixed number of launches per step, however many tensors.

The tensors stay where the model keeps them. A `TensorTable` holds device arrays of their addresses and
sizes and the (tensor, offset) of every BLOCK-element block, so one launch covers every block of every
tensor; it is rebuilt only when an address changes (a gradient freed and reallocated). The options (lr,
momentum, ...) go to the device each step as one float64 tensor, copied from pinned memory without a wait
(a 0-d tensor option is copied on the device), so a step reads nothing back to the host and the kernels
never recompile for a new lr.

Launches per param group and step:

- LARS: three. Per-block partial sums of ||w||^2 and ||g||^2; one program per tensor sums its blocks'
  partials in block order (deterministic, no atomics) into its trust ratio; the fused decay, trust ratio,
  momentum and weight update. An excluded group (plain SGD momentum) takes the last one only.
- Adam/AdamW: two. The update (with torch's formula and its optional grad_scale), then the step counts.

Given ``found_inf`` (a 0-d float tensor that is 1 after a non-finite gradient, as torch's fused optimizers
take it), every launch leaves the weights, moments and step counts as they were.

float32 tensors only, each dense in memory (contiguous or channels_last) with its gradient and state laid
out alike. This module imports Triton at import time: kernels.lars and kernels.adam import it for CUDA
tensors, and the tests run it on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048  # elements per program of the elementwise launches
REDUCE = 128  # partial sums a LARS ratio program adds at once
# No fused multiply-add: each product rounds on its own, as in the torch ops the kernels reproduce.
EXACT_FP = {"enable_fp_fusion": False}


def dense_alike(*tensors: Tensor) -> bool:
    """True when the tensors are float32, alike in strides and dense, so their elements can be walked
    in memory order as one flat array each."""
    first = tensors[0]
    return (all(t.dtype == torch.float32 and t.stride() == first.stride() and t.device == first.device
                for t in tensors)
            and (first.is_contiguous() or first.is_contiguous(memory_format=torch.channels_last)))


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` on `device` without a host wait: through pinned memory on CUDA (the caching host
    allocator keeps the pinned block until the copy is done)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_options(values: Sequence[float | Tensor], device: torch.device) -> Tensor:
    """The options as one float64 tensor on `device`; a tensor value is copied there on the device."""
    host = torch.tensor([0.0 if isinstance(v, Tensor) else float(v) for v in values], dtype=torch.float64)
    options = to_device(host, device)
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            options[i].copy_(value, non_blocking=True)
    return options


class TensorTable:
    """Device-side addresses of lists of tensors of the same sizes (one list per column: weights,
    gradients, state), with the tensor and start offset of every block of BLOCK elements."""

    def __init__(self, columns: Sequence[Sequence[Tensor]]) -> None:
        self.key = self.key_of(columns)
        first = columns[0]
        device = first[0].device
        sizes = torch.tensor([t.numel() for t in first], dtype=torch.int64)
        counts = (sizes + BLOCK - 1) // BLOCK
        tensor_of_block = torch.repeat_interleave(torch.arange(len(first)), counts)
        first_block = torch.zeros(len(first) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=first_block[1:])
        start_of_block = (torch.arange(int(first_block[-1])) - first_block[tensor_of_block]) * BLOCK
        addresses = [torch.tensor([t.data_ptr() for t in column], dtype=torch.int64) for column in columns]
        parts = [*addresses, sizes, tensor_of_block, start_of_block, first_block]
        # One host-to-device copy for the whole table.
        flat = to_device(torch.cat(parts), device)
        views = list(flat.split([p.numel() for p in parts]))
        self.addresses = views[:len(columns)]
        self.sizes, self.tensor_of_block, self.start_of_block, self.first_block = views[len(columns):]
        self.tensors = len(first)
        self.blocks = int(first_block[-1])

    @staticmethod
    def key_of(columns: Sequence[Sequence[Tensor]]) -> tuple[int, ...]:
        return tuple(x for column in columns for t in column for x in (t.data_ptr(), t.numel()))


def cached_table(cache: dict[int, TensorTable], slot: int, columns: Sequence[Sequence[Tensor]]) -> TensorTable:
    """The table of `columns` from cache[slot], rebuilt when an address or size changed."""
    table = cache.get(slot)
    if table is None or table.key != TensorTable.key_of(columns):
        table = cache[slot] = TensorTable(columns)
    return table


# ---------------------------------------------------------------- kernels


@triton.jit
def _block(sizes, tensor_of_block, start_of_block, found_inf, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block: its number, tensor, element offsets and mask (empty where found_inf is set)."""
    pid = tl.program_id(0)
    t = tl.load(tensor_of_block + pid)
    offsets = tl.load(start_of_block + pid) + tl.arange(0, BLOCK)
    size = tl.load(sizes + t)
    if HAS_FOUND_INF:
        size = tl.where(tl.load(found_inf) == 0, size, 0)
    return pid, t, offsets, offsets < size


@triton.jit
def _pointer(addresses, t):
    return tl.load(addresses + t).to(tl.pointer_type(tl.float32))


@triton.jit
def _lars_norms(w_addresses, g_addresses, sizes, tensor_of_block, start_of_block, partials, BLOCK: tl.constexpr):
    pid, t, offsets, mask = _block(sizes, tensor_of_block, start_of_block, sizes, False, BLOCK)
    w = tl.load(_pointer(w_addresses, t) + offsets, mask=mask, other=0.0)
    g = tl.load(_pointer(g_addresses, t) + offsets, mask=mask, other=0.0)
    tl.store(partials + 2 * pid, tl.sum(w * w, axis=0))
    tl.store(partials + 2 * pid + 1, tl.sum(g * g, axis=0))


# A kernel parameter must not be named `options`: Triton's launcher binds its own launch options under that name.
@triton.jit
def _lars_ratios(partials, first_block, hyper, ratios, unclipped,
                 TRUST_CLIP: tl.constexpr, HAS_MAX: tl.constexpr, REDUCE: tl.constexpr):
    t = tl.program_id(0)
    begin = tl.load(first_block + t)
    end = tl.load(first_block + t + 1)
    w_sq = tl.zeros([REDUCE], dtype=tl.float32)
    g_sq = tl.zeros([REDUCE], dtype=tl.float32)
    for b in range(begin, end, REDUCE):
        index = b + tl.arange(0, REDUCE)
        mask = index < end
        w_sq += tl.load(partials + 2 * index, mask=mask, other=0.0)
        g_sq += tl.load(partials + 2 * index + 1, mask=mask, other=0.0)
    # Correctly rounded sqrt and division, as torch's kernels: Triton's defaults are approximate on CUDA.
    w_norm = tl.sqrt_rn(tl.sum(w_sq, axis=0))
    g_norm = tl.sqrt_rn(tl.sum(g_sq, axis=0))
    lr = tl.load(hyper).to(tl.float32)
    weight_decay = tl.load(hyper + 2).to(tl.float32)
    coefficient = tl.load(hyper + 3).to(tl.float32)
    eps = tl.load(hyper + 4).to(tl.float32)
    ratio = tl.div_rn(coefficient * w_norm, g_norm + weight_decay * w_norm + eps)
    ratio = tl.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
    if TRUST_CLIP:
        ratio = tl.minimum(tl.div_rn(ratio, lr), 1.0)
    tl.store(unclipped + t, ratio)
    ratio = tl.maximum(ratio, tl.load(hyper + 5).to(tl.float32))
    if HAS_MAX:
        ratio = tl.minimum(ratio, tl.load(hyper + 6).to(tl.float32))
    tl.store(ratios + t, ratio)


@triton.jit
def _lars_update(w_addresses, g_addresses, m_addresses, sizes, tensor_of_block, start_of_block, ratios, hyper,
                 found_inf, EXCLUDE: tl.constexpr, NESTEROV: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid, t, offsets, mask = _block(sizes, tensor_of_block, start_of_block, found_inf, HAS_FOUND_INF, BLOCK)
    w_ptr = _pointer(w_addresses, t) + offsets
    m_ptr = _pointer(m_addresses, t) + offsets
    w = tl.load(w_ptr, mask=mask)
    g = tl.load(_pointer(g_addresses, t) + offsets, mask=mask)
    m = tl.load(m_ptr, mask=mask)
    lr = tl.load(hyper).to(tl.float32)
    momentum = tl.load(hyper + 1).to(tl.float32)
    if EXCLUDE:
        d = g
    else:
        d = (g + tl.load(hyper + 2).to(tl.float32) * w) * tl.load(ratios + t)
    m = momentum * m + d
    if NESTEROV:
        w = w - lr * (d + momentum * m)
    else:
        w = w - lr * m
    tl.store(m_ptr, m, mask=mask)
    tl.store(w_ptr, w, mask=mask)


@triton.jit
def _adam_update(p_addresses, g_addresses, m_addresses, v_addresses, step_addresses, sizes, tensor_of_block,
                 start_of_block, hyper, found_inf, grad_scale, DECOUPLED: tl.constexpr,
                 HAS_FOUND_INF: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    pid, t, offsets, mask = _block(sizes, tensor_of_block, start_of_block, found_inf, HAS_FOUND_INF, BLOCK)
    p_ptr = _pointer(p_addresses, t) + offsets
    m_ptr = _pointer(m_addresses, t) + offsets
    v_ptr = _pointer(v_addresses, t) + offsets
    p = tl.load(p_ptr, mask=mask)
    g = tl.load(_pointer(g_addresses, t) + offsets, mask=mask)
    m = tl.load(m_ptr, mask=mask)
    v = tl.load(v_ptr, mask=mask)
    if HAS_SCALE:
        g = g / tl.load(grad_scale)
    # Scalars combine in float64 before they meet float32 data, as torch's host-side Python floats do:
    # 1 - 0.999 taken in float32 is off by 1e-5 relative.
    lr64 = tl.load(hyper)
    beta1_64 = tl.load(hyper + 1)
    beta2_64 = tl.load(hyper + 2)
    eps = tl.load(hyper + 3).to(tl.float32)
    weight_decay64 = tl.load(hyper + 4)
    if DECOUPLED:
        p = p * (1 - lr64 * weight_decay64).to(tl.float32)
    else:
        g = g + weight_decay64.to(tl.float32) * p
    m = m + (1 - beta1_64).to(tl.float32) * (g - m)
    v = beta2_64.to(tl.float32) * v + (1 - beta2_64).to(tl.float32) * g * g
    step = (tl.load(_pointer(step_addresses, t)) + 1).to(tl.float64)
    correction1 = 1 - tl.exp(step * tl.log(beta1_64))
    correction2_sqrt = tl.sqrt(1 - tl.exp(step * tl.log(beta2_64)))
    step_size = (lr64 / correction1).to(tl.float32)
    denominator = tl.div_rn(tl.sqrt_rn(v), correction2_sqrt.to(tl.float32)) + eps
    p = p - tl.div_rn(step_size * m, denominator)  # correctly rounded, as torch's kernels
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    tl.store(p_ptr, p, mask=mask)


@triton.jit
def _count_steps(step_addresses, tensors, found_inf, HAS_FOUND_INF: tl.constexpr, REDUCE: tl.constexpr):
    increment = 1.0
    if HAS_FOUND_INF:
        increment = tl.where(tl.load(found_inf) == 0, 1.0, 0.0)  # GradScaler's flag may sum several devices'
    for i in range(0, tensors, REDUCE):
        index = i + tl.arange(0, REDUCE)
        mask = index < tensors
        pointers = tl.load(step_addresses + index, mask=mask, other=0).to(tl.pointer_type(tl.float32))
        tl.store(pointers, tl.load(pointers, mask=mask) + increment, mask=mask)


# ---------------------------------------------------------------- steps


def on_device_of(tensor: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors'."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def lars_step(table: TensorTable, group: dict, found_inf: Tensor | None) -> Tensor | None:
    """One FusedLARS step of `group` over `table` (columns: weights, gradients, momentum buffers); returns
    the tensors' trust ratios before the [min, max] clip (float32, on the device), None for an excluded
    group. The option keys are FusedLARS's."""
    with on_device_of(table.addresses[0]):
        return _lars_step(table, group, found_inf)


def _lars_step(table: TensorTable, group: dict, found_inf: Tensor | None) -> Tensor | None:
    w, g, m = table.addresses
    device = w.device
    max_ratio = group["max_trust_ratio"]
    options = device_options([group["lr"], group["momentum"], group["weight_decay"], group["trust_coefficient"],
                              group["eps"], group["min_trust_ratio"], 0.0 if max_ratio is None else max_ratio],
                             device)
    ratios = unclipped = None
    if not group["lars_exclude"]:
        partials = torch.empty(2 * table.blocks, dtype=torch.float32, device=device)
        ratios = torch.empty(table.tensors, dtype=torch.float32, device=device)
        unclipped = torch.empty_like(ratios)
        if table.blocks:
            _lars_norms[(table.blocks,)](w, g, table.sizes, table.tensor_of_block, table.start_of_block, partials,
                                        BLOCK=BLOCK, **EXACT_FP)
        _lars_ratios[(table.tensors,)](partials, table.first_block, options, ratios, unclipped,
                                       TRUST_CLIP=bool(group["trust_clip"]), HAS_MAX=max_ratio is not None,
                                       REDUCE=REDUCE, **EXACT_FP)
    if table.blocks:
        _lars_update[(table.blocks,)](w, g, m, table.sizes, table.tensor_of_block, table.start_of_block,
                                      options if ratios is None else ratios, options,
                                      options if found_inf is None else found_inf,
                                      EXCLUDE=bool(group["lars_exclude"]), NESTEROV=bool(group["nesterov"]),
                                      HAS_FOUND_INF=found_inf is not None, BLOCK=BLOCK, **EXACT_FP)
    return unclipped


def adam_step(table: TensorTable, group: dict, found_inf: Tensor | None, grad_scale: Tensor | None) -> None:
    """One torch.optim.Adam step (AdamW with ``decoupled_weight_decay``) of `group` over `table` (columns:
    params, gradients, exp_avg, exp_avg_sq, step); amsgrad and maximize are not taken."""
    with on_device_of(table.addresses[0]):
        _adam_step(table, group, found_inf, grad_scale)


def _adam_step(table: TensorTable, group: dict, found_inf: Tensor | None, grad_scale: Tensor | None) -> None:
    p, g, m, v, steps = table.addresses
    beta1, beta2 = group["betas"]
    options = device_options([group["lr"], beta1, beta2, group["eps"], group["weight_decay"]], p.device)
    flag = options if found_inf is None else found_inf
    if table.blocks:
        _adam_update[(table.blocks,)](p, g, m, v, steps, table.sizes, table.tensor_of_block, table.start_of_block,
                                      options, flag, options if grad_scale is None else grad_scale,
                                      DECOUPLED=bool(group.get("decoupled_weight_decay", False)),
                                      HAS_FOUND_INF=found_inf is not None, HAS_SCALE=grad_scale is not None,
                                      BLOCK=BLOCK, **EXACT_FP)
    # After the update, which read the old counts: one launch, ordered after it on the stream.
    _count_steps[(1,)](steps, table.tensors, flag, HAS_FOUND_INF=found_inf is not None, REDUCE=REDUCE,
                       **EXACT_FP)
