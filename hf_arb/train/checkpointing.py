"""Training checkpoints that survive kills and disk faults: atomic save, verified load, ``latest`` fallback.

The training script saves accelerate's state into a hidden temporary folder (``.tmp-checkpoint-<step>``) and
renames it to ``checkpoint-<step>`` only when every rank has written its part, then prunes older ones: a kill at any
moment leaves the previous checkpoints intact. Before resuming, :func:`checkpoint_problems` reads every file of a
checkpoint cheaply but completely enough to catch truncation (Zip CRCs of torch files, the safetensors header
against the file size, JSON parse), so a damaged checkpoint gives one line naming the file instead of a library
traceback mid-load, and :func:`find_resumable` lets ``--resume_from_checkpoint latest`` fall back to the newest
complete one.
"""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

logger = logging.getLogger("hf_arb")

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
#: Files every checkpoint of the training script has (accelerate's names; the sampler is custom checkpoint 0).
REQUIRED = ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders of ``output_dir``, oldest (smallest step) first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [d for d in out.glob(PREFIX + "*") if d.is_dir() and d.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda d: int(d.name[len(PREFIX):]))


def _file_problem(path: Path) -> str | None:
    """Why one checkpoint file cannot be loaded, or None. Reads it whole for Zip (torch) files: CRC-checked."""
    try:
        if path.stat().st_size == 0:
            return "empty (0 bytes)"
        suffix = path.suffix
        if suffix == ".json":
            json.loads(path.read_text())
        elif suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "np") as f:  # checks the header against the file size
                list(f.keys())
        elif suffix in (".bin", ".pkl", ".pt", ".pth"):
            if not zipfile.is_zipfile(path):
                return "truncated or not a torch file (no Zip directory)"
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad is not None:
                return f"corrupt (CRC mismatch in {bad})"
    except Exception as e:  # noqa: BLE001 - any failure to read is the answer
        return f"unreadable ({type(e).__name__}: {str(e)[:120]})"
    return None


def checkpoint_problems(path: str | Path, state_file: str, model_dirs: tuple[str, ...] = ("unet",),
                        model_files: tuple[str, ...] = (), required: tuple[str, ...] = REQUIRED) -> list[str]:
    """One line per missing or damaged file of a checkpoint folder; ``[]`` when it can be resumed from.

    Args:
        path: the ``checkpoint-<step>`` folder.
        state_file: the script's own counters file (must hold ``global_step`` and ``seed``).
        model_dirs: sub-folders holding a diffusers model (``config.json`` + weights, possibly sharded).
        model_files: files holding the trained weights directly (a LoRA checkpoint's
            ``pytorch_lora_weights.safetensors``).
        required: accelerate's files the checkpoint must have (default :data:`REQUIRED`; a ``--streaming`` run
            has no sampler, ``custom_checkpoint_0.pkl``, but per-rank ``stream_rank*.json`` files).
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a folder"]
    problems = []
    for name in (state_file, *required, *model_files):
        if not (path / name).is_file():
            problems.append(f"{path / name}: missing")
    for d in model_dirs:
        sub = path / d
        if not (sub / "config.json").is_file():
            problems.append(f"{sub / 'config.json'}: missing")
        weights = list(sub.glob("*.safetensors")) + list(sub.glob("*.bin"))
        if not weights:
            problems.append(f"{sub}: no weights file")
        for index in sub.glob("*.index.json"):
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except Exception:  # noqa: BLE001
                continue  # reported as unreadable below
            problems += [
                f"{sub / s}: missing (listed in {index.name})" for s in sorted(shards) if not (sub / s).is_file()
            ]
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        why = _file_problem(f)
        if why:
            problems.append(f"{f}: {why}")
    if not problems:
        try:
            state = json.loads((path / state_file).read_text())
            int(state["global_step"]), int(state["seed"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path / state_file}: no integer global_step / seed")
    return problems


def find_resumable(output_dir: str | Path, state_file: str, model_dirs: tuple[str, ...] = ("unet",),
                   model_files: tuple[str, ...] = (), required: tuple[str, ...] = REQUIRED
                   ) -> tuple[Path | None, list[str]]:
    """The newest checkpoint without problems, and the problems of the newer ones skipped on the way.

    Returns:
        ``(path or None, skipped)`` where ``skipped`` has one line per skipped checkpoint naming its first problem.
    """
    skipped = []
    for ckpt in reversed(list_checkpoints(output_dir)):
        problems = checkpoint_problems(ckpt, state_file, model_dirs, model_files, required)
        if not problems:
            return ckpt, skipped
        skipped.append(f"{ckpt.name} ({problems[0]}{f'; +{len(problems) - 1} more' if len(problems) > 1 else ''})")
    return None, skipped


def tmp_checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before :func:`publish_checkpoint` renames it."""
    return Path(output_dir) / f"{TMP_PREFIX}{int(step)}"


def publish_checkpoint(tmp: Path, keep: int | None) -> Path:
    """Rename a fully written temporary checkpoint into place, then prune older ones down to ``keep`` (main process).

    Stale temporary folders of killed runs are removed too. Returns the published ``checkpoint-<step>`` path.
    """
    step = int(tmp.name[len(TMP_PREFIX):])
    final = tmp.parent / f"{PREFIX}{step}"
    if final.exists():  # the same step saved again (e.g. a resumed run): replace it, never leave neither
        old = tmp.parent / f"{TMP_PREFIX}{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    for stale in tmp.parent.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep is not None:
        older = [d for d in list_checkpoints(tmp.parent) if d != final]
        for d in older[: max(0, len(older) - (keep - 1))]:
            logger.info("Removing old checkpoint %s (--checkpoints_total_limit %d).", d, keep)
            shutil.rmtree(d)
    return final


def expected_global_step(sampler_state: dict, gradient_accumulation_steps: int) -> int:
    """Optimizer updates done at a sampler position: ``epoch * ceil(S / A) + ceil(consumed / A)``.

    ``S`` is the sampler's batches per epoch and rank, ``A`` the accumulation steps; the last update of an epoch may
    hold fewer than ``A`` batches (accelerate syncs at the end of the loader), hence the ceilings.
    """
    a = int(gradient_accumulation_steps)
    spe, epoch, consumed = (int(sampler_state[k]) for k in ("steps_per_epoch", "epoch", "batches_consumed"))
    return epoch * -(-spe // a) + -(-consumed // a)
