"""kernels/: MSTopK (reference, compiled CPU path, Triton in its interpreter), FusedLARS, Adam."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import kernels.lars as lars_module
from kernels import FusedLARS, _native, build_adam, mstopk, mstopk_reference
from kernels.lars import LARSReference
from kernels.testing import gradient_like

pytestmark = pytest.mark.unit

mstopk_module = importlib.import_module("kernels.mstopk")  # kernels.mstopk is also the function



def recall(indices: torch.Tensor, x: torch.Tensor, k: int) -> float:
    exact = torch.topk(x.abs(), k).indices
    return torch.isin(indices, exact).sum().item() / k


def assert_same(result: tuple[torch.Tensor, torch.Tensor],
                expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(result[1], expected[1])
    assert torch.equal(result[0], expected[0])


# ---------------------------------------------------------------- MSTopK selection


@pytest.mark.parametrize("n", [1_000, 100_000, 1_000_000])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_mstopk_exact_k_high_recall_and_same_as_reference(n: int, density: float) -> None:
    x = gradient_like(n, seed=n)
    k = max(1, int(n * density))
    values, indices = mstopk(x, k)
    assert indices.dtype == torch.int64 and indices.numel() == k
    assert torch.equal(indices, indices.sort().values) and indices.unique().numel() == k
    assert torch.equal(values, x[indices])  # original signed values
    assert recall(indices, x, k) >= 0.99
    assert_same((values, indices), mstopk_reference(x, k))


@pytest.mark.parametrize("iters", [1, 3, 7, 32])
def test_mstopk_other_iteration_counts_match_reference(iters: int) -> None:
    x = gradient_like(50_000, seed=iters)
    result = mstopk(x, 500, iters)
    assert result[1].numel() == 500
    assert_same(result, mstopk_reference(x, 500, iters))


# ---------------------------------------------------------------- MSTopK guards

IMPLEMENTATIONS = [mstopk, mstopk_reference]


@pytest.mark.parametrize("topk", IMPLEMENTATIONS)
@pytest.mark.parametrize("k", [100, 101])
def test_k_at_least_numel_returns_everything(topk, k: int) -> None:
    x = gradient_like(100)
    values, indices = topk(x, k)
    assert torch.equal(indices, torch.arange(100)) and torch.equal(values, x)


@pytest.mark.parametrize("topk", IMPLEMENTATIONS)
@pytest.mark.parametrize("x, k, iters, match", [
    (torch.ones(10), 0, 20, "k must be positive, got k=0"),
    (torch.ones(10), -3, 20, "k must be positive, got k=-3"),
    (torch.ones(10), 2.0, 20, "k must be an int, got float"),
    (torch.ones(10), 2, 0, r"iters must be in \[1, 32\], got 0"),
    (torch.arange(10), 2, 20, "x must be a floating-point tensor, got torch.int64"),
    (torch.tensor([1.0, float("nan"), 2.0, 3.0]), 1, 20, "input contains NaN or inf"),
    (torch.tensor([1.0, float("-inf"), 2.0, 3.0]), 1, 20, "input contains NaN or inf"),
])
def test_bad_input_raises(topk, x: torch.Tensor, k, iters: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topk(x, k, iters)


@pytest.mark.parametrize("topk", IMPLEMENTATIONS)
def test_k_beyond_count_above_mean_falls_back_to_exact_topk(topk) -> None:
    x = gradient_like(10_000, seed=1)
    k = 6_000  # well over the ~30% of elements at or above mean(|x|)
    values, indices = topk(x, k)
    exact = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(indices, exact) and torch.equal(values, x[exact])


@pytest.mark.parametrize("topk", IMPLEMENTATIONS)
@pytest.mark.parametrize("fill", [0.0, -2.5])
def test_all_equal_input_still_gives_exactly_k(topk, fill: float) -> None:
    x = torch.full((5_000,), fill)
    values, indices = topk(x, 37)
    assert torch.equal(indices, torch.arange(37)) and torch.equal(values, torch.full((37,), fill))


@pytest.mark.parametrize("topk", IMPLEMENTATIONS)
def test_more_than_k_ties_at_the_maximum_take_the_first(topk) -> None:
    x = torch.tensor([1.0, -5.0, 0.5, 5.0, 5.0, 2.0, -5.0])
    values, indices = topk(x, 2)
    assert indices.tolist() == [1, 3] and values.tolist() == [-5.0, 5.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_compared_in_fp32_and_returned_in_its_dtype(dtype) -> None:
    x = gradient_like(20_000, seed=2).to(dtype)
    values, indices = mstopk(x, 200)
    assert values.dtype == dtype and indices.numel() == 200
    assert torch.equal(indices, mstopk(x.float(), 200)[1])
    assert_same((values, indices), mstopk_reference(x, 200))


def test_multidimensional_input_is_flattened() -> None:
    x = gradient_like(6_000, seed=3)
    values, indices = mstopk(x.view(60, 100), 60)
    assert_same((values, indices), mstopk(x, 60))


# ---------------------------------------------------------------- native build


def test_native_build_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DAWNBENCH_KERNEL_CACHE", str(tmp_path))
    built = _native.build("mstopk_cpu")
    mtime = built.stat().st_mtime_ns
    assert _native.build("mstopk_cpu") == built and built.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary files left


def test_missing_compiler_warns_and_falls_back_to_reference(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DAWNBENCH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    message = "could not build mstopk_cpu.*'no-such-compiler' not found"
    with pytest.warns(RuntimeWarning, match=message):
        assert _native.load.__wrapped__("mstopk_cpu") is None
    monkeypatch.setattr(mstopk_module, "native_library", lambda: None)
    x = gradient_like(3_000, seed=4)
    assert_same(mstopk(x, 30), mstopk_reference(x, 30))


# ---------------------------------------------------------------- FusedLARS


def clipped_shares(opt: FusedLARS | LARSReference) -> dict[str, float]:
    """The last step's shares of LARS tensors clipped to the max and to the min, as floats."""
    return {k: v.item() for k, v in opt.step_metrics().items()}


