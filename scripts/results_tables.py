"""Writes the results tables of README.md and docs/*.md from the benchmarks' result files in docs/results/.

A table sits between two markers, and everything between them is generated:

    <!-- results:topk -->
    ...
    <!-- /results -->

`results:NAME` renders docs/results/NAME.json (written by `python -m scripts.bench.NAME`) as that bench's
table, with a line naming the file, its date, machine, load and command (or says that the file does not exist
yet); `results:summary` is one row per result file present. Every number in these tables comes from a result file, so none is copied by hand.

    python -m scripts.results_tables           # rewrite the tables in place
    python -m scripts.results_tables --check   # exit 1 naming each table that differs from its result file
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "results"
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


class ResultsError(ValueError):
    """A marker names a table that cannot be made (no renderer, or no result file)."""


def num(value: float, digits: int = 3) -> str:
    """`digits` significant digits, thousands separated, no exponent."""
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if abs(value) >= 1e-3 else f"{value:.2e}"


def times(value: float) -> str:
    return f"{value:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def machine(record: dict[str, Any]) -> str:
    m = record["machine"]
    flags = ", ".join(m.get("cpu_flags", [])) or "no AVX2/AVX-512/AMX"
    return f"{m['cpu']}, {m['cores']} cores ({flags})"


def load_span(record: dict[str, Any]) -> tuple[float, float, bool] | None:
    """The 1-min load average at the start and end of the measurement, and whether it spans separate training
    runs: for a result made of runs (the TTA bench), the lowest at a run's start and the highest at a run's end,
    since the file may be written later from the runs' folders; else the bench process's own."""
    runs = record["result"].get("runs")
    if isinstance(runs, list) and runs:  # the TTA bench's runs (the quickstart bench's are a dict by name)
        return min(r["load_before"] for r in runs), max(r["load_after"] for r in runs), True
    load = record.get("load_avg_1min") or {}
    return None if load.get("start") is None else (load["start"], load["end"], False)


def provenance(bench: str, record: dict[str, Any]) -> str:
    load = load_span(record)
    commit = record["commit"][:12] + ("+dirty" if record["commit"].endswith("+dirty") else "")
    if load is None:
        load_text = ""
    elif load[2]:
        load_text = f"; 1-min load average from {load[0]:.1f} to {load[1]:.1f} at its runs' starts and ends"
    else:
        load_text = f"; 1-min load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
    return (f"From [`docs/results/{bench}.json`](results/{bench}.json): {record['date'][:16].replace('T', ' ')} "
            f"UTC, {machine(record)}{load_text}; `{record['command']}` at commit `{commit}`.")


def topk(r: dict[str, Any]) -> list[str]:
    rows = []
    for key, entry in r["results"].items():
        source, density = key.split()
        for threads in ("1t", "2t"):
            t = entry[threads]
            rows.append([source, f"{float(density):.1%}", f"{entry['k']:,}", threads[0], num(t["baseline_ms"]),
                         num(t["ms"]), times(t["ratio"]), f"{entry['recall']:.5f}"])
    return [f"{r['n']:,} fp32 values ({r['arch']}'s parameter count); torch.topk and MSTopK at the same "
            f"`torch.set_num_threads`:", "",
            *table(["gradients", "density", "k", "threads", "torch.topk ms", "MSTopK ms", "speed-up", "recall"],
                   rows)]


def input_pipeline(r: dict[str, Any]) -> list[str]:
    rows = []
    for name, e in r["results"].items():
        rows.append([e.get("label", name), e["output"], num(e["quiet_img_s"]), times(e["quiet_ratio"]),
                     num(e["loaded_img_s"]), times(e["loaded_ratio"]), num(e["cpu_ms_per_img"])])
    return [f"{r['images']:,} JPEGs, random-resized crops to {r['image_size']} px; \"loaded\": the bench runs "
            f"{r['load_procs']} CPU-spinning processes of its own during those epochs:", "",
            *table(["pipeline", "output", "quiet images/s", "vs (a)", "loaded images/s", "vs (a)", "CPU ms/image"],
                   rows)]


def data_wait(r: dict[str, Any]) -> list[str]:
    rows = []
    for cache in ("cold", "warm"):
        waits = r[f"{cache}_wait_ms"]
        for mode, label in (("sequential", "(a) sequential external source"), ("prefetch", "(b) prefetch thread")):
            rows.append([cache, label, num(waits[mode]), times(waits[mode] / waits["sequential"])])
    return [f"ResNet-18 training steps at {r['image_size']} px, {r['batch']} images per step (a step's compute: "
            f"{num(r['step_ms'])} ms):", "",
            *table(["cache", "external source", "data wait ms/step", "vs (a)"], rows)]


def comm(r: dict[str, Any]) -> list[str]:
    compute = r["results"]["compute only"]["step_ms"]
    rows = [[name, num(e["step_ms"]), num(e["step_ms"] - compute), num(e.get("bytes_sent", 0) / 2**20),
             num(e.get("bytes_inter_node", 0) / 2**20), f"{e.get('density', 1.0):.3g}"]
            for name, e in r["results"].items()]
    return [f"{r['arch']} ({r['params']:,} gradients) on real photos at {r['image_size']} px, {r['world']} gloo "
            f"processes as {r['world'] // r['ranks_per_node']} nodes x {r['ranks_per_node']} ranks, kinds "
            f"interleaved step by step; median of {r['steps']} steps, slowest rank:", "",
            *table(["exchange", "step ms", "comm ms", "MB sent/rank", "inter-node MB/rank", "density"], rows)]


def optim(r: dict[str, Any]) -> list[str]:
    rows = [["per-tensor loop LARS (baseline)", num(r["baseline_ms"]), "1.00x"],
            [f"FusedLARS ({r['path']})", num(r["ms"]), times(r["ratio"])],
            ["SGD foreach (reference: no norms or trust ratios)", num(r["sgd_foreach_ms"]), times(r["baseline_ms"] / r["sgd_foreach_ms"])]]
    return [f"One optimizer step over {r['model']}'s {r['tensors']} parameter tensors:", "",
            *table(["optimizer", "ms/step", "speed-up vs loop"], rows)]


def small_conv(r: dict[str, Any]) -> list[str]:
    rows = [[s["model"], s["px"], num(s["stock_ms"]), num(s["gemm_ms"]), times(s["stock_ms"] / s["gemm_ms"])]
            for s in r["steps"]]
    spread = r.get("layer_speedups")
    note = (f" Each convolution alone: {times(spread['min'])} to {times(spread['max'])}." if spread else "")
    return [f"A training step (forward, loss, backward), batch 32, {r['threads']} thread(s).{note}", "",
            *table(["model", "px", "stock ResNet ms", "small_map_gemm ms", "speed-up"], rows)]


def max_pool_speedup(entry: dict[str, Any]) -> float:
    return entry["stock_ms"] / entry["switched_ms"]


def max_pool(r: dict[str, Any]) -> list[str]:
    def rows(key: str, fields: Sequence[str]) -> list[list[Any]]:
        return [[*(s[f] for f in fields), num(s["stock_ms"]), num(s["switched_ms"]), times(max_pool_speedup(s))]
                for s in r[key]]
    model = ["threads", "model", "px", "precision"]
    header = [*model, "stock ResNet ms", "max_pool_channels_last ms", "speed-up"]
    pool = ["threads", "px", "precision"]
    return [f"Batch {r['batch']}, both models NCHW. The stem's pool alone, forward + backward:", "",
            *table([*pool, "NCHW kernel ms", "channels-last path ms", "speed-up"], rows("pool", pool)), "",
            "A training step (forward, loss, backward):", "", *table(header, rows("train", model)), "",
            "An evaluation forward:", "", *table(header, rows("eval", model))]


def max_pool_headline(r: dict[str, Any]) -> str:
    """The overall ratio, then the range of speed-ups over the training steps and over the evaluation forwards."""
    def spread(key: str) -> str:
        speedups = [max_pool_speedup(x) for x in r[key]]
        return f"{times(min(speedups))}-{times(max(speedups))}"
    return (f"{times(r['ratio'])} summed over every shape; training steps {spread('train')}; evaluation forwards "
            f"{spread('eval')}")


def replica_guard(r: dict[str, Any]) -> list[str]:
    return [*table(["what", "ms"], [["training step (" + r["baseline"] + ")", num(r["step_ms"])],
                                    ["weight checksum", num(r["checksum_ms"])]]), "",
            f"Checked every {r['every_steps']} steps and at each epoch end, {r['checks']} checks in a run of "
            f"{r['epochs']} epochs of {r['steps_per_epoch']} steps (the quickstart's), the guard costs "
            f"{100 * r['share']:.3g}% of its training time (its all-gather of one number per rank not timed)."]


def transformer(r: dict[str, Any]) -> list[str]:
    rows = [["DDP + Adam (baseline)", num(r["baseline_tokens_per_s"]), "1.00x", ""]]
    rows += [[f"recipe, {kind}", num(r[f"{kind}_tokens_per_s"]), times(statistics.median(ratios)),
              ", ".join(f"{x:.2f}" for x in ratios)] for kind, ratios in r["round_ratios"].items()]
    return [f"{r['rounds']} rounds, each in a rotated order; the ratio is the median over rounds of the same round's "
            "ratio.", "", *table(["contender", "tokens/s (median)", "vs baseline", "per round"], rows)]


def scaling(r: dict[str, Any]) -> list[str]:
    kinds = ("dense", "dense fp16", "topk", "hitopk", "auto")  # titles; newer results name "dense fp16" dense16
    rows = [[c["model"], c["layout"], c["rate"], num(c["compute_ms"]),
             *(num(c["step_ms"].get(k, c["step_ms"].get("dense16"))) for k in kinds),
             c["best_fixed"], f"{c['auto_vs_best']:.3f}",
             "{1:.3f} ({0:.3f}-{2:.3f})".format(*c["auto_vs_best_rounds"]), f"{c['auto_vs_dense']:.3f}",
             c["auto_plan_summary"],
             f"{100 * c['planner']['max_abs_error']:.0f}% (from {c['planner']['calibrated_on']})"
             if "planner" in c else "-"] for c in r["cells"]]
    oos = r.get("planner_out_of_sample_max_error")
    return [f"Step ms (median of {r['steps']} interleaved rounds, slowest rank; density {r['density']:g}); auto "
            f"against the best fixed exchange of its cell and against dense; the planner's largest out-of-sample "
            f"error per cell (calibrated at the layout's other shaped rate):", "",
            *table(["model", "nodes x ranks", "links", "compute only", *kinds, "best fixed", "auto / best",
                    "auto / best per round: median (IQR)", "auto / dense", "auto's plan (buckets)", "planner error"], rows), "",
            f"Auto within 5% of the best fixed exchange in every cell: **{r['auto_within_5pct_of_best']}**; never "
            f"more than 5% slower than dense: **{r['auto_never_5pct_slower_than_dense']}**; planner out of sample, "
            f"largest error: {'-' if oos is None else f'{100 * oos:.0f}%'}. Cells measured at commit "
            + ", ".join(f"`{c}`" for c in sorted({c.get("commit", "") for c in r["cells"]}) if c)
            + " (each cell's `commit`; a `--resume` run writes the file from saved cells)."]


def choice_text(choice: dict[str, Any] | None) -> str:
    return "" if not choice else ", ".join(f"{k} {v}" for k, v in choice.items())


def kept_choices(v: dict[str, Any]) -> str:
    """Every round's decision, when they differ."""
    seen = [choice_text(c) for c in v.get("choices", [v["choice"]])]
    return " / ".join(dict.fromkeys(seen)) + (" (per round: differ)" if len(set(seen)) > 1 else "")


