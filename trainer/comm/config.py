"""The `comm` section: which gradient exchange, its bucket size, wire dtype, top-k and PowerSGD settings."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from trainer.comm.plan import AUTO_CHOOSABLE
from trainer.config import require

CommKind = Literal["dense", "topk", "hitopk", "powersgd", "local", "auto"]
"""The values of `comm.kind`."""
Compression = Literal["none", "fp16", "bf16"]
"""The values of `comm.compression`."""


@dataclass
class CommConfig:
    kind: CommKind = "dense"
    """Gradient exchange: dense = bucketed allreduce; topk = every rank's top-k with error feedback,
    allgathered; hitopk = the paper's hierarchical top-k (dense inside a node, sparse between nodes); powersgd =
    PowerSGD's rank-r approximation of each gradient matrix with error feedback (two small allreduces); local =
    local SGD / DiLoCo: each rank steps on its own gradients, and every comm.local_steps steps one allreduce of
    the pseudo-gradient feeds an outer SGD step (trainer/comm/local.py); auto = measure the cluster during the
    dense warm-up, then per bucket the exchange (`comm.auto_kinds`: dense fp32, dense 16-bit, topk, hitopk,
    powersgd if listed) and density with the least predicted exposed time (docs/communicators.md)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB of fp32 gradients; each bucket is launched as soon as it is ready."""
    compression: Compression = "none"
    """Wire dtype of the dense allreduce (kind dense; kind auto: the 16-bit dtype it may choose, bf16 when
    none); the average is accumulated back in fp32."""
    density: float = 0.01
    """topk/hitopk: fraction of each bucket (of each rank's 1/L shard for hitopk) sent per step."""
    dense_below: int = 16384
    """topk/hitopk/powersgd: buckets with fewer elements go through a dense allreduce."""
    dense_warmup_steps: int = 0
    """topk/hitopk/powersgd: the first steps use a dense allreduce for every bucket (stable start); local: the
    first steps synchronise every step."""
    densities: list[float] = field(default_factory=lambda: [0.01, 0.003, 0.001])
    """auto: the densities it may choose from (those below min_density are left out)."""
    auto_kinds: list[str] = field(default_factory=lambda: ["dense", "dense16", "topk", "hitopk"])
    """auto: the exchanges it may choose per bucket (dense always among them). powersgd is opt-in: untuned, its
    rank-r approximation can cost accuracy that the step-time model does not see."""
    min_density: float = 0.01
    """auto: the lowest density the recipe has shown to converge; auto never sends less (1 = never sparse)."""
    calibration_steps: int = 6
    """auto: dense steps it measures before deciding (at least 3; dense_warmup_steps when that is larger)."""
    trial_steps: int = 6
    """auto: steps each plan on trial runs, timed, right after calibration, and all dense after them; the
    fastest plan is kept only if it measured faster than all dense (0: the model's plan is kept untried)."""
    redecide_every: int = 50
    """auto: steps between drift checks (the measured exchange times against the current plan's reference window:
    its second measured one, or the trial that chose it; re-decided when they moved by more than `hysteresis`)."""
    dense_recheck_every: int = 20
    """auto: drift checks a plan other than all dense runs before one short all-dense window (the steps a check
    times, + 1) compares them on today's links: a link that got faster barely shows in a top-k plan's chains,
    which are mostly its own selection (0: never; dense comes back only when the plan measures slower)."""
    hysteresis: float = 0.1
    """auto: the fraction by which measured chain times must move to re-decide, a new plan must be predicted
    faster, and a plan may measure slower than all dense before it reverts to dense."""
    selection: Literal["auto", "mstopk", "torch"] = "auto"
    """topk/hitopk/auto: how the k largest |g| are found: mstopk = the paper's threshold bisection
    (kernels/mstopk.py), torch = torch.topk (exact), auto = measured at start-up on the run's selection sizes
    (trainer/choices.py). They may pick different elements on ties and near the threshold."""
    selection_iters: int = 20
    """topk/hitopk: MSTopK bisection steps (more = closer to the exact top-k, same cost on the CPU path)."""
    powersgd_rank: int = 2
    """powersgd: rank r of each gradient matrix's approximation (rows x r and cols x r factors are sent)."""
    powersgd_warm_start: bool = True
    """powersgd: start each step's power iteration from the previous step's Q (else from a fresh random one)."""
    local_steps: int = 8
    """local: H, the optimizer steps of a round; a round also ends at every epoch's end (1 with outer_lr 1,
    outer_momentum 0 and plain SGD is data-parallel SGD)."""
    outer_lr: float = 1.0
    """local: the outer SGD step's rate on the averaged pseudo-gradient (1 with outer_momentum 0 = averaging)."""
    outer_momentum: float = 0.0
    """local: the outer step's Nesterov momentum (DiLoCo: outer_lr 0.7, outer_momentum 0.9); 0 = none."""
    local_density: float = 1.0
    """local: the fraction of the pseudo-gradient a synchronisation sends: 1 = all of it (one allreduce); below 1,
    each rank's top-k of it plus its residual, allgathered, the rest kept as error feedback (SparseLoCo)."""
    local_state: Literal["average", "keep"] = "average"
    """local: the inner optimizer's per-element state (momentum, Adam's moments) at a synchronisation: average =
    averaged over the ranks with the weights; keep = each rank keeps its own (DiLoCo), sending nothing for it."""
    local_overlap: bool = False
    """local: a round's end (after the dense warm-up) starts its pseudo-gradient's allreduce and training goes on;
    the outer step lands at the next round's end, each rank keeping the steps it took meanwhile (one round's
    delay). The epoch's end lands it and waits for its own synchronisation, which alone averages the BatchNorm
    statistics and the optimizer's state (docs/communicators.md)."""

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"comm.bucket_mb: must be > 0, got {self.bucket_mb}")
        require(0 < self.density <= 1, f"comm.density: must be in (0, 1], got {self.density}")
        require(self.dense_below >= 0, f"comm.dense_below: must be >= 0, got {self.dense_below}")
        require(self.dense_warmup_steps >= 0,
                f"comm.dense_warmup_steps: must be >= 0, got {self.dense_warmup_steps}")
        require(bool(self.densities) and all(0 < d <= 1 for d in self.densities),
                f"comm.densities: must be a non-empty list of numbers in (0, 1], got {self.densities}")
        require(0 < self.min_density <= 1, f"comm.min_density: must be in (0, 1], got {self.min_density}")
        require(self.min_density >= 1 or self.min_density <= max(self.densities),
                f"comm.min_density: {self.min_density} is above every comm.densities value {self.densities}, so "
                "auto could never send sparse; lower it, add a density, or set it to 1 to mean never sparse")
        valid = AUTO_CHOOSABLE
        unknown = [k for k in self.auto_kinds if k not in valid]
        near = [m[0] for k in unknown if (m := difflib.get_close_matches(k, valid, 1))]
        require(not unknown, f"comm.auto_kinds: {', '.join(map(repr, unknown))} is not an exchange auto can choose"
                             + (f" (did you mean {', '.join(near)}?)" if near else "") + f"; valid: {', '.join(valid)}")
        require("dense" in self.auto_kinds,
                f"comm.auto_kinds: must include dense (every bucket's fallback), got {self.auto_kinds}")
        require(self.calibration_steps >= 3, f"comm.calibration_steps: must be >= 3, got {self.calibration_steps}")
        require(self.trial_steps == 0 or self.trial_steps >= 2,
                f"comm.trial_steps: must be 0 or >= 2 (the first step of a plan is not timed), got {self.trial_steps}")
        require(self.redecide_every >= 1, f"comm.redecide_every: must be >= 1, got {self.redecide_every}")
        require(self.dense_recheck_every >= 0,
                f"comm.dense_recheck_every: must be >= 0 (0 = never), got {self.dense_recheck_every}")
        require(0 <= self.hysteresis < 1, f"comm.hysteresis: must be in [0, 1), got {self.hysteresis}")
        require(self.selection in ("auto", "mstopk", "torch"),
                f"comm.selection: must be auto, mstopk or torch, got {self.selection!r}")
        require(1 <= self.selection_iters <= 32,
                f"comm.selection_iters: must be in [1, 32], got {self.selection_iters}")
        require(self.powersgd_rank >= 1, f"comm.powersgd_rank: must be >= 1, got {self.powersgd_rank}")
        require(self.local_steps >= 1, f"comm.local_steps: must be >= 1, got {self.local_steps}")
        require(not (self.kind == "local" and self.compression == "fp16"),
                "comm.compression: fp16 with comm.kind local would flush a pseudo-gradient's small values to zero "
                "(no loss scale is behind it); use bf16 or none")
        require(self.outer_lr > 0, f"comm.outer_lr: must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"comm.outer_momentum: must be in [0, 1), got {self.outer_momentum}")
        require(0 < self.local_density <= 1, f"comm.local_density: must be in (0, 1], got {self.local_density}")
        require(self.local_state in ("average", "keep"),
                f"comm.local_state: must be average or keep, got {self.local_state!r}")
        require(not (self.local_density < 1 and self.compression != "none"),
                "comm.compression: a 16-bit wire applies to the dense pseudo-gradient of comm.kind local; with "
                "comm.local_density < 1 the top-k pairs go in fp32; set one of them")
        require(not (self.local_overlap and self.local_density < 1),
                "comm.local_overlap: overlaps the dense pseudo-gradient's allreduce; with comm.local_density < 1 the "
                "top-k pairs' allgather waits; set one of them")