def lars_problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8, 3, 3), (32, 16), (10,), (64,), (5, 5)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    params[4].zero_()  # ||w|| = 0 -> ratio 1
    grads = []
    for _ in range(20):
        step = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.01 for s in shapes]
        step[1].zero_()  # ||g|| = 0 -> ratio 1, only weight decay moves it
        grads.append(step)
    return params, grads


# No range, and one where, in lars_problem and kernel_lars_problem, the max binds for the tensor
# with a zero gradient (ratio 1), the min for the one that starts at zero (ratio near 5e-4 once it
# moved), and neither for the others (near 0.33); with trust_clip, the max binds for most.
TRUST_RANGES = [dict(min_trust_ratio=0.0, max_trust_ratio=None),
                dict(min_trust_ratio=0.1, max_trust_ratio=0.8)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("trust_clip", [False, True])
@pytest.mark.parametrize("trust_range", TRUST_RANGES, ids=["unbounded", "range"])
@pytest.mark.parametrize("block", [1 << 17, 300])  # one cache block, or several
def test_fused_lars_matches_per_tensor_reference(nesterov: bool, trust_clip: bool,
                                                 trust_range: dict, block: int,
                                                 monkeypatch) -> None:
    monkeypatch.setattr(lars_module, "CPU_BLOCK_ELEMENTS", block)
    params, grads = lars_problem()
    options = dict(weight_decay=5e-2, trust_coefficient=0.02, eps=1e-8, nesterov=nesterov,
                   trust_clip=trust_clip, **trust_range)
    decay = {**options, "lars_exclude": False}
    exclude = {**options, "lars_exclude": True}
    groups = [decay, decay, exclude, exclude, decay]
    lrs = [0.5 * (1 + s) / 20 for s in range(20)]  # a warm-up schedule
    momenta = [0.9 + 0.004 * s for s in range(20)]  # cyclic-momentum-like

    excluded = [g["lars_exclude"] for g in groups]
    weights, opt = run_lars(FusedLARS, params, grads, excluded, lrs, momenta, **options)
    expected, reference = run_lars(LARSReference, params, grads, excluded, lrs, momenta, **options)
    assert clipped_shares(opt) == pytest.approx(clipped_shares(reference))
    for w, e, p in zip(weights, expected, params):
        torch.testing.assert_close(w.detach(), e.detach(), rtol=1e-6, atol=1e-12)
    for i in (0, 2, 4):  # the updates are not negligible, so the comparison means something
        assert (weights[i] - params[i]).abs().max() > 1e-3


def kernel_lars_problem() -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[bool]]:
    """float32 tensors for the compiled path: lars_problem's edge cases (a zero weight, a zero
    gradient, exclusions) plus a decayed tensor larger than the kernel's cache block (2^18
    elements) and an excluded one of several tasks (2^14 elements each), so that both groups
    start more than one thread, threads share tensors, and the decayed group has two blocks."""
    params, grads = lars_problem(seed=3)
    gen = torch.Generator().manual_seed(4)
    big = [(512, 64, 3, 3), (300, 301)]
    params += [torch.randn(s, generator=gen, dtype=torch.float64) for s in big]
    for step in grads:
        step += [torch.randn(s, generator=gen, dtype=torch.float64) * 0.01 for s in big]
    excluded = [False, False, True, True, False, False, True]
    return ([p.float() for p in params], [[g.float() for g in step] for step in grads], excluded)


