"""The frame rules of the video VAEs: which frame counts a clip bucket may have. Pure Python, no decoding.

A causal video VAE keeps the first frame and compresses each following group of ``step`` frames into one latent
frame, so a clip it encodes has ``step * k + 1`` frames and ``k + 1`` latent frames. diffusers 0.42 states the step
in each pipeline (``tests/test_video_meta.py`` reads it from them): ``WanPipeline``, ``HunyuanVideoPipeline``,
``HunyuanVideo15Pipeline`` and ``CogVideoXPipeline`` use 4 (``vae_scale_factor_temporal``), ``LTXPipeline`` and
``LTX2Pipeline`` 8 (``vae_temporal_compression_ratio``). The frame axis of a clip :class:`~hf_arb.BucketSet` follows
these rules (:mod:`hf_arb.buckets.presets`); :mod:`hf_arb.video.frames` picks the frames of a clip that train.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_arb.checks import UsageError


@dataclass(frozen=True)
class FrameRule:
    """Clips of ``step * k + 1`` frames (k >= 0), the shape a causal video VAE encodes.

    Attributes:
        name: the family's name (``"wan"``, ``"ltx"``, ...).
        step: the VAE's temporal compression: frames per latent frame after the first.
        pipelines: the diffusers pipelines that state it (their ``vae_scale_factor_temporal`` or
            ``vae_temporal_compression_ratio``).
    """

    name: str
    step: int
    pipelines: tuple[str, ...] = ()

    def is_valid(self, frames: int) -> bool:
        """Whether a clip of ``frames`` frames fits the rule."""
        return frames >= 1 and (frames - 1) % self.step == 0

    def latent_frames(self, frames: int) -> int:
        """The latent frames of ``frames`` pixel frames, as the pipelines compute them: ``(frames - 1) // step + 1``."""
        return (frames - 1) // self.step + 1

    def floor(self, frames: int) -> int:
        """The largest valid frame count <= ``frames`` (``frames >= 1``)."""
        return (frames - 1) // self.step * self.step + 1


#: the frame rule of each video family, named as the family presets will be
FRAME_RULES: dict[str, FrameRule] = {
    "wan": FrameRule("wan", 4, ("WanPipeline",)),
    "hunyuan_video": FrameRule("hunyuan_video", 4, ("HunyuanVideoPipeline", "HunyuanVideo15Pipeline")),
    "cogvideox": FrameRule("cogvideox", 4, ("CogVideoXPipeline",)),
    "ltx": FrameRule("ltx", 8, ("LTXPipeline", "LTX2Pipeline")),
}


def frame_rule(rule: str | FrameRule) -> FrameRule:
    """The :class:`FrameRule` of a family name (a ``FrameRule`` passes through).

    Raises:
        UsageError: an unknown name; the message lists the known ones.
    """
    if isinstance(rule, FrameRule):
        return rule
    if rule not in FRAME_RULES:
        raise UsageError(f"unknown frame rule {rule!r}: use one of {sorted(FRAME_RULES)} (or a FrameRule(name, step)).")
    return FRAME_RULES[rule]


def valid_frame_counts(rule: str | FrameRule, max_frames: int) -> np.ndarray:
    """Every frame count the rule allows up to ``max_frames``, ascending: int64 of shape ``(max_frames // step + 1,)``
    for ``max_frames >= 1`` (``1, step + 1, 2 * step + 1, ...``), empty below 1."""
    r = frame_rule(rule)
    if max_frames < 1:
        return np.zeros(0, np.int64)
    return np.arange(1, int(max_frames) + 1, r.step, dtype=np.int64)


__all__ = ["FRAME_RULES", "FrameRule", "frame_rule", "valid_frame_counts"]
