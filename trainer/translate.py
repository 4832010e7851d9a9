"""The translate command of a sequence-to-sequence recipe: a trained run's model, greedy or beam search.

    python -m recipes.transformer translate RUN [--beam 4] [--len-penalty 1.0] [--average-last N] [--step N]
                                                [--input FILE|-] [--output FILE] [--split NAME] [--limit N]
                                                [--device cuda|cpu|cuda:1]

RUN is the run folder (its log.dir): its config.yaml says how to build the model and where the corpus and
its sentencepiece model are; its checkpoints give the weights (the newest complete one, or the mean of the
last N: `trainer.export.load_weights`). With --input, each line of FILE (or standard input) is translated
to a line of --output (or standard output). Without, the run's held-out split (test, else valid) is decoded
greedily and with the beam, and both sacreBLEU scores are printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from data.translation import TranslationData, TranslationDataError
from trainer.config import ConfigError, build_dataclass
from trainer.decoding import Search, evaluate_bleu, translate_lines
from trainer.dist import Topology
from trainer.export import ExportError, load_weights, read_run_config

C = TypeVar("C")
BuildModel = Callable[[Any, int], nn.Module]
"""A recipe's model from its `model` section and the vocabulary size."""


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", metavar="RUN", help="run folder (the run's log.dir)")
    parser.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy search; default 4)")
    parser.add_argument("--len-penalty", type=float, default=1.0,
                        help="score of a finished hypothesis = log-probability / length^this (fairseq's --lenpen)")
    parser.add_argument("--average-last", type=int, default=1, metavar="N",
                        help="average the weights of the last N checkpoints (default 1: the newest alone)")
    parser.add_argument("--step", type=int, help="the newest checkpoint used is the one of this step")
    parser.add_argument("--input", metavar="FILE|-", help="sentences to translate, one per line (- = stdin)")
    parser.add_argument("--output", metavar="FILE", help="where the translations go (default stdout)")
    parser.add_argument("--split", help="split scored without --input (default: the run's test split, else valid)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N sentences of the split")
    parser.add_argument("--data-root", help="the corpus folder, if it moved since training (default: data.root)")
    parser.add_argument("--device", help="torch device to decode on (default: cuda if available, else cpu)")
    return parser.parse_args(argv)


def resolve_device(name: str | None) -> torch.device:
    """The --device to decode on: the one named, or cuda when there is one, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ExportError(f"--device {name}: not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {name}: no CUDA device here (use --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ExportError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def load_run(config_cls: type[C], build_model: BuildModel, args: argparse.Namespace,
             device: torch.device) -> tuple[C, TranslationData, nn.Module, str]:
    """The run's config, corpus and model with its trained weights; and a line naming the checkpoints."""
    doc = read_run_config(args.run)
    doc.pop("git_commit", None)
    if args.data_root:
        doc.setdefault("data", {})["root"] = args.data_root
    try:
        cfg: Any = build_dataclass(config_cls, doc)
    except ConfigError as e:
        raise ConfigError(f"{Path(args.run) / 'config.yaml'}: {e}") from None
    state, chosen = load_weights(args.run, args.step, args.average_last)
    data = TranslationData(cfg.data)
    model = build_model(cfg.model, data.vocab_size)
    model.load_state_dict(state)
    model.to(device).eval()
    names = ", ".join(d.name for d in chosen)
    return cfg, data, model, (f"weights: {names}" if len(chosen) == 1 else f"weights: mean of {names}")


def translate_main(config_cls: type[C], build_model: BuildModel, argv: list[str], prog: str = "translate",
                   raise_errors: bool = False) -> dict[str, float]:
    """The command; returns {"greedy": BLEU, "beam": BLEU} when scoring a split, {} when translating text. A
    user mistake raises with `raise_errors` (tests match its text), else ends the process with one line."""
    args = parse_args(argv, prog)
    try:
        device = resolve_device(args.device)
        if args.beam < 1:
            raise ExportError(f"--beam must be >= 1, got {args.beam}")
        cfg, data, model, source = load_run(config_cls, build_model, args, device)
        search = Search(args.beam, args.len_penalty, cfg.train.decode_max_len_a, cfg.train.decode_max_len_b)
        print(f"{args.run}: {source}; beam {args.beam}, length penalty {args.len_penalty}", file=sys.stderr)
        if args.input:
            translate_file(model, data, args.input, args.output, search, device)
            return {}
        return score_split(model, data, cfg, args, search, device)
    except (ExportError, ConfigError, TranslationDataError, FileNotFoundError) as e:
        if raise_errors:
            raise
        raise SystemExit(f"translate error: {e}") from None


def translate_file(model: nn.Module, data: TranslationData, source: str, output: str | None, search: Search,
                   device: torch.device) -> None:
    """Each line of `source` (a file, or - for stdin) translated to a line of `output` (or stdout)."""
    if source != "-" and not Path(source).is_file():
        raise FileNotFoundError(f"--input {source}: no such file")
    text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    lines = text.splitlines()
    hyps, cut = translate_lines(model, data, lines, data.cfg.max_tokens, search, device)
    if cut:
        print(f"{cut} of {len(lines)} lines were cut to the model's longest input ({model.max_positions - 1} "
              "BPE tokens)", file=sys.stderr)
    out = "".join(h + "\n" for h in hyps)
    if output:
        Path(output).write_text(out, encoding="utf-8")
    else:
        sys.stdout.write(out)


def score_split(model: nn.Module, data: TranslationData, cfg: Any, args: argparse.Namespace, search: Search,
                device: torch.device) -> dict[str, float]:
    """sacreBLEU of greedy and beam search on a split; the beam's translations go to --output if given."""
    if args.split:
        split = {data.valid.name: data.valid, data.train.name: data.train,
                 **({data.test.name: data.test} if data.test is not None else {})}.get(args.split)
        if split is None:
            raise ExportError(f"--split {args.split}: the run's corpus has {data.train.name}, {data.valid.name}"
                              + (f", {data.test.name}" if data.test is not None else ""))
    else:
        split = data.test if data.test is not None else data.valid
    topo = Topology(device=device)
    greedy, _ = evaluate_bleu(model, data, split, topo, data.cfg.max_tokens, args.limit,
                              Search(1, 1.0, search.max_len_a, search.max_len_b))
    beam, hyps = evaluate_bleu(model, data, split, topo, data.cfg.max_tokens, args.limit, search)
    n = min(len(split), args.limit) if args.limit else len(split)
    print(f"{split.name} split, {n} sentences, sacreBLEU: greedy {greedy:.2f}, beam {search.beam} {beam:.2f}")
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return {"greedy": greedy, "beam": beam}
