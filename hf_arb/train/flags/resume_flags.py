"""The flags that shape what a checkpoint holds, recorded in its ``hf_arb_state.json`` and checked on resume.

A LoRA checkpoint holds adapter weights of one rank, alpha, set of targets and kind (DoRA), on the denoiser and maybe
the text encoders; a full fine-tune holds the denoiser (and its EMA copy); the sampler's state holds the plan of one
tier list, schedule, packing and reference columns; the optimizer's state is AdamW's or Prodigy's. Resuming with
another value of any of these fails deep in a library (a ``size mismatch`` per weight, "unet/config.json: missing"
for every healthy checkpoint, a sampler ``ValueError`` after the models load). :data:`SHAPING_FLAGS` is the one
list: :func:`shaping_flags` is what a checkpoint records, and :func:`check_saved_flags` compares it with this run's
flags before anything loads, one line per difference naming both values and the flag to pass. Checkpoints saved
before the record carry none and still resume (only their training mode is told from their files).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError

#: key of the record in ``hf_arb_state.json``
RECORD = "flags"


def _lora(read: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """A LoRA setting: recorded as None in a full fine-tune (where its flag is refused)."""
    return lambda a: read(a) if getattr(a, "lora", False) else None


def _clips(read: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """A clip run's setting (``--video_column``): recorded as None in an image run (where its flag is refused)."""
    return lambda a: read(a) if getattr(a, "video_column", None) else None


def _tiers(read: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
    """A tier setting: recorded as None with one tier (where its flag is refused)."""
    return lambda a: read(a) if len(getattr(a, "resolutions", None) or []) > 1 else None


#: the LoRA settings (rank None: a full fine-tune)
LORA_FLAGS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "rank": lambda a: a.rank,
    "lora_alpha": lambda a: float(a.rank if a.lora_alpha is None else a.lora_alpha),
    "lora_layers": lambda a: a.lora_layers,
    "lora_blocks": lambda a: a.lora_blocks,
    "use_dora": lambda a: bool(a.use_dora),
    "train_text_encoder": lambda a: bool(a.train_text_encoder),
}
#: flag -> its value as this run uses it (defaults filled), for every flag that shapes the saved state
SHAPING_FLAGS: dict[str, Callable[[argparse.Namespace], Any]] = {
    **{flag: _lora(read) for flag, read in LORA_FLAGS.items()},
    "use_ema": lambda a: bool(getattr(a, "use_ema", False)),
    "resolution_conditioning": lambda a: bool(getattr(a, "resolution_conditioning", False)),
    "resolution": lambda a: ",".join(map(str, getattr(a, "resolutions", None) or [a.resolution])),
    "resolution_schedule": _tiers(lambda a: a.resolution_schedule),
    "max_upscale": _tiers(lambda a: float(1.0 if a.max_upscale is None else a.max_upscale)),
    "packing": lambda a: bool(getattr(a, "packing", False)),
    "max_tokens": lambda a: a.max_tokens if getattr(a, "packing", False) else None,
    "reference_image_column": lambda a: list(getattr(a, "reference_image_column", None) or []) or None,
    "reference_policy": lambda a: a.reference_policy if getattr(a, "reference_image_column", None) else None,
    # prior preservation: every batch carries class images too (a resume without it would train other batches)
    "with_prior_preservation": lambda a: bool(getattr(a, "with_prior_preservation", False)),
    # a stream's per-rank state positions its source: an encoded dataset's latents shards, or the image shards
    "encoded_dataset": lambda a: bool(getattr(a, "encoded_dataset", None)) if getattr(a, "streaming", False) else None,
    # a clip run's batch size per bucket: the sampler's plan (its state holds each bucket's global batch)
    "video_token_budget": lambda a: getattr(a, "video_token_budget", None),
    "image_train_batch_size": lambda a: getattr(a, "image_train_batch_size", None),
    # a clip run's rows and their frame plans: slide windows are rows, and the frame buckets, the model's rate and the
    # short-clip policy decide each clip's bucket (a resume with others would train other rows, or other frames)
    "frame_sampling": _clips(lambda a: a.frame_sampling),
    "slide_stride": _clips(lambda a: getattr(a, "slide_stride", None)),
    "frames": _clips(lambda a: ",".join(map(str, a.frames)) if a.frames else None),
    "target_fps": _clips(lambda a: None if a.target_fps is None else float(a.target_fps)),
    "short_clips": _clips(lambda a: a.short_clips),
    # the optimizer's state: AdamW's moments or Prodigy's step-size estimate (its load would fail deep in torch)
    "optimizer": lambda a: "prodigy" if str(getattr(a, "optimizer", "AdamW")).lower() == "prodigy" else "AdamW",
}


