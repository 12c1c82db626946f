"""What every video family shares (Wan, LTX-Video, HunyuanVideo 1.5): (W, H, F) bucket checks against the
family's spatial multiple and frame rule, and the model card's generation of a trained bucket's frames as an MP4.

A video family subclasses :class:`VideoFamily` and says its ``frame_rule_name``, ``video_fps``,
:meth:`~hf_arb.families.Family.spatial_multiple`, ``vae_scale_factor``, ``token_patch`` and ``frame_rule``; the
bucket table's third column is the frame count (stills are 1-frame clips).
"""

from __future__ import annotations

import argparse
from typing import Any

from hf_arb.checks import UsageError

from .base import Models
from .flow_family import FlowFamily

__all__ = ["VideoFamily"]


class VideoFamily(FlowFamily):
    """A flow-matching video family: clips ``(B, C, F, H, W)`` in (W, H, F) buckets (see the module docstring)."""

    #: frames per second of the card's and the validation's MP4s (the family's own rate)
    video_fps = 16

    def check_buckets(self, models: Models, buckets: Any) -> None:
        """Every side a multiple of :meth:`spatial_multiple`, every frame count (a third column) fits
        :meth:`frame_rule`; else a UsageError naming the buckets and the fix."""
        import numpy as np

        res = np.asarray(buckets.resolutions, dtype=np.int64)
        step = self.spatial_multiple(models)
        bad = np.flatnonzero((res[:, :2] % step != 0).any(axis=1))
        if bad.size:
            shown = ", ".join("x".join(map(str, r)) for r in res[bad[:5], :2].tolist())
            raise UsageError(f"{bad.size} bucket(s) ({shown}) are not divisible by {step} (VAE factor "
                             f"{self.vae_scale_factor(models.vae)} x patch {self.token_patch(models.unet)}). For this "
                             f"{self.title} model: --bucket_step {step} (or a multiple of it).")
        if res.shape[1] > 2:
            rule = self.frame_rule(models)
            wrong = sorted({int(f) for f in res[:, 2] if not rule.is_valid(int(f))})
            if wrong:
                raise UsageError(f"bucket frame counts {wrong} do not fit {self.title}'s {rule.step}k+1 frames: use "
                                 f"{', '.join(str(rule.floor(f)) for f in wrong[:3])} (the counts below).")

    def generation_args(self, args: argparse.Namespace, shape: tuple[int, ...]) -> list[str]:
        """The prompt, ``height``, ``width`` and ``num_frames``: the bucket's frames (``shape[2]``), 1 for a bucket
        of stills."""
        frames = int(shape[2]) if len(shape) > 2 else 1
        return [*super().generation_args(args, shape), f"num_frames={frames}"]

    def generation_lines(self, call: str) -> list[str]:
        """Generate the frames and write them as an MP4 with diffusers' ``export_to_video`` at :attr:`video_fps`."""
        return [f"frames = pipe({call}).frames[0]  # a trained bucket shape",
                f'export_to_video(frames, "video.mp4", fps={self.video_fps})  # imageio + imageio-ffmpeg write the MP4']

    def card_code(self, args: argparse.Namespace, repo_id: str, shape: tuple[int, ...]) -> list[str]:
        """:meth:`Family.card_code` with ``export_to_video``'s import after the pipeline's."""
        code = super().card_code(args, repo_id, shape)
        return [*code[:2], "from diffusers.utils import export_to_video", *code[2:]]
