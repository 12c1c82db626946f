"""The flag audit (issue #24, "nothing is silently ignored"): every flag of the training script has a row in
docs/training.md's "Every flag, every mode" table, and a flag that a mode would ignore stops the run in one line
naming it (or, where upstream diffusers ignores it the same way, warns once from the main process).

Parse-level only: no model loads (the family is read from a Hub id's name, "m" is SD)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_text_to_image_arb as script  # noqa: E402
from hf_arb.train.environment import make_accelerator  # noqa: E402
from hf_arb.train.flags import arg_checks  # noqa: E402
from hf_arb.train.flags import args as train_args  # noqa: E402

SD, SD3, FLUX = "m", "org/stable-diffusion-3-medium", "black-forest-labs/FLUX.1-dev"
STREAM = ["--streaming", "--stream_key_column", "id"]


def parse(model: str, *extra: str):
    return script.parse_args(["--pretrained_model_name_or_path", model, "--train_data_dir", "d", "--report_to",
                              "tensorboard", *(["--full_finetune", "--learning_rate", "1e-5"] if "--rank" not in extra
                                               and "--lora" not in extra else []), *extra])


def audit_table() -> str:
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("\n## Every flag, every mode\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `--"))


def test_every_flag_has_a_row_in_the_audit_table():
    """Adding a flag to build_parser without deciding where it applies fails here."""
    flags = {s for a in train_args.build_parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    rows = audit_table().splitlines()
    listed = [f for row in rows for f in re.findall(r"`(--[a-z0-9_]+)`", row.split(" | ")[0])]
    assert len(flags) > 130 and len(listed) == len(set(listed)), "a flag has two rows"
    assert sorted(flags - set(listed)) == [], "flags with no row in docs/training.md 'Every flag, every mode'"
    assert sorted(set(listed) - flags) == [], "rows for flags the parser does not have"
    assert all(row.count(" | ") == 2 for row in rows)


def test_unset_values_are_the_parser_defaults():
    parser = train_args.build_parser()
    assert {k: parser.get_default(k) for k in arg_checks.UNSET} == arg_checks.UNSET


@pytest.mark.parametrize("model, extra, message", [
    (SD, ["--latent_cache_dir", "x"], "--latent_cache_dir x has no effect in this run: it sets where --cache_latents"),
    (SD, ["--latent_cache_variants", "3"], "--latent_cache_variants 3 has no effect in this run: it configures "
                                           "--cache_latents"),
    (SD, ["--cache_latents", "--center_crop", "--latent_cache_variants", "3"], "--center_crop without --random_flip "
                                                                               "has one crop/flip variant"),
    (SD, ["--resolution_embed_dim", "16"], "it sizes --resolution_conditioning"),
    (SD, ["--dream_detail_preservation", "2"], "add --dream_training"),
    (SD, ["--timestep_bias_multiplier", "2"], "--timestep_bias_strategy, which is none"),
    (SD, ["--timestep_bias_strategy", "later", "--timestep_bias_begin", "10"], "range, not later"),
    (SD, ["--timestep_bias_strategy", "later", "--timestep_bias_end", "900"], "range, not later"),
    (SD, ["--timestep_bias_strategy", "range", "--timestep_bias_portion", "0.5"], "earlier/later, not range"),
    (SD, ["--stream_buffer_size", "10"],
     "--stream_buffer_size 10 has no effect in this run: it configures --streaming"),
    (SD, ["--stream_on_overflow", "evict"], "it configures --streaming"),
    (FLUX, ["--lora_layers", "to_q"], "this is a full fine-tune: add --rank N"),
    (SD3, ["--lora_blocks", "0"], "this is a full fine-tune: add --rank N"),
    (SD, ["--hub_model_id", "me/x"], "--hub_model_id me/x has no effect in this run: it names the Hub repository"),
    (SD, ["--hub_token", "s3cret"], "--hub_token has no effect in this run: it is the token of --push_to_hub"),
    (SD, ["--report_to", "none", "--tracker_project_name", "p"], "--report_to none starts no tracker"),
    (SD, ["--report_to", "none", "--logging_dir", "l"], "--report_to none writes no logs"),
    (SD, ["--report_to", "none", "--debug_loss"], "--debug_loss has no effect in this run: its losses go to the"),
    (SD, ["--dataset_config_name", "c"], "a folder (--train_data_dir, --instance_data_dir) has none"),
    (SD, [*STREAM, "--bucket_leftover", "fill"], "--bucket_leftover fill has no effect in this run: --streaming"),
    (SD, [*STREAM, "--no_bucket_sync"], "--no_bucket_sync has no effect in this run: --streaming"),
    (SD, [*STREAM, "--dataloader_num_workers", "2"], "(no workers)"),
    (SD, [*STREAM, "--image_interpolation_mode", "bicubic"], "resizes with lanczos"),
    (SD, [*STREAM, "--repeats", "2"], "write the rows several times into the shards"),
    (FLUX, ["--packing", "--bucket_leftover", "catch_all"], "--packing has no buckets to pool leftovers into"),
    (FLUX, ["--packing", "--no_bucket_sync"], "--packing trains packs, not buckets"),
    (SD, ["--bucket_preset", "sdxl", "--bucket_step", "32"], "--bucket_step 32 has no effect: --bucket_preset sdxl "
                                                            "is a fixed table"),
    (SD, ["--aspect_ratio_buckets", "64,64", "--bucket_step", "16"], "--aspect_ratio_buckets gives every bucket"),
    (FLUX, ["--non_ema_revision", "abc"], "--non_ema_revision abc names a UNet revision"),
])
def test_a_flag_the_mode_ignores_is_refused_in_one_line(model, extra, message):
    with pytest.raises(script.UsageError) as err:
        parse(model, *extra)
    text = str(err.value)
    assert message in text and "\n" not in text and "s3cret" not in text
    flag = next(f for f in reversed(extra) if f.startswith("--") and f not in ("--streaming", "--stream_key_column",
                                                                               "--packing", "--cache_latents"))
    assert flag in text, text


def test_the_same_flags_in_their_own_mode_parse():
    """Each refused flag of the table above, given where it applies, is accepted."""
    parse(SD, "--cache_latents", "--latent_cache_dir", "x", "--latent_cache_variants", "3")
    parse(SD, "--resolution_conditioning", "--resolution_embed_dim", "16")
    parse(SD, "--dream_training", "--dream_detail_preservation", "2")
    parse(SD, "--timestep_bias_strategy", "range", "--timestep_bias_begin", "10", "--timestep_bias_multiplier", "2")
    parse(SD, "--ddp_comm_hook", "power_sgd", "--power_sgd_rank", "2")
    parse(SD, *STREAM, "--stream_buffer_size", "10", "--stream_on_overflow", "evict")
    parse(FLUX, "--rank", "4", "--lora_layers", "to_q", "--lora_blocks", "0")
    parse(SD, "--push_to_hub", "--hub_model_id", "me/x")
    parse(SD, "--bucket_preset", "kohya", "--bucket_step", "32")
    parse(SD, "--non_ema_revision", "abc")
    args = parse(FLUX, "--packing", "--bucket_leftover", "fill")
    assert args.bucket_leftover == "fill"


def test_validation_prompt_and_prompts_both_validate():
    args = parse(SD, "--validation_prompt", "a cat", "--validation_prompts", "a dog", "a fox")
    assert args.validation_prompts == ["a cat", "a dog", "a fox"]
    assert parse(SD, "--validation_prompt", "a cat").validation_prompts == ["a cat"]


def warnings_of(caplog, model: str, *extra: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=script.logger.name):
        parse(model, *extra)
    return [r.getMessage() for r in caplog.records if "--learning_rate" not in r.getMessage()]


@pytest.mark.parametrize("model, extra, message", [
    (SD, ["--validation_epochs", "3", "--num_validation_inference_steps", "5"],
     "--validation_epochs 3, --num_validation_inference_steps 5: no effect, there is no --validation_prompt"),
    (SD, ["--lr_warmup_steps", "100"], "--lr_warmup_steps 100: no effect with --lr_scheduler constant"),
    (SD, ["--lr_num_cycles", "3", "--lr_scheduler", "cosine"],
     "--lr_num_cycles 3: no effect with --lr_scheduler cosine"),
    (SD, ["--lr_power", "2"], "--lr_power 2.0: no effect with --lr_scheduler constant (only polynomial reads it)"),
    (SD, ["--instance_prompt", "sks", "--caption_column", "text"], "--instance_prompt 'sks' is not a caption here"),
    (SD, [*STREAM, "--resolution", "64", "--bucket_step", "16"],
     "--resolution 64, --bucket_step 16: not applied, --streaming trains the shards' own bucket columns"),
    (SD, ["--aspect_ratio_buckets", "64,64", "--resolution", "64"], "--resolution 64: not applied, "
                                                                    "--aspect_ratio_buckets gives every bucket's size"),
    (FLUX, ["--logit_mean", "0.5"], "--logit_mean 0.5: no effect with --weighting_scheme none"),
    (SD3, ["--mode_scale", "1.5"], "--mode_scale 1.5: no effect with --weighting_scheme logit_normal"),
    (FLUX, ["--packing", "--train_batch_size", "2"], "--train_batch_size 2: not applied, --packing sizes each step"),
    (SD, ["--ddp_comm_hook", "fp16", "--power_sgd_rank", "2"],
     "--power_sgd_rank 2: no effect with --ddp_comm_hook fp16"),
])
def test_an_upstream_flag_upstream_also_ignores_warns_once(caplog, monkeypatch, model, extra, message):
    monkeypatch.delenv("RANK", raising=False)
    said = warnings_of(caplog, model, *extra)
    assert len(said) == 1 and said[0].startswith(message), said
    monkeypatch.setenv("RANK", "1")  # the other ranks parse too, and say nothing
    assert warnings_of(caplog, model, *extra) == []


@pytest.mark.parametrize("model, extra", [
    (SD, ["--validation_prompt", "p", "--validation_epochs", "3"]),
    (SD, ["--lr_warmup_steps", "0"]),
    (SD, ["--lr_scheduler", "cosine", "--lr_warmup_steps", "100"]),
    (SD, ["--lr_scheduler", "cosine_with_restarts", "--lr_num_cycles", "3"]),
    (SD3, ["--logit_mean", "0.5"]),
    (FLUX, ["--weighting_scheme", "mode", "--mode_scale", "1.5"]),
    (FLUX, ["--packing", "--train_batch_size", "2", "--scale_lr"]),
    (SD, ["--resolution", "64"]),
])
def test_the_same_flags_where_they_apply_say_nothing(caplog, monkeypatch, model, extra):
    monkeypatch.delenv("RANK", raising=False)
    assert warnings_of(caplog, model, *extra) == []


@pytest.mark.parametrize("extra, named", [(["--ddp_comm_hook", "fp16"], "--ddp_comm_hook fp16"),
                                          (["--no_bucket_sync"], "--no_bucket_sync")])
def test_multi_process_flags_warn_in_a_single_process(caplog, tmp_path, monkeypatch, extra, named):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    args = parse(SD, "--report_to", "none", "--output_dir", str(tmp_path), *extra)
    from test_train import reset_accelerate

    try:
        with caplog.at_level(logging.WARNING, logger=script.logger.name):
            accelerator = make_accelerator(args)
        assert accelerator.num_processes == 1
    finally:
        reset_accelerate()  # accelerate's process-wide state, for the next test in this process
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{named}: no effect with one process") for m in said), said
