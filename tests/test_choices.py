"""Measured choices (trainer/choices.py) on a real small model through the real measurement path: timer doubles
add seconds to one candidate's measured steps, so each test knows which candidate must win; the decision ranks
share when they measure differently; the per-machine cache; a resumed run keeps its checkpoint's decision."""

import contextlib
import json
import math
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kernels.small_conv import SmallMapConv2d
from recipes.resnet50 import main
from tests.conftest import run_ranks
from trainer.checkpoint import checkpoint_dirs, load_model_state
from trainer.choices import Choice, ChoiceCache, Decision, Probe, Timer, checked_choice, decide, label, run_key, wall_timer
from trainer.comm.sparse import select_payload
from trainer.run_choices import RunStep, SelectionStep, settle
from trainer.classification import ClassificationTask, ClassificationTrainConfig
from trainer.comm import LocalCommunicator
from trainer.config import ConfigError
from trainer.dist import DistConfig, Topology, setup_distributed
from trainer.loop import Trainer
from trainer.precision import amp_candidates
from trainer.schedules import Phase

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
PHASES = [Phase(0, 2, image_size=8, batch_size=4), Phase(2, 3, image_size=12, batch_size=4)]


def small_task(topo: Topology = Topology(), classes: int = 4) -> ClassificationTask:
    torch.manual_seed(0)
    # The second convolution's output is 2x2 at 8 px (the GEMM path) and 3x3 at 12 px (F.conv2d).
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=4),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, classes))
    data = SimpleNamespace(num_classes=classes, train_size=32, val_size=12)
    return ClassificationTask(model, data, topo, PHASES, ClassificationTrainConfig(channels_last="auto"), 0.0,
                              small_map_gemm="auto")


def penalty(when, seconds: float = 1.0, log: list | None = None) -> Timer:
    """The wall clock, plus `seconds` on every step of a candidate for which `when(choice)` holds."""
    real = wall_timer(CPU)

    def timer(step, choice: Choice) -> float:
        if log is not None:
            log.append(dict(choice))
        return real(step, choice) + (seconds if when(choice) else 0.0)
    return timer


def decide_for(task: ClassificationTask, timer: Timer, cache: ChoiceCache | None = None,
               topo: Topology = Topology(), amp: str = "auto", budget: float = float("inf")):
    space = {"amp": amp_candidates(amp, CPU), **task.choice_space()}
    probes = task.probes([(p, 8 * (p.end_epoch - p.start_epoch), 1) for p in PHASES])
    step = RunStep(task, LocalCommunicator(topo), torch.optim.SGD(task.model.parameters(), lr=0.1, momentum=0.9), CPU)
    return decide(space, probes, step, topo, cache, run_key(topo, task.model, space, probes, 2), 2, timer, budget)


@pytest.mark.parametrize("name,slow", [("amp", "bf16"), ("amp", "off"), ("channels_last", True),
                                       ("channels_last", False), ("small_map_gemm", True),
                                       ("small_map_gemm", False)])
def test_the_candidate_measured_slower_is_not_kept(name, slow):
    decision = decide_for(small_task(), penalty(lambda c: c[name] == slow))
    assert decision.source == "measured" and decision.choice[name] != slow
    assert len(decision.costs_s) == 8  # every combination of the three choices was measured
    slowest = max(decision.costs_s, key=decision.costs_s.get)
    assert f"{name}_{ {True: 'on', False: 'off'}.get(slow, slow) }" in slowest


def test_a_candidate_with_a_slow_first_step_is_judged_on_its_measured_steps():
    """A first step's one-time work (creating a kernel for the shape) can make the fastest candidate look 3x
    behind in the warm-up round: it must still be measured, and kept."""
    fastest = {"amp": "bf16", "channels_last": False, "small_map_gemm": False}
    probes = small_task().probes([(p, 8 * (p.end_epoch - p.start_epoch), 1) for p in PHASES])
    warm = sum(p.warm for p in probes)
    real, calls = wall_timer(CPU), []

    def timer(step, choice: Choice) -> float:
        calls.append(choice == fastest)
        first = choice == fastest and sum(calls) <= warm  # its warm-up round: one step per warm probe
        return real(step, choice) + (3.0 if first else 0.0 if choice == fastest else 1.0)
    decision = decide_for(small_task(), timer)
    assert decision.choice == fastest
    assert sum(calls) == warm + 2 * len(probes)  # the warm-up and both measured rounds