def choices(r: dict[str, Any]) -> list[str]:
    cell = r["cell"]
    rows = [[name, num(v["clock_s"]), num(v["startup_s"]), times(v["epoch_ratio"]), times(v["vs_best_pinned"]),
             ", ".join(num(t, 3) for t in v["top1"]), kept_choices(v)] for name, v in cell["variants"].items()]
    return [f"The whole TTA recipe (2 ranks, 10 epochs at 24, 32 and 40 px, global batch 64, evaluation at 48 px, run "
            f"to the end), median of {r['rounds']} interleaved round(s). Clock = the training clock (the epochs, "
            "evaluations included); start-up = the measured choices before it. Pinned rows keep NCHW and, unless "
            "they say direct convs, the GEMM convolutions; they are the combinations the screen below kept "
            f"({', '.join(r['pinned'])}).", "",
            *table(["variant", "clock s", "start-up s", "clock / best pinned", "with start-up", "top-1 per round",
                    "choice"], rows), "",
            f"The defaults' clock (measuring run) over the fastest pinned combination's ({cell['best_pinned']}): "
            f"{r['ratio']:.3f}; with the start-up: {r['with_startup']:.3f}; served from the cache over measuring "
            f"(clock and start-up): {r['cached_over_measuring']:.3f}."]


