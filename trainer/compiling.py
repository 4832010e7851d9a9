"""torch.compile of the training model, and CUDA graphs through it: `train.compile` and `train.cuda_graphs`.

Both settle into one measured choice, `compile`, among torch.compile's modes: "off" (eager), "default" (inductor's
fused kernels) and "reduce-overhead" (the same, with forward and backward replayed as CUDA graphs by inductor's
CUDA graph trees; the optimizer's step, a few Triton launches, stays outside the graphs). At auto, the candidates
are timed like the other choices (trainer/choices.py), each compiled at every shape the run trains at during the
warm-up round, before the clock. The model is compiled in place (`nn.Module.compile`): the same parameters,
hooks and state_dict keys, so checkpoints and export do not change. Shapes are static (`dynamic=False`): one graph
per phase's training shape. Evaluation runs eager: rectangular validation batches come in many shapes, each one
would compile anew.

dynamo keeps at most `recompile_limit` graphs per code object and, past it, runs eager without a word; every
module compiled in place shares one code object, and every shape, precision, layout and mode is one more graph.
`allow_graphs` raises the limit to what the run needs and makes a run past it fail loudly instead.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import nn

from trainer.config import ConfigError

MODES = ("off", "default", "reduce-overhead")
BACKEND = "inductor"
"""torch.compile's backend; the tests set "eager" (the same guards and recompilations, no code generated)."""
_compiled: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def allow_graphs(graphs: int) -> None:
    """Let dynamo keep `graphs` compiled variants (with a margin for dynamo's own), and raise rather than fall back
    to eager past that."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs + 8)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * graphs + 16)
    config.fail_on_recompile_limit_hit = True


def graph_blockers(device: torch.device, world_size: int) -> list[str]:
    """Why forward and backward cannot be replayed as CUDA graphs here; empty when they can."""
    blockers = []
    if device.type != "cuda":
        blockers.append("CUDA graphs need a CUDA device")
    if world_size > 1:
        blockers.append("more than one rank: the communicator's exchange during backward has not been tested "
                        "under graph capture")
    return blockers


def compile_candidates(compile_mode: str, cuda_graphs: str, device: torch.device, world_size: int) -> list[str]:
    """The `compile` values to measure (one value: pinned) from train.compile (off/on/auto) and train.cuda_graphs
    (off/on/auto); a combination that cannot run here is a config error naming why."""
    blockers = graph_blockers(device, world_size)
    if cuda_graphs == "on":
        if compile_mode == "off":
            raise ConfigError("train.cuda_graphs: on needs train.compile on or auto (the graphs are torch.compile's "
                              "reduce-overhead mode)")
        if blockers:
            raise ConfigError("train.cuda_graphs: on cannot run here: " + "; ".join(blockers))
        return ["reduce-overhead"]
    candidates = {"off": ["off"], "on": ["default"], "auto": ["off", "default"]}[compile_mode]
    if cuda_graphs == "auto" and compile_mode != "off" and not blockers:
        candidates.append("reduce-overhead")
    return candidates


def apply_compile(model: nn.Module, mode: str) -> None:
    """Compile `model` in place with torch.compile's `mode`, or return it to eager ("off")."""
    if mode not in MODES:
        raise ValueError(f"apply_compile: mode must be one of {MODES}, got {mode!r}")
    if _compiled.get(model, "off") == mode:
        return
    if _compiled.get(model) == "reduce-overhead" and torch.cuda.is_available():
        # The recorded graphs hold their memory pool until reset: a measured candidate must not keep it.
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        reset_cudagraph_trees()
    if mode == "off":
        # nn.Module.compile keeps the compiled call here and has no public inverse; dynamo's cache of the graphs
        # stays, so compiling in the same mode again costs no new compilation.
        model._compiled_call_impl = None
    elif BACKEND == "inductor":
        model.compile(mode=None if mode == "default" else mode, dynamic=False)
    else:
        model.compile(backend=BACKEND, dynamic=False)
    _compiled[model] = mode


def compiled_mode(model: nn.Module) -> str:
    """The mode `apply_compile` last gave `model` ("off" if none)."""
    return _compiled.get(model, "off")


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Compiled modules run their eager forward inside (evaluation: shapes that vary batch to batch)."""
    with torch.compiler.set_stance("force_eager"):
        yield