def test_a_candidate_far_behind_is_dropped_at_its_first_shape():
    """Its first shape alone costs more than 4x the best complete warm-up: one step, then no more; its cost is
    that part (a lower bound), above every other."""
    slow = {"amp": "bf16", "channels_last": True, "small_map_gemm": True}
    log: list = []
    decision = decide_for(small_task(), penalty(lambda c: c == slow, 100.0, log))
    assert sum(c == slow for c in log) == 1
    cost = decision.costs_s[label(slow)]
    assert math.isfinite(cost) and cost >= 100.0 * 8 and cost == max(decision.costs_s.values())  # cut, not failed


def test_measuring_leaves_weights_buffers_grads_mode_and_generators_untouched():
    task = small_task()
    for p in task.model.parameters():
        p.grad = torch.full_like(p, 0.25)
    task.model.eval()
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    state = torch.random.get_rng_state()
    decide_for(task, penalty(lambda c: False))
    after = task.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics included
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in task.model.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)  # the Dropout's draws came from a forked generator
    assert not task.model.training


def test_probes_cover_every_training_and_evaluation_shape_with_the_runs_steps():
    task = small_task()
    phases = [Phase(0, 2, image_size=8, batch_size=4, val_image_size=12), Phase(2, 3, image_size=12, batch_size=4)]
    probes = task.probes([(phases[0], 16, 2), (phases[1], 8, 1)])
    steps = {(p.train, p.batch[0].shape[-1]): p.steps for p in probes}
    # 12 validation images on one rank in batches of 4: 3 per evaluation; both phases evaluate at 12 px
    assert steps == {(True, 8): 16, (True, 12): 8, (False, 12): 9}
    assert all(p.warm == p.train for p in probes)  # evaluations are warmed up in the first measured round


def test_the_task_applies_each_choice_both_ways():
    task = small_task()
    task.apply_choices({"channels_last": True, "small_map_gemm": True})
    assert task.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert type(task.model[0]) is SmallMapConv2d
    task.apply_choices({"channels_last": False, "small_map_gemm": False})
    assert task.model[0].weight.is_contiguous() and type(task.model[0]) is nn.Conv2d
    images, _ = task.prepare_probe(task.probes([(PHASES[0], 1, 0)])[0].batch)
    assert images.is_contiguous()
    task.apply_choices({"channels_last": True, "small_map_gemm": False})
    images, _ = task.prepare_probe(task.probes([(PHASES[0], 1, 0)])[0].batch)  # moved as a training batch is
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()


@pytest.mark.parametrize("budget,rounds", [(float("inf"), 3), (1e-9, 2)])
def test_the_budget_stops_the_rounds_after_the_first_measured_one(budget, rounds):
    """rounds = the warm-up and the measured ones the most measured candidate ran (2 measured at most here). Every
    step carries a second on top of its few milliseconds, so that the machine's noise cuts no fp32 candidate."""
    log: list = []
    slow_bf16 = penalty(lambda c: c["amp"] == "bf16", log=log)
    decision = decide_for(small_task(), lambda step, choice: slow_bf16(step, choice) + 1.0, budget=budget)
    probes = small_task().probes([(p, 8 * (p.end_epoch - p.start_epoch), 1) for p in PHASES])
    # the warm-up runs the warm probes (the evaluation at a training shape is not), each measured round all
    assert max(sum(c == other for c in log) for other in log) == sum(p.warm for p in probes) + (rounds - 1) * len(probes)


def test_a_failing_candidate_is_dropped_with_a_warning():
    real = penalty(lambda c: False)

    def timer(step, choice):
        if choice["amp"] == "bf16":
            raise RuntimeError("no bf16 kernel for this op\nsecond line")
        return real(step, choice)
    with pytest.warns(UserWarning, match=r"amp_bf16-.* failed and is dropped: RuntimeError: no bf16 kernel"):
        decision = decide_for(small_task(), timer)
    assert decision.choice["amp"] == "off"
    assert sum(cost == float("inf") for cost in decision.costs_s.values()) == 4


def test_pinned_choices_are_not_measured():
    task = small_task()
    task.space = {"channels_last": [False], "small_map_gemm": [True]}
    log: list = []
    decision = decide_for(task, penalty(lambda c: False, log=log), amp="off")
    assert decision.source == "pinned" and not log
    assert decision.choice == {"amp": "off", "channels_last": False, "small_map_gemm": True}