def choices_screen(r: dict[str, Any]) -> list[str]:
    rows = [[f"{size} px", name, num(v["clock_s"]), num(v["startup_s"]), times(v["epoch_ratio"]), kept_choices(v)]
            for size, cell in r["cells"].items() for name, v in cell["variants"].items()]
    commits = sorted({c for cell in r["cells"].values() for v in cell["variants"].values() for c in v["commits"]})
    return [f"The screen: one epoch of the TTA recipe per image size (2 ranks, global batch 64, evaluation at 48 px), "
            f"median of {r['rounds']} round(s), every pinned combination, run at "
            f"{', '.join(f'`{c[:12]}`' for c in commits) or 'the commit above'}. Kept for the whole-recipe runs "
            f"(within {r['bound']}x of the fastest pinned epoch at every size): {', '.join(r['kept'])}.", "",
            *table(["size", "variant", "epoch s", "start-up s", "epoch / best pinned", "choice"], rows)]


def quickstart(r: dict[str, Any]) -> list[str]:
    def scores(run: dict[str, Any]) -> str:
        return ", ".join(f"{k} {num(v, 4)}" for k, v in run.items() if k.startswith(("final_", "test_")))
    rows = [[name, num(v["wall_s"]) + (f" (setup {num(v['setup_s'])})" if "setup_s" in v else ""),
             num(v["elapsed_s"]), num(v["startup_s"]), f"{100 * v['startup_share']:.2f}%",
             v.get("source", "measured"), choice_text(v["choice"]) if "choice" in v else "(as measuring)", scores(v)]
            for name, v in r["runs"].items()]
    fresh = ("; make quickstart, fresh clone = the whole command in a fresh clone (venv set up from scratch, data, "
             "training, report), of which `make setup` the setup seconds"
             if any(name.startswith("make quickstart, fresh clone") for name in r["runs"]) else "")
    return ["The quickstarts on 2 CPU ranks (the run folders' summary.json and env.json); wall = torchrun start to "
            f"exit, clock = the trainer's (`elapsed_s`, after the start-up measurement){fresh}.", "",
            *table(["run", "wall s", "clock s", "start-up s", "start-up share", "choices from", "choice", "scores"],
                   rows)]


def paired(ratio: float | None) -> str:
    """A paired ratio (or their median); None: no seed where both sides reached the target."""
    return "none both reached" if ratio is None else f"{ratio:.3f}"


def tta_headline(r: dict[str, Any]) -> str:
    """The README's cell: per headline target the median ratio, the seeds in it, the range of the paired ratios
    and each side's misses; whether the recipe's measured choices came from the machine's cache."""
    def one(t: str) -> str:
        e = r["targets"][t]
        missed = [f"{side} missed {len(e['missed'][side])}" for side in ("baseline", "recipe") if e["missed"][side]]
        spread = [] if e["range"][0] is None else [f"range {e['range'][0]:.3f}-{e['range'][1]:.3f}"]
        return (f"{paired(e['ratio'])} at {100 * float(t):g}% ({e['seeds_in_median']} of {len(e['seeds'])} seeds"
                + "".join(f"; {m}" for m in [*spread, *missed]) + ")")
    choices = recipe_choices(r)
    cached = bool(choices) and all(c.get("source") == "cache" for c in choices)
    parts = [one(t) for t in r["headline"]]
    if amps := recipe_amps(r):
        parts.append(f"the recipe in {' or '.join('fp32' if a == 'off' else a for a in amps)} (measured), "
                     "the baseline in fp32")
    if cached:
        parts.append("the recipe's measured choices read from this machine's cache")
    return "; ".join(parts)


def tta(r: dict[str, Any]) -> list[str]:
    """Per target the paired ratios' median, intervals and misses; per seed the headline targets' times; each
    side's final top-1."""
    def seconds(x: float | None, epochs: int | None) -> str:
        return "missed" if x is None else f"{x:.1f} (ep. {epochs})"

    def missed(seeds: list[int]) -> str:
        return ", ".join(map(str, seeds)) or "none"

    targets, headline = r["targets"], r["headline"]
    rows = [[f"{100 * float(t):g}%{' (headline)' if t in headline else ''}",
             f"{e['seeds_in_median']} of {len(e['seeds'])}",
             f"**{paired(e['ratio'])}**" if t in headline else paired(e["ratio"]),
             "-" if e["interval"][0] is None else " to ".join(f"{x:.3f}" for x in e["interval"]),
             "-" if e["range"][0] is None else " to ".join(f"{x:.3f}" for x in e["range"]),
             missed(e["missed"]["baseline"]), missed(e["missed"]["recipe"])] for t, e in targets.items()]
    seeds = targets[headline[0]]["seeds"]
    per_seed = [[seed, *[cell for t in headline for cell in (
        seconds(targets[t]["baseline_s"][i], targets[t]["baseline_epochs"][i]),
        seconds(targets[t]["recipe_s"][i], targets[t]["recipe_epochs"][i]), paired(targets[t]["ratios"][i]))]]
        for i, seed in enumerate(seeds)]
    accuracy_line = tta_accuracy(r)
    return [*table(["target", "seeds both reached", "recipe / baseline, median", "bootstrap 90% interval", "range",
                    "baseline missed", "recipe missed"], rows), "",
            *table(["fresh seed", *[f"{h} {100 * float(t):g}%" for t in headline
                                    for h in ("baseline s to", "recipe s to", "ratio at")]], per_seed), "",
            f"Each target at {r['target_consecutive']} evaluations in a row; the median is over the seeds both sides "
            f"reached, a miss is listed, never counted as the other side's win. {accuracy_line} "
            f"{recipe_precision(r)}"]


