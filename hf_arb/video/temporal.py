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
- ``slide``: window ``window`` of the windows ``stride`` target frames apart (``target_frames`` by default: windows
  that do not overlap); window ``w`` starts at source frame ``w * nearest(stride * fps / target_fps)`` (at least 1
  apart): one long clip becomes several rows, :func:`slide_rows` lists them.

**One frame-planning rule.** :func:`plan_frames` is the single rule that annotation, training and decoding follow: a
:class:`FramePlan` ``(start, stride, count)`` in source frames: trained frame ``k`` is the source frame nearest the
position ``start + k * stride`` (ties to the earlier, :func:`nearest_index`), where ``start`` is a whole source frame
and ``stride = fps / target_fps`` (source frames per trained frame; 1 without a target rate, ``(frames - 1) /
(count - 1)`` for ``uniform``). :func:`sample_times` is the plan's positions in seconds; the decoder is given the
planned frames' own times (``indices / fps``), so on a constant-rate clip it returns exactly the planned frames, and
``hf-arb annotate`` matches each clip to the frame count the same rule holds (:func:`held_frames`) and, for
``slide``, writes each window's plan into its row.

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


def nearest_index(positions: np.ndarray | float) -> np.ndarray:
    """The source frame nearest each position (in source frames, from the clip's first frame): the one rounding rule
    of :class:`FramePlan`. A position half-way between two frames (and float noise within ``1e-6`` frames of it)
    takes the earlier frame, as :func:`nearest_frames` does by time. int64 of the shape of ``positions``."""
    return np.ceil(np.asarray(positions, np.float64) - 0.5 - _EPS).astype(np.int64)


def frame_steps(fps: np.ndarray | float, target_fps: float | None = None) -> np.ndarray:
    """Source frames per trained frame: ``fps / target_fps`` (1 without a target rate, and for an image, fps 0).
    float64 of the shape of ``fps``: the ``stride`` of every :class:`FramePlan` but ``uniform``'s."""
    _check(1, target_fps)
    f = np.asarray(fps, np.float64)
    if target_fps is None:
        return np.ones(f.shape, np.float64)
    return np.where(f > 0, f / float(target_fps), 1.0)


class FramePlan(NamedTuple):
    """The source frames a row trains on: frame ``k`` is the one nearest position ``start + k * stride``.

    Attributes:
        start: the first source frame (a whole frame).
        stride: source frames per trained frame (``fps / target_fps``; 1 at the clip's own rate; 0 for an image).
        count: the trained frames (the bucket's frame count).
    """

    start: int
    stride: float
    count: int

    def positions(self) -> np.ndarray:
        """float64 ``(count,)``: ``start + k * stride``, in source frames."""
        return self.start + self.stride * np.arange(self.count, dtype=np.float64)

    def indices(self, frames: int | None = None) -> np.ndarray:
        """int64 ``(count,)``: the planned source frames (:func:`nearest_index` of the positions); with the clip's
        ``frames``, a plan that runs past its end (a looped short clip) plays it again from the start."""
        idx = nearest_index(self.positions())
        return idx % int(frames) if frames else idx


def _slack(frames: np.ndarray, step: np.ndarray, target_frames: int) -> np.ndarray:
    """Whole source frames a window of ``target_frames`` can start at beyond frame 0 (negative: it does not fit)."""
    return np.floor((frames - 1) - (int(target_frames) - 1) * step + _EPS).astype(np.int64)


def slide_strides(fps: np.ndarray | float, target_frames: int, target_fps: float | None = None,
                  stride: int | None = None) -> np.ndarray:
    """Source frames between the starts of consecutive ``slide`` windows: the nearest whole frame to ``stride``
    target frames (default ``target_frames``), at least 1. int64 of the shape of ``fps``."""
    _check(target_frames, target_fps, stride)
    step = int(target_frames if stride is None else stride)
    return np.maximum(nearest_index(step * frame_steps(fps, target_fps)), 1)


