"""MSTopK: approximate top-k by threshold bisection (Shi et al., MLSys 2021, arXiv 2010.10458).

Selection by |x|, exactly k (value, index) pairs, without sorting x:

1. Thresholds lie on a grid between mean(|x|) and max(|x|), computed in float64 and rounded once to
   float32: ``T(j) = fp32(mean + (max - mean) * (j / 2**iters))`` for ``j = 0 .. 2**iters``, and
   ``T(2**iters + 1) = inf``. ``count(j) = #{i : |x_i| >= T(j)}`` never increases with j.
2. ``iters`` bisection steps find J, the largest j with ``count(j) > k``, so ``count(J + 1) <= k``
   (J = 2**iters when more than k elements tie at the maximum).
3. The result is every element with ``|x| >= T(J + 1)`` plus the first ``k - count(J + 1)``
   elements, by index, of the band ``T(J) <= |x| < T(J + 1)``. Indices come in ascending order;
   values are the original signed values, in x's dtype.

Guards: ``k >= numel`` returns every element; ``k <= 0`` raises ValueError; if ``count(0) <= k``
(k exceeds the number of elements at or above the mean, so the bisection range cannot hold the
answer) the result is the exact top-k of |x|: with v the k-th largest |x|, every element with
``|x| > v`` plus the first ones, by index, with ``|x| = v`` (step 3 with the band ``[v, v]``). NaN
or inf in x raises ValueError (when k < numel), except on the device path (`mstopk` on CUDA
tensors, and `mstopk_device_ops`), where raising would need a host sync: there the result is k NaN
values, in x's dtype, with indices 0 .. k-1. float16, bfloat16 and float64 inputs are compared in
float32. Inputs of any shape are flattened; indices refer to ``x.reshape(-1)``.

Four implementations share these semantics and are tested against each other:
``mstopk_reference`` (the literal algorithm: one pass over x per bisection step), a CPU path of
three streaming passes (kernels/csrc/mstopk_cpu.cpp: exact bit-pattern histograms replace the
per-step passes), and the device path for CUDA tensors, which never waits for the device
(kernels/mstopk_device.py: the algorithm and its torch-op version, which also runs on CPU tensors;
kernels/mstopk_triton.py: its Triton kernels). The CPU and Triton paths sum |x| in another order
than torch, so their mean may differ in the last float64 bit; that changes a float32 threshold only
on an exact rounding tie.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from kernels import _native
from kernels.mstopk_device import MAX_ITERS, check_args, everything, mstopk_device_ops

__all__ = ["MAX_ITERS", "mstopk", "mstopk_device_ops", "mstopk_reference", "mstopk_warm_up"]

LOW_BITS = 15  # the C++ scan bins |x| by bits 15..30 of its float32 pattern; refine by bits 0..14
HIGH_BINS = 1 << 16

# ---------------------------------------------------------------- shared pieces of the algorithm


def checked_mean(total: float, n: int) -> float:
    """mean(|x|) from sum(|x|); a non-finite sum means the input held NaN or inf."""
    if total != total or total in (float("inf"), float("-inf")):
        raise ValueError("mstopk: input contains NaN or inf; top-k by magnitude is undefined "
                         "(check the gradients for overflow before sparsifying)")
    return total / n


def threshold(mean: float, max_abs: float, j: int, iters: int) -> float:
    """T(j): grid point j of 2**iters between mean and max, rounded to float32; inf past the max."""
    grid = 1 << iters
    if j > grid:
        return float("inf")
    return struct.unpack("<f", struct.pack("<f", mean + (max_abs - mean) * (j / grid)))[0]


def _float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def keep_between(flat: Tensor, a: Tensor, lo: Tensor | float, hi: Tensor | float,
                 k: int) -> tuple[Tensor, Tensor]:
    """Step 3: every |x| >= hi, then the first elements by index with lo <= |x| < hi, k in all."""
    above = a >= hi
    band = (a >= lo) & ~above
    need = k - int(above.sum())
    keep = above | (band & (band.cumsum(0) <= need))
    indices = keep.nonzero().squeeze(1)
    return flat[indices], indices


def exact_topk(flat: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k of |x| (ascending indices, ties at the k-th by index): for count(0) <= k."""
    a = flat.float().abs()
    kth = torch.topk(a, k, sorted=False).values.min()
    return keep_between(flat, a, kth, torch.nextafter(kth, kth.new_tensor(float("inf"))), k)


