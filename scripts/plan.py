"""Planner: step time, time to target and cost of a recipe's gradient exchanges on a GPU cluster.

The command line of `trainer/comm/planner.py` (the plan) and `trainer/comm/emulated.py` (the emulated cluster
it is checked against): it loads the recipe's config and builds its model on the meta device, then prints
- ResNet recipe configs (`schedule.phases`): per phase and exchange the step time, then time to the
  recipe's last epoch with evaluation, and the cost; it recommends a fixed exchange and density (the
  densest within 3% of the fastest) and shows what auto would choose.
- Transformer recipe configs: step time per exchange and auto's choice (the epochs to the BLEU target are
  not known in advance, so there is no time to target).
- `--from-run RUN`: a `comm.kind: auto` run's own calibration (links, selection cost, buckets, ready
  times), re-planned at other inter-node bandwidths and cluster sizes.
- `--calibration` (written by scripts/bench/scaling.py as root): every step measured on the emulated
  cluster next to its prediction; the GPU plan takes the TCP efficiency of the shaped links from it and,
  for a model it measured, when backward releases each bucket.

Paper setting by default: 16 nodes x 8 V100, 25 Gbit/s between nodes, configs/resnet50_dawnbench.yaml, with
the published times as cited constants and the V100's compute as a stated assumption.

    python -m scripts.plan [--config configs/resnet50_dawnbench.yaml | --model transformer] [section.key=value ...]
        [--nodes 16 --gpus-per-node 8 --inter-gbit 25 --intra-gbyte 100 --price 24.48]
        [--calibration runs/scaling/calibration.json] [--from-run runs/<name> --rate-factors 0.1,1,10]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from scripts.bench.common import print_table
from trainer.comm.cost import Layout, Network, plan_summary
from trainer.comm.emulated import compare_with_measurements, load_calibration, tcp_efficiency
from trainer.comm.planner import (DENSITIES, NVLINK_BYTES_PER_S, P3_16XLARGE_USD_PER_HOUR, PUBLISHED_S,
                                  TCP_EFFICIENCY_DEFAULT, TRANSFORMER_UTILIZATION, V100_IMAGES_PER_S_224,
                                  V100_TENSOR_FLOPS, ModelSpec, PhasePlan, PlanError, calibration_densities,
                                  gpu_network, load_run_calibration, model_spec, phases_from_config, predict_run,
                                  recommend, replan, step_plans, strategies, transformer_compute_s)
from trainer.dawnbench_report import hms

WMT_VOCAB = 32000
"""The shared BPE vocabulary when the config's corpus is not prepared here (scripts/prepare_wmt.py's default)."""


# ---------------------------------------------------------------- recipes and models


def is_transformer_config(path: str, overrides: Sequence[str]) -> bool:
    """Whether the YAML (with its overrides) sets a Transformer recipe's model keys (d_model, heads, ...)."""
    from recipes.transformer_model import TransformerConfig
    from trainer.config import load_yaml_chain, parse_overrides

    if not Path(path).is_file():
        return False  # load_config reports it
    data, _ = load_yaml_chain(path)
    keys = set((data.get("model") or {})) | set(parse_overrides(list(overrides)).get("model", {}))
    return bool(keys & ({f.name for f in fields(TransformerConfig)} - {"dropout", "label_smoothing"}))


def load_recipe_config(path: str, overrides: Sequence[str], transformer: bool | None = None) -> Any:
    """The config as its recipe loads it (recipes/transformer.py's schema for a Transformer config, else
    recipes/resnet50.py's)."""
    from trainer.config import load_config

    if transformer is None:
        transformer = is_transformer_config(path, overrides)
    if transformer:
        from recipes.transformer import Config
    else:
        from recipes.resnet50 import Config  # type: ignore[assignment]
    return load_config(Config, path, list(overrides))


def transformer_vocab(cfg: Any) -> tuple[int, str]:
    """The shared vocabulary size: the prepared corpus's, else scripts/prepare_wmt.py's default."""
    from data.translation import MANIFEST, PREPARED

    manifest = Path(cfg.data.root) / PREPARED / MANIFEST
    if manifest.is_file():
        return int(json.loads(manifest.read_text())["vocab_size"]), f"from {manifest}"
    return WMT_VOCAB, f"{cfg.data.root} not prepared here: scripts/prepare_wmt.py's default"


