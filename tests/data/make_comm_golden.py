"""Writes tests/data/comm_golden.json: what the gradient communicators did, bit for bit, for
tests/test_comm_golden.py to hold later code to.

What it records. A tiny model (6 zero parameters, 310 elements, 4 buckets: one dense by size, three sparse,
odd sizes so hierarchical shards are padded) is fed seeded per-rank gradients for 6 steps on real gloo
groups. Cases: dense, dense16 (fp16 wire) and topk on 2 ranks; hitopk and auto on 2 nodes x 2 ranks (4
processes). auto is kept from calibrating (calibration_steps 1000) and given fixed mixed plans (`plans`:
step -> one [kind, density] per bucket), changed after step 3 so that the steps after the checkpoint fold
residuals that other kinds kept. The JSON holds:
  - `inputs`: every rank's gradient per step (float32, base64), so the test needs no generator of its own;
  - per case and rank, per step: sha256 of the averaged gradients (parameters in model order, raw bytes) and
    of the residuals (`comm.residuals`, none for dense; by bucket index: index, dtype, shape, raw bytes) and of
    the encoded `state_dict()` (below: steps, residual kinds);
  - per case and rank, `state`: the communicator's `state_dict()` after step 3, exactly (`encode`: dicts as
    [key, value] pairs, tensors as dtype, shape and base64 bytes, floats as float.hex).
Before writing, it checks that a fresh communicator loaded with the decoded state reproduces steps 4-6.

It uses only APIs that exist before and after the communicators' refactor (bb95bc1): build_communicator,
CommConfig, comm.plan, comm.residuals, state_dict/load_state_dict, trainer.testing.run_ranks; it imports
nothing from tests/, and the test imports nothing from here: they share only the JSON.

Regenerate (the committed JSON came from the parent of bb95bc1, ce895c3, the code before the refactor):
    git worktree add ../old_comm bb95bc1^
    cd ../old_comm && PYTHONPATH=. ../main/.venv/bin/python ../main/tests/data/make_comm_golden.py \
        --out ../main/tests/data/comm_golden.json   (from a checkout named main)
Against the current code (from the checkout itself, no PYTHONPATH) it must write the same JSON but for `source`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

import trainer
from trainer.comm import CommConfig, build_communicator
from trainer.comm.cost import Choice
from trainer.dist import DistConfig, setup_distributed
from trainer.testing import run_ranks

SIZES = [5, 61, 130, 17, 90, 7]
BUCKET_MB = 100 * 4 / 2**20  # buckets of at most 100 elements: [7, 90], [17], [130], [61, 5]
STEPS, CHECKPOINT_AFTER = 6, 3
SPARSE = dict(bucket_mb=BUCKET_MB, density=0.1, dense_below=20, selection="mstopk")
CASES = {  # name -> (world, ranks per node, CommConfig fields, plans: step -> [[kind, density] per bucket])
    "dense": (2, 0, dict(kind="dense", bucket_mb=BUCKET_MB), None),
    "dense16": (2, 0, dict(kind="dense", bucket_mb=BUCKET_MB, compression="fp16"), None),
    "topk": (2, 0, dict(kind="topk", dense_warmup_steps=1, **SPARSE), None),
    "hitopk": (4, 2, dict(kind="hitopk", dense_warmup_steps=1, **SPARSE), None),
    "auto": (4, 2, dict(kind="auto", calibration_steps=1000, **SPARSE),
             {0: [["hitopk", 0.1], ["dense16", 1.0], ["topk", 0.1], ["hitopk", 0.05]],
              3: [["topk", 0.1], ["dense", 1.0], ["hitopk", 0.1], ["dense16", 1.0]]}),
}


def encode(x):
    """A state_dict as JSON that decodes to the same values, bit for bit."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        return {"tensor": [str(t.dtype).removeprefix("torch."), list(t.shape),
                           base64.b64encode(t.view(-1).view(torch.uint8).numpy().tobytes()).decode()]}
    if isinstance(x, dict):
        return {"dict": sorted(([encode(k), encode(v)] for k, v in x.items()), key=json.dumps)}
    if isinstance(x, (list, tuple)):
        return {"list": [encode(v) for v in x]}
    if isinstance(x, float):
        return {"float": x.hex()}
    return x  # int, str, bool, None


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def digest_grads(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(tensor_bytes(p.grad) for p in model.parameters())).hexdigest()