def run_lars(cls: type[FusedLARS] | type[LARSReference], params: list[torch.Tensor],
             grads: list[list[torch.Tensor]], excluded: list[bool], lrs: list[float],
             momenta: list[float], frozen: tuple[torch.nn.Parameter, ...] = (), **options
             ) -> tuple[list[torch.nn.Parameter], FusedLARS | LARSReference]:
    """`cls` (FusedLARS or LARSReference) over copies of params for len(grads) steps, with a
    schedule of lr and momentum; `frozen` parameters (grad None) join the first group."""
    weights = [torch.nn.Parameter(p.clone()) for p in params]
    opt = cls([{"params": [*frozen, *(w for w, e in zip(weights, excluded) if not e)]},
                     {"params": [w for w, e in zip(weights, excluded) if e],
                      "lars_exclude": True}], lr=lrs[0], **options)
    for step, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"], group["momentum"] = lrs[step], momenta[step]
        for w, gw in zip(weights, g):
            w.grad = gw.clone()
        opt.step()
    return weights, opt


def assert_matches_reference(weights: list[torch.nn.Parameter], params: list[torch.Tensor],
                             grads: list[list[torch.Tensor]], excluded: list[bool],
                             lrs: list[float], momenta: list[float], opt: FusedLARS,
                             **options) -> None:
    """float32 results within 1e-6 of each tensor's largest value of the float64 reference: 20
    float32 roundings of w stay near 1e-7 relative, and elements near 0 get the tensor's scale.
    The last step's clipped shares are the reference's (no ratio lies near a bound)."""
    expected, reference = run_lars(LARSReference, [p.double() for p in params],
                                   [[g.double() for g in s] for s in grads], excluded, lrs, momenta,
                                   **options)
    assert clipped_shares(opt) == pytest.approx(clipped_shares(reference))
    for w, e, p in zip(weights, expected, params):
        torch.testing.assert_close(w.detach().double(), e.detach(), rtol=1e-6,
                                   atol=1e-6 * e.abs().max().item())
        assert (w - p).abs().max() > 1e-4  # every tensor moved: the comparison means something


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("trust_clip", [False, True])
@pytest.mark.parametrize("trust_range", TRUST_RANGES, ids=["unbounded", "range"])
@pytest.mark.parametrize("threads", [1, 3])  # one thread; shares that do not divide evenly
def test_fused_lars_compiled_cpu_path_matches_reference(nesterov: bool, trust_clip: bool,
                                                        trust_range: dict, threads: int,
                                                        monkeypatch) -> None:
    assert lars_module.native_library() is not None, "kernels/csrc/lars_cpu.cpp did not build"

    def no_foreach(*args, **kwargs):
        raise AssertionError("float32 CPU tensors took the foreach path, not lars_cpu.cpp")

    monkeypatch.setattr(FusedLARS, "_foreach_step", no_foreach)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    params, grads, excluded = kernel_lars_problem()
    # A conv weight in channels_last, as the trainer keeps them: its gradient and momentum buffer
    # share its strides, so the kernel takes it too.
    params[0] = params[0].to(memory_format=torch.channels_last)
    for step in grads:
        step[0] = step[0].to(memory_format=torch.channels_last)
    options = dict(weight_decay=5e-2, trust_coefficient=0.02, eps=1e-8, nesterov=nesterov,
                   trust_clip=trust_clip, **trust_range)
    lrs = [0.5 * (1 + s) / 20 for s in range(20)]  # a warm-up schedule
    momenta = [0.9 + 0.004 * s for s in range(20)]  # cyclic-momentum-like
    frozen = torch.nn.Parameter(torch.ones(7))  # grad None: skipped, no state
    try:
        weights, opt = run_lars(FusedLARS, params, grads, excluded, lrs, momenta, (frozen,),
                                **options)
    finally:
        torch.set_num_threads(previous_threads)
    assert torch.equal(frozen, torch.ones(7)) and frozen not in opt.state
    assert_matches_reference(weights, params, grads, excluded, lrs, momenta, opt, **options)


