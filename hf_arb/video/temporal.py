"""Which instants of a clip train: temporal sampling modes and frame-rate resampling by timestamps, pure functions.

A bucket asks for ``target_frames`` frames at the model's frame rate ``target_fps`` (16 for Wan, 24 for
HunyuanVideo; None keeps the clip's own rate). :func:`sample_times` returns the instants to show, in seconds from
the clip's first frame; :func:`nearest_frames` maps instants to the source frames nearest them, by each frame's
presentation time, so a clip of any frame rate, variable ones included, is resampled by its timestamps (a 24 fps
clip for 16 fps takes frames 0, 2, 3, 5, 6, ...; an 8 fps clip for 16 fps shows each frame twice, at its real
speed). The decoder (:mod:`hf_arb.video.decode`) applies the same rule to the timestamps it decodes.

Modes:

- ``head``: the window starts at the clip's first frame;
- ``random``: a start drawn uniformly among the source frames that keep the window inside the clip, from the row's
  own stream ``hf_arb.rng.row_rng(seed, epoch, row, ROW_FRAMES)`` (the draw of :func:`~hf_arb.video.frames.frame_plan`,
  which it equals where that one applies): every rank, worker and resumed run picks the same frames;
- ``uniform``: ``target_frames`` instants spread evenly from the first frame to the last, whatever ``target_fps``
  (the whole clip in one row; it needs ``target_frames`` distinct frames);
- ``slide``: window ``window`` of the consecutive windows ``stride`` target frames apart (``target_frames`` by
  default: windows that do not overlap): one long clip becomes several rows, :func:`slide_rows` lists them.

A clip holds ``held_frames(frames, fps, target_fps)`` frames at the target rate. One that holds fewer than the
bucket's count is *short*: the caller skips it (:func:`hf_arb.video.bad_clips.clip_problems` names it), or, with
``loop=True``, its frames repeat from the start (the clip is played again).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.rng import ROW_FRAMES, row_rng

#: the temporal sampling modes of :func:`sample_times`
TEMPORAL_MODES = ("head", "random", "uniform", "slide")
#: seconds: an instant this close to the midpoint of two frames takes the earlier one (float noise never decides)
TIE_S = 1e-6
_EPS = 1e-6  # in frames: absorbs float noise in "does the window fit"


def _check(target_frames: int, target_fps: float | None, stride: int | None = None) -> None:
    if isinstance(target_frames, bool) or not isinstance(target_frames, (int, np.integer)) or target_frames < 1:
        raise UsageError(f"target_frames must be a positive whole number of frames (e.g. 81), got {target_frames!r}.")
    if target_fps is not None and not target_fps > 0:
        raise UsageError(f"target_fps must be > 0 frames per second (e.g. 16 for Wan), got {target_fps!r}.")
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1):
        raise UsageError(f"the slide stride must be a positive number of target frames, got {stride!r}.")


def held_frames(frames: np.ndarray | int, fps: np.ndarray | float, target_fps: float | None = None) -> np.ndarray:
    """How many frames at ``target_fps`` each clip holds between its first and last frame.

    Args:
        frames: int, shape ``(n,)`` (or a scalar): the clips' frame counts (``original_frames``).
        fps: float, shape ``(n,)`` (or a scalar): their frame rates (0 for an image).
        target_fps: the model's frame rate; None: each clip's own (then the answer is ``frames``).

    Returns:
        int64, shape ``(n,)`` (0-d for scalars): ``floor((frames - 1) / fps * target_fps) + 1``; 1 for an image or
        a 1-frame clip, 0 for a clip of no frame.
    """
    _check(1, target_fps)
    n = np.asarray(frames, np.int64)
    f = np.asarray(fps, np.float64)
    rate = f if target_fps is None else np.float64(target_fps)
    with np.errstate(divide="ignore", invalid="ignore"):
        held = np.floor((n - 1) / f * rate + _EPS).astype(np.int64) + 1
    held = np.where((f > 0) & (n > 1), held, np.minimum(n, 1))
    return np.where(n < 1, 0, held)


def slide_counts(frames: np.ndarray | int, fps: np.ndarray | float, target_frames: int,
                 target_fps: float | None = None, stride: int | None = None, loop: bool = False) -> np.ndarray:
    """Windows of ``target_frames`` frames, ``stride`` target frames apart, in each clip (``mode="slide"``).

    Returns:
        int64 of the shape of ``frames``: ``(held - target_frames) // stride + 1``, 0 for a short clip (1 with
        ``loop``: it loops once into one window).
    """
    _check(target_frames, target_fps, stride)
    held = held_frames(frames, fps, target_fps)
    step = int(target_frames if stride is None else stride)
    count = np.where(held >= target_frames, (held - int(target_frames)) // step + 1, 0)
    if loop:
        count = np.where(held > 0, np.maximum(count, 1), 0)
    return count


class SlideRows(NamedTuple):
    """The rows of ``mode="slide"``: window ``windows[i]`` of clip ``rows[i]``, in row order.

    Attributes:
        rows: int64 ``(m,)``, the clip row of each window (non-decreasing).
        windows: int64 ``(m,)``, the window's index within its clip (0, 1, ... per row).
        counts: int64 ``(n,)``, the windows of each clip (0 for a short one).
    """

    rows: np.ndarray
    windows: np.ndarray
    counts: np.ndarray

    @property
    def clips(self) -> int:
        """Clips with at least one window."""
        return int(np.count_nonzero(self.counts))

    @property
    def short(self) -> int:
        """Clips with no window (shorter than one window)."""
        return int(self.counts.size - self.clips)

    def summary(self) -> str:
        """One line for the run's summary: clips, the rows they became, the clips too short for a window."""
        return (f"slide: {self.clips} clips -> {len(self.rows)} rows ({len(self.rows) - self.clips} added by "
                f"windows); {self.short} clips shorter than one window")