def build_model(cfg: Any, transformer: bool) -> Any:
    """The recipe's model on the meta device (shapes only, no memory)."""
    import torch

    with torch.device("meta"):
        if transformer:
            from recipes.transformer_model import build_transformer

            return build_transformer(cfg.model, transformer_vocab(cfg)[0])
        import torchvision

        return getattr(torchvision.models, cfg.model.arch)()


def recipe_model_spec(cfg: Any, transformer: bool, calibration: dict | None = None) -> ModelSpec:
    """The recipe's model as the planner sees it: its buckets and when backward releases them."""
    name = "transformer" if transformer else cfg.model.arch
    return model_spec(name, build_model(cfg, transformer).parameters(), cfg.comm.bucket_mb, calibration)


# ---------------------------------------------------------------- printing


def print_comparison(rows: list[dict[str, Any]], calibration: dict) -> float:
    print(f"Planner vs the emulated cluster (scripts/bench/scaling.py, {calibration.get('measured', '?')}, "
          f"{calibration.get('machine', '?')}). In sample: predicted from links fitted to the raw collectives, the "
          "compute-only steps, the buckets, and the exchange's CPU seconds per step measured in that very cell "
          "(on GPUs that work runs on the GPU); 'pieces only' uses the pieces' CPU cost measured alone instead:")
    print_table(["model", "nodes", "links", "exchange", "measured ms", "exchange CPU ms", "predicted ms", "error",
                 "pieces only ms", "error "],
                [[r["model"], f"{r['nodes']}x{r['ranks_per_node']}", r["rate"], r["exchange"], r["measured_s"] * 1e3,
                  r["exchange_cpu_s"] * 1e3, r["predicted_s"] * 1e3, f"{r['error'] * 100:+.1f}%", r["pieces_s"] * 1e3,
                  f"{(r['pieces_s'] / r['measured_s'] - 1) * 100:+.1f}%"] for r in rows])
    worst = max(abs(r["error"]) for r in rows)
    print(f"max |error| {worst * 100:.1f}% over {len(rows)} measured steps; pieces only: max |error| "
          f"{max(abs(r['pieces_s'] / r['measured_s'] - 1) for r in rows) * 100:.1f}%\n")
    return worst


def print_cluster(args: argparse.Namespace, net: Network, spec: ModelSpec, cfg: Any, efficiency: float,
                  efficiency_from: str) -> None:
    print(f"Plan: {args.config} on {args.nodes} nodes x {args.gpus_per_node} GPUs, {args.inter_gbit:g} Gbit/s "
          f"between nodes (payload {net.links['inter'].bytes_per_s * 8 / 1e9:.2f} Gbit/s at TCP efficiency "
          f"{efficiency:.3f}, {efficiency_from}), {args.intra_gbyte:g} GB/s inside a node, ${args.price:.2f}/node-hour")
    print(f"model {spec.name}: {spec.params:,} parameters in {len(spec.buckets)} buckets of <= "
          f"{cfg.comm.bucket_mb:g} MB; densities >= comm.min_density {cfg.comm.min_density:g} (the recipe's safe "
          "bound)")


def state_per_param(cfg: Any) -> int:
    """Optimizer state elements per parameter that comm.kind local averages (Adam's two moments, else momentum)."""
    return 2 if cfg.optim.name in ("adam", "adamw") else 1