def recipe_choices(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each recipe run's measured choices and how they were reached (its env.json's; {} where none)."""
    return [run.get("choices") or {} for run in r.get("runs", []) if run["side"] == "recipe"]


def recipe_amps(r: dict[str, Any]) -> list[str]:
    """The train.amp values the recipe's runs measured and chose (none where it was pinned)."""
    return sorted({str((c.get("choice") or {}).get("amp")) for c in recipe_choices(r)} - {"None"})


def recipe_precision(r: dict[str, Any]) -> str:
    """How the recipe's precision was set, and, where it was measured, what each run chose."""
    chosen = recipe_amps(r)
    if not chosen:
        return f"The recipe ran in {r['recipe_precision']}."
    return (f"The recipe's precision: {r['recipe_precision']}; its runs chose train.amp "
            f"{' or '.join(chosen)}.")


def tta_accuracy(r: dict[str, Any]) -> str:
    """Each side's mean final and best top-1 with the configs frozen for each headline target (once where both
    sides run one config throughout), naming the configs."""
    acc, frozen = r.get("accuracy"), r.get("frozen")
    if not acc:
        return "Final top-1 not recorded: these runs stopped at the target."
    if frozen is None:  # one config per side
        acc, frozen = {"": acc}, {}

    def pct(a: dict[str, Any], side: str, key: str) -> str:
        return f"{100 * a[side][key]:.1f}%"

    def configs(t: str) -> str:
        return " and ".join(f"`{frozen[side][t]}`" for side in ("baseline", "recipe")) if frozen else ""
    groups: dict[str, list[str]] = {}
    for t in acc:
        groups.setdefault(configs(t), []).append(t)
    parts = []
    for names, ts in groups.items():
        a = acc[ts[0]]
        where = (f" of {names} (frozen for {' and '.join(f'{100 * float(t):g}%' for t in ts)})" if names else "")
        parts.append(f"Final top-1, mean over the seeds{where}: baseline {pct(a, 'baseline', 'mean_final_top1')}, "
                     f"recipe {pct(a, 'recipe', 'mean_final_top1')} (best: {pct(a, 'baseline', 'mean_best_top1')} "
                     f"and {pct(a, 'recipe', 'mean_best_top1')}).")
    return " ".join(parts)


QUIET_LOAD = 4.0  # a 1-min load average below it at a tuning run's start: no other job was running


def override_text(item: str) -> str:
    """A tuning override as a table cell; a phase table as its image sizes and epochs."""
    key, _, value = item.partition("=")
    if key == "schedule.phases":
        import yaml

        phases = yaml.safe_load(value)
        return "phases " + ", ".join(f"{p['image_size']} px ep. {p['start_epoch']}-{p['end_epoch']}" for p in phases)
    return f"`{item}`"


def tta_tuning(runs: list[dict[str, Any]], targets: Sequence[float], consecutive: int) -> list[str]:
    """Every tuning run, read at each of `targets` from its curve (runs stopped at a target before runs went to
    the end show what they reached)."""
    from trainer.tta_stats import reached_at

    rows = []
    for run in runs:
        at = [reached_at(run["top1"], target, consecutive) for target in targets]
        rows.append([tuning_machine(run), run["date"][:16].replace("T", " "), f"`{run['commit'][:7]}`", run["side"],
                     "<br>".join(override_text(o) for o in run["overrides"]) or "none", run["seed"],
                     f"{100 * run['top1'][-1]:.1f}% after {run['epochs_run']}",
                     *["missed" if i is None else f"{run['elapsed_s'][i]:.1f} (epoch {i + 1})" for i in at],
                     f"{run['load_before']:.1f} → {run['load_after']:.1f}"])
    tuning = [r for r in runs if ablation_kind(r) is None]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in tuning:
        groups.setdefault((tuning_machine(r), r["side"]), []).append(r)
    counts = "; ".join(f"{cpu}, {side}: {len(mine)} runs, {sum(r['load_before'] < QUIET_LOAD for r in mine)} of them "
                       "alone" for (cpu, side), mine in sorted(groups.items()))
    if len(tuning) < len(runs):
        counts += f" (and {len(runs) - len(tuning)} ablation runs of the recipe, listed too, not counted)"
    return [*table(["machine", "date (UTC)", "commit", "side", "overrides", "seed", "last top-1",
                    *[f"s to {100 * t:g}% x {consecutive}" for t in targets], "load (1 min)"], rows), "",
            f"From [`docs/results/tta_tuning.json`](results/tta_tuning.json), appended by `python -m scripts.bench.tta "
            f"--tune SIDE --set KEY=VALUE`: {counts} (started at a 1-minute load below {QUIET_LOAD:g}; a run itself "
            "loads the 2-core box to about 2). The times of runs started under other jobs' load are not comparable; "
            "their curves are. Without overrides a run is the side's config at that commit."]


def machine_label(cpu: str, widest: str = "") -> str:
    """A CPU model with its widest vector extension where there is one: one model name covers machines that
    differ in it (per-machine results, tuning runs)."""
    return f"{cpu} ({widest})" if widest else cpu


def tuning_machine(run: dict[str, Any]) -> str:
    """A tuning run's machine (its widest vector extension where the record has one)."""
    return machine_label(run.get("cpu", "?"), run.get("cpu_widest", ""))


def ablation_kind(run: dict[str, Any]) -> str | None:
    """The exchange of an ablation run (`--tune recipe --ablation`: to the end, changing nothing but comm.kind;
    'auto (the config)' for no change); None for a tuning run."""
    kinds = [o.partition("=")[2] for o in run["overrides"] if o.startswith("comm.kind=")]
    if run.get("purpose") != "ablation" or run["side"] != "recipe" or "final_top1" not in run \
            or len(kinds) != len(run["overrides"]) or len(kinds) > 1:
        return None
    return kinds[0] if kinds else "auto (the config)"


