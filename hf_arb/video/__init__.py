"""Floor 2, ``video/`` (beside ``images/``, on the same floor): one clip at a time — its header metadata, its frame
rules, which of its frames train, and those frames decoded and fitted. Nothing above imports it yet (bucket sets with
a frame axis and the sampler's (W, H, F) keys are other slices of issue 37).

- :mod:`~hf_arb.video.metadata` — :func:`clip_metadata`: displayed size (rotation honoured), frames, fps, duration and
  codec from the container's header (PyAV's demuxer); an image is a 1-frame clip;
- :mod:`~hf_arb.video.arrow_batch` — :func:`clip_columns`: the clip columns of one Arrow batch, bad clips counted;
- :mod:`~hf_arb.video.frames` — the VAEs' ``step * k + 1`` frame rules and :func:`frame_plan`, a clip's window;
- :mod:`~hf_arb.video.temporal` — :func:`plan_frames`, the one frame-planning rule annotation, training and decoding
  follow (a :class:`FramePlan` of source frames); :func:`sample_times`: the ``head``, ``random``, ``uniform`` and
  ``slide`` modes at the model's frame rate, :func:`nearest_frames` (resampling by timestamps), :func:`slide_rows`
  (clips into windows, vectorised);
- :mod:`~hf_arb.video.bad_clips` — :class:`BadClip` kinds, :class:`ClipLimits`, :func:`clip_problems` (vectorised)
  and :class:`BadClipLog`: bad clips counted and named, never ending a run;
- :mod:`~hf_arb.video.decode` — :func:`decode_frames` / :func:`read_clip`: seek, decode only the planned frames, fit
  each with the image fit and one crop per clip; :class:`ClipFrameReader` counts bad clips instead of raising.
- :mod:`~hf_arb.video.dataset` — :class:`BucketedClipDataset`: annotated rows fitted to (W, H, F) buckets for training
  (a still through the image path, a clip through :func:`read_clip`; a bad clip replaced and counted as a bad image).

May import: the ground floor, :mod:`hf_arb.buckets` and :mod:`hf_arb.images` (an image is read by its header, a
frame is fitted as an image is). PyAV (``pip install hf-arb[video]``) is imported only when a clip is opened.
"""

from .arrow_batch import CLIP_COLUMNS, clip_columns, skip_counts
from .bad_clips import BAD_CLIP_KINDS, CLIP_NOTES, BadClip, BadClipLog, ClipLimits, clip_problems
from .decode import ClipFrameReader, ClipFrames, decode_frames, read_clip
from .frames import FRAME_RULES, FramePlan, FrameRule, frame_plan, frame_rule, valid_frame_counts
from .metadata import ClipMetadata, ClipMetadataError, clip_metadata
from .temporal import (
    TEMPORAL_MODES,
    SlideRows,
    frame_indices,
    frame_steps,
    held_frames,
    nearest_frames,
    nearest_index,
    plan_frames,
    sample_times,
    slide_counts,
    slide_rows,
    slide_strides,
)

__all__ = [
    "BAD_CLIP_KINDS",
    "CLIP_COLUMNS",
    "CLIP_NOTES",
    "FRAME_RULES",
    "TEMPORAL_MODES",
    "BadClip",
    "BadClipLog",
    "ClipFrameReader",
    "ClipFrames",
    "ClipLimits",
    "ClipMetadata",
    "ClipMetadataError",
    "FramePlan",
    "FrameRule",
    "SlideRows",
    "clip_columns",
    "clip_metadata",
    "clip_problems",
    "decode_frames",
    "frame_indices",
    "frame_plan",
    "frame_rule",
    "frame_steps",
    "held_frames",
    "nearest_frames",
    "nearest_index",
    "plan_frames",
    "read_clip",
    "sample_times",
    "skip_counts",
    "slide_counts",
    "slide_rows",
    "slide_strides",
    "valid_frame_counts",
]
