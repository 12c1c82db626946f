"""Resolution-dependent timestep shift of flow-matching models (SD3/SD3.5, Flux.1), per bucket.

At inference diffusers shifts the sigma schedule by ``mu``, a linear function of the image's latent token count
(``calculate_shift`` in the SD3 and Flux pipelines), whenever the scheduler's config has
``use_dynamic_shifting``. Training a bucketed batch with one global shift trains every bucket at the wrong
noise level; these pure functions give each bucket the ``mu`` the stock pipeline uses for that height × width,
and apply it to training sigmas exactly as ``FlowMatchEulerDiscreteScheduler.set_timesteps`` does.

Clip buckets (``(k, 3)`` tables of ``(width, height, frames)``) count the latent frames too, as the video pipelines
do (``LTXPipeline``: ``video_sequence_length = latent_num_frames * latent_height * latent_width``, with
``latent_num_frames = (num_frames - 1) // vae_temporal_compression_ratio + 1``): pass ``frame_step``, the VAE's
temporal compression (``hf_arb.buckets.frames.FRAME_RULES[family].step``).

Example:
    ```py
    >>> from hf_arb import BucketSet
    >>> from hf_arb.families.shift import ShiftConfig, bucket_shift_table, shift_sigmas
    >>> cfg = ShiftConfig(use_dynamic_shifting=True)          # Flux.1's scheduler values
    >>> table = bucket_shift_table(BucketSet.preset("flux_kontext"), cfg, vae_scale_factor=8, patch_size=2)
    >>> int(table["image_seq_len"][8]), round(float(table["mu"][8]), 4)   # 1024 x 1024
    (4096, 1.15)
    >>> sigmas = shift_sigmas(t, table["mu"][bucket_of_batch], cfg)      # t: the batch's sampled timesteps in (0, 1]
    ```
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ShiftConfig:
    """The scheduler values the shift depends on (names and defaults of ``FlowMatchEulerDiscreteScheduler``).

    Attributes:
        base_image_seq_len, max_image_seq_len: token counts where ``mu`` equals ``base_shift`` / ``max_shift``.
        base_shift, max_shift: ``mu`` at those token counts.
        shift: the static shift used when ``use_dynamic_shifting`` is off.
        use_dynamic_shifting: shift by ``mu`` (resolution-dependent) instead of ``shift``.
        time_shift_type: ``"exponential"`` (``e^mu / (e^mu + (1/t - 1))``) or ``"linear"`` (``mu / (mu + 1/t - 1)``).
    """

    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"

    def __post_init__(self) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"`time_shift_type` must be 'exponential' or 'linear', got {self.time_shift_type!r}.")
        if self.max_image_seq_len == self.base_image_seq_len:
            raise ValueError(f"`max_image_seq_len` and `base_image_seq_len` are both {self.base_image_seq_len}; "
                             "mu's slope would divide by zero.")

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any]) -> ShiftConfig:
        """Read the values from a scheduler's ``config`` (e.g. ``pipe.scheduler.config``); missing keys default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: config[k] for k in names if k in config and config[k] is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for run reports and checkpoints)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _table(resolutions: Any) -> np.ndarray:
    """A bucket table as int64 ``(k, D)``: ``(k, 2)`` (width, height) or ``(k, 3)`` (width, height, frames); a flat
    pair list is read as ``(k, 2)``."""
    res = np.asarray(getattr(resolutions, "resolutions", resolutions), dtype=np.int64)
    return res if res.ndim == 2 and res.shape[1] in (2, 3) else res.reshape(-1, 2)


def check_latent_sizes(resolutions: Any, vae_scale_factor: int = 8, patch_size: int = 2) -> None:
    """Raise unless every bucket side is divisible by ``vae_scale_factor × patch_size``.

    Args:
        resolutions: ``(k, 2)`` ``(width, height)`` (e.g. ``BucketSet.resolutions``), or ``(k, 3)`` with frames.

    Raises:
        ValueError: naming the first buckets that are not legal and the step the bucket set needs.
    """
    res = _table(resolutions)[:, :2]
    step = int(vae_scale_factor) * int(patch_size)
    bad = np.flatnonzero((res % step != 0).any(axis=1))
    if bad.size:
        shown = ", ".join(f"{w}x{h}" for w, h in res[bad[:5]].tolist())
        raise ValueError(
            f"{bad.size} bucket(s) ({shown}{', …' if bad.size > 5 else ''}) are not divisible by {step} "
            f"(VAE factor {vae_scale_factor} × patch size {patch_size}), so their latents cannot be patched. "
            f"Use bucket sides that are multiples of {step}: a bucket step that is a multiple of {step} "
            "(`--bucket_step`, `BucketSet.preset(..., step=...)`) or a preset whose table is."
        )


