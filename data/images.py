"""What an encoded file holds, and how an odd one is made decodable: screening before DALI sees the bytes.

A decode error inside a DALI pipeline invalidates the whole pipeline, so every file is screened once with
PIL's header parser (tens of microseconds, no pixel decoding) before its bytes reach DALI: JPEG and PNG
(whatever the file is called; ImageNet has PNGs named .JPEG, CMYK and grayscale JPEGs) go to DALI as they
are; other formats and exotic PNG modes are transcoded to a plain RGB JPEG once; a file that is cut short
or not an image is bad (skipped, counted and named in the log).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

JPEG_END = b"\xff\xd9"  # EOI marker; entropy-coded data never contains it (0xFF is stuffed with 0x00)
PNG_END = b"IEND"
TAIL_BYTES = 1024  # some writers pad after the end marker; look for it in the last KiB
DALI_PNG_MODES = {"1", "L", "LA", "P", "RGB", "RGBA"}


class BadImage(ValueError):
    """The bytes are not a decodable image; the message says why."""


@dataclass(frozen=True)
class Screened:
    """A file's verdict: its pixel size, and whether DALI can take the bytes as they are."""

    height: int
    width: int
    transcode: bool


def screen(data: bytes | np.ndarray) -> Screened:
    """Parse the header only; raise BadImage for a file that is not an image or is cut short."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    try:
        img = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BadImage(f"not an image ({err.__class__.__name__})") from None
    width, height = img.size
    tail = raw[-TAIL_BYTES:]
    if img.format == "JPEG":
        if JPEG_END not in tail:
            raise BadImage("truncated JPEG (no end-of-image marker)")
        return Screened(height, width, transcode=False)
    if img.format == "PNG":
        if PNG_END not in tail:
            raise BadImage("truncated PNG (no IEND chunk)")
        return Screened(height, width, transcode=img.mode not in DALI_PNG_MODES)
    return Screened(height, width, transcode=True)


def open_rgb(data: bytes | np.ndarray, draft_short_side: int = 0) -> Image.Image:
    """Decode to an RGB PIL image (CMYK, grayscale, palette and alpha converted); BadImage if it fails.

    draft_short_side lets libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale, keeping the shorter side at least that.
    """
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    try:
        img = Image.open(io.BytesIO(raw))
        if draft_short_side:
            scale = draft_short_side / min(img.size)
            img.draft("RGB", (round(img.width * scale), round(img.height * scale)))
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise BadImage(f"cannot decode ({err})") from None


def transcode_to_jpeg(data: bytes | np.ndarray, quality: int = 95) -> np.ndarray:
    """A plain RGB JPEG with the same pixels (up to JPEG loss), for files DALI cannot decode as they are."""
    out = io.BytesIO()
    open_rgb(data).save(out, "JPEG", quality=quality)
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


def lowres_shape(height: int, width: int, short_side: int, max_aspect: float) -> tuple[int, int]:
    """(h, w) of the low-resolution copy: shorter side = short_side, longer side capped at max_aspect x it."""
    scale = short_side / min(height, width)
    cap = int(short_side * max_aspect)
    return min(cap, max(short_side, round(height * scale))), min(cap, max(short_side, round(width * scale)))


def decode_lowres(data: bytes | np.ndarray, short_side: int, max_aspect: float) -> np.ndarray:
    """Decode and resize so the shorter side is short_side (a center crop beyond max_aspect): HWC uint8."""
    img = open_rgb(data, draft_short_side=short_side)
    scale = short_side / min(img.size)
    full_w, full_h = max(short_side, round(img.width * scale)), max(short_side, round(img.height * scale))
    h, w = lowres_shape(img.height, img.width, short_side, max_aspect)
    pixels = np.asarray(img.resize((full_w, full_h), Image.Resampling.BILINEAR))
    top, left = (full_h - h) // 2, (full_w - w) // 2
    return np.ascontiguousarray(pixels[top:top + h, left:left + w])