@pytest.mark.parametrize("clip", [dict(trust_clip=True),
                                  dict(trust_clip=False, **TRUST_RANGES[1])], ids=["clip", "range"])
def test_fused_lars_mixed_and_fallback_tensors_match_reference(clip: dict, monkeypatch) -> None:
    """Tensors the kernel cannot take (float64, strides unlike the weight's) take the foreach path
    in the same step; without a compiler every tensor does, with the same result."""
    params, grads, excluded = kernel_lars_problem()
    params[1] = params[1].double()
    for step in grads:
        step[1] = step[1].double()
        step[6] = step[6].t().contiguous().t()  # column-major gradient of a row-major weight
    options = dict(weight_decay=5e-2, trust_coefficient=0.02, eps=1e-8, nesterov=True, **clip)
    lrs, momenta = [0.1] * 20, [0.9] * 20
    paths = {"kernel": 0, "foreach": 0}

    def counting(name: str, fn):
        def wrapper(*args, **kwargs):
            paths[name] += len(args[-1])  # bufs: one per tensor
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(lars_module, "_kernel_step", counting("kernel", lars_module._kernel_step))
    monkeypatch.setattr(FusedLARS, "_foreach_step",  # the bound classmethod, called unbound
                        staticmethod(counting("foreach", FusedLARS._foreach_step)))
    weights, opt = run_lars(FusedLARS, params, grads, excluded, lrs, momenta, **options)
    assert paths == {"kernel": 5 * 20, "foreach": 2 * 20}
    assert_matches_reference(weights, params, grads, excluded, lrs, momenta, opt, **options)

    monkeypatch.setattr(lars_module, "native_library", lambda: None)  # as after a failed build
    paths.update(kernel=0, foreach=0)
    weights, opt = run_lars(FusedLARS, params, grads, excluded, lrs, momenta, **options)
    assert paths == {"kernel": 0, "foreach": 7 * 20}
    assert_matches_reference(weights, params, grads, excluded, lrs, momenta, opt, **options)


@pytest.mark.parametrize("exclude", [False, True])
def test_fused_lars_compiled_path_takes_empty_tensors(exclude: bool) -> None:
    """A group of empty tensors has no norm work at all; its update must not wait for any."""
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    empty.grad = torch.zeros(0, 3)
    FusedLARS([{"params": [empty], "lars_exclude": exclude}], lr=0.1, weight_decay=0.1).step()
    w = torch.nn.Parameter(torch.ones(5))
    w.grad = torch.ones(5)
    FusedLARS([{"params": [empty, w], "lars_exclude": exclude}], lr=0.1, momentum=0.0,
              trust_coefficient=1.0, trust_clip=True).step()
    torch.testing.assert_close(w.detach(), torch.full((5,), 0.9))  # ratio 1 (clipped) or none


