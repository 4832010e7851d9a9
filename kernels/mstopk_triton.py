"""MSTopK on CUDA with Triton: the primitives of kernels/mstopk_device.py's sync-free algorithm.

`TritonPasses` implements the three primitives of `sync_free_mstopk` with one launch each per
call, pass or selection, and torch ops only for a few tiny reductions and prefix sums on the device:

- stats: per-block float64 sums and float32 maxima of |x|;
- count: one program per BLOCK elements compares each element with the pass's LANES thresholds
  (a [SUB, LANES] tile at a time) and adds its counts atomically. Each program first derives the
  pass's base from the previous pass's counts, so the search needs no separate launch between
  passes; where the gate is 0 (the fallback search when it is not needed) the programs only store
  the base;
- select: per-block counts of the elements above and inside the band, exclusive prefix sums over
  the blocks, then each program writes its kept indices in ascending order from an in-block prefix
  sum. Positions past k, possible only for non-finite input, are masked.

Thresholds are computed in the kernels exactly as `key_thresholds` does (float64, no fused
multiply-add, rounded once to float32). Inputs of any float dtype are compared in float32. Only
long-stable `tl` APIs are used (Triton 2.2+). This module imports Triton at import time;
kernels.mstopk imports it only for CUDA tensors, and `TRITON_INTERPRET=1` runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.mstopk_device import INF_BITS, LANES, check_args, everything, sync_free_mstopk

BLOCK = 4096  # elements per program
SUB = 256  # elements per [SUB, LANES] comparison tile inside a program
# No fused multiply-add in T(j), so thresholds round exactly as in the float64 reference.
EXACT_FP = {"enable_fp_fusion": False}
# Scalars that change from pass to pass: one compiled variant for all their values.
PASS_SCALARS = ["p", "prev_step", "step", "points", "limit"]
_INF_BITS = tl.constexpr(INF_BITS)  # kernels read module globals only as constexpr


@triton.jit
def _key_thresholds(stats_ptr, keys, GRID: tl.constexpr, FLOAT_KEYS: tl.constexpr):
    # As kernels.mstopk_device.key_thresholds: a float32 bit pattern, or T(j) in float64 arithmetic.
    if FLOAT_KEYS:
        t = tl.minimum(keys, _INF_BITS).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        mean = tl.load(stats_ptr)
        span = tl.load(stats_ptr + 1)
        t = (mean + span * (keys.to(tl.float64) / GRID)).to(tl.float32)
        t = tl.where(keys > GRID, float("inf"), t)
    return t


@triton.jit
def _load_abs(x_ptr, n, offs):
    # Out-of-range lanes read -1, which no threshold (>= 0) counts.
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.where(offs < n, tl.abs(x), -1.0)


@triton.jit
def _stats_kernel(x_ptr, n, sums_ptr, maxes_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
    tl.store(sums_ptr + pid, tl.sum(a.to(tl.float64), axis=0))
    tl.store(maxes_ptr + pid, tl.max(a, axis=0))


@triton.jit(do_not_specialize=PASS_SCALARS)
def _count_kernel(x_ptr, n, stats_ptr, gate_ptr, base_ptr, counts_ptr, p, prev_step, step, points,
                  limit, GRID: tl.constexpr, FLOAT_KEYS: tl.constexpr, BLOCK: tl.constexpr,
                  SUB: tl.constexpr, LANES: tl.constexpr):
    # Pass p of a search (see Passes.count): base moves past every key of pass p - 1 whose count
    # exceeded the limit (lane 0 is the base itself), then counts |x| >= T(base + t * step).
    pid = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    prev = tl.load(counts_ptr + (p - 1) * LANES + lanes)
    moved = tl.maximum(tl.sum((prev > limit).to(tl.int64), axis=0) - 1, 0)
    base = tl.load(base_ptr + p - 1) + moved * prev_step
    tl.store(base_ptr + p, base)  # every program stores the same value
    thr = _key_thresholds(stats_ptr, base + lanes.to(tl.int64) * step, GRID, FLOAT_KEYS)
    thr = tl.where(lanes < points, thr, float("inf"))
    if tl.load(gate_ptr) == 0:  # a closed gate: nothing to count
        return
    acc = tl.zeros([LANES], dtype=tl.int32)
    for start in range(0, BLOCK, SUB):
        a = _load_abs(x_ptr, n, pid.to(tl.int64) * BLOCK + start + tl.arange(0, SUB))
        acc += tl.sum((a[:, None] >= thr[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + p * LANES + lanes, acc.to(tl.int64))


@triton.jit
def _classify(x_ptr, n, bounds_ptr, pid, BLOCK: tl.constexpr):
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = _load_abs(x_ptr, n, offs)
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    inside = offs < n  # non-finite input can make the bounds NaN or negative
    return offs, inside & (a >= hi), inside & (a >= lo) & (a < hi)


@triton.jit
def _band_count_kernel(x_ptr, n, bounds_ptr, block_counts_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _, above, band = _classify(x_ptr, n, bounds_ptr, pid, BLOCK)
    tl.store(block_counts_ptr + 2 * pid, tl.sum(above.to(tl.int64), axis=0))
    tl.store(block_counts_ptr + 2 * pid + 1, tl.sum(band.to(tl.int64), axis=0))


@triton.jit
def _select_kernel(x_ptr, n, k, bounds_ptr, band_start_ptr, out_start_ptr, need_ptr, out_ptr,
                   BLOCK: tl.constexpr):
    # Keep every element above and the first `need` band elements by index; write ascending.
    pid = tl.program_id(0)
    offs, above, band = _classify(x_ptr, n, bounds_ptr, pid, BLOCK)
    band = band.to(tl.int64)
    band_rank = tl.load(band_start_ptr + pid) + tl.cumsum(band, axis=0) - band
    keep = (above | ((band != 0) & (band_rank < tl.load(need_ptr)))).to(tl.int64)
    pos = tl.load(out_start_ptr + pid) + tl.cumsum(keep, axis=0) - keep
    tl.store(out_ptr + pos, offs, mask=(keep != 0) & (pos >= 0) & (pos < k))


def _exclusive_cumsum(t: Tensor) -> Tensor:
    return t.cumsum(0) - t


class TritonPasses:
    """kernels.mstopk_device.Passes with Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    def __init__(self, flat: Tensor) -> None:
        self.x = flat.contiguous()
        self.n = self.x.numel()
        self.blocks = triton.cdiv(self.n, BLOCK)

    def _empty(self, *shape: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.x.device)

    def stats(self) -> tuple[Tensor, Tensor]:
        sums = self._empty(self.blocks, dtype=torch.float64)
        maxes = self._empty(self.blocks, dtype=torch.float32)
        _stats_kernel[(self.blocks,)](self.x, self.n, sums, maxes, BLOCK=BLOCK)
        return sums.sum(), maxes.max()

    def count(self, stats: Tensor, gate: Tensor, base: Tensor, counts: Tensor, p: int,
              prev_step: int, step: int, points: int, limit: int, grid: int,
              float_keys: bool) -> None:
        _count_kernel[(self.blocks,)](self.x, self.n, stats, gate, base, counts, p, prev_step, step,
                                      points, limit, GRID=0 if float_keys else grid,  # one variant
                                      FLOAT_KEYS=float_keys, BLOCK=BLOCK, SUB=SUB, LANES=LANES,
                                      **EXACT_FP)

    def select(self, bounds: Tensor, k: int) -> Tensor:
        block_counts = self._empty(self.blocks, 2, dtype=torch.int64)
        _band_count_kernel[(self.blocks,)](self.x, self.n, bounds, block_counts, BLOCK=BLOCK)
        above_n, band_n = block_counts.unbind(1)
        need = k - above_n.sum(0, keepdim=True)
        band_start = _exclusive_cumsum(band_n)
        out_start = _exclusive_cumsum(above_n) + torch.minimum(band_start, need)
        indices = torch.zeros(k, dtype=torch.int64, device=self.x.device)
        _select_kernel[(self.blocks,)](self.x, self.n, k, bounds, band_start, out_start, need,
                                       indices, BLOCK=BLOCK)
        return indices


def mstopk_triton(x: Tensor, k: int, iters: int = 20) -> tuple[Tensor, Tensor]:
    """kernels.mstopk's device path with Triton kernels: no host sync.

    Arguments and errors as kernels.mstopk; NaN or inf in x gives k NaN values and indices
    0 .. k-1 (kernels/mstopk_device.py).
    """
    flat = check_args(x, k, iters)
    if k >= flat.numel():
        return everything(flat)
    return sync_free_mstopk(flat, k, iters, TritonPasses(flat))
