"""Bad clips never end a run: each is refused with a kind and a reason, counted, and named.

A clip can be bad before a frame is decoded (its header: unreadable, no video, an absurd size, length or frame rate,
shorter than the bucket's frames) or while decoding (a damaged or cut body). Each gets a :class:`BadClip` with a
stable ``kind`` (:data:`BAD_CLIP_KINDS`) and a reason that names the numbers; :class:`BadClipLog` counts them per kind
and keeps the sources' names, as :class:`~hf_arb.images.bad_images.BadImageLog` does for images. Two things are not
bad but are counted and named the same way (:data:`CLIP_NOTES`): a variable frame rate (resampled by timestamps, so
the clip trains at the model's rate) and a short clip looped because ``loop=True`` was asked.

:func:`clip_problems` checks a whole column of clip metadata at once (numpy, no loop over rows): the reason of each
row, ``"<kind>: <detail>"`` or None. The limits are :class:`ClipLimits`' options.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .temporal import held_frames

logger = logging.getLogger("hf_arb")

#: the kinds of bad clip, each with what it means
BAD_CLIP_KINDS: dict[str, str] = {
    "unreadable": "the container cannot be opened or its header read (missing, empty, cut or corrupt header)",
    "corrupt": "the decoder fails on the media data (a damaged body)",
    "truncated": "the stream ends before the planned frames (a body cut after an intact header)",
    "no_video": "no video stream (audio only), or a video stream with no frame",
    "too_large": "a side above ClipLimits.max_side",
    "too_small": "a side below ClipLimits.min_side",
    "too_long": "longer than ClipLimits.max_seconds",
    "bad_fps": "a frame rate outside ClipLimits.min_fps..max_fps",
    "too_short": "fewer frames at the target rate than the bucket needs (loop=True loops it instead)",
}
#: what is counted and named but still trains
CLIP_NOTES: dict[str, str] = {
    "vfr": "a variable frame rate: frames chosen by their timestamps",
    "looped": "shorter than the bucket's frames: played again from its start, as loop=True asks",
}


class BadClip(ValueError):
    """A clip that cannot train, with a stable ``kind`` (:data:`BAD_CLIP_KINDS`) and a reason naming the numbers.

    Attributes:
        kind: the key of :data:`BAD_CLIP_KINDS`.
        source: a short description of the clip (a path, ``"<bytes: 123>"``).
        detail: what was seen.
    """

    def __init__(self, kind: str, source: str, detail: str = "") -> None:
        if kind not in BAD_CLIP_KINDS:
            raise ValueError(f"unknown bad-clip kind {kind!r}: use one of {sorted(BAD_CLIP_KINDS)}.")
        self.kind, self.source, self.detail = kind, source, detail
        super().__init__(f"Bad clip {source}: {kind}" + (f" ({detail})" if detail else "") + ".")

    @property
    def reason(self) -> str:
        """``"<kind>: <detail>"``, the form of :func:`clip_problems` and ``skip_reason``."""
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


@dataclass(frozen=True)
class ClipLimits:
    """What counts as an absurd clip: the options of :func:`clip_problems` (images are checked for size only).

    Attributes:
        max_side: the largest width or height in pixels (8192: DCI 8K; 7680x4320 UHD fits).
        min_side: the smallest width or height (16: two latent cells of an 8x VAE).
        max_seconds: the longest clip (3600: an hour; longer is a stream dump or a broken header).
        min_fps, max_fps: the frame-rate range (0.1 to 1000: time-lapses to high-speed cameras; outside it the
            header is broken).
    """

    max_side: int = 8192
    min_side: int = 16
    max_seconds: float = 3600.0
    min_fps: float = 0.1
    max_fps: float = 1000.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_side <= self.max_side:
            raise ValueError(f"ClipLimits needs 1 <= min_side <= max_side, got {self.min_side} and {self.max_side}.")
        if not 0 <= self.min_fps <= self.max_fps or not self.max_seconds > 0:
            raise ValueError(f"ClipLimits needs 0 <= min_fps <= max_fps and max_seconds > 0, got {self}.")


def clip_problems(width: np.ndarray, height: np.ndarray, frames: np.ndarray, fps: np.ndarray,
                  limits: ClipLimits | None = None, *, target_frames: np.ndarray | int | None = None,
                  target_fps: float | None = None, loop: bool = False, mode: str = "head") -> np.ndarray:
    """The problem of each clip, vectorised: ``"<kind>: <detail>"`` or None.

    Args:
        width, height: int ``(n,)``, displayed sizes (``original_width``/``original_height``).
        frames: int ``(n,)``, frame counts (``original_frames``; 1 for an image).
        fps: float ``(n,)``, frame rates (0 for an image).
        limits: the thresholds (default :class:`ClipLimits()`).
        target_frames: int ``(n,)`` or one count: the frames each row's bucket needs; None skips the length check.
        target_fps: the model's frame rate (None: each clip's own).
        loop: short clips loop (then they are not a problem: the reader counts them as ``looped``).
        mode: ``"uniform"`` needs ``target_frames`` distinct frames whatever the rate; the others need them at
            ``target_fps``.

    Returns:
        object ``(n,)``: None for a good clip, else a reason; the first problem in the order no_video, too_large,
        too_small, bad_fps, too_long, too_short. Strings are built for the bad rows only.
    """
    lim = limits or ClipLimits()
    w, h = np.asarray(width, np.int64), np.asarray(height, np.int64)
    n, f = np.asarray(frames, np.int64), np.asarray(fps, np.float64)
    image = (f <= 0) & (n == 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        seconds = np.where(f > 0, n / f, 0.0)
    checks = [
        ("no_video", n < 1, lambda i: "zero frames"),
        ("too_large", np.maximum(w, h) > lim.max_side,
         lambda i: f"{w[i]}x{h[i]} has a side above max_side={lim.max_side}"),
        ("too_small", np.minimum(w, h) < lim.min_side,
         lambda i: f"{w[i]}x{h[i]} has a side below min_side={lim.min_side}"),
        ("bad_fps", ~image & ((f < lim.min_fps) | (f > lim.max_fps)),
         lambda i: f"{f[i]:g} fps is outside {lim.min_fps:g}..{lim.max_fps:g}"),
        ("too_long", seconds > lim.max_seconds,
         lambda i: f"{seconds[i]:.1f} s is above max_seconds={lim.max_seconds:g}"),
    ]
    if target_frames is not None and not loop:
        need = np.broadcast_to(np.asarray(target_frames, np.int64), n.shape)
        held = n if mode == "uniform" else held_frames(n, f, target_fps)
        rate = "" if mode == "uniform" or target_fps is None else f" at {target_fps:g} fps"
        checks.append(("too_short", held < need,
                       lambda i: f"{n[i]} frames at {f[i]:g} fps hold {held[i]}{rate}, fewer than {need[i]}"))
    out = np.full(n.shape, None, object)
    open_ = np.ones(n.shape, bool)
    for kind, mask, detail in checks:
        hit = np.flatnonzero(mask & open_)
        for i in hit:
            out[i] = f"{kind}: {detail(i)}"
        open_[hit] = False
    return out


class BadClipLog:
    """Counts bad clips (and notes) per kind and names them; logs each kind's first clip; appends JSON lines.

    Args:
        path: a JSON-lines file (e.g. ``<output_dir>/skipped_clips.jsonl``), one object per event
            ``{"kind", "source", "row", "detail"}``; None keeps them in memory only.
        max_names: names kept per kind (the count goes on past it).

    Attributes:
        counts: ``Counter`` of kind -> clips.
        names: kind -> the first ``max_names`` sources (``"row 12: 'clip.mp4'"``).
    """

    def __init__(self, path: str | os.PathLike | None = None, max_names: int = 100) -> None:
        self.path = None if path is None else Path(path)
        self.max_names = max_names
        self.counts: Counter[str] = Counter()
        self.names: dict[str, list[str]] = {}

    def record(self, kind: str, source: str, row: int | None = None, detail: str = "") -> None:
        """Count one clip of ``kind`` (a :data:`BAD_CLIP_KINDS` or :data:`CLIP_NOTES` key) and name it."""
        if kind not in BAD_CLIP_KINDS and kind not in CLIP_NOTES:
            raise ValueError(f"unknown clip kind {kind!r}: use one of {sorted({**BAD_CLIP_KINDS, **CLIP_NOTES})}.")
        name = source if row is None else f"row {row}: {source}"
        if not self.counts[kind]:
            level = logging.INFO if kind in CLIP_NOTES else logging.WARNING
            logger.log(level, "Clip %s: %s%s (counted; further %s clips are only counted)", name, kind,
                       f" ({detail})" if detail else "", kind)
        self.counts[kind] += 1
        kept = self.names.setdefault(kind, [])
        if len(kept) < self.max_names:
            kept.append(name)
        if self.path is not None:
            entry: dict[str, Any] = {"kind": kind, "source": source, "row": row, "detail": detail}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(entry, default=str) + "\n").encode())  # one write: whole lines across ranks
            finally:
                os.close(fd)

    @property
    def skipped(self) -> int:
        """Clips refused (notes not counted)."""
        return sum(v for k, v in self.counts.items() if k in BAD_CLIP_KINDS)

    def summary(self) -> str:
        """One line per kind seen: ``"too_short: 3 skipped (row 4: 'a.mp4', ...)"``; empty when none."""
        lines = []
        for kind in [*BAD_CLIP_KINDS, *CLIP_NOTES]:
            if self.counts[kind]:
                what = "skipped" if kind in BAD_CLIP_KINDS else "trained"
                shown = ", ".join(self.names[kind][:3]) + (", ..." if self.counts[kind] > 3 else "")
                lines.append(f"{kind}: {self.counts[kind]} {what} ({shown})")
        return "\n".join(lines)