def slide_counts(frames: np.ndarray | int, fps: np.ndarray | float, target_frames: int,
                 target_fps: float | None = None, stride: int | None = None, loop: bool = False) -> np.ndarray:
    """Windows of ``target_frames`` frames in each clip (``mode="slide"``): window ``w`` starts at source frame ``w *
    slide_strides(...)``, and every start that keeps the window inside the clip is taken.

    Returns:
        int64 of the shape of ``frames``: ``slack // slide_stride + 1`` where ``slack`` is the last start that fits,
        0 for a short clip (1 with ``loop``: it loops once into one window).
    """
    _check(target_frames, target_fps, stride)
    n = np.asarray(frames, np.int64)
    held = held_frames(n, fps, target_fps)
    slack = np.maximum(_slack(n, frame_steps(fps, target_fps), target_frames), 0)
    count = np.where(held >= target_frames, slack // slide_strides(fps, target_frames, target_fps, stride) + 1, 0)
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


def plan_frames(frames: int, fps: float, target_frames: int, *, target_fps: float | None = None,
                mode: str = "head", seed: int = 0, epoch: int = 0, row: int = 0, window: int = 0,
                stride: int | None = None, loop: bool = False, start: int | None = None) -> FramePlan:
    """The one frame-planning rule: the :class:`FramePlan` of a clip for a bucket of ``target_frames`` frames.

    Annotation (the frame count a clip holds, a ``slide`` row's plan), training (each row's plan and its cache key) and
    decoding (the frames asked of the decoder) all call it, so the annotated ``bucket_frames`` is what decoding returns.

    Args:
        frames: the clip's frame count (1 for an image).
        fps: its (average) frame rate (0 for an image).
        target_frames: the bucket's frame count.
        target_fps: the model's frame rate; None keeps the clip's (consecutive frames).
        mode: ``"head"``, ``"random"``, ``"uniform"`` or ``"slide"`` (module docstring).
        seed, epoch, row: ``mode="random"`` draws its start from ``row_rng(seed, epoch, row, ROW_FRAMES)``.
        window, stride: ``mode="slide"``: which window, and target frames between window starts (default
            ``target_frames``); ``window < slide_counts(...)``.
        loop: a short clip plays again from its start instead of being refused.
        start: a start already planned (an annotated ``slide`` row's ``frame_start``), instead of the mode's.

    Returns:
        :class:`FramePlan`; without ``loop`` every planned frame lies in ``[0, frames)``.

    Raises:
        UsageError: a bad argument (mode, counts, a window past the last one).
        ValueError: a short clip without ``loop`` (check with :func:`held_frames` or ``clip_problems`` first), a clip
            of several frames with no frame rate, or a ``start`` that does not keep the window inside the clip.
    """
    _check(target_frames, target_fps, stride)
    if mode not in TEMPORAL_MODES:
        raise UsageError(f"unknown temporal mode {mode!r}: use one of {list(TEMPORAL_MODES)}.")
    if frames < 1:
        raise ValueError(f"a clip of {frames} frames has nothing to train on: skip it before sampling.")
    count = int(target_frames)
    if fps <= 0:
        if frames > 1:
            raise ValueError(f"a clip of {frames} frames with frame rate {fps!r} cannot be sampled in time.")
        return FramePlan(0, 0.0, count)  # an image: its one frame, repeated if asked
    step = float(frame_steps(fps, target_fps))
    held = int(held_frames(frames, fps, target_fps))
    fits = frames >= count if mode == "uniform" else held >= count
    if not fits:
        if not loop:
            rate = float(fps if target_fps is None else target_fps)
            raise ValueError(f"a clip of {frames} frames at {fps:g} fps holds {held} frames at {rate:g} fps, fewer "
                             f"than {count}: skip it (clip_problems names it) or pass loop=True.")
        if mode == "slide" and window != 0:
            raise UsageError(f"a short clip loops into one window; window {window} does not exist.")
        return FramePlan(0, step, count)  # played again from the start (FramePlan.indices(frames) wraps)
    if mode == "uniform":
        return FramePlan(0, (frames - 1) / (count - 1) if count > 1 else 0.0, count)
    slack = int(_slack(np.int64(frames), np.float64(step), count))
    if start is not None:
        if not 0 <= int(start) <= slack:
            raise ValueError(f"a window of {count} frames starting at source frame {start} does not fit a clip of "
                             f"{frames} frames at {fps:g} fps (the last start that fits is {slack}): annotate again.")
        return FramePlan(int(start), step, count)
    first = 0
    if mode == "random" and slack > 0:
        first = int(row_rng(seed, epoch, row, ROW_FRAMES).integers(0, slack + 1))
    elif mode == "slide":
        n_windows = int(slide_counts(frames, fps, count, target_fps, stride))
        if not 0 <= window < n_windows:
            raise UsageError(f"window {window} does not exist: this clip has {n_windows} windows (slide_rows lists "
                             "them).")
        first = window * int(slide_strides(fps, count, target_fps, stride))
    return FramePlan(first, step, count)


def sample_times(frames: int, fps: float, target_frames: int, *, target_fps: float | None = None,
                 mode: str = "head", seed: int = 0, epoch: int = 0, row: int = 0, window: int = 0,
                 stride: int | None = None, loop: bool = False) -> np.ndarray:
    """The instants of a clip that train in a bucket of ``target_frames`` frames: :func:`plan_frames`' positions in
    seconds, a pure function of its arguments.

    Args:
        frames, fps, target_frames, target_fps, mode, seed, epoch, row, window, stride, loop: as :func:`plan_frames`.

    Returns:
        float64, shape ``(target_frames,)``: seconds from the clip's first frame. ``head``, ``random`` and ``slide``
        are ``1 / target_fps`` apart (``1 / fps`` without a target), ``uniform`` spans the clip evenly; without
        ``loop`` all lie in ``[0, (frames - 1) / fps]`` and increase. :func:`frame_indices` gives the frames (those of
        :meth:`FramePlan.indices`).

    Raises:
        UsageError, ValueError: as :func:`plan_frames`.
    """
    plan = plan_frames(frames, fps, target_frames, target_fps=target_fps, mode=mode, seed=seed, epoch=epoch, row=row,
                       window=window, stride=stride, loop=loop)
    if fps <= 0:
        return np.zeros(plan.count, np.float64)
    return (plan.positions() % frames) / fps  # a looped clip plays again: period frames / fps


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
