"""DAWNBench entry files and a markdown summary of a finished run folder (`report`).

In the format of the ImageNet training entries of https://github.com/stanford-futuredata/dawn-bench-entries
(README.md, "ImageNet Training"): `<author>_<model>_<hardware tag>_<framework>.json` (version, author,
authorEmail, framework, codeURL, model, hardware, costPerHour in USD, timestamp yyyy-mm-dd, misc), the `.tsv`
of the same name (epoch, hours, top1Accuracy, top5Accuracy in percent, one row per evaluated epoch) and
report.md, the run beside published ImageNet entries.

Everything about the run is read from its files (summary.json through trainer.dawnbench.read_summary,
config.yaml, dawnbench.tsv, and env.json, the run record of trainer.run_record: devices, driver, versions,
hosts); the published figures are the cited constants of trainer.dawnbench.PUBLISHED. The hardware is the
devices env.json records, or given text, or ("auto") the machine this runs on. The command line is
scripts/dawnbench_report.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import yaml

from trainer.classification import DawnbenchWriter  # the TSV format is defined once, there
from trainer.dawnbench import PUBLISHED, PUBLISHED_TARGET, RunSummary, SummaryError, read_summary
from trainer.run_record import cpu_info, describe_devices, read_run_record

DAWNBENCH_VERSION = "v1.0"  # the only version the entries repository defines


class ReportError(ValueError):
    """The run folder is missing, unfinished or inconsistent; the message is one line."""


# ------------------------------------------------------------ reading the run

@dataclass
class Run:
    """What a finished run folder says about itself (accuracies as fractions, times in seconds)."""

    dir: Path
    summary: RunSummary
    config: dict[str, Any]
    record: dict[str, Any] | None = None
    """env.json (trainer.run_record); None for a run folder written before the record existed."""

    @property
    def history(self) -> list[dict[str, float]]:
        """One record per evaluated epoch of the final run: epoch, eval/top1, eval/top5, time/elapsed_s."""
        return self.summary.history

    @property
    def world_size(self) -> int:
        return int(self.summary["world_size"])

    @property
    def has_target(self) -> bool:
        return bool(self.summary.targets)

    @property
    def time_to_target_s(self) -> float | None:
        return self.summary.time_to_target_s

    @property
    def epochs_to_target(self) -> int | None:
        return self.summary.epochs_to_target

    def target_text(self) -> str:
        parts = [f"{100 * self.summary[f'target_{k}']:g}% {k.replace('top', 'top-')}"
                 for k in ("top1", "top5") if self.summary[f"target_{k}"]]
        dataset = self.config.get("data", {}).get("root", "?")
        return f"{' and '.join(parts) or 'none set'}, {dataset} (held-out split)"


REPORT_KEYS = ("steps", "target_top1", "target_top5", "final_top1", "final_top5")
"""What the report reads from summary.json beyond trainer.dawnbench.SUMMARY_KEYS (a classification run's)."""


def read_run(run_dir: Path) -> Run:
    """The run's summary, resolved config and evaluation history; a clear ReportError if any is missing."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder (pass a recipe's log.dir, e.g. runs/quickstart "
                          f"after `make quickstart`)")
    for name in ("summary.json", "config.yaml", "dawnbench.tsv"):
        if not (run_dir / name).is_file():
            raise ReportError(f"{run_dir / name}: not found (the run did not finish, or {run_dir} is not a run "
                              f"folder written by a recipe)")
    try:
        summary = read_summary(run_dir, REPORT_KEYS)
    except SummaryError as e:
        raise ReportError(str(e)) from None
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise ReportError(f"{run_dir / 'config.yaml'}: not valid YAML ({' '.join(str(e).split())})") from None
    if not summary.history:
        raise ReportError(f"{run_dir / 'summary.json'}: no evaluated epochs in its history; nothing to report")
    return Run(run_dir, summary, config, read_run_record(run_dir))


def read_dawnbench_tsv(path: Path) -> list[list[str]]:
    """Rows (as strings) of a DAWNBench ImageNet training TSV, after checking the header and every value."""
    lines = path.read_text().splitlines()
    if not lines or lines[0] + "\n" != DawnbenchWriter.HEADER:
        raise ReportError(f"{path}: header must be {DawnbenchWriter.HEADER.strip()!r} (tab-separated)")
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    for n, row in enumerate(rows, start=2):
        try:
            ok = len(row) == 4 and int(row[0]) >= 0 and float(row[1]) >= 0 and all(
                0 <= float(v) <= 100 for v in row[2:])
        except ValueError:
            ok = False
        if not ok:
            raise ReportError(f"{path}:{n}: expected 'epoch<TAB>hours<TAB>top1<TAB>top5' with accuracies in "
                              f"percent, got {lines[n - 1]!r}")
    return rows


def entry_tsv(run: Run) -> tuple[str, list[list[str]]]:
    """The final run's TSV (text and rows), written by the trainer's own writer, after checking that the run's
    dawnbench.tsv holds exactly those rows: it is appended to, so reruns and resumed runs leave earlier rows
    above them, and a run still in progress has rows that summary.json does not."""
    with tempfile.TemporaryDirectory() as tmp:  # DawnbenchWriter writes files; nothing lands in --out unchecked
        path = Path(tmp) / "entry.tsv"
        writer = DawnbenchWriter(path)
        for h in run.history:
            writer.write("epoch", 0, h)
        writer.close()
        text, mine = path.read_text(), read_dawnbench_tsv(path)
    logged = read_dawnbench_tsv(run.dir / "dawnbench.tsv")
    it = iter(logged)
    for row in mine:  # in order, possibly with rows of earlier attempts in between
        if row not in it:
            raise ReportError(f"{run.dir / 'dawnbench.tsv'}: no row {' '.join(row)!r} for epoch {row[0]} of "
                              f"summary.json (the TSV belongs to another run?)")
    if logged[-1] != mine[-1]:
        raise ReportError(f"{run.dir / 'dawnbench.tsv'}: its last row (epoch {logged[-1][0]}) is not the last "
                          f"evaluation in summary.json (epoch {mine[-1][0]}); is the run still going, or was it "
                          f"restarted without finishing?")
    return text, mine


# ------------------------------------------------------------ hardware and the entry JSON

@dataclass
class Hardware:
    text: str
    tag: str
    """Short hardware tag for the DAWNBench file name, e.g. 2cpu or 8gpu."""


def hardware_from_run(run: Run) -> Hardware:
    """What the run folder records: the devices of env.json; without it, the world size, and the device only
    where dist.backend names it."""
    backend = run.config.get("dist", {}).get("backend", "auto")
    n = run.world_size
    described = describe_devices(run.record) if run.record else None
    if described:
        on_gpu = any(str(r.get("device", "")).startswith("cuda") for r in run.record["hosts"]["ranks"])
        return Hardware(described, f"{n}{'gpu' if on_gpu else 'cpu'}")
    if backend == "gloo":  # trainer/dist/torch_backend.py: gloo ranks run on the CPU
        return Hardware(f"{n} CPU process{'es' * (n != 1)} (gloo)", f"{n}cpu")
    if backend == "nccl":  # one GPU per rank
        return Hardware(f"{n} GPU{'s' * (n != 1)} (NCCL)", f"{n}gpu")
    return Hardware(f"{n} rank{'s' * (n != 1)}; device not recorded in the run folder (no env.json; "
                    f"dist.backend: {backend}; pass --hardware)", f"{n}rank")


def hardware_of_this_machine(run: Run) -> Hardware:
    """`--hardware auto`: the device the run's dist.backend picks on this machine, and its model name."""
    import torch  # slow to import: only when asked

    from trainer.dist import resolve_backend

    backend = run.config.get("dist", {}).get("backend", "auto")
    n = run.world_size
    try:
        on_gpu = torch.cuda.is_available() if backend == "horovod" else resolve_backend(backend) == "nccl"
    except ValueError as e:  # nccl configured, no CUDA here: this is not the machine that ran it
        raise ReportError(f"--hardware auto: {e}") from None
    if on_gpu:
        return Hardware(f"{n} × {torch.cuda.get_device_name(0)} (one per rank; {torch.cuda.device_count()} "
                        f"on this machine)", f"{n}gpu")
    return Hardware(f"{n} CPU process{'es' * (n != 1)} on {cpu_info()['model']}, {os.cpu_count()} logical cores, "
                    "no GPU", f"{n}cpu")


def environment(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The entry's record of where the run ran (env.json's devices, driver, versions, hosts); None without one."""
    if not record:
        return None
    gpus, hosts = record.get("gpus") or {}, record.get("hosts") or {}
    return {"devices": describe_devices(record), "driver": gpus.get("driver"), "gpuModels": gpus.get("nvidia_smi"),
            "cpu": (record.get("cpu") or {}).get("model"), "versions": record.get("versions"),
            "python": record.get("python"), "hosts": hosts.get("names"), "worldSize": hosts.get("world_size"),
            "recordedAt": record.get("time"), "measuredChoices": record.get("choices"),
            "earlierStarts": record.get("earlier_starts") or []}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-") or "unknown"


def entry_json(run: Run, author: str, author_email: str, framework: str, code_url: str, hardware: Hardware,
               cost_per_hour: float) -> dict[str, Any]:
    """The entry JSON: the fields of the DAWNBench README, in its order; run details go in misc."""
    phases = run.config.get("schedule", {}).get("phases", [])
    misc: dict[str, Any] = {
        "dataset": run.config.get("data", {}).get("root"),
        "target": {f"{k}Accuracy": round(100 * run.summary[f"target_{k}"], 4) for k in ("top1", "top5")},
        "targetReached": run.time_to_target_s is not None,
        "timeToTargetSeconds": run.time_to_target_s,
        "epochsToTarget": run.epochs_to_target,
        "epochsRun": run.summary["epochs_run"],
        "steps": run.summary["steps"],
        "elapsedSeconds": run.summary["elapsed_s"],
        "finalTop1Accuracy": round(100 * run.summary["final_top1"], 4),
        "finalTop5Accuracy": round(100 * run.summary["final_top5"], 4),
        "worldSize": run.world_size,
        "optimizer": run.config.get("optim", {}).get("name"),
        "communicator": run.config.get("comm", {}).get("kind"),
        "dataBackend": run.config.get("data", {}).get("backend"),
        "imageSize": [{"image_size": p["image_size"], "epochs": p["end_epoch"] - p["start_epoch"]} for p in phases],
        "batchSize": [{"batch_size": p["batch_size"], "epochs": p["end_epoch"] - p["start_epoch"]} for p in phases],
        "gitCommit": run.config.get("git_commit"),
        "environment": environment(run.record),
    }
    if not cost_per_hour:
        misc["costNote"] = "costPerHour not given (--cost-per-hour); 0 is a placeholder, not a price"
    return {"version": DAWNBENCH_VERSION, "author": author, "authorEmail": author_email, "framework": framework,
            "codeURL": code_url, "model": run.config.get("model", {}).get("arch", "unknown"),
            "hardware": hardware.text, "costPerHour": float(cost_per_hour), "timestamp": date.today().isoformat(),
            "misc": misc}


# ------------------------------------------------------------ the markdown summary

def hms(seconds: float) -> str:
    """DAWNBench's h:mm:ss."""
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render_report(run: Run, entry: dict[str, Any], rows: list[list[str]], files: list[Path]) -> str:
    s = run.summary
    final = f"final top-1 {100 * s['final_top1']:.2f}%, top-5 {100 * s['final_top5']:.2f}%"
    if run.time_to_target_s is not None:
        tta = run.time_to_target_s
        time_cell = f"{hms(tta)} ({tta:.1f} s, epoch {run.epochs_to_target})"
        cost = tta / 3600 * entry["costPerHour"]  # DAWNBench: hours to target × cost per hour
        cost_cell = f"${cost:.2f}" if entry["costPerHour"] else "$0.00 (no --cost-per-hour given)"
        status = f"target reached in {tta:.1f} s at epoch {run.epochs_to_target}"
    else:
        best = 100 * run.summary.best("top1")
        label = "target not reached" if run.has_target else "no target set"
        time_cell = f"{label} (best top-1 {best:.2f}% in {hms(s['elapsed_s'])})"
        cost_cell = f"— ({label})"
        status = label
    lines = [
        f"# DAWNBench report: {run.dir.name}",
        "",
        f"Run `{run.dir}`: {entry['model']}, world size {run.world_size}, {s['epochs_run']} epochs "
        f"({s['steps']} steps) in {s['elapsed_s']:.1f} s; {final}; {status}.",
        "",
        "| Entry | Time to target | Target | Hardware | Cost (USD) | Source |",
        "|---|---|---|---|---|---|",
    ]
    for p in PUBLISHED:
        links = ", ".join(f"[{i + 1}]({url})" for i, url in enumerate(p.sources))
        cost = f"${p.cost_usd:.2f}" if p.cost_usd is not None else "—"
        lines.append(f"| {p.name} | {hms(p.time_s)} | {PUBLISHED_TARGET} | {p.hardware} | {cost} | {links} |")
    lines.append(f"| **This run ({run.dir.name})** | {time_cell} | {run.target_text()} | {entry['hardware']} | "
                 f"{cost_cell} | measured: `summary.json`, `dawnbench.tsv` |")
    lines += [
        "",
        "Published rows are ResNet-50 on ImageNet to 93% top-5 as their sources state them; this run's task and "
        "target are its own, so the rows stand side by side and are not a ranking. Cost is hours to target × "
        f"cost per hour (costPerHour {entry['costPerHour']:g} USD), as DAWNBench computes it.",
        "",
        *environment_lines(entry["misc"]["environment"]),
        "## Per evaluated epoch (the entry TSV)",
        "",
        "| epoch | hours | top-1 % | top-5 % |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
        "",
        "## Files",
        "",
        *(f"- `{f.name}`" for f in files),
        "",
    ]
    return "\n".join(lines)


def environment_lines(env: dict[str, Any] | None) -> list[str]:
    """The report's environment section, from env.json (one line saying it is missing otherwise)."""
    if env is None:
        return ["## Environment", "", "Not recorded: the run folder has no env.json (written by runs since the "
                "run record exists).", ""]
    v = env.get("versions") or {}
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    hosts = env.get("hosts") or []
    lines = ["## Environment (`env.json`)", "", f"- devices: {env['devices']}",
             f"- driver: {env.get('driver') or 'none (no nvidia-smi)'}; CPU: {env.get('cpu')}",
             f"- versions: {versions}; Python {env.get('python')}",
             f"- hosts ({len(hosts)}): {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''}"]
    choices = env.get("measuredChoices")
    if choices:
        kept = ", ".join(f"{k} {v}" for k, v in choices["choice"].items())
        lines.append(f"- measured choices ({choices['source']}): {kept}; {choices['seconds']:.1f} s at start-up, "
                     "before the clock (not in the time to target above)")
    for earlier in env.get("earlierStarts", []):
        lines.append(f"- earlier start {earlier.get('time')}: world size {earlier.get('world_size')} on "
                     f"{', '.join(earlier.get('hosts') or [])} ({', '.join(earlier.get('devices') or [])})")
    return [*lines, ""]


def report(run_dir: Path, out: Path | None = None, author: str = "unknown", author_email: str = "",
           framework: str | None = None, code_url: str = "", hardware: str | None = None,
           cost_per_hour: float = 0.0) -> list[Path]:
    """Write the entry JSON, the entry TSV and report.md; return their paths."""
    if not (cost_per_hour >= 0 and math.isfinite(cost_per_hour)):
        raise ReportError(f"--cost-per-hour: must be a finite number >= 0 (USD), got {cost_per_hour}")
    run = read_run(run_dir)
    tsv_text, rows = entry_tsv(run)
    if hardware == "auto":
        hw = hardware_of_this_machine(run)
    elif hardware:
        hw = Hardware(hardware, slug(hardware)[:40].strip("-"))
    else:
        hw = hardware_from_run(run)
    framework = framework or f"PyTorch {importlib.metadata.version('torch')}"
    entry = entry_json(run, author, author_email, framework, code_url, hw, cost_per_hour)
    out = out or run_dir / "dawnbench"
    out.mkdir(parents=True, exist_ok=True)
    # DAWNBench names both files [author]_[model]_[hardware tag]_[framework]
    stem = "_".join(slug(p) for p in (author, entry["model"], hw.tag, framework.split()[0]))
    json_path, tsv_path, md_path = out / f"{stem}.json", out / f"{stem}.tsv", out / "report.md"
    tsv_path.write_text(tsv_text)
    json_path.write_text(json.dumps(entry, indent=4) + "\n")
    md_path.write_text(render_report(run, entry, rows, [json_path, tsv_path]))
    return [json_path, tsv_path, md_path]