def slide_rows(frames: np.ndarray, fps: np.ndarray, target_frames: int, target_fps: float | None = None,
               stride: int | None = None, loop: bool = False) -> SlideRows:
    """Expand clips into (row, window) pairs for ``mode="slide"``, vectorised (no loop over rows).

    Args:
        frames: int ``(n,)``, the clips' frame counts.
        fps: float ``(n,)``, their frame rates.
        target_frames: the bucket's frame count.
        target_fps: the model's frame rate (None: each clip's own).
        stride: target frames between window starts (default ``target_frames``: windows that do not overlap).
        loop: a short clip loops into one window instead of none.

    Returns:
        :class:`SlideRows`: ``rows`` and ``windows`` of shape ``(counts.sum(),)``; ``summary()`` reports the count.
    """
    counts = slide_counts(frames, fps, target_frames, target_fps, stride, loop).reshape(-1)
    total = int(counts.sum())
    rows = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # each row's first position in the output
    windows = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
    return SlideRows(rows, windows, counts)


def sample_times(frames: int, fps: float, target_frames: int, *, target_fps: float | None = None,
                 mode: str = "head", seed: int = 0, epoch: int = 0, row: int = 0, window: int = 0,
                 stride: int | None = None, loop: bool = False) -> np.ndarray:
    """The instants of a clip that train in a bucket of ``target_frames`` frames: a pure function of its arguments.

    Args:
        frames: the clip's frame count (1 for an image).
        fps: its (average) frame rate (0 for an image).
        target_frames: the bucket's frame count.
        target_fps: the model's frame rate; None keeps the clip's (consecutive frames).
        mode: ``"head"``, ``"random"``, ``"uniform"`` or ``"slide"`` (module docstring).
        seed, epoch, row: ``mode="random"`` draws its start from ``row_rng(seed, epoch, row, ROW_FRAMES)``.
        window, stride: ``mode="slide"``: which window, and target frames between window starts (default
            ``target_frames``); ``window < slide_counts(...)``.
        loop: a short clip plays again from its start (period ``frames / fps``) instead of being refused.

    Returns:
        float64, shape ``(target_frames,)``: seconds from the clip's first frame. ``head``, ``random`` and ``slide``
        are ``1 / target_fps`` apart (``1 / fps`` without a target), ``uniform`` spans the clip evenly; without
        ``loop`` all lie in ``[0, (frames - 1) / fps]`` and increase. :func:`frame_indices` gives the frames.

    Raises:
        UsageError: a bad argument (mode, counts, a window past the last one).
        ValueError: a short clip without ``loop`` (check with :func:`held_frames` or ``clip_problems`` first), or
            a clip of several frames with no frame rate.
    """
    _check(target_frames, target_fps, stride)
    if mode not in TEMPORAL_MODES:
        raise UsageError(f"unknown temporal mode {mode!r}: use one of {list(TEMPORAL_MODES)}.")
    if frames < 1:
        raise ValueError(f"a clip of {frames} frames has nothing to train on: skip it before sampling.")
    if fps <= 0:
        if frames > 1:
            raise ValueError(f"a clip of {frames} frames with frame rate {fps!r} cannot be sampled in time.")
        return np.zeros(int(target_frames), np.float64)  # an image: its one frame, repeated if asked
    rate = float(fps if target_fps is None else target_fps)
    steps = np.arange(int(target_frames), dtype=np.float64)
    held = int(held_frames(frames, fps, target_fps))
    fits = frames >= target_frames if mode == "uniform" else held >= target_frames
    if not fits:
        if not loop:
            raise ValueError(f"a clip of {frames} frames at {fps:g} fps holds {held} frames at {rate:g} fps, fewer "
                             f"than {target_frames}: skip it (clip_problems names it) or pass loop=True.")
        if mode == "slide" and window != 0:
            raise UsageError(f"a short clip loops into one window; window {window} does not exist.")
        return (steps / rate) % (frames / fps)  # played again from the start: period frames / fps
    if mode == "uniform":
        if target_frames == 1:
            return np.zeros(1, np.float64)
        return np.linspace(0.0, frames - 1, int(target_frames)) / fps
    start = 0.0
    if mode == "random":
        slack = int(np.floor((frames - 1) - (target_frames - 1) * fps / rate + _EPS))  # in source frames
        if slack > 0:
            start = int(row_rng(seed, epoch, row, ROW_FRAMES).integers(0, slack + 1)) / fps
    elif mode == "slide":
        count = int(slide_counts(frames, fps, target_frames, target_fps, stride))
        if not 0 <= window < count:
            raise UsageError(f"window {window} does not exist: this clip has {count} windows (slide_rows lists them).")
        start = window * int(target_frames if stride is None else stride) / rate
    return start + steps / rate


