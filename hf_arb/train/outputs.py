"""What a run leaves: validation grids, the saved pipeline or LoRA, the model card, the push and the bad-image
count (the start-up report is the data source's: :mod:`hf_arb.train.sources.reports`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.families import Family, Models
from hf_arb.lazy import LazyModule

from .files import BUCKETS_FILE, SKIPPED_ROWS_FILE
from .flags.upstream_flags import pipeline_call_kwargs, use_validation_scheduler
from .models import complete_models, place, unwrap
from .progress import Progress
from .quantization import card_lines as quant_card_lines
from .sources.dataset import bucket_origin
from .sources.multi import mix_card_lines
from .videos import DEFAULT_FPS, log_videos, save_videos

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def validation_shapes(buckets: Any, rows: Any = None) -> list[tuple[int, ...]]:
    """Portrait, square and landscape bucket ``(w, h)``: the buckets closest to 2:3, 1:1 and 3:2 in log aspect (clip
    buckets: ``(w, h, frames)``, the most frames at that aspect).
    ``rows``: rows per bucket id (:meth:`~hf_arb.train.sources.base.Source.bucket_rows`; ids past its end have none):
    only buckets with rows are chosen (of a clip table, those of more than 1 frame where any has rows: a video run
    validates clips), every bucket where none has rows or ``rows`` is None.
    Several tiers (a :class:`~hf_arb.train.sources.tiers.TierTable`): one bucket of every tier, its portrait one
    (``rows`` not used)."""
    if getattr(buckets, "bucket_sets", None) is not None:
        return list(dict.fromkeys(validation_shapes(b)[0] for b in buckets.bucket_sets))
    res = np.asarray(buckets.resolutions)
    if rows is not None:
        counts = np.asarray(rows, dtype=np.int64)[: len(res)]
        trained = np.flatnonzero(counts > 0)
        res = res[trained] if len(trained) else res
        if res.shape[1] == 3 and (res[:, 2] > 1).any():
            res = res[res[:, 2] > 1]
    log_aspect = np.log(res[:, 0] / res[:, 1])
    out: list[tuple[int, ...]] = []
    longest = (-res[:, 2],) if res.shape[1] == 3 else ()  # clip buckets: (w, h, frames), the most frames
    for target in (np.log(2 / 3), 0.0, np.log(3 / 2)):
        i = int(np.lexsort((-res[:, 0] * res[:, 1], *longest, np.round(np.abs(log_aspect - target), 9)))[0])
        wh = tuple(int(v) for v in res[i])
        if wh not in out:
            out.append(wh)
    return out


def image_grid(rows: list[list[Any]]) -> Any:
    """Paste PIL images of different sizes into one grid (one row per prompt, one column per shape)."""
    from PIL import Image

    cols = max(len(r) for r in rows)
    cw = [max(r[c].width for r in rows if c < len(r)) for c in range(cols)]
    rh = [max(im.height for im in r) for r in rows]
    grid = Image.new("RGB", (sum(cw), sum(rh)), "white")
    y = 0
    for r, h in zip(rows, rh):
        x = 0
        for c, im in enumerate(r):
            grid.paste(im, (x, y))
            x += cw[c]
        y += h
    return grid


def _generate(args: argparse.Namespace, accelerator: Any, pipe: Any, shapes: list[tuple[int, ...]],
              bar: Any, family: Family) -> list[list[Any]]:
    """One row of images per validation prompt, one column per shape (and validation image), seeded per image
    (:meth:`~hf_arb.families.Family.generate`: a video family's frames as one strip)."""
    rows = []
    for i, prompt in enumerate(args.validation_prompts):
        row = []
        for shape in shapes:  # (w, h), or (w, h, frames) for clip buckets
            for j in range(args.num_validation_images):
                bar.update()
                g = torch.Generator(device=accelerator.device).manual_seed(args.seed + 1000 * i + j)
                row.append(family.generate(pipe, shape, prompt=prompt,  # by name: Flux.2's first is an image
                                           num_inference_steps=args.num_validation_inference_steps, generator=g,
                                           **pipeline_call_kwargs(args), **family.validation_kwargs(args)))
        rows.append(row)
    return rows


def log_validation(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
                   step: int, dtype: torch.dtype, *, pipe: Any = None, name: str | None = None,
                   rows: Any = None) -> Path | None:
    """Generate every prompt at portrait / square / landscape buckets, save one grid PNG, log it to trackers.
    ``rows``: the run's rows per bucket (:func:`validation_shapes` picks among buckets with rows).

    ``pipe``: a ready pipeline (the final LoRA check loads the saved adapter into the base model); by default one
    is built around ``unet`` (which carries the adapter in LoRA mode).
    """
    if not args.validation_prompts or not accelerator.is_main_process:
        return None
    if pipe is None:  # an encoded dataset's run trained without the VAE and the text encoders: they load now
        complete_models(args, models, accelerator.device, dtype)
    built, pipe = pipe is None, pipe or models.family.build_pipeline(args, models, unet, dtype)
    if not (built and getattr(args, "offload", False)):  # --offload: its frozen parts stream to the device themselves
        pipe = pipe.to(accelerator.device)
    use_validation_scheduler(args, pipe)  # --validation_scheduler (train_dreambooth.py)
    pipe.set_progress_bar_config(disable=True)
    shapes = validation_shapes(buckets, rows)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(args.validation_prompts) * len(shapes) * args.num_validation_images, unit="img",
               desc="Validation images", leave=False)  # under the Steps bar: gone once the grid is saved
    # mixed precision: the scheduler returns float32 latents that meet bf16/fp16 weights, as in diffusers' scripts
    half = dtype in (torch.float16, torch.bfloat16)
    with torch.autocast(accelerator.device.type, dtype=dtype) if half else contextlib.nullcontext():
        rows = _generate(args, accelerator, pipe, shapes, bar, models.family)
    bar.close()
    path = Path(args.output_dir) / "validation" / f"{name or f'step-{step:06d}'}.png"
    # a video family's samples: an MP4 per prompt and shape, at the run's (or the family's) frame rate
    fps = getattr(args, "target_fps", None) or getattr(models.family, "video_fps", DEFAULT_FPS)
    rows, videos = save_videos(rows, shapes, args.num_validation_images, path.with_suffix(""), fps)
    grid = image_grid(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image("validation", np.asarray(grid), step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(grid, caption=" | ".join(args.validation_prompts))]})
    log_videos(accelerator.trackers, videos, step, fps)
    logger.info("Validation grid (%s at %s) saved to %s%s", args.validation_prompts, shapes, path,
                f", {len(videos)} MP4(s) in {path.with_suffix('')}" if videos else "")
    del pipe
    return path




