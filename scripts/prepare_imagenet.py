"""ImageNet from the official ILSVRC2012 archives to the recipes' layout: DATA/train/<wnid>/*.JPEG and
DATA/val/<wnid>/*.JPEG (validation sorted into class folders), then the count check of `python -m data DATA`.

    python scripts/prepare_imagenet.py --archives ~/ilsvrc2012 --out /data/imagenet [--workers 8]
    python scripts/prepare_imagenet.py --train-tar T.tar --val-tar V.tar --devkit D.tar.gz --out DATA
    python scripts/prepare_imagenet.py --val-tar V.tar --val-labels LOC_val_solution.csv --out DATA
    python scripts/prepare_imagenet.py --val-labels LOC_val_solution.csv --out DATA   # sort an unsorted DATA/val/

--archives DIR looks there for ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz
(or LOC_val_solution.csv); a flag given explicitly wins. Interrupted (Ctrl-C, a kill, a full disk)? Run the
same command again: it finishes the job without redoing the classes already extracted. About 150 GB are
written; the archives are read once, as streams.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data import ilsvrc
from data.layout import DatasetNotFoundError, preflight

BLACKLIST = "ILSVRC2014_clsloc_validation_blacklist.txt"  # data.val_exclude of configs/resnet50_dawnbench.yaml


def find_inputs(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None]:
    """(train tar, val tar, labels) from the explicit flags, else from --archives."""
    d = args.archives
    if d is not None and not d.is_dir():
        raise ilsvrc.PrepareError(f"--archives {d}: no such folder")

    def pick(given: Path | None, *names: str) -> Path | None:
        if given is not None:
            if not given.is_file():
                raise ilsvrc.PrepareError(f"{given}: no such file")
            return given
        return next((d / n for n in names if d is not None and (d / n).is_file()), None)

    train = pick(args.train_tar, ilsvrc.TRAIN_TAR)
    val = pick(args.val_tar, ilsvrc.VAL_TAR)
    labels = pick(args.devkit or args.val_labels, ilsvrc.DEVKIT, *ilsvrc.LABEL_FILES)
    if train is None and val is None and labels is None:
        where = f"in {d}" if d is not None else "(no --archives folder given)"
        raise ilsvrc.PrepareError(f"no archives found {where}: expected {ilsvrc.TRAIN_TAR}, {ilsvrc.VAL_TAR} and "
                                  f"{ilsvrc.DEVKIT} (from {ilsvrc.DOWNLOADS}) or LOC_val_solution.csv")
    return train, val, labels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"{__doc__}\n{ilsvrc.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the dataset root (data.root) to write")
    parser.add_argument("--archives", type=Path, default=None, help="folder holding the official archives")
    parser.add_argument("--train-tar", type=Path, default=None, help=ilsvrc.TRAIN_TAR)
    parser.add_argument("--val-tar", type=Path, default=None, help=ilsvrc.VAL_TAR)
    labels = parser.add_mutually_exclusive_group()
    labels.add_argument("--devkit", type=Path, default=None, help=ilsvrc.DEVKIT)
    labels.add_argument("--val-labels", type=Path, default=None,
                        help="LOC_val_solution.csv, or a 'FILE WNID' list (see below)")
    parser.add_argument("--workers", type=int, default=1, help="processes extracting class archives at once")
    parser.add_argument("--expect", choices=("auto", "imagenet", "any"), default="auto",
                        help="the final check (python -m data --expect); auto: ImageNet's counts for WordNet-id classes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers: must be >= 1, got {args.workers}")
    try:
        train_tar, val_tar, label_path = find_inputs(args)
        done = ilsvrc.prepare(args.out, train_tar, val_tar, label_path, args.workers, not args.no_progress)
        if train_tar is not None:
            print(f"train: {len(done.train)} classes extracted by this run ({sum(done.train.values()):,} images)")
        if done.val:
            print(f"val: {len(done.val)} classes, {sum(done.val.values()):,} images")
        absent = [split for split in ("train", "val") if not (args.out / split).is_dir()]
        if absent:  # one split prepared on its own: the count check waits for the other
            print(f"{args.out}: no {' or '.join(absent)}/ yet (prepare it with the same --out); the count check "
                  f"runs when both splits are there")
        else:
            print(preflight(args.out, args.expect))
            if not (args.out / BLACKLIST).is_file():
                print(f"note: configs/resnet50_dawnbench.yaml leaves out the images listed in {BLACKLIST} (from the "
                      f"ILSVRC2014 devkit's data/): copy it into {args.out}, or pass data.val_exclude= to validate "
                      f"on every image")
    except ilsvrc.PrepareError as e:
        raise SystemExit(f"prepare_imagenet: {e}") from None
    except DatasetNotFoundError as e:
        raise SystemExit(f"prepare_imagenet: the final check failed: {e}") from None
    except KeyboardInterrupt:
        print(f"\ninterrupted: run the same command again to finish {args.out}", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
