"""The communicators against what the code before their refactor (bb95bc1) did, bit for bit: tests/data/comm_golden.json.

That file, written by tests/data/make_comm_golden.py against the old code (its `source`), holds every rank's
input gradients for 6 steps on a tiny model; per case (dense, dense16, topk on 2 ranks; hitopk and auto with
fixed mixed plans on 2 nodes x 2 ranks) and rank, after each step the sha256 of the averaged gradients, of the
residuals and of the whole state_dict; and the state_dict after step 3 itself, exactly. Two promises:
  - the current code gives the same averaged gradients, residuals and state at every step, and the same
    state_dict after step 3 (its keys are a checkpoint's interface);
  - a fresh communicator loaded with the OLD state continues as the old code did: steps 4-6 bit for bit
    (gradients, residuals, and the state it would write: step count, residual kinds).
Nothing here is shared with the generator but the JSON (its encoding is decoded here on its own).
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import run_ranks
from trainer.comm import CommConfig, build_communicator
from trainer.comm.plan import Choice
from trainer.dist import DistConfig, setup_distributed

pytestmark = pytest.mark.dist

GOLDEN = json.loads((Path(__file__).parent / "data" / "comm_golden.json").read_text())
SIZES, STEPS, AFTER = GOLDEN["sizes"], GOLDEN["steps"], GOLDEN["checkpoint_after"]


def decode(x):
    """The generator's JSON encoding back to the values (tensors bit for bit; dict keys keep their type)."""
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


def encode(x):
    """The inverse of `decode`, in the generator's canonical form (dict items sorted), to compare states."""
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
    return x


def raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def digests(model: nn.Module, comm) -> dict[str, str]:
    """sha256 of the averaged gradients (model order), of the residuals (by bucket: index, dtype, shape, bytes) and
    of the encoded state_dict (also its step count and residual kinds)."""
    h = hashlib.sha256()
    for i, r in sorted(comm.residuals.items()):
        h.update(f"{i}:{r.dtype}:{list(r.shape)};".encode() + raw(r))
    return {"grads": hashlib.sha256(b"".join(raw(p.grad) for p in model.parameters())).hexdigest(),
            "residuals": h.hexdigest(),
            "state": hashlib.sha256(json.dumps(encode(comm.state_dict())).encode()).hexdigest()}


class Case:
    def __init__(self, name: str) -> None:
        c = GOLDEN["cases"][name]
        self.cfg = CommConfig(**c["config"])
        self.plans = {int(s): [Choice(k, d) for k, d in p] for s, p in c["plans"].items()}

    def build(self, topo):
        model = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SIZES)
        comm = build_communicator(self.cfg, model, topo)
        if self.plans:  # auto: the plan in force at the checkpoint (a resumed run is given its plan again)
            comm.plan = list(self.plans[max(s for s in self.plans if s < AFTER)])
        return model, comm

    def run(self, model, comm, inputs: list[torch.Tensor], steps: range) -> list[dict[str, str]]:
        out = []
        for step in steps:
            if step in self.plans:
                comm.plan = list(self.plans[step])
            model.zero_grad(set_to_none=True)
            sum((p * g).sum() for p, g in zip(model.parameters(), inputs[step].split(SIZES))).backward()
            comm.finish()
            out.append(digests(model, comm))
        return out


def _rank(rank: int, world: int, per_node: int, names: list[str]) -> dict:
    topo = setup_distributed(DistConfig(ranks_per_node=per_node, backend="gloo", timeout_s=60))
    inputs = [decode(g) for g in GOLDEN["inputs"][rank]]
    out = {}
    for name in names:  # an error fails the fixture, every test: ranks that went on after it would fall out of step
        case = Case(name)
        model, comm = case.build(topo)
        steps = case.run(model, comm, inputs, range(AFTER))
        state = encode(comm.state_dict())
        steps += case.run(model, comm, inputs, range(AFTER, STEPS))
        comm.detach()
        model, comm = case.build(topo)  # fresh, from the old code's checkpoint
        comm.load_state_dict(decode(GOLDEN["cases"][name]["ranks"][rank]["state"]))
        resumed = case.run(model, comm, inputs, range(AFTER, STEPS))
        comm.detach()
        out[name] = {"steps": steps, "state": state, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def current(tmp_path_factory) -> dict[str, list[dict]]:
    """Per case, per rank: the current code's digests of steps 1-6, its state after step 3, and the digests of
    steps 4-6 of a communicator loaded with the old state. One spawn of ranks per layout."""
    layouts: dict[tuple[int, int], list[str]] = {}
    for name, c in GOLDEN["cases"].items():
        layouts.setdefault((c["world"], c["ranks_per_node"]), []).append(name)
    out = {}
    for (world, per_node), names in sorted(layouts.items()):
        by_rank = run_ranks(_rank, world, tmp_path_factory.mktemp(f"golden{world}x{per_node}"), per_node, names)
        out.update({name: [r[name] for r in by_rank] for name in names})
    return out


def first_difference(got: list[dict], want: list[dict], first_step: int) -> str | None:
    for step, (g, w) in enumerate(zip(got, want), start=first_step + 1):
        for what in ("grads", "residuals", "state"):
            if g[what] != w[what]:
                return f"step {step}: the {what} differ"
    return None if len(got) == len(want) else f"{len(got)} steps, expected {len(want)}"


@pytest.mark.parametrize("name", ["dense", "dense16", "topk", "hitopk", "auto"])
def test_the_exchange_is_bitwise_the_old_one(current, name):
    """Steps 1-6: the averaged gradients and residuals of every rank, and the state after step 3 (its keys
    and values), as the old code's. auto runs fixed mixed plans (no calibration): the executor, not the policy."""
    for rank, (got, want) in enumerate(zip(current[name], GOLDEN["cases"][name]["ranks"])):
        problem = first_difference(got["steps"], want["steps"], 0)
        assert problem is None, f"{name}, rank {rank}: {problem}"
        assert decode(got["state"]).keys() == decode(want["state"]).keys(), f"{name}, rank {rank}: state keys"
        assert got["state"] == want["state"], f"{name}, rank {rank}: the state after step {AFTER} differs"


@pytest.mark.parametrize("name", ["dense", "dense16", "topk", "hitopk", "auto"])
def test_an_old_checkpoint_resumes_bitwise(current, name):
    """A fresh communicator loaded with the old code's state after step 3 gives the old code's steps 4-6."""
    for rank, (got, want) in enumerate(zip(current[name], GOLDEN["cases"][name]["ranks"])):
        problem = first_difference(got["resumed"], want["steps"][AFTER:], AFTER)
        assert problem is None, f"{name}, rank {rank}, resumed from the old state: {problem}"


@pytest.mark.unit
def test_the_golden_file_checks_something():
    """The recorded run exercises what the tests promise: residuals kept and changing, of both sparse kinds and
    auto's mixed kinds, in the checkpoint."""
    for name in ("topk", "hitopk", "auto"):
        for rank in GOLDEN["cases"][name]["ranks"]:
            state = decode(rank["state"])
            assert state["steps"] == AFTER and state["residuals"], name
            assert len({s["residuals"] for s in rank["steps"]}) == STEPS, name  # a new residual every step
    assert set(decode(GOLDEN["cases"]["auto"]["ranks"][0]["state"])["residual_kinds"].values()) == {2, 3}
    assert GOLDEN["cases"]["hitopk"]["world"] == 4 and GOLDEN["cases"]["hitopk"]["ranks_per_node"] == 2