def tta_ablation(runs: list[dict[str, Any]]) -> list[str]:
    """The recipe's ablation runs (`ablation_kind`), grouped by machine and exchange: their seeds, commits and
    final and best top-1."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        if (kind := ablation_kind(run)) is not None:
            groups.setdefault((tuning_machine(run), kind), []).append(run)
    if not groups:
        return ["_No ablation run yet: `python -m scripts.bench.tta --tune recipe --ablation --set comm.kind=KIND "
                "--tuning-seeds 0 1 2` runs one._"]

    def pct(values: list[float]) -> str:
        return f"{100 * statistics.mean(values):.2f}% ({100 * min(values):.2f}-{100 * max(values):.2f})"
    rows = [[cpu, f"`{kind}`", ", ".join(str(r["seed"]) for r in group),
             ", ".join(f"`{c}`" for c in sorted({r["commit"][:7] + ("+dirty" if r["commit"].endswith("+dirty") else "")
                                               for r in group})),
             pct([r["final_top1"] for r in group]), pct([r["best_top1"] for r in group])]
            for (cpu, kind), group in sorted(groups.items())]
    return table(["machine", "comm.kind", "tuning seeds", "commit", "final top-1, mean (range)",
                  "best top-1, mean (range)"], rows)


def cluster_tta(r: dict[str, Any]) -> list[str]:
    """Per link rate and kind: median seconds from the launch to each target (range over the seeds that reached it;
    misses named), epochs, final and best top-1, bytes per node, auto's seconds; then the "which kind when" table."""
    def time_cell(e: dict[str, Any]) -> str:
        text = "missed" if e["median_s"] is None else num(e["median_s"])
        if e["range_s"] is not None and e["median_s"] is not None:
            text += f" ({num(e['range_s'][0])}-{num(e['range_s'][1])})"
        return text + (f", missed {len(e['missed'])}" if e["missed"] and e["median_s"] is not None else "")

    def pct(a: dict[str, Any]) -> str:
        return f"{100 * a['median']:.1f}% ({100 * a['range'][0]:.1f}-{100 * a['range'][1]:.1f})"
    rows = []
    for rate, kinds in r["cells"].items():
        for kind, c in kinds.items():
            at = c["targets"].get(f"{cluster_which_target(r)}")
            rows.append([rate, kind, *[time_cell(e) for e in c["targets"].values()],
                         "-" if at is None or at["vs_dense"] is None else f"{at['vs_dense']:.2f}",
                         "-" if at is None or at["median_epochs"] is None else num(at["median_epochs"]),
                         pct(c["final_top1"]), pct(c["best_top1"]), num(c["comm_mb_per_node"]["bytes_sent"]),
                         num(c["comm_mb_per_node"]["bytes_inter_node"]),
                         "-" if c["interface_mb_sent_per_node"] is None else num(c["interface_mb_sent_per_node"]),
                         ", ".join(f"{k} {num(v)}" for k, v in c["auto_s"].items()) or "-"])
    which = cluster_which_target(r)
    return [f"{r['model']} on the TTA photos, {r['layout']} ranks (nodes x ranks) of the emulated cluster, every run "
            f"to the end of its schedule; seconds from the launch (start-up included) to each target at "
            f"{r['target_consecutive']} evaluations in a row, median over {cluster_seeds_run(r)} "
            f"({r['runs_done']} of {r['runs_planned']} runs) with the range of the seeds that reached it; a miss "
            "counts as infinitely slow, so a median is a miss when half the seeds or more missed.", "",
            *table(["links", "kind", *[f"s to {100 * float(t):g}%" for t in r["targets"]],
                    f"/ dense at {100 * float(which):g}%", f"epochs to {100 * float(which):g}%", "final top-1",
                    "best top-1", "comm MB/node", "comm inter-node MB/node", "interface MB sent/node",
                    "auto's seconds"], rows), "",
            *cluster_which_kind(r)]


def cluster_seeds_run(r: dict[str, Any]) -> str:
    """The seeds that have runs, and the planned ones that have none yet."""
    ran = sorted({run["seed"] for run in r.get("runs", ())}) or list(r["seeds"])
    left = [s for s in r["seeds"] if s not in ran]
    spread = ": no spread" if len(ran) == 1 else ""
    return (f"seed{'s' if len(ran) > 1 else ''} {', '.join(map(str, ran))}"
            + (f" ({', '.join(map(str, left))} not yet run{spread})" if left else ""))


def cluster_which_target(r: dict[str, Any]) -> str:
    return next(iter(r["which_kind"].values()))["target"] if r["which_kind"] else "0.7"


def cluster_which_kind(r: dict[str, Any]) -> list[str]:
    """Which kind when: per link rate (and the one model), the kind with the least median time to the target."""
    vs_best = r.get("auto_vs_best", {})
    rows = [[rate, r["model"], "none reached it" if w["kind"] is None else f"**{w['kind']}**",
             "-" if w["median_s"] is None else num(w["median_s"]), cluster_auto_vs_best(vs_best.get(rate))]
            for rate, w in r["which_kind"].items()]
    return [f"Which kind when: the least median seconds to {100 * float(cluster_which_target(r)):g}% top-1, start-up "
            "included (a kind's misses count against it, never for another kind); auto's median over the fastest "
            "per-step kind's (dense, dense16, topk, hitopk, powersgd), and seed by seed:", "",
            *table(["links", "model", "kind", "median s", "auto / fastest per-step kind"], rows)]


def cluster_headline(r: dict[str, Any]) -> str:
    """The README row: the headline ratio, which kind per rate, auto against the fastest per-step kind."""
    text = ("-" if r["ratio"] is None else f"{r['ratio']:.3f}") + "; which kind: " + ", ".join(
        f"{rate} {w['kind'] or 'none'}" for rate, w in r["which_kind"].items())
    if r.get("auto_vs_best"):
        text += "; auto / fastest per-step kind: " + ", ".join(
            f"{rate} {cluster_ratio(a['ratio'])}" for rate, a in r["auto_vs_best"].items())
    return text + ("" if r["complete"] else f" (partial: {cluster_seeds_run(r)}; {r['runs_done']} of "
                                            f"{r['runs_planned']} runs)")


