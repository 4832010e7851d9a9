"""MSTopK without host synchronisation: the search and the selection stay on the tensor's device.

kernels.mstopk's selection (same result, bit for bit; the semantics are in its module docstring) for
callers that must not wait for the device, such as the gradient communicator on a side CUDA stream.
Everything derived from the data is a device tensor: mean and max are 0-d tensors, the counts and
the threshold choice are computed by device ops, and every output has a size known on the host
(k is an int), so no call reads a value back and no output is sized from data.

The algorithm, in terms of a "search" for the largest key whose count exceeds a limit:

1. stats: sum(|x|) in float64 and max(|x|); mean = sum / n.
2. Grid search: keys j = 0 .. 2**(iters + 1) - 1 stand for the thresholds T(j) (inf past 2**iters),
   limit k. Each pass counts ``|x| >= threshold`` for LANES keys at once, ``base + t * step``, and
   moves base past every key whose count exceeds the limit; LANE_BITS bits per pass, so iters = 20
   (21 bits) takes five passes. The result is J, and the first pass's count of key 0 is count(0).
3. Fallback search, needed only where count(0) <= k: a device flag gates it (the Triton kernels
   return at once, the torch ops zero its counts). Keys are the float32 bit patterns of
   non-negative values (31 bits, seven passes), limit k - 1, so the result is the bit pattern of
   the k-th largest |x|.
4. Selection between bounds (lo, hi): (T(J), T(J + 1)), or (v, next float after v) for the k-th
   largest v in the fallback. Every |x| >= hi is kept, plus the first ``k - #{|x| >= hi}`` elements
   by index with lo <= |x| < hi; an exclusive prefix sum gives each kept element its output
   position, written into a k-sized buffer.

Input that holds NaN or inf cannot raise without a sync: instead the result is k NaN values (in x's
dtype) with indices 0 .. k-1, detectable on the device (``values.isnan().any()``) or by whoever
reads the values anyway.

The steps above are written once (`sync_free_mstopk`) over three primitives (statistics, one
counting pass, selection). `TorchPasses` implements them with torch ops, on any device;
kernels/mstopk_triton.py implements them with Triton kernels for CUDA. `mstopk_device_ops` is the
torch version as a function: it runs on CPU tensors, which is how the algorithm is tested without a
GPU, and on CUDA where Triton is missing.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

MAX_ITERS = 32
LANE_BITS = 5  # bits of the key decided per counting pass
LANES = 1 << LANE_BITS  # keys counted per pass: base + t * step for t < 2**bits
FLOAT_KEY_BITS = 31  # non-negative float32 bit patterns (the sign bit of |x| is clear)
INF_BITS = 0x7F800000  # float32 +inf; larger patterns are NaN and count nothing, as inf does here


def check_args(x: Tensor, k: int, iters: int) -> Tensor:
    """x flattened (indices refer to ``x.reshape(-1)``), after the checks every path shares."""
    if not x.is_floating_point():
        raise ValueError(f"mstopk: x must be a floating-point tensor, got {x.dtype}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"mstopk: k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"mstopk: k must be positive, got k={k}")
    if isinstance(iters, bool) or not isinstance(iters, int):
        raise ValueError(f"mstopk: iters must be an int, got {type(iters).__name__}")
    if not 1 <= iters <= MAX_ITERS:
        raise ValueError(f"mstopk: iters must be in [1, {MAX_ITERS}], got {iters}")
    return x.reshape(-1)


def everything(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The result for k >= numel: every element, indices 0 .. numel-1."""
    return flat, torch.arange(flat.numel(), device=flat.device)


def key_thresholds(keys: Tensor, stats: Tensor, grid: int, float_keys: bool) -> Tensor:
    """float32 thresholds of int64 keys: T(j) of the grid (stats = [mean, max - mean]), or the
    float32 whose bit pattern is the key (patterns past +inf give +inf)."""
    if float_keys:
        return keys.clamp(0, INF_BITS).to(torch.int32).view(torch.float32)
    # The reference's float64 expression, term by term (separate ops: no fused multiply-add).
    t = (stats[0] + stats[1] * (keys.double() / grid)).float()
    return torch.where(keys > grid, float("inf"), t)


