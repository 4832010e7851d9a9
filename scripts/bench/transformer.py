"""Transformer training throughput on CPU: this recipe's step against a textbook DDP + Adam loop.

Every contender trains the same model (torch's nn.Transformer with shared embeddings, the sizes of
configs/transformer_quickstart_cpu.yaml, same initial weights) on the same token batches of the synthetic
corpus, as 2 gloo processes (2 nodes x 1 rank, one thread each):
- baseline: DistributedDataParallel, torch.optim.Adam without fused or foreach kernels (one tensor at a
  time), loss.backward(), step() — the plain loop;
- recipe dense / recipe hitopk: trainer.loop.Trainer.train_step, i.e. gradients bucketed and exchanged from
  autograd hooks by trainer/comm (dense allreduce, or the paper's hierarchical top-k at the quickstart's
  density) and torch's fused Adam (kernels/adam.py).
tokens/s counts the target tokens of both ranks (the recipe's time/tokens_per_s). Contenders run in
rounds, each round in a rotated order so that neither warm caches nor load from other processes favour one;
per contender the median of the rounds. ratio (JSON) = the median over rounds of (recipe dense / baseline) in
the same round, with every round's ratio recorded (the spread); hitopk's likewise. The recipe's figure is its
step with the dense exchange (the quickstart's comm.kind is auto, which chooses per bucket at run time from
measurements this fixed-steps bench does not make; hitopk is the paper's exchange).

    python -m scripts.bench.transformer [--quick] [--rounds 6]
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from data import synthetic_translation as synth
from data.translation import TranslationData
from recipes.transformer import Config
from recipes.transformer_model import build_transformer
from scripts.bench.common import bench_parser, emit_result, parse_args, print_table
from trainer.comm import build_communicator
from trainer.config import load_config
from trainer.dist import DistConfig, setup_distributed
from trainer.loop import Trainer
from trainer.metrics import LogConfig
from trainer.optim import build_optimizer
from trainer.testing import run_ranks
from trainer.train_config import Components
from trainer.translation import TranslationTask, translation_loss

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "transformer_quickstart_cpu.yaml"
WORLD = 2


def build_contenders(cfg: Config, data: TranslationData, topo: Any, log_dir: str) -> dict[str, Callable]:
    """name -> step(batch) returning this rank's target tokens; each with its own model copy."""
    def fresh_model() -> torch.nn.Module:
        torch.manual_seed(cfg.train.seed)
        return build_transformer(cfg.model, data.vocab_size)

    contenders: dict[str, Callable] = {}
    model = fresh_model()
    ddp = DistributedDataParallel(model)
    adam = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                            fused=False, foreach=False)

    def baseline(batch: Any) -> int:
        loss, n = translation_loss(ddp, batch, cfg.model.label_smoothing)
        loss.backward()
        adam.step()
        adam.zero_grad(set_to_none=True)
        return n

    contenders["baseline DDP + Adam"] = baseline
    for kind in ("dense", "hitopk"):
        cfg.comm.kind = kind
        model = fresh_model()
        optimizer = build_optimizer(model, cfg.optim)
        task = TranslationTask(model, data, topo, cfg.train, cfg.model.label_smoothing)
        run_cfg = dataclasses.replace(cfg, log=LogConfig(dir=log_dir, tensorboard=False))
        trainer = Trainer(run_cfg, topo, task, Components(model, optimizer, build_communicator(cfg.comm, model, topo)))
        contenders[f"recipe {kind}"] = lambda batch, trainer=trainer: trainer.train_step(batch)[1]
    return contenders


def worker(rank: int, world: int, corpus: str, workdir: str, steps: int, rounds: int, threads: int
           ) -> dict[str, Any] | None:
    """One rank (of trainer.testing.run_ranks): every contender's tokens/s; rank 0 returns them."""
    torch.set_num_threads(threads)
    cfg = load_config(Config, CONFIG, [f"data.root={corpus}"])
    quickstart_kind = cfg.comm.kind
    topo = setup_distributed(DistConfig(ranks_per_node=1))
    data = TranslationData(cfg.data, topo.rank, topo.world_size, cfg.train.seed)
    batches = list(data.train_batches(epoch=0))[:steps]
    contenders = build_contenders(cfg, data, topo, str(Path(workdir) / f"log{rank}"))
    for step in contenders.values():  # warm-up: first-call allocations, hook registration, thread start
        for batch in batches[:2]:
            step(batch)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step = contenders[name]
            dist.barrier()
            start = time.perf_counter()
            tokens = sum(step(batch) for batch in batches)
            total = torch.tensor([float(tokens), time.perf_counter() - start])
            dist.all_reduce(total)  # both ranks' tokens; the mean of their seconds
            rates[name].append(float(total[0]) / (float(total[1]) / world))
    if rank != 0:
        return None
    return {"rates": {k: statistics.median(v) for k, v in rates.items()}, "per_round": rates, "kind": quickstart_kind,
            "params": sum(p.numel() for p in build_transformer(cfg.model, data.vocab_size).parameters()),
            "tokens_per_rank": cfg.data.max_tokens}


def main() -> None:
    parser = bench_parser("transformer", __doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds, each in a rotated order (default 6: each of the 3 contenders first twice)")
    args = parse_args(parser)
    if args.device != "cpu":
        parser.error("this benchmark runs CPU ranks over gloo; the GPU path is checked by scripts/gpu_check.sh")
    steps, rounds = (4, 3) if args.quick else (8, args.rounds)
    threads = max(1, args.threads // WORLD)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = synth.prepare(Path(tmp) / "corpus", n_train=3000, n_valid=20, n_test=20, vocab_size=1000)
        result = run_ranks(worker, WORLD, tmp, str(corpus), tmp, steps, rounds, threads, timeout=3600)[0]
    rates, per_round = result["rates"], result["per_round"]
    base = rates["baseline DDP + Adam"]
    ratios = {kind: [round(x / b, 3) for x, b in zip(per_round[f"recipe {kind}"], per_round["baseline DDP + Adam"])]
              for kind in ("dense", "hitopk")}
    print(f"{result['params'] / 1e6:.2f} M parameters, <= {result['tokens_per_rank']} tokens per rank per step, "
          f"{WORLD} gloo ranks x {threads} thread(s), {rounds} rounds of {steps} steps each, rotated order")
    print_table(["contender", "tokens/s", "vs baseline (median of rounds)", "per round"],
                [[k, v, statistics.median(ratios[k[7:]]) if k.startswith("recipe") else 1.0,
                  ratios.get(k[7:], "")] for k, v in rates.items()])
    emit_result("transformer", "DDP + torch.optim.Adam (not fused, not foreach), same model and batches",
                statistics.median(ratios["dense"]), comm="dense", quickstart_comm=result["kind"], rounds=rounds,
                round_ratios=ratios, hitopk_ratio=statistics.median(ratios["hitopk"]),
                recipe_tokens_per_s=round(rates["recipe dense"]), baseline_tokens_per_s=round(base),
                dense_tokens_per_s=round(rates["recipe dense"]), hitopk_tokens_per_s=round(rates["recipe hitopk"]))


if __name__ == "__main__":
    main()