def shaping_flags(args: argparse.Namespace) -> dict[str, Any]:
    """This run's :data:`SHAPING_FLAGS`, JSON-serialisable: what ``hf_arb_state.json`` records under :data:`RECORD`."""
    return {flag: read(args) for flag, read in SHAPING_FLAGS.items()}


def as_flag(flag: str, value: Any) -> str:
    """A recorded value as the command line gives it: ``--rank 4``, ``--use_dora``, ``no --use_dora``."""
    if value is None or value is False:
        return f"no --{flag}"
    if value is True:
        return f"--{flag}"
    if isinstance(value, list):
        return " ".join(f"--{flag} {v}" for v in value)
    return f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}"


def _fix(flag: str, value: Any) -> str:
    return f"drop --{flag}" if value is None or value is False else f"pass {as_flag(flag, value)}"


def legacy_rank(ckpt: Path) -> int | None:
    """The LoRA rank of a checkpoint saved before the record (None: a full fine-tune's), read from the adapter file's
    header (no tensor loaded); 0 where it cannot be read (a damaged file: the checkpoint's own check names it)."""
    from hf_arb.train.lora import LORA_WEIGHTS_NAME

    path = ckpt / LORA_WEIGHTS_NAME
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            down = next(k for k in f.keys() if "lora_A" in k or "lora.down" in k or "lora_down" in k)
            return int(f.get_slice(down).get_shape()[0])
    except Exception:  # noqa: BLE001 - any failure to read it is the answer
        return 0


def saved_flags(ckpt: Path, state_file: str) -> dict[str, Any] | None:
    """The record of a checkpoint; for one saved before it, the training mode alone (``rank``); None if unreadable."""
    try:
        state = json.loads((ckpt / state_file).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    if isinstance(state.get(RECORD), dict):
        return state[RECORD]
    rank = legacy_rank(ckpt)
    return None if rank == 0 else {"rank": rank}


def newest_with_state(output_dir: Path, state_file: str) -> Path | None:
    """The newest ``checkpoint-*`` of ``output_dir`` whose state file reads (``--resume_from_checkpoint latest``)."""
    from hf_arb.train.checkpointing import list_checkpoints

    for ckpt in reversed(list_checkpoints(output_dir)):
        if saved_flags(ckpt, state_file) is not None:
            return ckpt
    return None


def flag_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One sentence per flag whose recorded value differs from this run's (only the flags ``saved`` records)."""
    was_rank, rank = saved.get("rank", now["rank"]), now["rank"]
    lines = []
    mode_differs = (was_rank is None) != (rank is None)  # then the mode is said once, not each LoRA setting
    if mode_differs:
        if was_rank is None:
            lines.append(f"it is a full fine-tune, and this run trains LoRA (--rank {rank}): drop --rank and --lora")
        else:
            lines.append(f"it trained LoRA adapters (--rank {was_rank}), and this run is a full fine-tune: pass "
                         f"--rank {was_rank}")
    for flag in SHAPING_FLAGS:
        if flag not in saved or saved[flag] == now[flag] or (mode_differs and flag in LORA_FLAGS):
            continue
        if flag == "lora_alpha" and saved[flag] == saved.get("rank") and now[flag] == now["rank"]:
            continue  # both alphas are their rank's default: the rank's line says it
        lines.append(f"it was saved with {as_flag(flag, saved[flag])}, this run has {as_flag(flag, now[flag])}: "
                     f"{_fix(flag, saved[flag])}")
    return lines


def check_saved_flags(args: argparse.Namespace, ckpt: Path | None, state_file: str) -> None:
    """Before the checkpoint's files are checked and anything loads: the flags it records must be this run's.

    Raises:
        UsageError: one line per difference, ``Checkpoint X: it was saved with --rank 4, this run has --rank 8:
            pass --rank 4`` (a different training mode: one line naming the flag that selects it).
    """
    saved = None if ckpt is None else saved_flags(ckpt, state_file)
    if not saved:
        return
    lines = flag_differences(saved, shaping_flags(args))
    if lines:
        raise UsageError("\n".join(f"Checkpoint {ckpt}: {line} to resume it (or start a new run in another "
                                   "--output_dir)." for line in lines))