def cluster_ratio(x: float | None) -> str:
    return "missed" if x is None else f"{x:.3f}"


def cluster_auto_vs_best(a: dict[str, Any] | None) -> str:
    """Auto's median over the fastest per-step kind's, that kind, and the ratio per seed."""
    if a is None:
        return "-"
    return (cluster_ratio(a["ratio"]) + f" ({a['best']}; "
            + (", ".join(f"seed {s}: {x:.3f}" for s, x in a["per_seed"].items()) or "no seed both reached") + ")")


def links(r: dict[str, Any]) -> list[str]:
    """Per rate: plain TCP between the emulated nodes, then each node-crossing link auto fits, against it."""
    def mb(x: float) -> str:
        return f"{x / 1e6:.1f}"

    def fit(c: dict[str, Any], which: str) -> str:
        f = c.get(which)
        return "-" if f is None else f"{mb(f['bytes_per_s'])} ({times(f['ratio'])}{'' if f['within'] else ', off'})"

    rates = r["per_rate"]
    sizes = [f"{num(int(n) / 2**20) + ' MB' if int(n) >= 2**20 else num(int(n) / 2**10) + ' KB'} alone / back to back"
             for n in next(iter(rates.values()))["tcp"]["messages"]]
    tcp = [[rate, *(mb(v["tcp"][k]) for k in ("one_way_bytes_per_s", "duplex_up_bytes_per_s", "duplex_down_bytes_per_s",
                                              "two_flows_bytes_per_s")),
            *(f"{mb(m['alone_bytes_per_s'])} / {mb(m['back_to_back_bytes_per_s'])}"
              for m in v["tcp"]["messages"].values()),
            f"{v['tcp']['ping_rtt_s'] * 1e6:.0f}"] for rate, v in rates.items()]
    rows = [[rate, c["link"], mb(v["tcp"]["one_way_bytes_per_s"]), fit(c, "auto"),
             "{:.2f}-{:.2f}".format(*c["auto_repeat_ratio_range"]), fit(c, "large"), fit(c, "all")]
            for rate, v in rates.items() for c in v["links"]]
    scales = " and ".join(f"x{s}" for s in r.get("scales", ()))
    return ["Plain TCP between the 2 emulated nodes, MB/s (RTT in us):", "",
            *table(["links", "one way", "duplex up", "duplex down", "two flows one way", *sizes, "RTT"], tcp), "",
            f"Each link auto fits (trainer.comm.cost.build_network) on {r['layout']} gloo ranks, MB/s and its ratio to "
            f"plain TCP one way ('off': by more than {r['tolerance']:.0%}); auto's probe sizes: the median fit of "
            f"repeats and the range of their ratios; larger sizes: the same probes at {scales} their smaller size:", "",
            *table(["links", "link", "TCP", "auto's sizes", "range", "larger sizes", "all points"], rows)]


SUMMARY: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "tta": ("time to accuracy, recipe / torchvision-reference baseline (each tuned on tuning seeds), fresh seeds, "
            "median paired ratio",
            tta_headline),
    "topk": ("MSTopK speed-up over torch.topk, gradients of a real training step, k = 0.1%, equal threads",
             lambda r: f"{r['arch']}: {times(r['ratio_1thread'])} (1 thread), {times(r['ratio_2threads'])} (2), "
                       f"recall {r['recall_real_gradients']:.4f}"),
    "input_pipeline": ("input pipeline images/s over torchvision's ImageFolder (seeded per image) + DataLoader (workers "
                       "started afresh every epoch), quiet / under the "
                       "bench's own load",
                       lambda r: f"DALI decoding the originals: {times(r['results']['dali_files']['quiet_ratio'])} / "
                                 f"{times(r['results']['dali_files']['loaded_ratio'])}; best, "
                                 f"{r['results'][r['best']]['label']} ({r['results'][r['best']]['output']}): "
                                 f"{times(r['ratio'])} / "
                                 f"{times(r['loaded_ratio'])}"),
    "data_wait": ("data wait per step, prefetch thread / sequential, cold cache",
                  lambda r: times(r["ratio"])),
    "comm": ("training step time, dense / hitopk, 2 x 2 gloo ranks on one box (loopback links)",
             lambda r: f"{r['ratio']:.2f} (above 1: hitopk faster); {r['inter_node_bytes_ratio']:.0f}x fewer "
                       f"inter-node bytes"
                       + (f"; dense / auto {r['results']['dense']['step_ms'] / r['results']['auto']['step_ms']:.2f}"
                          if "auto" in r["results"] else "")),
    "optim": ("FusedLARS step over a per-tensor LARS loop", lambda r: times(r["ratio"])),
    "small_conv": ("ResNet steps with small-map GEMM convolutions over oneDNN's", lambda r: times(r["ratio"])),
    "max_pool": ("ResNet steps and evaluation forwards (NCHW) with the channels-last max pool over ATen's NCHW "
                 "pool", max_pool_headline),
    "replica_guard": ("replica guard's share of training time (the checksum; its all-gather not timed)",
                      lambda r: f"{100 * r['share']:.3g}% (every {r['every_steps']} steps and {r['epochs']} epoch "
                                "ends: the quickstart)"),
    "transformer": ("Transformer recipe (dense exchange) tokens/s over DDP + Adam",
                    lambda r: f"{times(r['ratio'])} (median of {r['rounds']} rotated rounds: "
                              f"{min(r['round_ratios']['dense']):.2f}-{max(r['round_ratios']['dense']):.2f})"),
    "choices": ("the TTA recipe at its defaults (precision, layout, convolutions, communicator measured), training "
                "clock / the fastest pinned combination's",
                lambda r: f"{r['ratio']:.3f} ({r['with_startup']:.3f} with the start-up); cached / measuring "
                          f"{r['cached_over_measuring']:.3f}"),
    "quickstart": ("quickstart: the start-up measurement's share of `make quickstart` on a fresh clone / of the "
                   "training command, measuring / cached; scores",
                   lambda r: f"{100 * r['ratio']:.2f}%"
                             + (f" (median of {len(r['fresh_clone_shares'])}: "
                                f"{', '.join(f'{100 * x:.1f}%' for x in r['fresh_clone_shares'])})"
                                if len(r.get("fresh_clone_shares", [])) > 1 else "")
                             + f" / {100 * r.get('training_startup_share', r['ratio']):.2f}% / "
                             f"{100 * r['cached_startup_share']:.2f}%; top-1 "
                             f"{r['runs']['resnet, measuring'].get('final_top1', float('nan')):.4f}"
                             + (f", BLEU {r['runs']['transformer, measuring']['test_bleu']:.1f}"
                                if "transformer, measuring" in r["runs"] else "")),
    "cluster_tta": ("emulated cluster, time to 70% top-1 from the launch: the best per-step kind's median / dense's, "
                    "slowest link run",
                    cluster_headline),
    "links": ("emulated cluster: the node-crossing links auto fits at start-up / plain TCP between the nodes",
              lambda r: (lambda auto: f"{sum(abs(x - 1) <= r['tolerance'] for x in auto.values())} of {len(auto)} "
                         f"within {100 * r['tolerance']:g}%; " + ", ".join(f"{k} {x:.2f}" for k, x in auto.items()))(
                  {f"{rate} {c['link']}": c["auto"]["ratio"]
                   for rate, v in r["per_rate"].items() for c in v["links"]})),
    "scaling": ("emulated cluster (network namespaces, shaped links): comm.kind auto's step / the best fixed "
                "exchange's, worst cell",
                lambda r: f"{max(c['auto_vs_best'] for c in r['cells']):.3f} over {len(r['cells'])} cells; / dense, "
                          f"worst: {max(c['auto_vs_dense'] for c in r['cells']):.3f}"),
}
TABLES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "topk": topk, "input_pipeline": input_pipeline, "data_wait": data_wait, "comm": comm, "optim": optim,
    "small_conv": small_conv, "max_pool": max_pool, "replica_guard": replica_guard, "transformer": transformer,
    "tta": tta, "scaling": scaling, "choices": choices, "choices_screen": choices_screen, "quickstart": quickstart,
    "cluster_tta": cluster_tta, "links": links}
