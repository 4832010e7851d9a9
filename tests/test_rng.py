"""The random generators' state goes through a checkpoint file (torch.save, then torch.load(weights_only=True))
and back: after the restore, torch, NumPy, Python's random (and CUDA, where present) draw what they drew right
after the save."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainer.checkpoint import load_file, save_file
from trainer.rng import rng_state, seed_everything, seed_rank, set_rng_state

pytestmark = pytest.mark.unit

DEVICES = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])


def draws(device: torch.device) -> dict[str, list[float]]:
    out = {"torch": torch.rand(4).tolist(), "numpy": np.random.rand(4).tolist(),
           "numpy_gauss": [float(np.random.standard_normal())], "python": [random.random() for _ in range(4)]}
    if device.type == "cuda":
        out["cuda"] = torch.rand(4, device=device).tolist()
    return out


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_generators_restored_from_a_checkpoint_file_draw_the_same(tmp_path, device):
    seed_everything(123)
    draws(device)  # somewhere in the middle of the streams
    save_file(rng_state(device), tmp_path / "rank-00000.pt")
    expected = draws(device)
    draws(device)  # the streams move on (a restore that does nothing would draw these next)
    state = load_file(tmp_path, "rank-00000.pt", verify=False)  # torch.load(weights_only=True)
    set_rng_state(state, device)
    assert draws(device) == expected
    assert set(state) >= {"torch", "numpy", "python"} and ("cuda" in state) == (device.type == "cuda")


def test_seed_rank_gives_each_rank_and_step_its_own_stream_the_same_on_every_restart():
    seed_rank(0, 1, 5)
    first = draws(torch.device("cpu"))
    seed_rank(0, 1, 5)
    assert draws(torch.device("cpu")) == first
    seed_rank(0, 2, 5)
    assert draws(torch.device("cpu")) != first