# ---------------------------------------------------------------- reference


def mstopk_reference(x: Tensor, k: int, iters: int = 20) -> tuple[Tensor, Tensor]:
    """The literal algorithm in torch, one pass over x per bisection step (see the module doc)."""
    flat = check_args(x, k, iters)
    if k >= flat.numel():
        return everything(flat)
    a = flat.float().abs()
    mean = checked_mean(a.sum(dtype=torch.float64).item(), a.numel())
    max_abs = a.max().item()

    def count(j: int) -> int:
        return int((a >= threshold(mean, max_abs, j, iters)).sum())

    if count(0) <= k:
        return exact_topk(flat, k)
    # Invariant: count(lo) > k >= count(hi).
    lo, hi = 0, 1 << iters
    if count(hi) > k:  # more than k elements tie at the maximum: take them from the band [max, inf)
        lo, hi = hi, hi + 1
    else:
        for _ in range(iters):
            mid = (lo + hi) // 2
            if count(mid) > k:
                lo = mid
            else:
                hi = mid
    return keep_between(flat, a, threshold(mean, max_abs, lo, iters),
                        threshold(mean, max_abs, hi, iters), k)


# ---------------------------------------------------------------- fast CPU path


def _last_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Largest j in [lo, hi) with pred(j); pred is true then false, pred(lo) and not pred(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _mstopk_cpu(lib: ctypes.CDLL, flat: Tensor, k: int, iters: int) -> tuple[Tensor, Tensor]:
    """Same J as the reference, found from exact histograms in three passes instead of iters + 2.

    Non-negative float32 values order like their bit patterns, so the top-bits histogram bounds
    count(j) by the counts above and at T(j)'s bin. Bisecting those bounds gives j_lo (surely
    count > k) and j_hi (surely count <= k); every grid point strictly between them has its
    threshold in the one bin where the suffix count crosses k, so a histogram of that bin's low bits
    makes count(j) exact there. Searching on monotone counts over the full grid finds the same J as
    the reference's bisection.
    """
    x = flat.to(torch.float32).contiguous()
    n, threads = x.numel(), torch.get_num_threads()
    hist = torch.empty(HIGH_BINS, dtype=torch.int64)
    total, max_abs = ctypes.c_double(), ctypes.c_float()
    lib.mstopk_scan(x.data_ptr(), n, threads, ctypes.byref(total), ctypes.byref(max_abs),
                    hist.data_ptr())
    mean, peak, grid = checked_mean(total.value, n), max_abs.value, 1 << iters
    suffix = torch.cat([hist.flip(0).cumsum(0).flip(0), hist.new_zeros(1)])  # # in bins >= b

    def bits(j: int) -> int:
        return _float_bits(threshold(mean, peak, j, iters))

    def surely_above_k(j: int) -> bool:  # count(j) >= #elements in bins above T(j)'s bin
        return j < 0 or int(suffix[(bits(j) >> LOW_BITS) + 1]) > k

    def maybe_above_k(j: int) -> bool:  # count(j) <= #elements in T(j)'s bin and above
        return j < 0 or int(suffix[bits(j) >> LOW_BITS]) > k

    j_lo = _last_true(-1, grid + 1, surely_above_k)  # j = -1 stands for count = n > k
    j_hi = _last_true(j_lo, grid + 1, maybe_above_k) + 1
    if j_hi - j_lo > 1:
        crossing = bits(j_lo + 1) >> LOW_BITS
        low = torch.empty(1 << LOW_BITS, dtype=torch.int64)
        lib.mstopk_refine(x.data_ptr(), n, threads, crossing, low.data_ptr())
        low_suffix = torch.cat([low.flip(0).cumsum(0).flip(0), low.new_zeros(1)])
        base = int(suffix[crossing + 1])

        def exact_above_k(j: int) -> bool:
            return base + int(low_suffix[bits(j) & ((1 << LOW_BITS) - 1)]) > k

        j_lo = _last_true(j_lo, j_hi, exact_above_k)
    if j_lo < 0:  # count(0) <= k
        return exact_topk(flat, k)
    above = torch.empty(k, dtype=torch.int64)
    band = torch.empty(k, dtype=torch.int64)
    written = torch.empty(2, dtype=torch.int64)
    lib.mstopk_select(x.data_ptr(), n, threads, threshold(mean, peak, j_lo, iters),
                      threshold(mean, peak, j_lo + 1, iters), k, k, above.data_ptr(),
                      band.data_ptr(), written.data_ptr())
    n_above = int(written[0])
    indices = torch.cat([above[:n_above], band[:k - n_above]]).sort().values
    return flat[indices], indices


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, c_int, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.mstopk_scan.argtypes = [ptr, i64, c_int, ptr, ptr, ptr]
    lib.mstopk_refine.argtypes = [ptr, i64, c_int, ctypes.c_uint32, ptr]
    lib.mstopk_select.argtypes = [ptr, i64, c_int, f32, f32, i64, i64, ptr, ptr, ptr]
    for fn in (lib.mstopk_scan, lib.mstopk_refine, lib.mstopk_select):
        fn.restype = None
    return lib


def native_library() -> ctypes.CDLL | None:
    """The compiled CPU kernels, or None (after one warning) where they cannot be built."""
    lib = _native.load("mstopk_cpu")
    return lib if lib is None or lib.mstopk_scan.argtypes else _bind(lib)


# ---------------------------------------------------------------- entry point


@functools.cache
def device_path() -> Callable[[Tensor, int, int], tuple[Tensor, Tensor]]:
    """The sync-free implementation for CUDA tensors: the Triton kernels, or (after one warning)
    the same algorithm in torch ops where Triton cannot be imported."""
    try:
        from kernels.mstopk_triton import mstopk_triton  # Triton is imported only for GPU work
    except ImportError as err:
        warnings.warn(f"mstopk: Triton unavailable ({err}); CUDA tensors use the torch-op "
                      "version of the device path", RuntimeWarning, stacklevel=2)
        return mstopk_device_ops
    return mstopk_triton


def mstopk(x: Tensor, k: int, iters: int = 20) -> tuple[Tensor, Tensor]:
    """Approximate top-k of |x|: (values, int64 indices), exactly min(k, numel) of them.

    Semantics, guards and errors are in the module docstring. CUDA tensors take the device path
    (Triton kernels; no host sync, so NaN or inf in x gives NaN values rather than a ValueError),
    CPU tensors the compiled kernels (or, where no C++ compiler works, `mstopk_reference`).
    """
    flat = check_args(x, k, iters)
    if k >= flat.numel():
        return everything(flat)
    if flat.is_cuda:
        return device_path()(flat, k, iters)
    lib = native_library()
    if lib is None:
        return mstopk_reference(flat, k, iters)
    return _mstopk_cpu(lib, flat, k, iters)


def mstopk_warm_up(device: torch.device | str, sizes: Iterable[tuple[int, int]], iters: int = 20,
            dtype: torch.dtype = torch.float32) -> None:
    """Compile, ahead of the first timed step, what `mstopk` runs on `device` for these sizes.

    sizes: the (numel, k) pairs of the calls to come (per gradient bucket: the shard size and its
    k). On CUDA every pair gets one call on zeros of `dtype` on the current stream, then the device
    synchronises: Triton compiles a kernel on its first launch for each new dtype, iters and
    integer-argument specialisation (numel and k divisible by 16 or equal to 1), and the device
    path launches all its kernels on every call whatever the data, so zeros reach them all. On
    the CPU it builds or loads the compiled kernels. Only call it where a sync is allowed.
    """
    device = torch.device(device)
    if device.type != "cuda":
        native_library()
        return
    for numel, k in sizes:
        mstopk(torch.zeros(numel, dtype=dtype, device=device), k, iters)
    torch.cuda.synchronize(device)
