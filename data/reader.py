"""One split's samples as the pipelines want them: screened encoded bytes, or L3 low-res pixels.

Bad data never stops a run: a file that cannot be read or decoded is skipped (in training the next good
index takes its place, so every rank keeps its batch size and step count), counted, and named once in
the log; a file DALI cannot take as it is (an unusual format) is transcoded once and kept in memory.
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Callable, Literal

import numpy as np

from data.cache import SplitCache
from data.images import BadImage, decode_lowres, screen, transcode_to_jpeg
from data.layout import Split

log = logging.getLogger(__name__)

class FileState(IntEnum):
    """A file's verdict, kept per sample in a uint8 array."""

    UNSEEN = 0
    GOOD = 1
    BAD = 2


UNSEEN, GOOD, BAD = FileState.UNSEEN, FileState.GOOD, FileState.BAD
Fetch = Literal["encoded", "lowres"]
"""What a sample is read as: its encoded bytes, or its pre-decoded low-resolution pixels."""


class NoGoodImagesError(ValueError):
    """Every file of a split is unreadable: nothing to train or validate on."""


class SampleReader:
    """Reads sample i of a split through its cache; remembers each file's verdict and pixel size."""

    def __init__(self, split: Split, cache: SplitCache, lowres_short_side: int, lowres_max_aspect: float) -> None:
        self.split, self.cache = split, cache
        self.lowres_short_side, self.lowres_max_aspect = lowres_short_side, lowres_max_aspect
        n = len(split)
        self.state = np.full(n, UNSEEN, dtype=np.uint8)
        self.heights, self.widths = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self.replacements: dict[int, np.ndarray] = {}  # transcoded bytes of files DALI cannot decode as they are
        self.skipped = 0

    def reject(self, i: int, reason: str) -> None:
        if self.state[i] != BAD:
            self.state[i] = BAD
            self.skipped += 1
            log.warning("data: skipped %s: %s", self.split.url(i), reason)

    def encoded(self, i: int) -> np.ndarray | None:
        """Bytes DALI can decode, or None for a bad file; the first read screens the header."""
        if self.state[i] == BAD:
            return None
        if i in self.replacements:
            return self.replacements[i]
        try:
            data = self.cache.encoded(i)
            if self.state[i] == UNSEEN:
                verdict = screen(data)
                self.heights[i], self.widths[i] = verdict.height, verdict.width
                if verdict.transcode:
                    data = self.replacements[i] = transcode_to_jpeg(data)
                self.state[i] = GOOD
        except (OSError, BadImage) as err:
            self.reject(i, str(err))
            return None
        return data

    def lowres(self, i: int) -> np.ndarray | None:
        """HWC uint8 pixels from L3 (decoded and stored on a miss), or None for a bad file."""
        assert self.cache.lowres is not None, "lowres() needs the L3 level"
        if self.state[i] == BAD:
            return None
        pixels = self.cache.lowres.get(i)
        if pixels is None:
            data = self.encoded(i)
            if data is None:
                return None
            try:
                pixels = decode_lowres(data, self.lowres_short_side, self.lowres_max_aspect)
            except BadImage as err:
                self.reject(i, str(err))
                return None
            self.cache.lowres.put(i, pixels)
        return pixels

    def read(self, i: int, fetch: Fetch) -> np.ndarray | None:
        """Sample i as `fetch` says (None for a bad file)."""
        return self.lowres(i) if fetch == "lowres" else self.encoded(i)

    def first_good(self, i: int, fetch: Fetch) -> tuple[int, np.ndarray]:
        """(j, data) for the first index j = i, i+1, ... (wrapping) whose file is good."""
        n = len(self.split)
        for k in range(n):
            j = (i + k) % n
            data = self.read(j, fetch)
            if data is not None:
                return j, data
        raise NoGoodImagesError(f"{self.split.folder}: none of the {n} files can be decoded (see the warnings above)")

    def recheck(self, indices: list[int], decodes: Callable[[np.ndarray], bool]) -> None:
        """After DALI failed on a batch (its error does not say which file): try each file alone with
        `decodes`; one it rejects is transcoded if PIL can decode it, else bad."""
        for i in dict.fromkeys(indices):
            data = self.encoded(i)
            if data is None or i in self.replacements or decodes(data):
                continue
            try:
                self.replacements[i] = transcode_to_jpeg(data)
            except BadImage as err:
                self.reject(i, f"{err} (found after DALI failed to decode it)")

    def stats(self) -> dict[str, float]:
        return {"data/skipped_images": float(self.skipped), "data/transcoded_images": float(len(self.replacements))}