def image_seq_len(widths: Any, heights: Any, vae_scale_factor: int = 8, patch_size: int = 2, frames: Any = None,
                  frame_step: int = 1, patch_size_t: int = 1) -> np.ndarray:
    """Latent tokens after patching, ``(h / vae / patch) * (w / vae / patch)``, vectorised; int64 of shape ``(n,)``.

    With ``frames`` (clips), times the latent frames after temporal patching:
    ``ceil(((frames - 1) // frame_step + 1) / patch_size_t)`` (1 for an image).

    Raises:
        ValueError: a size not divisible by ``vae_scale_factor * patch_size`` (see :func:`check_latent_sizes`).
    """
    w = np.atleast_1d(np.asarray(widths, dtype=np.int64))
    h = np.atleast_1d(np.asarray(heights, dtype=np.int64))
    check_latent_sizes(np.stack([w, h], 1), vae_scale_factor, patch_size)
    step = vae_scale_factor * patch_size
    tokens = (h // step) * (w // step)
    if frames is None:
        return tokens
    f = np.atleast_1d(np.asarray(frames, dtype=np.int64))
    latent = (f - 1) // int(frame_step) + 1  # (n,) as every video pipeline counts them
    return tokens * -(-latent // int(patch_size_t))


def calculate_mu(seq_len: Any, config: ShiftConfig) -> np.ndarray:
    """``mu`` for token counts, the same float64 arithmetic as diffusers' ``calculate_shift``; shape of ``seq_len``."""
    m = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    b = config.base_shift - m * config.base_image_seq_len
    return np.asarray(seq_len, dtype=np.float64) * m + b


def shift_sigmas(t: Any, mu: Any, config: ShiftConfig) -> Any:
    """Shift sigmas (or timesteps ``t`` in ``(0, 1]``) as ``FlowMatchEulerDiscreteScheduler.set_timesteps`` does.

    With ``use_dynamic_shifting``: ``time_shift(mu, 1.0, t)`` (exponential or linear); otherwise the static
    ``shift * t / (1 + (shift - 1) * t)`` and ``mu`` is ignored. ``t`` and ``mu`` broadcast (a per-sample ``mu``
    for a batch); numpy arrays and torch tensors both work and keep their type, dtype and device. The scheduler's
    ``shift_terminal`` stretch and Karras/exponential/beta conversions act on a whole inference schedule and have
    no per-sample training counterpart; they are not applied.
    """
    if not config.use_dynamic_shifting:
        s = config.shift
        t = t if _is_torch(t) else np.asarray(t)
        return s * t / (1 + (s - 1) * t)
    if _is_torch(t):
        import torch

        mu_t = torch.as_tensor(np.asarray(mu, dtype=np.float64) if not _is_torch(mu) else mu, device=t.device)
        mu_t = mu_t.to(torch.float64)
        if config.time_shift_type == "exponential":
            e = torch.exp(mu_t)
            return (e / (e + (1 / t.to(torch.float64) - 1))).to(t.dtype)
        return (mu_t / (mu_t + (1 / t.to(torch.float64) - 1))).to(t.dtype)
    mu_a = np.asarray(mu, dtype=np.float64)
    if config.time_shift_type == "exponential":
        e = np.exp(mu_a) if mu_a.ndim else math.exp(float(mu_a))
        return e / (e + (1 / np.asarray(t) - 1))
    return mu_a / (mu_a + (1 / np.asarray(t) - 1))


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def bucket_shift_table(buckets: Any, config: ShiftConfig, vae_scale_factor: int = 8,
                       patch_size: int = 2, frame_step: int | None = None,
                       patch_size_t: int = 1) -> dict[str, np.ndarray]:
    """Each bucket's ``image_seq_len`` and ``mu``, aligned with the bucket ids.

    Args:
        buckets: a :class:`~hf_arb.BucketSet` (or ``(k, 2)`` ``(width, height)``; ``(k, 3)`` with frames).
        config: the scheduler's values (:meth:`ShiftConfig.from_scheduler_config`).
        frame_step: clip buckets: the VAE's temporal compression (``FRAME_RULES[family].step``); the token count
            includes the latent frames (:func:`image_seq_len`). Needed for a ``(k, 3)`` table.
        patch_size_t: clip buckets: the transformer's temporal patch size.

    Returns:
        ``{"image_seq_len": int64 (k,), "mu": float64 (k,)}``; ``mu`` is what the stock pipeline passes to
        ``set_timesteps`` at that size (computed even when the config shifts statically, for the report).

    Raises:
        ValueError: a bucket not divisible by ``vae_scale_factor * patch_size`` (naming the step needed), or clip
            buckets without ``frame_step``.
    """
    res = _table(buckets)
    frames = None
    if res.shape[1] == 3:
        if frame_step is None:
            raise ValueError("Clip buckets (width, height, frames) count latent frames in the sequence length: pass "
                             "frame_step, the VAE's temporal compression (hf_arb.buckets.frames.FRAME_RULES[family]"
                             ".step: 4 for Wan and HunyuanVideo, 8 for LTX).")
        frames = res[:, 2]
    seq = image_seq_len(res[:, 0], res[:, 1], vae_scale_factor, patch_size, frames, frame_step or 1, patch_size_t)
    return {"image_seq_len": seq, "mu": calculate_mu(seq, config)}


def shift_table_text(buckets: Any, config: ShiftConfig, vae_scale_factor: int = 8, patch_size: int = 2,
                     frame_step: int | None = None, patch_size_t: int = 1) -> str:
    """The per-bucket shift as text: id, width, height (frames for clips), image_seq_len, mu, and the shifted sigma at
    t = 0.5."""
    res = _table(buckets)
    clip = res.shape[1] == 3
    table = bucket_shift_table(res, config, vae_scale_factor, patch_size, frame_step, patch_size_t)
    mid = shift_sigmas(np.full(len(res), 0.5), table["mu"], config)
    lines = [f"{'id':>3}  {'width':>5}  {'height':>6}" + (f"  {'frames':>6}" if clip else "")
             + f"  {'seq_len':>7}  {'mu':>7}  {'sigma(0.5)':>10}"]
    for i, (r, n, mu, s) in enumerate(zip(res.tolist(), table["image_seq_len"].tolist(), table["mu"].tolist(),
                                          np.asarray(mid).tolist())):
        lines.append(f"{i:>3}  {r[0]:>5}  {r[1]:>6}" + (f"  {r[2]:>6}" if clip else "")
                     + f"  {n:>7}  {mu:7.4f}  {s:10.4f}")
    return "\n".join(lines)
