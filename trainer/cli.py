"""The command line every recipe shares: `--config FILE [--resume] [section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys
from typing import TypeVar

from trainer.config import ConfigError, format_reference, load_config

T = TypeVar("T")


def parse_config(cls: type[T], argv: list[str] | None = None, prog: str | None = None) -> T:
    """Parse the command line into a validated `cls`; a config mistake exits with status 2 and one message."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Keys, types, defaults (override any of them as section.key=value):\n\n" + format_reference(cls))
    parser.add_argument("--config", help="YAML recipe (may name a `base:` to inherit from)")
    parser.add_argument("--resume", action="store_true", help="resume from the newest valid checkpoint in log.dir")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.epochs=3 optim.lr=0.5")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + (["train.resume=true"] if args.resume else [])
    try:
        return load_config(cls, args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
