"""`python -m data ROOT`: the launchers' pre-flight dataset check; one line and exit status 1 on failure."""

import sys

from data.layout import DatasetNotFoundError, check_dataset

try:
    print(f"{sys.argv[1]}: {check_dataset(sys.argv[1])} classes")
except DatasetNotFoundError as e:
    raise SystemExit(f"dataset error: {e}") from None
