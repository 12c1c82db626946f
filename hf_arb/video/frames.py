"""The frame rules of the video VAEs, and which frames of a clip train: pure functions, no decoding.

A causal video VAE keeps the first frame and compresses each following group of ``step`` frames into one latent
frame, so a clip it encodes has ``step * k + 1`` frames and ``k + 1`` latent frames. diffusers 0.42 states the step
in each pipeline (``tests/test_video_meta.py`` reads it from them):

- ``WanPipeline.vae_scale_factor_temporal`` (4; ``AutoencoderKLWan.scale_factor_temporal``); its ``__call__``
  rounds ``num_frames`` with ``num_frames // 4 * 4 + 1`` when ``num_frames % 4 != 1`` (default 81);
- ``HunyuanVideoPipeline`` / ``HunyuanVideo15Pipeline.vae_scale_factor_temporal`` (4; defaults 129 and 121);
- ``CogVideoXPipeline.vae_scale_factor_temporal`` (4; its default is its transformer's ``sample_frames``, 49);
- ``LTXPipeline`` / ``LTX2Pipeline.vae_temporal_compression_ratio`` (8; ``LTXPipeline``'s default is 161).

Every pipeline computes the latent frames as ``(num_frames - 1) // step + 1`` (:meth:`FrameRule.latent_frames`).

:func:`frame_plan` picks the frames of a clip for a bucket of ``target_frames``: a window of ``count`` frames,
``stride`` source frames apart, starting at source frame ``start`` (:class:`~hf_arb.video.temporal.FramePlan`, the one
rule of :func:`~hf_arb.video.temporal.plan_frames`: ``stride = fps / target_fps``, each position rounded to the
nearest source frame, so a 24 fps clip for 16 fps takes frames 0, 1, 3, 4, 6, ...). ``count`` is the bucket's frame
count, or, for a clip too short for it, the longest count the rule allows. The start is ``0`` (``mode="head"``) or
drawn uniformly from every start that keeps the window inside the clip (``mode="random"``), from the row's own stream
``hf_arb.rng.row_rng(seed, epoch, row, ROW_FRAMES)``: a pure function of (seed, epoch, row), so every rank, worker and
resumed run picks the same frames, and each epoch sees another window of a long clip.
"""

from __future__ import annotations

from hf_arb.buckets.frames import FRAME_RULES, FrameRule, frame_rule, valid_frame_counts  # noqa: F401 (re-exported)
from hf_arb.checks import UsageError

from .temporal import FramePlan, held_frames, plan_frames

# FrameRule, FRAME_RULES, frame_rule and valid_frame_counts live on the buckets' floor (hf_arb.buckets.frames: a bucket
# set's frame axis follows them) and are imported from here as before.
__all__ = ["MODES", "FramePlan", "frame_plan"]

#: frame-window modes of :func:`frame_plan` (``uniform`` and ``slide``, several windows per clip, are the next slice's)
MODES = ("head", "random")


def frame_plan(original_frames: int, fps: float, target_frames: int, rule: str | FrameRule, *, seed: int = 0,
               epoch: int = 0, row: int = 0, target_fps: float | None = None, mode: str = "random") -> FramePlan:
    """The window of a clip that trains in a bucket of ``target_frames`` frames: a pure function of its arguments.

    Args:
        original_frames: the clip's frames (``original_frames`` of :func:`~hf_arb.video.arrow_batch.clip_columns`;
            1 for an image).
        fps: the clip's frame rate (0 for an image: the stride is then 1).
        target_frames: the bucket's frame count; valid for ``rule``.
        rule: a family name of :data:`FRAME_RULES` or a :class:`FrameRule`.
        seed, epoch, row: the run's seed, the epoch and the dataset row (``mode="random"`` draws from their stream).
        target_fps: the model's frame rate; the stride is ``fps / target_fps`` source frames. None: stride 1.
        mode: ``"head"`` (the window starts at frame 0) or ``"random"`` (a uniform start among those that keep the
            window inside the clip).

    Returns:
        ``FramePlan(start, stride, count)``: ``count`` is ``target_frames`` when the clip holds that many frames at
        the target rate, else the largest valid count it holds; every frame of ``indices()`` is below
        ``original_frames``.

    Raises:
        UsageError: a clip with no frame, a ``target_frames`` the rule does not allow (the message names the nearest
            valid counts), a non-positive ``target_fps`` or an unknown mode.
    """
    r = frame_rule(rule)
    if mode not in MODES:
        raise UsageError(f"unknown frame mode {mode!r}: use one of {list(MODES)}.")
    if original_frames < 1:
        raise UsageError(f"a clip of {original_frames} frames has nothing to train on: skip it before planning.")
    if not r.is_valid(target_frames):
        below = r.floor(target_frames) if target_frames >= 1 else 1
        raise UsageError(f"{target_frames} frames do not fit the {r.name} rule ({r.step}k+1 frames): use {below} or "
                         f"{below + r.step}.")
    if target_fps is not None and not target_fps > 0:
        raise UsageError(f"target_fps must be > 0 frames per second (e.g. 16 for Wan), got {target_fps!r}.")
    if fps <= 0 and original_frames > 1:  # frames but no rate: consecutive frames (stride 1), as the clip stores them
        fps, target_fps = 1.0, None
    count = min(int(target_frames), r.floor(int(held_frames(original_frames, fps, target_fps))))
    return plan_frames(int(original_frames), float(fps), count, target_fps=target_fps, mode=mode, seed=seed,
                       epoch=epoch, row=row)