def split_bits(bits: int) -> list[int]:
    """Bits decided by each counting pass: as even as LANE_BITS allows, larger first."""
    passes = -(-bits // LANE_BITS)
    return [bits // passes + (i < bits % passes) for i in range(passes)]


class Passes(Protocol):
    """The primitives of `sync_free_mstopk`, bound to one flat input x."""

    def stats(self) -> tuple[Tensor, Tensor]:
        """(sum(|x|) as a 0-d float64 tensor, max(|x|) as a 0-d float32 tensor)."""

    def count(self, stats: Tensor, gate: Tensor, base: Tensor, counts: Tensor, p: int,
              prev_step: int, step: int, points: int, limit: int, grid: int,
              float_keys: bool) -> None:
        """Counting pass p, in place: ``base[p] = base[p-1] + prev_step * max(#{counts[p-1] >
        limit} - 1, 0)``; ``counts[p, t] = #{|x| >= threshold(base[p] + t * step)}`` for t <
        points and 0 for the other lanes; all of counts[p] stays 0 where the 0-d gate is 0."""

    def select(self, bounds: Tensor, k: int) -> Tensor:
        """int64[k]: ascending indices of every |x| >= bounds[1], then of the first ``k - #{|x| >=
        bounds[1]}`` by index with bounds[0] <= |x| < bounds[1]. Positions past k (possible only
        for non-finite input) are dropped, unwritten positions hold 0."""


def _moved(counts: Tensor, limit: int) -> Tensor:
    # Lane 0 is the base itself (count > limit, except key 0 in the first pass): keys past the base.
    return ((counts > limit).sum() - 1).clamp(min=0)


def _search(passes: Passes, stats: Tensor, gate: Tensor, limit: int, bits: int, grid: int,
            float_keys: bool) -> tuple[Tensor, Tensor]:
    """(largest key in [0, 2**bits) whose count exceeds limit, or 0; the per-pass counts)."""
    plan = split_bits(bits)
    base = torch.zeros(len(plan) + 1, dtype=torch.int64, device=stats.device)
    counts = torch.zeros(len(plan) + 1, LANES, dtype=torch.int64, device=stats.device)
    remaining, prev_step = bits, 0
    for p, pass_bits in enumerate(plan, 1):
        remaining -= pass_bits
        step = 1 << remaining
        passes.count(stats, gate, base, counts, p, prev_step, step, 1 << pass_bits, limit, grid,
                      float_keys)
        prev_step = step
    return base[-1] + _moved(counts[-1], limit), counts  # the last pass has step 1


def sync_free_mstopk(flat: Tensor, k: int, iters: int, passes: Passes) -> tuple[Tensor, Tensor]:
    """kernels.mstopk for a flat tensor with 0 < k < numel (checked by the caller), no host sync."""
    n, grid = flat.numel(), 1 << iters
    total, peak = passes.stats()
    mean = total / n
    stats = torch.stack([mean, peak.double() - mean])  # as the reference: mean, max - mean
    always = torch.ones((), dtype=torch.int64, device=flat.device)
    j, grid_counts = _search(passes, stats, always, k, iters + 1, grid, float_keys=False)
    fallback = grid_counts[1, 0] <= k  # count(0) <= k: the exact top-k
    v, _ = _search(passes, stats, fallback.long(), k - 1, FLOAT_KEY_BITS, grid, float_keys=True)
    bounds = torch.where(fallback, key_thresholds(torch.stack([v, v + 1]), stats, grid, True),
                         key_thresholds(torch.stack([j, j + 1]), stats, grid, False))
    indices = passes.select(bounds, k)
    finite = total.isfinite()
    indices = torch.where(finite, indices, torch.arange(k, device=flat.device))
    return flat[indices].masked_fill(~finite, float("nan")), indices


class TorchPasses:
    """The primitives in torch ops: any device, no host reads (the reference for the Triton ones)."""

    def __init__(self, flat: Tensor) -> None:
        self.a = flat.float().abs()
        self.lanes = torch.arange(LANES, device=flat.device)

    def stats(self) -> tuple[Tensor, Tensor]:
        return self.a.sum(dtype=torch.float64), self.a.max()

    def count(self, stats: Tensor, gate: Tensor, base: Tensor, counts: Tensor, p: int,
              prev_step: int, step: int, points: int, limit: int, grid: int,
              float_keys: bool) -> None:
        base[p] = base[p - 1] + _moved(counts[p - 1], limit) * prev_step
        thresholds = key_thresholds(base[p] + self.lanes * step, stats, grid, float_keys)
        thresholds = torch.where(self.lanes < points, thresholds, float("inf"))
        # Ascending thresholds (NaN only from non-finite stats, whose result is discarded):
        # bucket = #{thresholds <= |x|}, so |x| >= thresholds[t] exactly when bucket > t.
        bucket = torch.searchsorted(thresholds.nan_to_num(nan=float("inf")), self.a, right=True)
        hist = torch.zeros(LANES + 1, dtype=torch.int64, device=self.a.device)
        hist.scatter_add_(0, bucket, torch.ones_like(bucket))
        counts[p] = hist.flip(0).cumsum(0).flip(0)[1:] * gate

    def select(self, bounds: Tensor, k: int) -> Tensor:
        above = self.a >= bounds[1]
        band = (self.a >= bounds[0]) & ~above
        need = k - above.sum()
        band_rank = band.cumsum(0) - band.long()  # band elements before this one
        keep = above | (band & (band_rank < need))
        pos = keep.cumsum(0) - keep.long()
        slot = torch.where(keep & (pos >= 0) & (pos < k), pos, k)  # slot k collects the rest
        out = torch.zeros(k + 1, dtype=torch.int64, device=self.a.device)
        out.scatter_(0, slot, torch.arange(self.a.numel(), device=self.a.device))
        return out[:k]


def mstopk_device_ops(x: Tensor, k: int, iters: int = 20) -> tuple[Tensor, Tensor]:
    """kernels.mstopk's result in torch ops without a host sync, on any device.

    Arguments and errors as kernels.mstopk, except that NaN or inf in x gives k NaN values and
    indices 0 .. k-1 instead of a ValueError (see the module docstring).
    """
    flat = check_args(x, k, iters)
    if k >= flat.numel():
        return everything(flat)
    return sync_free_mstopk(flat, k, iters, TorchPasses(flat))