def test_a_second_identical_run_reads_the_cache_without_measuring(tmp_path):
    cache = ChoiceCache(tmp_path)
    first = decide_for(small_task(), penalty(lambda c: c["amp"] == "bf16"), cache)
    log: list = []
    second = decide_for(small_task(), penalty(lambda c: c["amp"] == "off", log=log), cache)
    assert not log and second.source == "cache" and second.choice == first.choice
    assert second.costs_s == first.costs_s and first.choice["amp"] == "off"


def test_the_cache_key_changes_with_torch_world_size_and_shapes(monkeypatch):
    task = small_task()
    space = {"amp": ["off", "bf16"], **task.choice_space()}
    probes = task.probes([(p, 8, 1) for p in PHASES])
    key = run_key(Topology(), task.model, space, probes, 2)
    assert run_key(Topology(), task.model, space, probes, 2) == key
    assert run_key(Topology(world_size=2, ranks_per_node=2), task.model, space, probes, 2) != key
    bigger = [Phase(0, 2, image_size=8, batch_size=8), PHASES[1]]  # one phase's batch changes, nothing else
    assert run_key(Topology(), task.model, space, task.probes([(p, 8, 1) for p in bigger]), 2) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert run_key(Topology(), task.model, space, probes, 2) != key


def test_a_miss_on_another_key_measures_again(tmp_path):
    cache = ChoiceCache(tmp_path)
    decide_for(small_task(), penalty(lambda c: False), cache)
    log: list = []
    decision = decide_for(small_task(), penalty(lambda c: False, log=log), cache, amp="off")  # another space
    assert log and decision.source == "measured"


def test_a_truncated_or_foreign_cache_entry_is_ignored_with_a_warning(tmp_path):
    cache = ChoiceCache(tmp_path)
    decide_for(small_task(), penalty(lambda c: c["amp"] == "bf16"), cache)
    (entry,) = tmp_path.glob("*.json")
    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])
    with pytest.warns(UserWarning, match="cannot be read"):
        assert decide_for(small_task(), penalty(lambda c: c["amp"] == "off"), cache).source == "measured"
    doc = json.loads(entry.read_text())  # rewritten whole by the measurement above
    doc["key"]["world_size"] = 64
    entry.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="not this machine's and run shape's entry"):
        assert decide_for(small_task(), penalty(lambda c: False), cache).source == "measured"


def _ranks_measure_differently(rank: int, world: int) -> None:
    topo = setup_distributed(DistConfig())
    # Alone, rank 0 would keep bf16 (its fp32 steps are 1 s slower); rank 1's bf16 steps are 3 s slower.
    slow = penalty(lambda c: c["amp"] == "off", 1.0) if rank == 0 else penalty(lambda c: c["amp"] == "bf16", 3.0)
    decision = decide_for(small_task(topo), slow, topo=topo)
    decisions = topo.world.gather_object(decision.choice)
    if rank == 0:
        assert all(d == decision.choice for d in decisions) and decision.choice["amp"] == "off"


@pytest.mark.dist
def test_ranks_that_measure_differently_take_one_decision(tmp_path):
    run_ranks(_ranks_measure_differently, 2, tmp_path)


def _measuring_exchange_gradients(rank: int, world: int) -> list[float]:
    topo = setup_distributed(DistConfig(ranks_per_node=2, timeout_s=60))  # 4 ranks: 2 nodes; 2 ranks: 1 node
    model = nn.Linear(3, 1, bias=False)
    exchange = Trainer.measuring_exchange(SimpleNamespace(topo=topo, model=model))
    exchange.attach()
    (model.weight.sum() * (rank + 1)).backward()  # every element's gradient: rank + 1
    exchange.finish()
    return model.weight.grad.flatten().tolist()


@pytest.mark.dist
def test_the_measurements_exchange_stays_on_the_node(tmp_path):
    """The training probes' gradients are averaged over the node's ranks, never across the links between nodes
    (2 nodes x 2 ranks: the world's average would be 2.5 everywhere); on one node, over all its ranks; one rank
    per node: no exchange."""
    grads = run_ranks(_measuring_exchange_gradients, 4, tmp_path)
    assert grads == [[1.5] * 3, [1.5] * 3, [3.5] * 3, [3.5] * 3]
    (tmp_path / "one-node").mkdir()
    assert run_ranks(_measuring_exchange_gradients, 2, tmp_path / "one-node") == [[1.5] * 3, [1.5] * 3]
    one_per_node = Topology(rank=1, world_size=2, ranks_per_node=1)  # no intra-node group
    assert Trainer.measuring_exchange(SimpleNamespace(topo=one_per_node, model=nn.Linear(3, 1))) is None


