"""Decode only the frames a clip trains on, each fitted to the bucket with one crop for the whole clip.

:func:`decode_frames` takes the instants to show (:func:`~hf_arb.video.temporal.sample_times`) and:

1. seeks (PyAV ``Container.seek``, backward: the keyframe at or before the first instant); when the seek lands
   after it (an inexact index) it decodes from the start instead;
2. decodes forward and picks, for each instant, the frame whose presentation time is nearest
   (:func:`~hf_arb.video.temporal.nearest_frames`' rule, applied while streaming: a frame is chosen once the next
   one is seen), so variable-frame-rate clips are resampled by their timestamps;
3. converts and fits only the chosen frames: :func:`hf_arb.images.geometry.plan_fit` once per clip, then
   :func:`hf_arb.images.fitting.render_plan` per frame, the image path's resize and crop, with the display
   rotation applied as the matching EXIF orientation;
4. stops after the frame that decides the last instant.

At most two decoded frames are held besides the output ``(F, 3, H, W)`` array, which is allocated once at the
bucket's size: nothing grows with the clip's length. :func:`read_clip` is the whole path for one row (header,
limits, instants, frames); :class:`ClipFrameReader` wraps it so that a bad clip is counted and named in a
:class:`~hf_arb.video.bad_clips.BadClipLog` and returns None instead of raising.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.images.fitting import open_image, render_plan
from hf_arb.images.geometry import CropMode, FitPlan, plan_fit
from hf_arb.images.sizes import open_and_read
from hf_arb.rng import ROW_CROP, row_rng

from .bad_clips import BadClip, BadClipLog, ClipLimits, clip_problems
from .metadata import ClipMetadata, ClipMetadataError, ClipSource, metadata_of_open
from .temporal import TIE_S, FramePlan, held_frames, plan_frames

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: display rotation (degrees counter-clockwise, as FFmpeg reports it, mod 360) -> the EXIF orientation that shows the
#: stored frame the same way (FFmpeg's autorotate turns a -90 degree matrix clockwise, EXIF 6)
ROTATION_TO_EXIF = {0: 1, 90: 8, 180: 3, 270: 6}
#: a clip whose frame intervals spread more than this fraction (or 2 ms) is variable-frame-rate
VFR_SPREAD = 0.1


@dataclass(frozen=True)
class ClipFrames:
    """The frames of one clip fitted to a bucket.

    Attributes:
        frames: uint8 ``(F, 3, H, W)``: RGB, the bucket's height and width.
        times: float64 ``(F,)``: the presentation time (seconds from the clip's start) of the source frame each
            output frame is.
        target_times: float64 ``(F,)``: the instants asked for.
        original_size: ``(h, w)`` of the displayed clip (rotation applied), SDXL's ``original_size``.
        crop_top_left: ``(y, x)`` of the crop in the scaled frame, the same for every frame.
        flipped: whether every frame was mirrored.
        scaled_size: ``(width, height)`` every frame was scaled to before the crop.
        rotation: the display rotation applied (degrees, as FFmpeg reports it).
        decoded: frames the decoder produced (the planned ones, those between them, and those from the keyframe).
        vfr: the frame intervals vary (in the header's rates or the decoded timestamps): frames chosen by timestamp.
        looped: the clip was shorter than the bucket and played again (``loop=True``).
    """

    frames: np.ndarray
    times: np.ndarray
    target_times: np.ndarray
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    scaled_size: tuple[int, int]
    rotation: int = 0
    decoded: int = 0
    vfr: bool = False
    looped: bool = False

    @property
    def target_size(self) -> tuple[int, int]:
        """``(h, w)`` of the bucket."""
        return (int(self.frames.shape[2]), int(self.frames.shape[3]))

    def to_tensor(self) -> torch.Tensor:
        """The frames as float32 ``(F, 3, H, W)`` in [-1, 1]: ``v / 127.5 - 1``, as
        :func:`~hf_arb.images.fitting.to_tensor` gives an image."""
        import torch

        return torch.from_numpy(self.frames).to(torch.float32).div_(127.5).sub_(1.0)


def _describe(source: Any) -> str:
    if isinstance(source, Mapping):
        return repr(str(source["path"])) if source.get("path") else f"<bytes: {len(source.get('bytes') or b'')}>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<bytes: {len(source)}>"
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(source).__name__}>"


def _unreadable(source: str, reason: str, detail: str = "") -> BadClip:
    return BadClip("unreadable", source, reason + (f" ({detail})" if detail else ""))


def _with_file(source: ClipSource, read: Any) -> Any:
    """``read(binary file, name)`` of a path (fsspec URLs too), bytes, a file object or a ``{"bytes", "path"}``
    value."""
    if isinstance(source, Mapping):
        if source.get("bytes") is not None:
            return _with_file(source["bytes"], read)
        if source.get("path"):
            return _with_file(os.fspath(source["path"]), read)
        raise BadClip("unreadable", "<empty value>", "no bytes and no path")
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise BadClip("unreadable", _describe(source), "empty (0 bytes)")
        return read(io.BytesIO(source), _describe(source))
    if isinstance(source, (str, os.PathLike)):
        return open_and_read(os.fspath(source), _describe(source), read, _unreadable)
    if hasattr(source, "read"):
        return read(source, _describe(source))
    raise BadClip("unreadable", _describe(source),
                  "pass a path, bytes, a binary file object or a {'bytes', 'path'} dict")


def _metadata(fp: Any, name: str) -> ClipMetadata:
    try:
        return metadata_of_open(fp, name)
    except ClipMetadataError as e:
        kind = "no_video" if e.reason.startswith("no video") or e.reason == "zero frames" else "unreadable"
        raise BadClip(kind, name, e.reason) from e


def _orientation(rotation: int) -> int:
    return ROTATION_TO_EXIF[round(rotation / 90) * 90 % 360]


def _header_vfr(stream: Any) -> bool:
    """Whether the header's average rate differs from its base rate (MP4 writes both; a VFR clip's differ)."""
    avg, base = stream.average_rate, stream.base_rate
    return bool(avg and base and abs(float(avg) / float(base) - 1) > 0.01)


def _render(frame: Any, plan: FitPlan, orientation: int, resample: str, name: str) -> np.ndarray:
    """One decoded frame, fitted: uint8 ``(3, H, W)``."""
    try:
        im, _ = render_plan(frame.to_image(), plan, orientation, resample=resample, draft=False)
    except ValueError as e:  # the frame's size is not the header's: a stream that changes size mid-clip
        raise BadClip("corrupt", name, f"a frame of {frame.width}x{frame.height} differs from the header's size") from e
    return np.asarray(im).transpose(2, 0, 1)


def _decoded(container: Any, stream: Any, name: str) -> Any:
    """The stream's frames in presentation order (demuxed and decoded packet by packet). An FFmpeg error becomes a
    :class:`BadClip`: ``truncated`` when a packet was cut short (FFmpeg flags a partial read as corrupt, as at the end
    of a cut file), ``corrupt`` otherwise."""
    import av

    cut, n = False, 0
    try:
        for packet in container.demux(stream):
            cut = cut or packet.is_corrupt
            for frame in packet.decode():
                n += 1
                yield frame
    except av.FFmpegError as e:
        raise BadClip("truncated" if cut else "corrupt", name,
                      f"{type(e).__name__} after {n} frames" + (" (the data ends mid-packet)" if cut else f": {e}"))


class _Picker:
    """Chooses, while frames stream by in time order, the frame nearest each wanted instant, and fits it."""

    def __init__(self, times: np.ndarray, plan: FitPlan, orientation: int, resample: str, name: str) -> None:
        order = np.argsort(times, kind="stable")
        self.order, self.wanted = order.tolist(), times[order].tolist()  # ascending; Python floats: a loop per frame
        bw, bh = plan.bucket
        self.out = np.empty((times.size, 3, bh, bw), np.uint8)  # the only allocation at the bucket's size
        self.chosen = np.empty(times.size, np.float64)
        self.count = times.size
        self.plan, self.orientation, self.resample, self.name = plan, orientation, resample, name
        self.j, self.last_src, self.last_out = 0, None, -1

    @property
    def done(self) -> bool:
        return self.j == self.count

    def take(self, frame: Any, t: float, until: float | None) -> None:
        """``frame`` (at ``t``) for every pending instant nearer to it than to the next frame (at ``until``; None:
        the stream ended, every pending instant)."""
        while self.j < self.count and (until is None or self.wanted[self.j] - t <= until - self.wanted[self.j]
                                             + TIE_S):
            k = self.order[self.j]
            if frame is self.last_src:
                self.out[k] = self.out[self.last_out]
            else:
                self.out[k] = _render(frame, self.plan, self.orientation, self.resample, self.name)
                self.last_src, self.last_out = frame, k
            self.chosen[k] = t
            self.j += 1


def _decode(fp: Any, name: str, meta: ClipMetadata, plan: FitPlan, times: np.ndarray, resample: str,
            ) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """(frames, chosen times, frames decoded, vfr) of the instants ``times`` of an open clip."""
    import av

    try:
        container = av.open(fp, "r")
    except av.FFmpegError as e:
        raise BadClip("unreadable", name, f"{type(e).__name__}: {e}"[:160]) from e
    with container:
        streams = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
        if not streams:
            raise BadClip("no_video", name, "no video stream")
        stream = streams[0]
        tb = stream.time_base or Fraction(1, 1_000_000)
        origin = stream.start_time or 0
        interval = 1.0 / meta.fps if meta.fps > 0 else 0.0
        first = float(times.min())
        decoded, seek = 0, first > 0
        while True:
            if seek:  # the keyframe at or before the first instant
                container.seek(origin + int(first / float(tb)), stream=stream, backward=True, any_frame=False)
            pick = _Picker(times, plan, _orientation(meta.rotation), resample, name)
            prev, prev_t, lo_dt, hi_dt, overshoot = None, 0.0, np.inf, 0.0, False
            for frame in _decoded(container, stream, name):
                decoded += 1
                t = float((frame.pts - origin) * tb) if frame.pts is not None else prev_t + interval
                if prev is None:
                    overshoot = seek and t > first + TIE_S  # the seek landed after the first instant
                    if overshoot:
                        break
                elif t <= prev_t:
                    continue  # a repeated or backward timestamp: keep the first
                else:
                    lo_dt, hi_dt = min(lo_dt, t - prev_t), max(hi_dt, t - prev_t)
                    pick.take(prev, prev_t, t)
                    if pick.done:
                        break
                prev, prev_t = frame, t
            if not overshoot:
                break
            seek = False  # decode from the start instead
            container.seek(origin, stream=stream, backward=True, any_frame=False)
        if not pick.done:  # the stream ended: what is left takes the last frame, unless it ends well before them
            if prev is None:
                raise BadClip("no_video", name, "the video stream holds no frame")
            if pick.wanted[-1] - prev_t > 2 * interval + TIE_S:
                raise BadClip("truncated", name, f"the stream ends at {prev_t:.3f} s, before the frame planned at "
                                                 f"{pick.wanted[-1]:.3f} s (the header says {meta.frames} frames)")
            pick.take(prev, prev_t, None)
        vfr = _header_vfr(stream) or (hi_dt > 0 and hi_dt - lo_dt > max(VFR_SPREAD * lo_dt, 0.002))
    return pick.out, pick.chosen, decoded, bool(vfr)


def decode_frames(source: ClipSource, times: np.ndarray, size: tuple[int, int], *, crop: CropMode = "center",
                  rng: np.random.Generator | None = None, flip: bool = False, resample: str = "lanczos",
                  metadata: ClipMetadata | None = None) -> ClipFrames:
    """Decode the frames of ``source`` nearest each instant of ``times``, fitted to ``size`` with one crop.

    Args:
        source: a path (fsspec URLs too), the encoded bytes, a binary file object, or a ``datasets.Video(decode=
            False)`` value ``{"bytes", "path"}``. An image is a 1-frame clip (every instant is its one frame).
        times: float ``(F,)``: seconds from the clip's first frame (:func:`~hf_arb.video.temporal.sample_times`).
        size: the bucket ``(width, height)``.
        crop, rng, flip: as :func:`hf_arb.images.fitting.fit_to_bucket`; drawn once, applied to every frame.
        resample: the resize filter (``"lanczos"`` default, as for images).
        metadata: the clip's :class:`~hf_arb.video.metadata.ClipMetadata` when already read (else its header is).

    Returns:
        :class:`ClipFrames`, ``frames`` uint8 ``(F, 3, H, W)``.

    Raises:
        BadClip: unreadable, no video, a damaged body (``corrupt``) or one that ends before the instants
            (``truncated``).
    """
    t = np.asarray(times, np.float64).reshape(-1)
    if t.size == 0 or not np.all(np.isfinite(t)) or np.any(t < 0):
        raise UsageError(f"times must be seconds >= 0, at least one, got {t.tolist()[:8]}.")

    def read(fp: Any, name: str) -> ClipFrames:
        meta = metadata or _metadata(fp, name)
        plan = plan_fit((meta.width, meta.height), size, crop=crop, rng=rng, flip=flip)
        if meta.is_image:
            im, _ = render_plan(open_image(fp), plan, None, resample=resample, draft=True)
            frames = np.broadcast_to(np.asarray(im).transpose(2, 0, 1), (t.size, 3, *plan.target_size)).copy()
            chosen, decoded, vfr = np.zeros_like(t), 1, False
        else:
            frames, chosen, decoded, vfr = _decode(fp, name, meta, plan, t, resample)
        return ClipFrames(frames, chosen, t, plan.original_size, plan.crop_top_left, plan.flipped, plan.scaled_size,
                          meta.rotation, decoded, vfr)

    return _with_file(source, read)


def read_clip(source: ClipSource, size: tuple[int, int], target_frames: int, *, target_fps: float | None = None,
              mode: str = "head", seed: int = 0, epoch: int = 0, row: int = 0, window: int = 0,
              stride: int | None = None, loop: bool = False, crop: CropMode = "center", flip: bool = False,
              resample: str = "lanczos", limits: ClipLimits | None = None,
              metadata: ClipMetadata | None = None, plan: FramePlan | None = None) -> ClipFrames:
    """One row's frames: header, limits, the frame plan (:func:`~hf_arb.video.temporal.plan_frames`), decode and fit.

    The decoder is given the planned frames' own times (``indices / fps``), so a constant-rate clip yields exactly the
    planned source frames (no instant half-way between two frames is left to the container's timestamp rounding), and
    a variable-rate one the frame nearest each planned frame's time by its own timestamps.

    Args:
        source: the clip (as :func:`decode_frames`).
        size: the bucket's ``(width, height)``; ``target_frames`` its frame count.
        target_fps, mode, seed, epoch, row, window, stride, loop: as :func:`~hf_arb.video.temporal.plan_frames`.
        crop: ``"center"`` or ``"random"`` (drawn from ``row_rng(seed, epoch, row, ROW_CROP)``, the image path's
            stream), one crop for every frame; ``flip`` mirrors them all.
        resample: the resize filter.
        limits: the :class:`~hf_arb.video.bad_clips.ClipLimits` (default thresholds when None).
        metadata: the header when already read.
        plan: the row's :class:`~hf_arb.video.temporal.FramePlan` when already planned (a training dataset plans from
            its annotated columns): decoded as it is (``plan.count`` must be ``target_frames``) instead of planning
            from the header.

    Returns:
        :class:`ClipFrames` (``looped`` set when the clip was shorter than the bucket and ``loop`` was asked;
        ``target_times`` the plan's instants, :func:`~hf_arb.video.temporal.sample_times`).

    Raises:
        BadClip: every kind of :data:`~hf_arb.video.bad_clips.BAD_CLIP_KINDS`, named.
    """
    meta = metadata if metadata is not None else _with_file(source, _metadata)
    name = _describe(source)
    if plan is not None and plan.count != target_frames:
        raise UsageError(f"a plan of {plan.count} frames for a bucket of {target_frames}.")
    problem = clip_problems(np.array([meta.width]), np.array([meta.height]), np.array([meta.frames]),
                            np.array([meta.fps]), limits, target_frames=None if plan is not None else target_frames,
                            target_fps=target_fps, loop=loop, mode=mode)[0]
    if problem is not None:
        kind, _, detail = problem.partition(": ")
        raise BadClip(kind, name, detail)
    if plan is None:
        plan = plan_frames(meta.frames, meta.fps, target_frames, target_fps=target_fps, mode=mode, seed=seed,
                           epoch=epoch, row=row, window=window, stride=stride, loop=loop)
    idx = plan.indices(meta.frames if loop else None)
    if not meta.is_image and int(idx.max()) >= meta.frames:
        raise BadClip("too_short", name, f"{meta.frames} frames at {meta.fps:g} fps, the plan needs frame "
                                         f"{int(idx.max())}")
    times = idx / meta.fps if meta.fps > 0 else np.zeros(idx.shape)  # the planned frames' own times
    rng = row_rng(seed, epoch, row, ROW_CROP) if crop == "random" else None
    out = decode_frames(source, times, size, crop=crop, rng=rng, flip=flip, resample=resample, metadata=meta)
    held = int(meta.frames if mode == "uniform" else held_frames(meta.frames, meta.fps, target_fps))
    asked = (plan.positions() % meta.frames) / meta.fps if meta.fps > 0 else out.target_times  # the plan's instants
    return replace(out, target_times=asked, looped=not meta.is_image and held < target_frames)


class ClipFrameReader:
    """:func:`read_clip` for a training loop: a bad clip is counted and named in ``log`` and gives None.

    Args:
        log: where bad clips and notes go (a new in-memory :class:`~hf_arb.video.bad_clips.BadClipLog` when None).
        **options: :func:`read_clip`'s keyword options fixed for the run (``target_fps``, ``mode``, ``stride``,
            ``loop``, ``crop``, ``resample``, ``limits``, ``seed``).

    Usage errors (:class:`~hf_arb.checks.UsageError`) and a missing PyAV still raise: they are the run's mistake,
    not one clip's. Each clip is counted once per kind (by row, else by source) however often it is read.
    """

    OPTIONS = ("target_fps", "mode", "stride", "loop", "crop", "resample", "limits", "seed")

    def __init__(self, log: BadClipLog | None = None, **options: Any) -> None:
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            raise UsageError(f"unknown ClipFrameReader option(s) {sorted(unknown)}: use {list(self.OPTIONS)}.")
        self.log = log if log is not None else BadClipLog()
        self.options = options
        self._seen: set[tuple[str, Any]] = set()

    def _record(self, kind: str, source: str, row: int | None, detail: str) -> None:
        key = (kind, source if row is None else row)
        if key not in self._seen:
            self._seen.add(key)
            self.log.record(kind, source, row, detail)

    def __call__(self, source: ClipSource, size: tuple[int, int], target_frames: int, *, row: int | None = None,
                 epoch: int = 0, window: int = 0, flip: bool = False,
                 metadata: ClipMetadata | None = None) -> ClipFrames | None:
        """The row's :class:`ClipFrames`, or None for a bad clip (counted and named)."""
        try:
            out = read_clip(source, size, target_frames, epoch=epoch, row=row or 0, window=window, flip=flip,
                            metadata=metadata, **self.options)
        except (UsageError, ImportError):
            raise
        except BadClip as e:
            self._record(e.kind, e.source, row, e.detail)
            return None
        except Exception as e:  # noqa: BLE001 - one clip never ends the run: anything else FFmpeg raises is damage
            self._record("corrupt", _describe(source), row, f"{type(e).__name__}: {e}"[:200])
            return None
        if out.vfr:
            self._record("vfr", _describe(source), row, "frames chosen by their timestamps")
        if out.looped:
            self._record("looped", _describe(source), row, f"played again to fill {target_frames} frames")
        return out