def clip_problem(dtype: torch.dtype, cls: type[FusedLARS] | type[LARSReference] = FusedLARS
                 ) -> tuple[list[torch.nn.Parameter], FusedLARS | LARSReference]:
    """Three LARS tensors w = (3, 4), ||w|| = 5, whose gradients (0.6, 0.8), (0.15, 0.2) and
    (0.375, 0.5) give, with eta 0.1 and no decay or eps, trust ratios 0.5, 2 and 0.8; the range
    [0.6, 1] clips the first to 0.6 (min) and the second to 1 (max). An excluded tensor (1, 1)
    with gradient (1, 1) takes plain SGD and is no layer of the metrics."""
    grads = [(0.6, 0.8), (0.15, 0.2), (0.375, 0.5), (1.0, 1.0)]
    weights = [torch.nn.Parameter(torch.tensor(w, dtype=dtype))
               for w in [(3.0, 4.0)] * 3 + [(1.0, 1.0)]]
    for w, g in zip(weights, grads):
        w.grad = torch.tensor(g, dtype=dtype)
    opt = cls([{"params": weights[:3]}, {"params": weights[3:], "lars_exclude": True}],
              lr=1.0, momentum=0.0, trust_coefficient=0.1, eps=0.0, min_trust_ratio=0.6,
              max_trust_ratio=1.0)
    return weights, opt


@pytest.mark.parametrize("path", ["foreach", "compiled", "foreach float32", "reference"])
def test_fused_lars_trust_range_by_hand(path: str, monkeypatch) -> None:
    """w - lr * clip(ratio, 0.6, 1) * g, worked out by hand for clip_problem's tensors: FusedLARS's
    paths and the reference the other tests compare them with."""
    if path == "foreach float32":
        monkeypatch.setattr(lars_module, "native_library", lambda: None)
    dtype = torch.float64 if path in ("foreach", "reference") else torch.float32
    weights, opt = clip_problem(dtype, LARSReference if path == "reference" else FusedLARS)
    metrics = opt.step_metrics()  # before any step: nothing clipped
    assert {k: v.item() for k, v in metrics.items()} == {
        "optim/lars_clipped_max_fraction": 0.0, "optim/lars_clipped_min_fraction": 0.0}
    opt.step()
    expected = [(3 - 0.6 * 0.6, 4 - 0.6 * 0.8),    # 0.5 -> 0.6: the min binds
                (3 - 1.0 * 0.15, 4 - 1.0 * 0.2),   # 2 -> 1: the max binds
                (3 - 0.8 * 0.375, 4 - 0.8 * 0.5),  # 0.8: inside the range
                (0.0, 0.0)]                        # excluded: w - lr * g
    for w, e in zip(weights, expected):
        torch.testing.assert_close(w.detach(), torch.tensor(e, dtype=w.dtype))
    metrics = opt.step_metrics()
    assert set(metrics) == {"optim/lars_clipped_max_fraction", "optim/lars_clipped_min_fraction"}
    for value in metrics.values():
        assert value.dim() == 0 and value.device == weights[0].device
        assert value.item() == pytest.approx(1 / 3)


def test_fused_lars_step_metrics_follow_the_last_step() -> None:
    """The fractions describe the last step only: a second step inside the range reports none."""
    weights, opt = clip_problem(torch.float32)
    opt.step()
    for group in opt.param_groups:
        group["min_trust_ratio"], group["max_trust_ratio"] = 0.0, 2.0
    opt.step()  # same gradients, ratios now 0.44, 1.9 and 0.72: all inside [0, 2]
    assert {k: v.item() for k, v in opt.step_metrics().items()} == {
        "optim/lars_clipped_max_fraction": 0.0, "optim/lars_clipped_min_fraction": 0.0}
    for group in opt.param_groups:  # ratios 0.396, 1.71, 0.648; no upper bound
        group["min_trust_ratio"], group["max_trust_ratio"] = 1.0, None
    opt.step()
    assert {k: v.item() for k, v in opt.step_metrics().items()} == {
        "optim/lars_clipped_max_fraction": 0.0,
        "optim/lars_clipped_min_fraction": pytest.approx(2 / 3)}


