"""Floor 2, ``video/`` (beside ``images/``, on the same floor): one clip at a time — its header metadata, its frame
rules, which of its frames train. The first slice of issue 37: nothing here decodes a frame, and nothing above
imports it yet (bucket sets with a frame axis and the sampler's (W, H, F) keys are the next slices).

- :mod:`~hf_arb.video.metadata` — :func:`clip_metadata`: displayed size (rotation honoured), frames, fps, duration and
  codec from the container's header (PyAV's demuxer); an image is a 1-frame clip;
- :mod:`~hf_arb.video.arrow_batch` — :func:`clip_columns`: the clip columns of one Arrow batch, bad clips counted;
- :mod:`~hf_arb.video.frames` — the VAEs' ``step * k + 1`` frame rules and :func:`frame_plan`, a clip's window.

May import: the ground floor, :mod:`hf_arb.buckets` and :mod:`hf_arb.images` (an image is read by its header).
PyAV (``pip install hf-arb[video]``) is imported only when a clip is opened.
"""

from .arrow_batch import CLIP_COLUMNS, clip_columns, skip_counts
from .frames import FRAME_RULES, FramePlan, FrameRule, frame_plan, frame_rule, valid_frame_counts
from .metadata import ClipMetadata, ClipMetadataError, clip_metadata

__all__ = [
    "CLIP_COLUMNS",
    "FRAME_RULES",
    "ClipMetadata",
    "ClipMetadataError",
    "FramePlan",
    "FrameRule",
    "clip_columns",
    "clip_metadata",
    "frame_plan",
    "frame_rule",
    "skip_counts",
    "valid_frame_counts",
]