def save_model_card(args: argparse.Namespace, repo_id: str, buckets: Any, family: Family, *,
                    images: list[str] | None = None, stats: dict[str, Any] | None = None, rows: Any = None) -> Path:
    """Write ``README.md`` in output_dir: works with or without validation images and trackers; the family gives
    its tags, license, paragraphs and loading code. ``rows``: the run's rows per bucket (as for validation): the
    "Use" code generates at a bucket the run trained (:func:`validation_shapes`)."""
    base = args.pretrained_model_name_or_path
    tags = [*family.card_tags, "text-to-image", "diffusers", "diffusers-training", "aspect-ratio-bucketing", "hf_arb"]
    front = ["---", f"license: {family.card_license}", f"base_model: {base}", "library_name: diffusers", "tags:"]
    front += [f"- {t}" for t in tags] + ["inference: true", "---", ""]
    labels = buckets.labels()
    body = [
        f"# {repo_id}", "",
        f"Fine-tuned from **{base}** with aspect-ratio bucketing (hf_arb's `train_text_to_image_arb.py`): each "
        "image was trained at close to its own aspect ratio, and every batch held one bucket shape.", "",
        f"* buckets: {len(labels)} ({', '.join(labels[:12])}{', ...' if len(labels) > 12 else ''}), "
        f"from {bucket_origin(args)}",
        *(buckets.card_lines() if hasattr(buckets, "card_lines") else []),
        f"* steps: {stats.get('global_step') if stats else args.max_train_steps}, batch size {args.train_batch_size} "
        f"per device, gradient accumulation {args.gradient_accumulation_steps}, learning rate {args.learning_rate}",
        f"* mixed precision: {(stats or {}).get('mixed_precision', args.mixed_precision)}; dataset: "
        f"{args.dataset_name or args.train_data_dir or args.instance_data_dir or getattr(args, 'dataset_config', '')}",
        *quant_card_lines(args),  # --do_fp8_training, --bnb_quantization_config_path
        *mix_card_lines(stats), "",  # --dataset_config: rows, repeats and shares per dataset
    ]
    if getattr(args, "lora", False):
        body += [f"LoRA adapters (rank {args.rank}, alpha {args.lora_alpha or args.rank}) on the "
                 f"{family.denoiser_title}" + (" and the text encoder(s)" if args.train_text_encoder else "")
                 + f", in `pytorch_lora_weights.safetensors`; load them into **{base}**.", ""]
    body += family.card_lines(args)
    shape = validation_shapes(buckets, rows)[0]  # a bucket the run trained, as validation's
    body += ["## Use", "", "```python", *usage_snippet(args, repo_id, family, shape=shape), "```", ""]
    if args.validation_prompts:
        body += ["## Validation", "", "Prompts: " + "; ".join(f"`{p}`" for p in args.validation_prompts), ""]
        body += [f"![validation]({Path(p).relative_to(args.output_dir).as_posix()})" for p in images or []]
        body += [f"[{v.name}]({v.relative_to(args.output_dir).as_posix()})" for p in images or []  # a video family
                 for v in sorted(Path(p).with_suffix("").glob("*.mp4"))]  # its MP4s beside the grid
        body += [""]
    if args.report_to not in (None, "none", ""):
        body += [f"Training curves were logged to {args.report_to} (project `{args.tracker_project_name}`).", ""]
    path = Path(args.output_dir) / "README.md"
    path.write_text("\n".join(front + body))
    return path