def test_fused_lars_loads_a_state_dict_without_the_trust_range() -> None:
    """A checkpoint saved before the trust range existed loads with the range unset."""
    weights, opt = clip_problem(torch.float64)
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["min_trust_ratio"], group["max_trust_ratio"]
    opt.load_state_dict(state)
    opt.step()
    assert [g["max_trust_ratio"] for g in opt.param_groups] == [None, None]
    torch.testing.assert_close(weights[1].detach(), torch.tensor([3 - 2 * 0.15, 4 - 2 * 0.2],
                                                                 dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # foreach path, compiled path
def test_fused_lars_state_dict_round_trip(dtype: torch.dtype) -> None:
    params, grads = lars_problem(seed=1)
    params = [p.to(dtype) for p in params]
    grads = [[g.to(dtype) for g in step] for step in grads]

    def make(weights):
        return FusedLARS([{"params": weights[:2]}, {"params": weights[2:], "lars_exclude": True}],
                         lr=0.1, weight_decay=1e-3, trust_clip=True)

    straight = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make(straight)
    for g in grads:
        for w, gw in zip(straight, g):
            w.grad = gw.clone()
        opt.step()

    resumed = [torch.nn.Parameter(p.clone()) for p in params]
    first = make(resumed)
    for g in grads[:10]:
        for w, gw in zip(resumed, g):
            w.grad = gw.clone()
        first.step()
    state = copy.deepcopy(first.state_dict())
    copies = [torch.nn.Parameter(w.detach().clone()) for w in resumed]
    second = make(copies)
    second.load_state_dict(state)
    for g in grads[10:]:
        for w, gw in zip(copies, g):
            w.grad = gw.clone()
        second.step()
    for a, b in zip(straight, copies):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-0.1), "lr must be >= 0, got -0.1"),
    (dict(lr=0.1, momentum=-0.5), "momentum must be >= 0, got -0.5"),
    (dict(lr=0.1, weight_decay=-1e-4), "weight_decay must be >= 0, got -0.0001"),
    (dict(lr=0.1, trust_coefficient=0.0), "trust_coefficient must be > 0, got 0.0"),
    (dict(lr=0.1, min_trust_ratio=-1e-5), "min_trust_ratio must be >= 0, got -1e-05"),
    (dict(lr=0.1, max_trust_ratio=0.0), r"max_trust_ratio must be None, or > 0 and >= "
                                        r"min_trust_ratio \(0.0\), got 0.0"),
    (dict(lr=0.1, min_trust_ratio=0.5, max_trust_ratio=0.1),
     r"max_trust_ratio must be None, or > 0 and >= min_trust_ratio \(0.5\), got 0.1"),
])
def test_fused_lars_rejects_bad_options(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FusedLARS([torch.nn.Parameter(torch.ones(3))], **kwargs)


def test_fused_lars_rejects_sparse_gradients() -> None:
    w = torch.nn.Parameter(torch.ones(4, 2))
    w.grad = torch.ones(4, 2).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        FusedLARS([w], lr=0.1).step()


# ---------------------------------------------------------------- Adam


@pytest.mark.parametrize("name, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_build_adam_matches_torch_reference(name: str, cls) -> None:
    params, grads = lars_problem(seed=2)
    params = [p.float() for p in params]
    options = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=1e-2)
    built_weights = [torch.nn.Parameter(p.clone()) for p in params]
    ref_weights = [torch.nn.Parameter(p.clone()) for p in params]
    built = build_adam(built_weights, name, **options)
    reference = cls(ref_weights, foreach=False, **options)
    assert built.defaults["fused"] is True  # CPU supports the fused kernel
    for g in grads:
        for a, b, gw in zip(built_weights, ref_weights, g):
            a.grad, b.grad = gw.float(), gw.float().clone()
        built.step()
        reference.step()
    for a, b in zip(built_weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_build_adam_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown name 'sgd' \\(valid: adam, adamw\\)"):
        build_adam([torch.nn.Parameter(torch.ones(2))], "sgd")
