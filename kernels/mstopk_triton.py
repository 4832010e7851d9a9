"""MSTopK on CUDA with Triton: kernels.mstopk_reference's selection, no host sync in the search.

Instead of iters launches of "count >= one threshold", each pass counts 2**BITS_PER_PASS + 1 grid
thresholds at once (the 16-way equivalent of four bisection steps), so iters = 20 takes five passes.
Each pass derives its range on the device from the previous pass's counts; the host syncs once,
after the search, to raise on NaN/inf and to take the exact-top-k fallback. Selection then writes
the kept indices in ascending order from per-block counts and an in-block prefix sum. Only
long-stable `tl` APIs are used (Triton 2.2+); inputs of any float dtype are compared in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.mstopk import checked_mean, exact_topk

BLOCK = 4096  # elements per program
SUB = 256  # elements per [SUB, LANES] comparison tile inside a program
BITS_PER_PASS = 4
LANES = 32  # >= 2**BITS_PER_PASS + 1 thresholds per pass
# No fused multiply-add in T(j), so thresholds round exactly as in the float64 reference.
EXACT_FP = {"enable_fp_fusion": False}


@triton.jit
def _threshold(stats_ptr, j, GRID: tl.constexpr):
    # T(j) exactly as kernels.mstopk.threshold: float64 arithmetic, rounded once to float32.
    mean = tl.load(stats_ptr)
    span = tl.load(stats_ptr + 1)
    t = (mean + span * (j.to(tl.float64) / GRID)).to(tl.float32)
    return tl.where(j > GRID, float("inf"), t)


@triton.jit
def _load_abs(x_ptr, n, offs):
    # Out-of-range lanes read -1, which no threshold (>= 0) counts.
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.where(offs < n, tl.abs(x), -1.0)


@triton.jit
def _stats_kernel(x_ptr, n, sums_ptr, maxes_ptr, BLOCK: tl.constexpr):
    # A NaN or inf makes the float64 sum non-finite; the host checks it once, after the search.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
    tl.store(sums_ptr + pid, tl.sum(a.to(tl.float64), axis=0))
    tl.store(maxes_ptr + pid, tl.max(a, axis=0))


@triton.jit
def _count_kernel(x_ptr, n, k, stats_ptr, base_ptr, counts_ptr, p, prev_step, step, num_thr,
                  GRID: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, LANES: tl.constexpr):
    # Pass p counts |x| >= T(base + t * step) for t < num_thr; base moves past every threshold of
    # pass p - 1 whose count exceeded k. Row 0 of counts/base is the initial state.
    pid = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    prev = tl.load(counts_ptr + (p - 1) * LANES + lanes)
    moved = tl.maximum(tl.sum((prev > k).to(tl.int64), axis=0) - 1, 0)
    base = tl.load(base_ptr + p - 1) + moved * prev_step
    tl.store(base_ptr + p, base)  # every program stores the same value
    thr = _threshold(stats_ptr, base + lanes.to(tl.int64) * step, GRID)
    thr = tl.where(lanes < num_thr, thr, float("inf"))
    acc = tl.zeros([LANES], dtype=tl.int32)
    for start in range(0, BLOCK, SUB):
        a = _load_abs(x_ptr, n, pid.to(tl.int64) * BLOCK + start + tl.arange(0, SUB))
        acc += tl.sum((a[:, None] >= thr[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + p * LANES + lanes, acc.to(tl.int64))


@triton.jit
def _classify(x_ptr, n, stats_ptr, j_ptr, pid, GRID: tl.constexpr, BLOCK: tl.constexpr):
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = _load_abs(x_ptr, n, offs)
    j = tl.load(j_ptr)
    hi = _threshold(stats_ptr, j + 1, GRID)
    return offs, a >= hi, (a >= _threshold(stats_ptr, j, GRID)) & (a < hi)


@triton.jit
def _band_count_kernel(x_ptr, n, stats_ptr, j_ptr, block_counts_ptr, GRID: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _, above, band = _classify(x_ptr, n, stats_ptr, j_ptr, pid, GRID, BLOCK)
    tl.store(block_counts_ptr + 2 * pid, tl.sum(above.to(tl.int64), axis=0))
    tl.store(block_counts_ptr + 2 * pid + 1, tl.sum(band.to(tl.int64), axis=0))


@triton.jit
def _select_kernel(x_ptr, n, stats_ptr, j_ptr, band_start_ptr, out_start_ptr, need_ptr, out_ptr,
                   GRID: tl.constexpr, BLOCK: tl.constexpr):
    # Keep every element above and the first `need` band elements by index; write ascending.
    pid = tl.program_id(0)
    offs, above, band = _classify(x_ptr, n, stats_ptr, j_ptr, pid, GRID, BLOCK)
    band = band.to(tl.int64)
    band_rank = tl.load(band_start_ptr + pid) + tl.cumsum(band, axis=0) - band
    keep = (above | ((band != 0) & (band_rank < tl.load(need_ptr)))).to(tl.int64)
    pos = tl.load(out_start_ptr + pid) + tl.cumsum(keep, axis=0) - keep
    tl.store(out_ptr + pos, offs, mask=keep != 0)


def _exclusive_cumsum(t: Tensor) -> Tensor:
    return t.cumsum(0) - t


def mstopk_triton(flat: Tensor, k: int, iters: int) -> tuple[Tensor, Tensor]:
    """kernels.mstopk for a flat tensor with 0 < k < numel (checked by the caller)."""
    x = flat.contiguous()
    n, grid = x.numel(), 1 << iters
    blocks = triton.cdiv(n, BLOCK)
    sums = torch.empty(blocks, dtype=torch.float64, device=x.device)
    maxes = torch.empty(blocks, dtype=torch.float32, device=x.device)
    _stats_kernel[(blocks,)](x, n, sums, maxes, BLOCK=BLOCK)
    total = sums.sum()
    mean = total / n
    stats = torch.stack([mean, maxes.max().double() - mean])  # as the reference: mean, max - mean

    passes = triton.cdiv(iters, BITS_PER_PASS)
    base = torch.zeros(passes + 1, dtype=torch.int64, device=x.device)
    counts = torch.zeros(passes + 1, LANES, dtype=torch.int64, device=x.device)
    counts[0, 0] = k + 1  # initial state: "count(0) > k", so pass 1 starts its range at j = 0
    prev_step, remaining = 0, iters
    for p in range(1, passes + 1):
        bits = min(BITS_PER_PASS, remaining)
        remaining -= bits
        step = 1 << remaining
        _count_kernel[(blocks,)](x, n, k, stats, base, counts, p, prev_step, step, (1 << bits) + 1,
                                 GRID=grid, BLOCK=BLOCK, SUB=SUB, LANES=LANES, **EXACT_FP)
        prev_step = step
    # The last pass has step 1, so J is its base plus the thresholds it moved past.
    j = base[-1:] + (counts[-1] > k).sum() - 1
    # The one host sync: NaN/inf raise; count(0) <= k takes the exact top-k.
    total, fallback = torch.stack([total, (counts[1, 0] <= k).double()]).tolist()
    checked_mean(total, n)
    if fallback:
        return exact_topk(flat, k)

    block_counts = torch.empty(blocks, 2, dtype=torch.int64, device=x.device)
    _band_count_kernel[(blocks,)](x, n, stats, j, block_counts, GRID=grid, BLOCK=BLOCK,
                                      **EXACT_FP)
    above_n, band_n = block_counts.unbind(1)
    need = k - above_n.sum(0, keepdim=True)
    band_start = _exclusive_cumsum(band_n)
    out_start = _exclusive_cumsum(above_n) + torch.minimum(band_start, need)
    indices = torch.empty(k, dtype=torch.int64, device=x.device)
    _select_kernel[(blocks,)](x, n, stats, j, band_start, out_start, need, indices, GRID=grid,
                              BLOCK=BLOCK, **EXACT_FP)
    return flat[indices], indices