def print_resnet_plan(cfg: Any, args: argparse.Namespace, net: Network, spec: ModelSpec, phases: list[PhasePlan]
                      ) -> dict[str, Any]:
    print(f"compute per GPU: {args.images_per_s:g} img/s at 224 px (stated assumption, scaled by pixels)")
    print_table(["phase", "epochs", "image px", "global batch", "steps/epoch", "compute ms/step"],
                [[i, p.epochs, p.image_size, p.batch_size, p.steps_per_epoch, p.compute_s * 1e3]
                 for i, p in enumerate(phases)])
    preds = [predict_run(phases, spec, s, net, args.price, cfg.comm.dense_warmup_steps, cfg.train.eval_every_epochs,
                         args.images_per_s) for s in strategies(cfg.comm, args.densities, state_per_param(cfg))]
    print("\nPredicted (training + evaluation; data loading, start-up and checkpoints not modelled):")
    print_table(["exchange", *[f"step ms @{p.image_size}" for p in phases], "train s", "eval s", "time", "cost $"],
                [[p.strategy.label, *[s * 1e3 for s in p.step_s], p.train_s, p.eval_s, hms(p.total_s), p.cost_usd]
                 for p in preds])
    auto = preds[-1]
    best = recommend(preds)
    print(f"\nRecommendation: {best.strategy.label} ({hms(best.total_s)}, ${best.cost_usd:.2f}); the densest "
          "setting within 3% of the fastest fixed one (density changes convergence; the planner assumes the "
          "recipe's epochs hold)")
    print("comm.kind auto would choose, per phase: "
          + "; ".join(f"@{p.image_size} px {plan_summary(plan)}" for p, plan in zip(phases, auto.plans))
          + f" ({hms(auto.total_s)}, ${auto.cost_usd:.2f})")
    configured = next((p for p in preds if p.strategy.is_configured(cfg.comm)), None)
    if configured is not None:
        print(f"The config's own choice, comm.kind={cfg.comm.kind}: {hms(configured.total_s)}, "
              f"${configured.cost_usd:.2f}")
    print("Published (DAWNBench time to 93% top-5, 128 V100, 25 Gbit/s; end to end, incl. data loading):")
    for who, seconds in PUBLISHED_S.items():
        print(f"  {hms(seconds)}  {who}")
    return {"recommended": best.strategy.label, "recommended_s": round(best.total_s, 1),
            "configured_s": round(configured.total_s, 1) if configured else None,
            "dense_s": round(preds[0].total_s, 1), "auto_s": round(auto.total_s, 1),
            "auto_plan": [[c.label for c in plan] for plan in auto.plans], "published_s": PUBLISHED_S}


def print_transformer_plan(cfg: Any, args: argparse.Namespace, net: Network, spec: ModelSpec) -> dict[str, Any]:
    tokens = cfg.data.max_tokens
    if args.step_ms:
        compute_s, source = args.step_ms / 1e3, "--step-ms"
    else:
        compute_s = transformer_compute_s(spec.params, tokens)
        source = (f"6 x parameters x tokens at {TRANSFORMER_UTILIZATION:g} of a V100's {V100_TENSOR_FLOPS / 1e12:g} "
                  "TFLOPS (stated assumption; --step-ms replaces it)")
    print(f"vocabulary {transformer_vocab(cfg)[0]:,} ({transformer_vocab(cfg)[1]}); compute per step: "
          f"{tokens:,} tokens per GPU, {compute_s * 1e3:.1f} ms ({source})")
    rows, out, fixed = [], [], []
    for s, t, plan in step_plans(strategies(cfg.comm, args.densities, state_per_param(cfg)), spec, compute_s, net):
        rows.append([s.label, t * 1e3, (t - compute_s) * 1e3, plan_summary(plan)])
        out.append({"exchange": s.label, "step_ms": round(t * 1e3, 2), "plan": [ch.label for ch in plan]})
        if s.choice is not None:  # a fixed exchange (not auto, not local)
            fixed.append(out[-1])
    print("\nPredicted step (the epochs to the BLEU target are not known in advance: no time to target):")
    print_table(["exchange", "step ms", "exposed exchange ms", "buckets"], rows)
    best = min(fixed, key=lambda r: r["step_ms"])
    print(f"\nFastest fixed exchange: {best['exchange']} ({best['step_ms']:.1f} ms); auto: {out[-1]['step_ms']:.1f} ms")
    return {"steps": out, "recommended": best["exchange"], "compute_ms": round(compute_s * 1e3, 2)}