def test_a_pinned_precision_the_device_cannot_run_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="train.amp: fp16 needs CUDA"):
        amp_candidates("fp16", CPU)
    native: list = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native.append(
        including_emulation) or False)  # a GPU that only emulates bf16 (V100, T4)
    with pytest.raises(ConfigError, match=r"train.amp: bf16 is not supported by this GPU"):
        amp_candidates("bf16", torch.device("cuda"))
    assert amp_candidates("auto", torch.device("cuda")) == ["fp16"] and native == [False, False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert amp_candidates("auto", torch.device("cuda")) == ["bf16", "fp16"]
    assert amp_candidates("auto", CPU) == ["off", "bf16"]


def test_a_restored_choice_the_run_no_longer_allows_is_a_config_error():
    space = {"amp": ["off"], "channels_last": [False, True]}
    assert checked_choice({"amp": "off", "channels_last": True}, space) == {"amp": "off", "channels_last": True}
    with pytest.raises(ConfigError, match=r"train.amp: the checkpoint trained with 'bf16', which this config"):
        checked_choice({"amp": "bf16", "channels_last": True}, space)
    with pytest.warns(UserWarning, match="the checkpoint holds no channels_last; using False"):
        assert checked_choice({"amp": "off"}, space) == {"amp": "off", "channels_last": False}


class SelectingCommunicator(LocalCommunicator):
    """A local communicator that reports sparse selections (as hitopk across nodes does), so that `settle` has
    a selection to keep."""

    iters = 20  # MSTopK's bisection steps

    def selection_candidates(self) -> list[str]:
        return ["mstopk", "torch"]

    def selection_sizes(self) -> dict[tuple[int, float], int]:
        return {(4096, 0.01): 2}


def test_a_resume_keeps_the_checkpointed_selection_and_measures_nothing_it_holds():
    """The checkpoint's model choices and selection are kept without a measured step (a timer that records every
    call stays empty); the input threads it cannot hold are left to measure (none here: no loader)."""
    task = small_task()
    step = RunStep(task, SelectingCommunicator(Topology()), torch.optim.SGD(task.model.parameters(), lr=0.1), CPU)
    log: list = []
    restored = Decision({"amp": "bf16", "channels_last": True, "small_map_gemm": False, "selection": "torch",
                         "workers": 4}, "checkpoint")
    decision, space = settle(restored, ["off", "bf16"], [(PHASES[0], 6, 1)], step, Topology(), None, rounds=1,
                             budget=float("inf"), timer=penalty(lambda c: False, log=log), cores=2)
    assert not log and decision.source == "checkpoint"
    assert decision.choice == {"amp": "bf16", "channels_last": True, "small_map_gemm": False, "selection": "torch"}
    assert task.model[0].weight.is_contiguous(memory_format=torch.channels_last)  # the model's choices applied
    fresh, _ = settle(None, ["off", "bf16"], [(PHASES[0], 6, 1)], step, Topology(), None, rounds=1,
                      budget=float("inf"), timer=penalty(lambda c: c.get("selection") == "mstopk", log=log), cores=2)
    assert fresh.choice["selection"] == "torch" and any("selection" in c for c in log)  # measured when not restored


def test_a_cached_decision_with_a_failed_candidate_is_recorded():
    cached = Decision({"amp": "off"}, "cache", {"amp_off": 1.5, "amp_bf16": None}, 0.01)  # null: failed, from JSON
    assert cached.to_dict()["costs_s"] == {"amp_off": 1.5, "amp_bf16": None}
    assert cached.metrics()["choices/amp_off_s"] == 1.5 and "choices/amp_bf16_s" not in cached.metrics()
    assert "amp_bf16 failed" in cached.describe()


def test_labels_name_every_choice():
    assert label({"amp": "bf16", "channels_last": True}) == "amp_bf16-channels_last_on"


@pytest.mark.e2e
def test_a_resumed_run_keeps_the_checkpoints_decision_not_the_caches(tmp_path, digits_root):
    """Straight run (measured, cached), then its last checkpoint removed and the cache entry flipped to the other
    precision: the resume from the epoch-1 checkpoint must train on with the checkpoint's choices and end bitwise
    equal. Reading the (flipped) cache instead would train the last epoch in the other precision."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    argv = ["--config", "configs/quickstart_cpu.yaml", f"data.root={digits_root}", f"log.dir={out}",
            "model.arch=resnet18", "data.workers=0", "train.threads=1", "log.progress=false",
            "log.tensorboard=false", "comm.kind=dense", "train.epochs=2", "train.max_steps_per_epoch=3",
            "schedule.phases=[{start_epoch: 0, end_epoch: 2, image_size: 16, batch_size: 16}]",
            "train.deterministic=true", "train.target_top1=0", "train.checkpoint_every_epochs=1",
            "train.keep_checkpoints=3", f"train.choices_cache={cache}", "train.calibration_rounds=1"]
    first = main(argv)
    assert first["choices"]["source"] == "measured"
    newest = checkpoint_dirs(out)[0]
    final = load_model_state(newest)
    shutil.rmtree(newest)
    (entry,) = cache.glob("*.json")
    doc = json.loads(entry.read_text())
    doc["choice"]["amp"] = {"off": "bf16", "bf16": "off"}[doc["choice"]["amp"]]
    entry.write_text(json.dumps(doc))
    resumed = main([*argv, "--resume"])
    assert resumed["choices"] == {"choice": first["choices"]["choice"], "source": "checkpoint", "costs_s": {},
                                  "seconds": 0.0, "parts_s": {}}
    assert json.loads((out / "env.json").read_text())["choices"]["source"] == "checkpoint"
    for name, value in load_model_state(checkpoint_dirs(out)[0]).items():
        assert torch.equal(value, final[name]), name


# ---------------------------------------------------------------- top-k selection and input threads


@pytest.mark.parametrize("slow", ["mstopk", "torch"])
def test_the_selection_measured_slower_is_not_kept(slow):
    space = {"selection": ["mstopk", "torch"]}
    probes = [Probe((4096, 0.01), 20, "select 4096"), Probe((1000, 0.1), 10, "select 1000")]
    log: list = []
    subject = SelectionStep(CPU, 20)
    slow_timer = penalty(lambda c: c["selection"] == slow, 0.05, log)

    def timer(step, choice):
        assert subject.selection == choice["selection"]  # the subject runs the candidate it is timed as
        return slow_timer(step, choice)
    decision = decide(space, probes, subject, Topology(), None, run_key(Topology(), None, space, probes, 2), 2, timer)
    assert decision.source == "measured" and decision.choice == {"selection": {"mstopk": "torch", "torch": "mstopk"}[slow]}
    assert decision.costs_s[f"selection_{slow}"] > 20 * 0.05  # every step of the slow one carried the penalty
    assert {c["selection"] for c in log} == {"mstopk", "torch"}


def test_torch_selection_sends_the_exact_top_k_in_index_order_and_keeps_the_rest():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    acc = x.clone()
    payload = select_payload(acc, 50, 20, "torch")
    values, indices = payload[:50], payload[50:].view(torch.int32).long()
    assert torch.equal(indices, indices.sort().values)
    assert set(indices.tolist()) == set(x.abs().topk(50).indices.tolist())
    assert torch.equal(values, x[indices])
    assert torch.equal(acc + torch.zeros_like(x).index_put_((indices,), values), x)  # sent + kept = the input


def test_a_run_applies_the_measured_selection_and_input_threads(digits_root, tmp_path):
    """`settle` on a real DALI loader of the digits (threads, no processes): input threads are measured on the
    run's own loader and model (a timer double makes 1 thread slow) and applied; the loaders made for measuring
    are stopped; a communicator without selection adds no selection choice; a second run with a fresh model
    reads every group from the cache."""
    from data import DataConfig, build_image_data
    task = small_task(classes=10)
    task.data = build_image_data(DataConfig(root=str(digits_root), backend="dali"), 0, 1, seed=0)
    cache = ChoiceCache(tmp_path)
    try:
        assert task.input_candidates(1) == [1, 2] and task.input_candidates(4) == [1, 2, 4]
        step = RunStep(task, LocalCommunicator(Topology()), torch.optim.SGD(task.model.parameters(), lr=0.1), CPU)
        log: list = []
        # GEMM convolutions kept: a key built from the model as the last candidate left it would differ next run
        slow = penalty(lambda c: c.get("workers") == 1 or c.get("amp") == "bf16" or c.get("small_map_gemm") is False,
                       1.0, log)
        decision, space = settle(None, ["off", "bf16"], [(PHASES[0], 6, 1), (PHASES[1], 2, 1)], step, Topology(),
                                 cache, rounds=1, budget=float("inf"), timer=slow, cores=2)
        assert decision.choice["amp"] == "off" and decision.choice["workers"] == 2 and "selection" not in decision.choice
        assert set(space) == {"amp", "channels_last", "small_map_gemm"}
        assert decision.costs_s["workers_1"] > decision.costs_s["workers_2"] and decision.source == "measured"
        tried = [c["workers"] for c in log if "workers" in c]
        assert tried[:2] == [1, 2] and tried[-1] == 2  # interleaved (no warm-up round: applying warms a loader)
        assert not [t for t in threading.enumerate() if t.name == "dali-source-prefetch" and t.is_alive()]
        task.use_workers(decision.choice["workers"])
        assert task.data.workers == 2 and task.loader_for(PHASES[0]).spec.threads == 2
        again = small_task(classes=10)  # a new process: the model as built, before any choice was applied
        again.data = task.data
        step = RunStep(again, LocalCommunicator(Topology()), torch.optim.SGD(again.model.parameters(), lr=0.1), CPU)
        log.clear()
        second, _ = settle(None, ["off", "bf16"], [(PHASES[0], 6, 1), (PHASES[1], 2, 1)], step, Topology(), cache,
                           rounds=1, budget=float("inf"), timer=slow, cores=2)
        assert not log and second.source == "cache" and second.choice == decision.choice
        # the seconds per group of choices, in the record and the log line
        assert set(decision.parts_s) == set(second.parts_s) == {"amp+channels_last+small_map_gemm", "workers"}
        assert sum(decision.parts_s.values()) == pytest.approx(decision.seconds)
        assert "(amp+channels_last+small_map_gemm " in decision.describe() and ", workers " in decision.describe()
    finally:
        task.data.close()


class CountingSubject:
    """A Subject whose steps only record (candidate, probe) in order; the timer gives each candidate a fixed
    time per step, so the test knows every cost exactly."""

    def __init__(self) -> None:
        self.current, self.calls = None, []

    def apply(self, choice: Choice) -> None:
        self.current = choice["x"]

    def step(self, batch, train: bool) -> None:
        self.calls.append((self.current, batch))

    def preserved(self):
        return contextlib.nullcontext()


def test_the_first_measured_round_cuts_at_its_prune_factor_against_its_own_best_largest_probes_first():
    """Per-step times 1.0, 2.0 and 1.2; probes of 10, 1 and 5 steps, the last warmed up in round 1 (an untimed step
    before its timed one). Round 1 runs the probes largest first; candidate 1 passes 1.25 x candidate 0's complete
    16 s after its second probe and is cut there (a 2x cut, a best carried over from the warm-up's two probes, or
    the probes in their listed order would each run other steps)."""
    from trainer.choices import measure

    probes = [Probe("p10", 10, "p10"), Probe("p1", 1, "p1"), Probe("p5", 5, "p5", train=False, warm=False)]
    subject, per_step = CountingSubject(), {0: 1.0, 1: 2.0, 2: 1.2}

    def timer(step, choice: Choice) -> float:
        step()
        return per_step[choice["x"]]
    costs = measure([{"x": 0}, {"x": 1}, {"x": 2}], probes, subject, 2, timer)
    warm_up, first, second = subject.calls[:6], subject.calls[6:17], subject.calls[17:]
    assert warm_up == [(c, p) for c in range(3) for p in ("p10", "p1")]
    assert first == [(0, "p10"), (0, "p5"), (0, "p5"), (0, "p1"), (1, "p10"), (1, "p5"), (1, "p5"),
                     (2, "p10"), (2, "p5"), (2, "p5"), (2, "p1")]
    assert costs == [16.0, 30.0, pytest.approx(19.2)]  # the cut one's cost: its part, a lower bound
    assert second == [(0, "p10"), (0, "p5"), (0, "p1"), (2, "p10"), (2, "p5"), (2, "p1")]  # no warm-up step again;
    # within 1.25x: measured again, the cut one not


def test_with_no_probe_marked_warm_the_warm_up_runs_them_all():
    from trainer.choices import measure

    subject = CountingSubject()
    probes = [Probe("a", 2, "a", warm=False), Probe("b", 1, "b", warm=False)]
    measure([{"x": 0}], probes, subject, 1, lambda step, choice: step() or 1.0)
    assert subject.calls == [(0, "a"), (0, "b")] * 2
