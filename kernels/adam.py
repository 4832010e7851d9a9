"""Adam/AdamW: torch's own optimizers with the fastest correct implementation per device.

On the CPU, torch's fused kernel (one kernel per tensor group; faster there than foreach=False and than
foreach=True, which allocates the intermediate lists). On CUDA, `TritonAdam`: torch's Adam whose float32
dense groups take two Triton launches per step whatever the number of tensors (kernels/optim_triton.py),
where torch's fused kernel launches once per chunk of tensors; torch's fused Adam where Triton cannot be
imported. Other devices keep torch's default.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal

import torch
from torch import Tensor

from kernels._triton import optim_kernels, runs_on

FUSED_DEVICES = ("cpu", "cuda")


class TritonAdam(torch.optim.Adam):
    """torch.optim.Adam (AdamW with ``decoupled_weight_decay=True``) with the update of each param group
    whose tensors are float32 and dense in kernels/optim_triton.py.

    The options, state (``step`` a 0-d float32 tensor on the device, ``exp_avg``, ``exp_avg_sq``) and
    state_dict are those of torch's fused Adam, which also runs the groups the kernels do not take (amsgrad,
    maximize, complex, other dtypes or layouts). ``grad_scale`` and ``found_inf`` (set by GradScaler, or by
    trainer/nonfinite.py) are honoured on the device as torch's fused step honours them: a step with
    ``found_inf`` nonzero changes no weight, moment or step count.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True,
                         decoupled_weight_decay=decoupled_weight_decay)
        self._tables: dict[int, Any] = {}  # per param group: kernels.optim_triton.TensorTable

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_tables", {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; `closure` (run with grad enabled) gives the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for slot, group in enumerate(self.param_groups):
            columns: tuple[list[Tensor], ...] = ([], [], [], [], [], [])
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = columns
            has_complex = self._init_group(group, *columns)
            if not params:
                continue
            kernels = optim_kernels() if runs_on(params[0].device) else None
            if (kernels is not None and not (group["amsgrad"] or group["maximize"] or has_complex)
                    and all(kernels.dense_alike(*t) for t in zip(params, grads, exp_avgs, exp_avg_sqs))):
                table = kernels.cached_table(self._tables, slot, [params, grads, exp_avgs, exp_avg_sqs, steps])
                kernels.adam_step(table, group, found_inf, grad_scale)
                continue
            beta1, beta2 = group["betas"]
            torch.optim.adam.adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                                  amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                                  maximize=group["maximize"], foreach=group["foreach"],
                                  capturable=group["capturable"], differentiable=group["differentiable"],
                                  fused=group["fused"], grad_scale=grad_scale, found_inf=found_inf,
                                  decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss


def build_adam(params: Iterable[Tensor] | Iterable[dict[str, Any]],
               name: Literal["adam", "adamw"] = "adam", lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adam ("adam": L2 penalty in the gradient) or AdamW ("adamw": decoupled decay): `TritonAdam` when every
    tensor is on CUDA and Triton imports, else torch.optim.Adam / AdamW, fused on the CPU and CUDA."""
    if name not in ("adam", "adamw"):
        raise ValueError(f"build_adam: unknown name {name!r} (valid: adam, adamw)")
    params = list(params)
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    devices = {t.device.type for t in tensors}
    options = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if devices == {"cuda"} and optim_kernels() is not None:
        return TritonAdam(params, decoupled_weight_decay=name == "adamw", **options)
    fused = len(devices) == 1 and devices <= set(FUSED_DEVICES)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, fused=fused or None, **options)