def nearest_frames(frame_times: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The frame nearest each instant, by presentation time (ties and float noise within :data:`TIE_S`: the earlier).

    Args:
        frame_times: float ``(n,)``, ascending: each source frame's time in seconds (``n >= 1``).
        times: float ``(f,)``: the instants wanted (any order).

    Returns:
        int64 ``(f,)``: indices into ``frame_times``; non-decreasing where ``times`` is.
    """
    ft = np.asarray(frame_times, np.float64)
    t = np.asarray(times, np.float64)
    if ft.size == 0:
        raise ValueError("a clip with no frame has no nearest frame.")
    after = np.searchsorted(ft, t, side="right")  # the first frame later than t
    lo = np.clip(after - 1, 0, ft.size - 1)
    hi = np.clip(after, 0, ft.size - 1)
    return np.where(t - ft[lo] <= ft[hi] - t + TIE_S, lo, hi).astype(np.int64)


def frame_indices(frames: int, fps: float, times: np.ndarray) -> np.ndarray:
    """The source frames of a constant-rate clip nearest ``times``: :func:`nearest_frames` on ``arange(frames) / fps``.

    Returns:
        int64, the shape of ``times``, in ``[0, frames)``. (A variable-rate clip's frames are chosen by their
        decoded timestamps instead; :func:`hf_arb.video.decode.decode_frames` does that.)
    """
    if fps <= 0:
        return np.zeros(np.shape(times), np.int64)
    return nearest_frames(np.arange(int(frames), dtype=np.float64) / fps, times)