def usage_snippet(args: argparse.Namespace, repo_id: str, family: Family,
                  shape: tuple[int, int] = (512, 768)) -> list[str]:
    """The model card's "Use" code: plain diffusers, no hf_arb, runnable as printed
    (:meth:`hf_arb.families.Family.card_code`; tests/test_card_code.py runs it where ``import hf_arb`` fails)."""
    return family.card_code(args, repo_id, shape)


def saved_line(args: argparse.Namespace, family: Family) -> str:
    """The run's last line: where the output is and how stock diffusers loads it
    (:meth:`hf_arb.families.Family.saved_message`: the card's loading code)."""
    return family.saved_message(args, args.output_dir)


def save_final(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
               progress: Progress, validation_images: list[str], stats: dict[str, Any],
               rows: Any = None) -> None:
    """Save the pipeline (the family's stock diffusers class), buckets, card, push."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    unet = unwrap(accelerator, unet)
    if models.ema_unet is not None:
        models.ema_unet.copy_to(unet.parameters())
    if args.pretrained_vae_model_name_or_path:  # the saved pipeline takes the run's VAE (the rest: the base's)
        complete_models(args, models, accelerator.device, torch.float32)
    pipe = models.family.build_pipeline(args, models, unet, torch.float32, final=True)
    models.family.save_pipeline(args, pipe, args.output_dir)  # stock diffusers loads it (SD: + its pipeline.py)
    (Path(args.output_dir) / BUCKETS_FILE).write_text(json.dumps(buckets.to_dict(), indent=1))
    done = Path(args.output_dir) / "validation" / f"step-{progress.global_step:06d}.png"
    if not done.exists():  # the last epoch's validation may already show these weights
        last = log_validation(args, accelerator, models, unet, buckets, progress.global_step, torch.float32,
                              rows=rows)
        if last is not None:
            validation_images.append(str(last))
    finish_outputs(args, buckets, models, validation_images, stats, rows)


def save_final_lora(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
                    progress: Progress, validation_images: list[str], stats: dict[str, Any],
                    rows: Any = None) -> None:
    """Write ``pytorch_lora_weights.safetensors`` (no pipeline, as upstream), then validate by loading that file
    into a fresh base pipeline with ``load_lora_weights``, the way users will."""
    from hf_arb.train.lora import save_kohya_lora, save_lora

    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    cls = models.family.pipeline_class(args)
    encoders = [accelerator.unwrap_model(te) for te in models.trained_text_encoders or []]
    save_lora(models.family.lora_file_class(args), args.output_dir, unwrap(accelerator, unet), encoders or None,
              denoiser=models.family.denoiser_name)
    if getattr(args, "output_kohya_format", False):  # train_dreambooth_lora_sdxl.py's second file, kohya's keys
        save_kohya_lora(args.output_dir, alpha=float(args.rank if args.lora_alpha is None else args.lora_alpha))
    (Path(args.output_dir) / BUCKETS_FILE).write_text(json.dumps(buckets.to_dict(), indent=1))
    if args.validation_prompts:
        if args.pretrained_vae_model_name_or_path:
            complete_models(args, models, accelerator.device, torch.float32)
        parts = {"vae": place(models.vae, dtype=torch.float32)} if args.pretrained_vae_model_name_or_path else {}
        pipe = cls.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant,
                                   **parts)
        from hf_arb.logs import no_text_encoder_lora_note

        with no_text_encoder_lora_note() if not encoders else contextlib.nullcontext():  # expected: UNet-only LoRA
            models.family.load_lora_into(pipe, args.output_dir)
        last = log_validation(args, accelerator, models, None, buckets, progress.global_step, torch.float32,
                              pipe=pipe, name=f"final-{progress.global_step:06d}", rows=rows)
        if last is not None:
            validation_images.append(str(last))
    finish_outputs(args, buckets, models, validation_images, stats, rows)


def finish_outputs(args: argparse.Namespace, buckets: Any, models: Models, validation_images: list[str],
                   stats: dict[str, Any], rows: Any = None) -> None:
    """Model card in output_dir (always: it says how to load the folder; ``rows``: the run's rows per bucket, for
    the card's shape), then the push if asked."""
    repo_id = args.output_dir
    if args.push_to_hub:
        from huggingface_hub import create_repo

        repo_id = create_repo(repo_id=args.hub_model_id or Path(args.output_dir).name, exist_ok=True,
                              token=args.hub_token).repo_id
    save_model_card(args, repo_id, buckets, models.family, images=validation_images, stats=stats, rows=rows)
    print(saved_line(args, models.family), flush=True)
    if args.push_to_hub:
        from huggingface_hub import upload_folder

        upload_folder(repo_id=repo_id, folder_path=args.output_dir, commit_message="End of training",
                      ignore_patterns=["step_*", "epoch_*", "checkpoint-*", "latent_cache/*", "batches/*"],
                      token=args.hub_token)


def report_bad_images(args: argparse.Namespace, accelerator: Any) -> int:
    """Rows whose image failed to decode during the run (and were replaced), from skipped_rows.jsonl; warns once."""
    from hf_arb.images.bad_images import read_bad_rows

    accelerator.wait_for_everyone()
    path = Path(args.output_dir) / SKIPPED_ROWS_FILE
    rows = read_bad_rows(path)
    if rows and accelerator.is_main_process:
        logger.warning("%d row(s) had images that could not be decoded and were replaced by rows of the same bucket; "
                       "see %s. Re-annotate with `hf-arb annotate ... --verify` to skip them up front.", len(rows),
                       path)
    return len(rows)


def batch_captions(batch: dict[str, Any]) -> dict[str, Any]:
    """Check the data pipeline's batch carries ``captions`` (a list of strings, one per sample)."""
    if "captions" not in batch:
        raise KeyError(f"The data pipeline's batch has no captions; keys are {sorted(batch)}.")
    return batch