def print_from_run(args: argparse.Namespace) -> dict[str, Any]:
    """What auto would choose, and the exposed exchange it predicts, at other bandwidths and cluster sizes,
    from a run's own calibration (links, selection cost, bucket sizes and ready times)."""
    from trainer.comm.auto import network_from_calibration

    cal = load_run_calibration(args.from_run)
    measured = Layout(int(cal["nodes"]), int(cal["ranks_per_node"]))
    base, sizes, ready = network_from_calibration(cal, measured)
    densities = calibration_densities(cal) or _parse_densities(args.densities)
    factors = _parse_densities(args.rate_factors, "--rate-factors", upper=None)
    layouts = [measured, Layout(measured.nodes * 4, measured.per_node)]
    if (args.nodes, args.gpus_per_node) != (16, 8) or measured.per_node > 1:
        layouts.append(Layout(args.nodes, args.gpus_per_node))
    print(f"From {args.from_run}: measured on {measured.nodes} nodes x {measured.per_node} ranks; "
          f"{len(sizes)} buckets, {sum(sizes):,} gradients; links "
          + ", ".join(f"{k} {v.bytes_per_s * 8 / 1e9:.3g} Gbit/s" for k, v in base.links.items())
          + f"; selection {base.selection.per_element_s * 1e9:.1f} ns/element; min density {cal['min_density']:g}")
    print("Other layouts keep the measured links (the node-crossing ones scaled by the factor, no faster than the "
          "hosts) and ready times.")
    rows, out = [], []
    for r in replan(cal, base, sizes, ready, densities, layouts, factors):
        lay = f"{r.layout.nodes}x{r.layout.per_node}"
        rows.append([lay, f"x{r.rate_factor:g}", plan_summary(r.plan), r.exposed_s * 1e3, r.dense_exposed_s * 1e3])
        out.append({"layout": lay, "rate_factor": r.rate_factor, "plan": [c.label for c in r.plan],
                    "exposed_ms": round(r.exposed_s * 1e3, 2), "dense_exposed_ms": round(r.dense_exposed_s * 1e3, 2)})
    print_table(["nodes", "inter-node rate", "auto's choice (buckets)", "exposed ms", "all dense exposed ms"], rows)
    return {"from_run": str(args.from_run), "plans": out}


# ---------------------------------------------------------------- entry point


def _parse_densities(text: str, option: str = "--densities", upper: float | None = 1.0) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PlanError(f"{option} {text!r}: expected numbers separated by commas, e.g. 0.001,0.01") from None
    if not values or any(not 0 < v or (upper is not None and v > upper) for v in values):
        what = "density" if option == "--densities" else "value"
        raise PlanError(f"{option} {text!r}: each {what} must be in (0, {upper if upper is not None else float('inf'):g}]")
    return values


def _parse_compute(items: Sequence[str]) -> dict[int, float]:
    out = {}
    for item in items:
        size, sep, ms = item.partition("=")
        try:
            out[int(size)] = float(ms) / 1e3
        except ValueError:
            raise PlanError(f"--compute-ms {item!r}: expected IMAGE_PX=MS_PER_IMAGE, e.g. 96=0.16") from None
        if not sep or out[int(size)] <= 0:
            raise PlanError(f"--compute-ms {item!r}: expected IMAGE_PX=MS_PER_IMAGE with MS > 0")
    return out