NOT_YET = {"cluster_tta": "_No result file yet, so no table: `sudo .venv/bin/python -m scripts.bench.cluster_tta` "
                          "(root; many hours, resumable with `--resume OUT`) writes `docs/results/cluster_tta.json` "
                          "once every planned run has finished._\n"}
"""What a block says before its bench's first result file exists, where the generic line would not do."""


PER_MACHINE = ("tta",)
"""Benches whose results file is per machine (docs/results/BENCH-<machine>.json): a run elsewhere is a file of
its own, and each one renders."""


def bench_of(path: Path) -> str:
    """The bench a results file belongs to: its name, less the machine of a per-machine bench's file."""
    head = path.stem.split("-")[0]
    return head if head in PER_MACHINE else path.stem


def result_files(results_dir: Path, bench: str) -> list[Path]:
    """The bench's results files: BENCH.json, or every BENCH-<machine>.json of a per-machine bench."""
    if bench in PER_MACHINE:
        return sorted(p for p in results_dir.glob(f"{bench}-*.json") if ".quick" not in p.name)
    return [path] if (path := results_dir / f"{bench}.json").exists() else []


def summary(results_dir: Path) -> str:
    from trainer.run_record import widest_flag

    rows = []
    for bench, (what, figure) in SUMMARY.items():
        for path in result_files(results_dir, bench):
            record = json.loads(path.read_text())
            load, m = load_span(record), record["machine"]
            # one model name covers machines that differ in their widest vector extension
            cpu = machine_label(m["cpu"], widest_flag(m.get("cpu_flags", [])))
            rows.append([what, figure(record["result"]), f"[{path.stem}](docs/results/{path.name})",
                         f"{cpu}, {m['cores']} cores, {record['date'][:10]}",
                         "" if load is None else f"{load[0]:.1f} → {load[1]:.1f}"])
    if not rows:
        raise ResultsError(f"{results_dir}: no result files; `make bench` writes them")
    return "\n".join(table(["what", "result", "file", "machine, date", "load (1 min)"], rows)) + "\n"


def render(name: str, results_dir: Path = RESULTS_DIR) -> str:
    """The generated text of the block `<!-- results:NAME -->`."""
    if name == "summary":
        return summary(results_dir)
    if name in ("tta_tuning", "tta_ablation"):
        return render_tuning(results_dir, name)
    if name == "gpu_check":
        path = results_dir / "gpu_check.json"
        if not path.exists():
            return "_No GPU run yet: `scripts/gpu_check.sh` on a CUDA machine prints the rows to record._\n"
        return "\n".join(gpu_check(json.loads(path.read_text()))) + "\n"
    if name == "cluster_tta_tuning":
        path = results_dir / "cluster_tta_tuning.json"
        if not path.exists():
            return ("_No tuning run yet: `python -m scripts.bench.cluster_tta --tune KIND` writes "
                    "`docs/results/cluster_tta_tuning.json`._\n")
        return "\n".join(cluster_tta_tuning(json.loads(path.read_text()))) + "\n"
    quick = name.endswith("_quick")  # a bench's --quick run (BENCH.quick.json), in the bench's own table
    bench = name.removesuffix("_quick")
    if bench not in TABLES:
        raise ResultsError(f"results:{name}: no such table (known: summary, tta_tuning, tta_ablation, "
                           "cluster_tta_tuning, "
                           f"{', '.join(TABLES)}, each also as NAME_quick)")
    quick_file = results_dir / f"{bench}.quick.json"
    paths = ([quick_file] if quick_file.exists() else []) if quick else result_files(results_dir, name)
    if not paths and quick:
        return f"_No quick run yet: `python -m scripts.bench.{bench} --quick` writes `{bench}.quick.json`._\n"
    if not paths:
        if name in NOT_YET:
            return NOT_YET[name]
        return f"_No result file yet: `python -m scripts.bench.{name}` writes `docs/results/{name}.json`._\n"
    blocks = []
    for path in paths:
        record = json.loads(path.read_text())
        head = [f"**{machine(record)}**", ""] if name in PER_MACHINE else []
        blocks.append("\n".join([*head, *TABLES[bench](record["result"]), "", provenance(path.stem, record)]))
    return "\n\n".join(blocks) + "\n"