def digest_residuals(comm) -> str:
    h = hashlib.sha256()
    for i, r in sorted(getattr(comm, "residuals", {}).items()):  # dense keeps none (before: no attribute)
        h.update(f"{i}:{r.dtype}:{list(r.shape)};".encode() + tensor_bytes(r))
    return h.hexdigest()


def make_inputs(world: int) -> list[list[torch.Tensor]]:
    """inputs[rank][step]: one flat float32 gradient of all parameters, heavy-tailed (top-k has a choice)."""
    out = []
    for rank in range(world):
        steps = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            n = sum(SIZES)
            steps.append(torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 10)
        out.append(steps)
    return out


def run_steps(model, comm, inputs, plans, steps) -> list[dict[str, str]]:
    out = []
    for step in steps:
        if plans and step in plans:
            comm.plan = [Choice(k, d) for k, d in plans[step]]
        model.zero_grad(set_to_none=True)
        sum((p * g).sum() for p, g in zip(model.parameters(), inputs[step].split(SIZES))).backward()
        comm.finish()
        out.append({"grads": digest_grads(model), "residuals": digest_residuals(comm),
                    "state": hashlib.sha256(json.dumps(encode(comm.state_dict())).encode()).hexdigest()})
    return out


def model_and_comm(cfg, topo, plans):
    model = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SIZES)
    comm = build_communicator(cfg, model, topo)
    if plans:  # the plan in force at the checkpoint (a resumed run is given its plan again)
        comm.plan = [Choice(k, d) for k, d in plans[max(s for s in plans if s < CHECKPOINT_AFTER)]]
    return model, comm


def _rank(rank: int, world: int, per_node: int, names: list[str], inputs) -> dict:
    topo = setup_distributed(DistConfig(ranks_per_node=per_node, backend="gloo", timeout_s=60))
    out = {}
    for name in names:
        _, _, fields, plans = CASES[name]
        cfg = CommConfig(**fields)
        model, comm = model_and_comm(cfg, topo, plans)
        steps = run_steps(model, comm, inputs[rank], plans, range(CHECKPOINT_AFTER))
        state = encode(comm.state_dict())
        steps += run_steps(model, comm, inputs[rank], plans, range(CHECKPOINT_AFTER, STEPS))
        comm.detach()
        model, comm = model_and_comm(cfg, topo, plans)  # the old code's own resume from the decoded state
        comm.load_state_dict(decode(json.loads(json.dumps(state))))
        resumed = run_steps(model, comm, inputs[rank], plans, range(CHECKPOINT_AFTER, STEPS))
        assert resumed == steps[CHECKPOINT_AFTER:], f"{name}: a resumed communicator does not continue the same"
        comm.detach()
        out[name] = {"steps": steps, "state": state}
    return out


def decode(x):
    if isinstance(x, dict):
        if "tensor" in x:
            dtype, shape, data = x["tensor"]
            raw = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
            return raw.view(getattr(torch, dtype)).reshape(shape).clone()
        if "dict" in x:
            return {decode(k): decode(v) for k, v in x["dict"]}
        if "list" in x:
            return [decode(v) for v in x["list"]]
        return float.fromhex(x["float"])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    src = Path(trainer.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "trainer/comm",
                            "trainer/dist", "kernels"], capture_output=True, text=True).stdout.strip()
    inputs = make_inputs(max(world for world, _, _, _ in CASES.values()))
    cases = {}
    for world, per_node in sorted({(w, p) for w, p, _, _ in CASES.values()}):
        names = [n for n, c in CASES.items() if c[:2] == (world, per_node)]
        with tempfile.TemporaryDirectory() as tmp:
            by_rank = run_ranks(_rank, world, tmp, per_node, names, inputs, timeout=300)
        for name in names:
            cases[name] = {"world": world, "ranks_per_node": per_node, "config": CASES[name][2],
                           "plans": {str(s): p for s, p in (CASES[name][3] or {}).items()},
                           "ranks": [{"steps": r[name]["steps"], "state": r[name]["state"]} for r in by_rank]}
    golden = {"source": {"commit": commit + (" (trainer/comm, trainer/dist or kernels modified)" if dirty else ""), "trainer": str(src)},
              "sizes": SIZES, "steps": STEPS, "checkpoint_after": CHECKPOINT_AFTER,
              "inputs": [[encode(g) for g in steps] for steps in inputs], "cases": {n: cases[n] for n in CASES}}
    args.out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) from {golden['source']}")


if __name__ == "__main__":
    main()