CONFIGS = {"resnet": "configs/resnet50_dawnbench.yaml", "transformer": "configs/transformer_wmt16_en_de.yaml"}
"""The config planned when --config is not given (by --model's recipe)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/plan.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="", help=f"recipe YAML (default {CONFIGS['resnet']}; with --model "
                                                f"transformer {CONFIGS['transformer']})")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for the recipe")
    p.add_argument("--model", default="", help="transformer, or a ResNet arch (resnet50, ...) replacing model.arch "
                                               "(default: the config's model)")
    p.add_argument("--nodes", type=int, default=16, help="nodes (default 16)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--inter-gbit", type=float, default=25.0, help="inter-node link, Gbit/s per direction (default 25)")
    p.add_argument("--intra-gbyte", type=float, default=NVLINK_BYTES_PER_S / 1e9,
                   help=f"intra-node ring bandwidth, GB/s (default {NVLINK_BYTES_PER_S / 1e9:g}: NVLink, assumed)")
    p.add_argument("--price", type=float, default=P3_16XLARGE_USD_PER_HOUR,
                   help=f"$ per node-hour (default {P3_16XLARGE_USD_PER_HOUR}: AWS p3.16xlarge on demand)")
    p.add_argument("--images-per-s", type=float, default=V100_IMAGES_PER_S_224,
                   help=f"ResNet: training images/s of one GPU at 224 px (default {V100_IMAGES_PER_S_224:g}: V100, cited)")
    p.add_argument("--compute-ms", nargs="*", default=[], metavar="PX=MS",
                   help="ResNet: measured compute (fwd+bwd) ms per image at an image size; replaces the scaled assumption")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="Transformer: measured compute (fwd+bwd) ms of one step on one GPU; replaces the FLOPs estimate")
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)),
                   help="sparse densities to consider besides the config's comm.densities (those below its "
                        "comm.min_density are left out)")
    p.add_argument("--from-run", default="", metavar="RUN",
                   help="a comm.kind=auto run folder (>= 2 nodes): what auto would choose at other bandwidths and "
                        "cluster sizes, from that run's own calibration")
    p.add_argument("--rate-factors", default="0.1,0.2,0.5,1,2,5,10",
                   help="with --from-run: inter-node bandwidths to plan for, as factors of the measured one")
    p.add_argument("--calibration", default="runs/scaling/calibration.json",
                   help="scripts/bench/scaling.py's measurements (compared when present; '' = none)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except PlanError as e:  # ConfigError is a ValueError too, but has its own prefix
        print(f"plan.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as e:
        print(f"plan.py: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def check_args(args: argparse.Namespace) -> None:
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for name in ("inter_gbit", "intra_gbyte", "images_per_s"):
        if not getattr(args, name) > 0:
            raise PlanError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.price < 0 or args.step_ms < 0:
        raise PlanError(f"--price and --step-ms: must be >= 0, got {args.price} and {args.step_ms}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.from_run:
        return print_from_run(args)
    check_args(args)
    args.densities = _parse_densities(args.densities)
    compute = _parse_compute(args.compute_ms)
    wants_transformer = args.model == "transformer"
    args.config = args.config or CONFIGS["transformer" if wants_transformer else "resnet"]
    transformer = is_transformer_config(args.config, args.overrides)
    if args.model and wants_transformer != transformer:
        raise PlanError(f"--model {args.model}: {args.config} is a {'Transformer' if transformer else 'ResNet'} "
                        "recipe config; pass a config of that recipe with --config, or leave --model out")
    overrides = list(args.overrides) + ([f"model.arch={args.model}"] if args.model and not transformer else [])
    cfg = load_recipe_config(args.config, overrides, transformer)

    calibration, worst = None, None
    explicit = args.calibration != build_parser().get_default("calibration")
    if args.calibration and (explicit or Path(args.calibration).is_file()):
        calibration = load_calibration(args.calibration)
        worst = print_comparison(compare_with_measurements(calibration), calibration)
    else:
        print(f"(no calibration{f' at {args.calibration}' if args.calibration else ''}: run scripts/bench/scaling.py "
              "as root to measure the emulated cluster and compare the planner with it)\n")

    efficiency, source = TCP_EFFICIENCY_DEFAULT, "assumed"
    if calibration:
        efficiency, source = tcp_efficiency(calibration), "measured on the emulated cluster"
    spec = recipe_model_spec(cfg, transformer, calibration)
    net = gpu_network(args.nodes, args.gpus_per_node, args.inter_gbit, args.intra_gbyte, efficiency)
    print_cluster(args, net, spec, cfg, efficiency, source)
    if transformer:
        out = print_transformer_plan(cfg, args, net, spec)
    else:
        phases = phases_from_config(cfg, net.layout.world, compute_s_per_image=compute, images_per_s_224=args.images_per_s)
        out = print_resnet_plan(cfg, args, net, spec, phases)
    if worst is not None:
        out["calibration_max_error"] = round(worst, 4)
    return out


if __name__ == "__main__":
    main()