def cluster_tta_tuning(runs: list[dict[str, Any]]) -> list[str]:
    """Every tuning run of a cluster_tta kind's settings (every override it ran with: the kind's own at the time
    and the run's --set): its times from the launch to each target, its accuracy and bytes, and how many runs each
    kind had."""
    targets = list(runs[0]["time_to_s"]) if runs else []
    rows = [[r.get("cpu", "?"), r["date"][:16].replace("T", " "),
             f"`{r['commit'][:7]}{'+dirty' if r['commit'].endswith('+dirty') else ''}`", r["kind"],
             "<br>".join(override_text(o) for o in r["overrides"] if not o.startswith("comm.kind=")) or "none",
             r["rate"], r["seed"],
             *["missed" if r["time_to_s"].get(t) is None else f"{r['time_to_s'][t]:.0f}" for t in targets],
             f"{100 * r['final_top1']:.1f}%", f"{r['comm_bytes_per_node']['bytes_inter_node'] / 1e6:,.0f}",
             f"{r['load_before']:.1f} → {r['load_after']:.1f}"] for r in runs]
    counts: dict[tuple[str, str], int] = {}
    for r in runs:
        counts[(r.get("cpu", "?"), r["kind"])] = counts.get((r.get("cpu", "?"), r["kind"]), 0) + 1
    return [*table(["machine", "finished (UTC)", "commit", "kind", "settings", "links", "seed",
                    *[f"s to {100 * float(t):g}%" for t in targets], "final top-1", "inter-node MB/node",
                    "load (1 min)"], rows), "",
            "From [`docs/results/cluster_tta_tuning.json`](results/cluster_tta_tuning.json), appended by `python -m "
            "scripts.bench.cluster_tta --tune KIND --set KEY=VALUE`: "
            + "; ".join(f"{cpu}, {kind}: {n} runs" for (cpu, kind), n in sorted(counts.items()))
            + ". Seconds from the launch (start-up included), on tuning seeds only; a +dirty commit ran with changes "
            "not yet committed (the next commit holds them)."]


def gpu_check_latest(record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each check's rows from the latest run that ran the check, in the first full run's order; and the run each
    check's rows came from."""
    latest: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    order: list[str] = []
    for run in record["runs"]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in run["output"]["rows"]:
            groups.setdefault(row["group"], []).append(row)
        for group, rows in groups.items():
            latest[group] = (run["run"], rows)
            if group not in order:
                order.append(group)
    return [row for g in order for row in latest[g][1]], {g: latest[g][0] for g in order}


def gpu_check(record: dict[str, Any]) -> list[str]:
    """The GPU check's rows, each check from its latest run; then every run (when, the tree it ran, what it ran,
    its counts) and the runs' notes."""
    rows, run_of = gpu_check_latest(record)
    first = record["runs"][0]["output"]["machine"]
    versions = ", ".join(f"{k} {first[k]}" for k in ("torch", "cuda", "cudnn", "nccl", "driver", "triton",
                                                      "torchvision", "dali") if k in first)
    out = [*table(["check", "result", "run", "detail"],
                  [[r["check"], f"**{r['result']}**", run_of[r["group"]], r["detail"].replace("|", "\\|")]
                   for r in rows]), "",
           *table(["run", "UTC", "tree", "command", "pass / fail / skip"],
                  [[r["run"], r["date"][:16].replace("T", " "),
                    f"`{r['commit'][:7]}{'+dirty' if r['commit'].endswith('+dirty') else ''}`: {r['tree']}",
                    f"`{r['command']}`",
                    f"{r['output']['pass']} / {r['output']['fail']} / {r['output']['skip']}"] for r in record["runs"]]),
           ""]
    out += [f"Run {r['run']}: {r['note']}" for r in record["runs"] if r.get("note")]
    return [*out, "", f"From [`docs/results/gpu_check.json`](results/gpu_check.json): {record['device']}; "
                      f"{versions}."]


def render_tuning(results_dir: Path, name: str = "tta_tuning") -> str:
    """From the TTA tuning history: every run, read at each headline target of the bench as it is now
    (`tta_tuning`), or the recipe's exchange ablation (`tta_ablation`)."""
    from trainer.tta_stats import HEADLINE, TARGET_CONSECUTIVE

    path = results_dir / "tta_tuning.json"
    if not path.exists():
        return "_No tuning run yet: `python -m scripts.bench.tta --tune SIDE` writes `docs/results/tta_tuning.json`._\n"
    runs = json.loads(path.read_text())
    lines = tta_tuning(runs, HEADLINE, TARGET_CONSECUTIVE) if name == "tta_tuning" else tta_ablation(runs)
    return "\n".join(lines) + "\n"


def regenerate(text: str, results_dir: Path = RESULTS_DIR) -> tuple[str, list[str]]:
    """`text` with every results block rewritten, and the names of the blocks whose text changed."""
    stale: list[str] = []

    def replace(match: re.Match) -> str:
        body = render(match["name"], results_dir)
        if body != match["body"]:
            stale.append(match["name"])
        return match[1] + body + match[4]

    return BLOCK.sub(replace, text), stale


def documents(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.results_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the result files are")
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    stale_any = False
    for path in args.files or documents():
        text = path.read_text()
        try:
            new, stale = regenerate(text, args.results_dir)
        except ResultsError as err:
            print(f"{path}: {err}", file=sys.stderr)
            return 2
        for name in stale:
            stale_any = True
            source = args.results_dir / ("*.json" if name == "summary" else f"{name}.json")
            print(f"{path}: table results:{name} differs from {source}" if args.check
                  else f"{path}: rewrote results:{name}")
        if not args.check and new != text:
            path.write_text(new)
    if args.check and stale_any:
        print("run `python -m scripts.results_tables` to regenerate them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
