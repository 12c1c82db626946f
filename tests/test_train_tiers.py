"""Multi-resolution (tiered) training in train_text_to_image_arb.py (issue #27): the flags and their refusals, each
row fitted to its bucket *in the batch's tier* (SDXL time ids, latent-cache keys), the flow shift per tier, the
tiered sampler behind accelerate's prepared loader, and (slow) tiny SD and Flux runs whose curriculum switches tier
mid-run, resumed from a checkpoint before the switch, that load in stock diffusers (an SD LoRA the same way, loaded
with ``load_lora_weights``); the 2-process SD run is in the shared batch (``ddp_batch``, tests/_train_fixtures.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _train_fixtures import GROUP, SD_BASE, batch_result
from test_train import max_weight_diff, read_trace, reset_accelerate, run_script

from hf_arb.checks import UsageError
from hf_arb.train.flags import args as train_args
from hf_arb.train.outputs import validation_shapes
from hf_arb.train.sources.tiers import TierTable, tier_pairs, tier_table

MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # the family is read from the name: nothing is loaded
TIERS = ["--resolution", "32,64", "--bucket_step", "16"]
SWITCH = 4  #: the curriculum's tier switch (global step)
CURRICULUM = ["--resolution_schedule", f"curriculum:0-{SWITCH}:32,{SWITCH}-:64"]


def parse(*extra: str):
    return train_args.parse_args(["--pretrained_model_name_or_path", MODEL, "--train_data_dir", "unused",
                                  "--full_finetune", "--bucket_step", "16", *extra])


# ------------------------------------------------------------------------------------ fast: flags
def test_one_resolution_keeps_the_single_tier_path():
    args = parse("--resolution", "64")
    assert (args.resolution, args.resolutions, args.resolution_schedule) == (64, [64], None)
    assert tier_table(args) is None
    default = parse()  # the family's default resolution, one tier
    assert default.resolutions == [default.resolution] == [512]


def test_several_tiers_default_to_random_and_build_one_table():
    args = parse("--resolution", "32,64")
    assert (args.resolution, args.resolutions, args.resolution_schedule) == (32, [32, 64], "random")
    table = tier_table(args)
    assert isinstance(table, TierTable) and table.tiers.resolutions == (32, 64)
    sets = table.bucket_sets
    assert len(table) == len(sets[0]) + len(sets[1]) and table.offsets.tolist() == [0, len(sets[0]), len(table)]
    assert table.resolutions[: len(sets[0])].tolist() == sets[0].resolutions.tolist()  # tier 0 = annotation table
    labels = table.labels()
    assert len(set(labels)) == len(labels) and labels[0].endswith("@32") and labels[-1].endswith("@64")
    # the same preset rule at every resolution: each tier's buckets have about resolution² pixels
    for r, bs in zip((32, 64), sets):
        assert np.all(np.abs(np.log(bs.areas / r**2)) < np.log(2))
    assert table.tiers.max_upscale == 1.0 and tier_table(parse("--resolution", "32,64", "--max_upscale", "2")
                                                         ).tiers.max_upscale == 2.0
    shapes = validation_shapes(table)  # one bucket of every tier
    assert len(shapes) == 2 and all(tuple(s) in set(map(tuple, bs.resolutions.tolist())) for s, bs in zip(shapes, sets))


@pytest.mark.parametrize("extra, message", [
    (["--resolution", "64", "--resolution_schedule", "random"], "--resolution_schedule random needs several tiers"),
    (["--resolution", "64", "--max_upscale", "2"], "--max_upscale 2.0 needs several tiers"),
    ([*TIERS, "--no_bucket_sync"], "--no_bucket_sync is not supported with several tiers"),
    ([*TIERS, "--aspect_ratio_buckets", "32,32;16,48"], "--aspect_ratio_buckets is not supported with several tiers"),
    ([*TIERS, "--bucket_leftover", "catch_all"], "--bucket_leftover catch_all is not supported with several tiers"),
    ([*TIERS, "--bucket_preset", "sdxl"], "--bucket_preset sdxl is a fixed table"),
    ([*TIERS, "--resolution_schedule", "curriculum:0-4:32,4-:128"], "'128' is not one of the run's resolutions"),
    ([*TIERS, "--resolution_schedule", "progressive:0"], "`progressive` needs 1 increasing switch"),
    ([*TIERS, "--max_upscale", "0"], "--max_upscale must be a number > 0"),
    (["--resolution", "512,1048576"], "--resolution 1048576"),  # a pixel count as a tier
])
def test_unsupported_combinations_are_refused_in_one_line(extra, message):
    with pytest.raises(UsageError) as err:
        parse(*extra)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_packing_and_streaming_with_tiers_take_every_schedule():
    flux = ["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev", "--train_data_dir", "unused",
            "--full_finetune", *TIERS]
    args = train_args.parse_args([*flux, "--packing"])
    assert (args.resolution_schedule, args.max_tokens) == ("random", 16)  # one image of the largest tier (64/16)²
    args = train_args.parse_args([*flux, "--packing", *CURRICULUM])  # one pack stream per tier (test_pack_tiers.py)
    assert args.resolution_schedule == CURRICULUM[-1]
    args = parse(*TIERS, "--streaming", "--stream_key_column", "id")  # random: one RandomTierStream
    assert args.streaming and args.resolution_schedule == "random"
    args = parse(*TIERS, "--streaming", "--stream_key_column", "id", *CURRICULUM)  # one stream per tier
    assert args.streaming and args.resolution_schedule == CURRICULUM[-1]


def test_resolution_values_are_checked_by_argparse(capsys):
    for bad in ("32,32", "32,x", "0,64"):
        with pytest.raises(SystemExit):
            parse("--resolution", bad)
        assert "argument --resolution" in capsys.readouterr().err


def test_tiers_on_a_dataset_annotated_at_another_resolution_get_one_fix_that_works(tmp_path, caplog):
    """Issue 34, item 7: a 2-tier run on a dataset annotated at another first resolution got a warning to add
    --bucket_preset budget, then an error to pass the table flags it was annotated with or train on raw images. Now
    one error line, before any model, with one fix; and that fix runs (rows re-assigned at every tier, no image)."""
    import datasets

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.testing.tiny import save_tiny_imagefolder
    from hf_arb.train.data import dataset_with_buckets

    images = save_tiny_imagefolder(tmp_path / "images", per_size=1)
    ds = datasets.load_dataset("imagefolder", data_dir=str(images), split="train")
    add_bucket_columns(ds, BucketSet.preset("budget", resolution=512), show_summary=False).save_to_disk(
        str(tmp_path / "annotated"))  # (hf-arb annotate's table at --resolution 512)
    run = ["--pretrained_model_name_or_path", MODEL, "--dataset_name", str(tmp_path / "annotated"), "--full_finetune",
           "--resolution", "256,512", "--output_dir", str(tmp_path / "out"), "--seed", "0"]
    with caplog.at_level("WARNING"), pytest.raises(UsageError) as err:
        dataset_with_buckets(train_args.parse_args(run), None)
    message = str(err.value)
    assert "\n" not in message and message.endswith(": add --bucket_preset budget to re-assign its rows at every tier "
                                                     "from their stored sizes (no image is opened).")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # no second, different advice before it
    caplog.clear()
    with caplog.at_level("WARNING"):
        ds, table = dataset_with_buckets(train_args.parse_args([*run, "--bucket_preset", "budget"]), None)
    assert isinstance(table, TierTable) and table.tiers.resolutions == (256, 512)
    assert not any("Drop those flags" in r.getMessage() for r in caplog.records)  # (dropping them is the error)


# ------------------------------------------------------------------------------------ fit, time ids, cache keys
@pytest.fixture(scope="module")
def tiered_images(train_assets):
    import datasets

    from hf_arb import add_bucket_columns
    from hf_arb.sampling.tiered.plan import tier_bucket_ids
    from hf_arb.train.sources.dataset import image_dataset

    args = parse(*TIERS, "--output_dir", "unused", "--seed", "0")
    table = tier_table(args)
    ds = datasets.load_dataset("imagefolder", data_files={"train": str(Path(train_assets["images"]) / "**")},
                               split="train")
    ds = add_bucket_columns(ds, table.bucket_sets[0], image_column="image", show_summary=False)
    w, h = np.asarray(ds["original_width"], float), np.asarray(ds["original_height"], float)
    return image_dataset(args, ds, table), table, tier_bucket_ids(w, h, table.tiers), ds


def test_rows_are_fitted_to_their_bucket_in_the_batchs_tier(tiered_images):
    """SDXL's time ids (original size, crop, target size) come from this fit: the target is the tier's bucket."""
    from hf_arb.train.cache.cache_keys import entry_key

    images, table, ids, ds = tiered_images
    pairs = tier_pairs(ds, table)  # what --cache_latents encodes: every (row, tier) the row is eligible for
    assert pairs == {(r, table.combined(t, b)) for t in (0, 1) for r, b in enumerate(ids[t].tolist()) if b >= 0}
    row = 1
    keys = set()
    for tier in (0, 1):
        bucket = int(ids[tier, row])
        w, h = table.bucket_sets[tier].resolutions[bucket].tolist()
        plan = images.fit_row(row, tier, bucket, 0)
        assert tuple(plan.target_size) == (h, w)
        batch = images.collate([images[(row, tier, bucket, 0)]])
        assert tuple(batch["pixel_values"].shape) == (1, 3, h, w)
        assert batch["target_sizes"][0].tolist() == [h, w]  # what SDXL's add_time_ids end with
        assert int(batch["buckets"][0]) == table.combined(tier, bucket)
        keys.add(entry_key("content", plan.key(), "vae"))  # the latent cache's key of this (row, tier, bucket)
    assert len(keys) == 2  # a row cached at two tiers has two entries


def test_flow_shift_mu_is_the_pipelines_for_each_tiers_bucket():
    """Flow families shift every batch by the mu of its latent size (families/flow.py batch_sigmas): two tiers'
    buckets get the mu the stock Flux pipeline computes for that height x width, so they differ."""
    import torch
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from hf_arb.families.flow import batch_sigmas
    from hf_arb.families.shift import ShiftConfig, shift_sigmas
    from hf_arb.sampling.tiered.plan import Tiers

    config = ShiftConfig(use_dynamic_shifting=True)  # Flux.1's scheduler: 256 → 0.5, 4096 → 1.15
    table = TierTable(Tiers.preset("budget", [512, 1024], 64), "random")
    t = torch.linspace(0.05, 0.95, 7)
    mus = []
    for tier, bs in enumerate(table.bucket_sets):
        w, h = validation_shapes(bs)[1]  # the square-most bucket of the tier
        seq = (h // 16) * (w // 16)  # VAE factor 8, 2x2 patches: the pipeline's image_seq_len
        mu = calculate_shift(seq, 256, 4096, 0.5, 1.15)
        torch.testing.assert_close(batch_sigmas(t, (h // 8, w // 8), 2, config), shift_sigmas(t, mu, config))
        mus.append(mu)
    assert mus[1] > mus[0] + 0.4  # 1024² has 4x the tokens of 512²


# ------------------------------------------------------------------------------------ the sampler under accelerate
class Keys:
    """A dataset whose item is its key: the loader yields the sampler's ``(row, tier, bucket, epoch)`` batches."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, key):
        return tuple(key)


def test_tiered_sampler_resumes_through_resume_dataloader():
    """find_sampler finds a TieredBatchSampler behind accelerate's prepared loader, and resume_dataloader continues
    the uninterrupted sequence across the tier switch."""
    import torch
    from accelerate import Accelerator

    from hf_arb import resume_dataloader
    from hf_arb.sampling.accelerate import find_sampler
    from hf_arb.sampling.tiered.plan import Tiers
    from hf_arb.sampling.tiered.sampler import TieredBatchSampler

    rng = np.random.default_rng(0)
    w, h = rng.integers(64, 300, 200), rng.integers(64, 300, 200)
    tiers = Tiers.preset("budget", [32, 64], 16)

    def loader():
        s = TieredBatchSampler(w, h, tiers, "curriculum:0-7:32,7-:64", batch_size=2, seed=3, return_keys=True)
        return torch.utils.data.DataLoader(Keys(), batch_sampler=s, collate_fn=lambda k: k)

    reset_accelerate()
    try:
        acc = Accelerator(cpu=True)
        full = acc.prepare(loader())
        assert isinstance(find_sampler(full), TieredBatchSampler)
        whole = [b for e in range(2) for b in (full.set_epoch(e) or list(full))]  # two epochs of L steps
        L = len(whole) // 2
        for done in (5, 9, L + 3):  # before the switch, after it, in the next epoch
            rest, epoch = resume_dataloader(acc, acc.prepare(loader()), done)
            assert epoch == done // L and list(rest) == whole[done : (epoch + 1) * L]
    finally:
        reset_accelerate()
    tiers_seen = [k[0][1] for k in whole[:L]]
    assert set(tiers_seen[:7]) == {0} and set(tiers_seen[7:]) == {1}


def test_random_epochs_of_their_own_length_resume_consistently(tiered_images):
    """Under ``random`` every epoch has its own length (its draw's drops): the schedule counts the real epochs
    (pack_schedule) and the checkpoint check adds up the updates of each epoch, not epoch x the current length."""
    import argparse

    from hf_arb.sampling.tiered.sampler import TieredBatchSampler
    from hf_arb.train.progress import Progress, check_resumed_step
    from hf_arb.train.schedule import pack_schedule

    _, table, _, ds = tiered_images
    sampler = TieredBatchSampler.from_dataset(ds, table.tiers, "random", batch_size=2, num_replicas=1, seed=0)
    lengths = [sampler.steps_in(e) for e in range(4)]
    assert sum(lengths[:3]) != 3 * lengths[0], lengths  # the fixture's draws: epochs of different lengths
    args = argparse.Namespace(gradient_accumulation_steps=2, max_train_steps=None, num_train_epochs=4,
                              lr_warmup_steps=0, mixed_precision="no")
    assert pack_schedule(args, sampler, 1).max_train_steps == sum(-(-n // 2) for n in lengths)
    args.gradient_accumulation_steps = 1
    micro = updates = sum(lengths[:3]) + 1  # one step into epoch 3
    optimizer = type("Opt", (), {"state_dict": lambda self: {"state": {}}})()
    check_resumed_step(args, None, Progress(updates, 0, micro), sampler, optimizer, Path("ckpt"))
    with pytest.raises(UsageError, match="is inconsistent"):
        check_resumed_step(args, None, Progress(updates + 1, 0, micro), sampler, optimizer, Path("ckpt"))


# ------------------------------------------------------------------------------------ slow: a tiny SD run on 2 tiers
@pytest.fixture(scope="module")
def tier_runs(train_assets, tmp_path_factory):
    """8 steps of ``curriculum:0-4:32,4-:64`` with one pixel budget (checkpoint at step 3, before the switch), and
    the run resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("tiers")
    base = ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", train_assets["images"],
            *SD_BASE, "--full_finetune", *TIERS, *CURRICULUM, "--max_train_steps", "8", "--checkpointing_steps", "3",
            "--max_pixels_per_batch", "4096",  # one budget: 2 images (--train_batch_size) at 32, 1 at 64
            "--validation_prompts", "a photo", "--num_validation_images", "1", "--num_validation_inference_steps", "1"]
    full, resumed = root / "full", root / "resumed"
    stats = run_script([*base, "--output_dir", str(full)])
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    again = run_script([*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    return {"full": full, "resumed": resumed, "stats": stats, "again": again}


@pytest.mark.slow
def test_curriculum_switches_tier_mid_run(tier_runs):
    trace = read_trace(tier_runs["full"], 0)
    assert [t["step"] for t in trace] == list(range(8))
    table = json.loads((tier_runs["full"] / "hf_arb_buckets.json").read_text())
    sizes = [{tuple(r) for r in t["buckets"]["resolutions"]} for t in table["tiers"]]
    for t in trace:
        tier = 0 if t["step"] < SWITCH else 1
        h, w = t["shape"][2:]
        assert t["label"] == f"{w}x{h}@{(32, 64)[tier]}" and (w, h) in sizes[tier]
        assert t["shape"][0] == (2, 1)[tier]  # the pixel budget's batch size in that tier
        assert t["time_ids_first"][-2:] == [h, w]  # target size: the bucket of the tier
    assert table["schedule"] == CURRICULUM[1]
    assert "tier 0 (32)" in tier_runs["stats"]["log"] and "tier 1 (64)" in tier_runs["stats"]["log"]
    card = (tier_runs["full"] / "README.md").read_text()
    assert "resolution tiers: 32, 64" in card and CURRICULUM[1] in card
    from PIL import Image

    grid = Image.open(tier_runs["stats"]["validation_images"][-1])  # one bucket of each tier, side by side
    shapes = [tuple(s) for s in validation_shapes(tier_table(parse(*TIERS, *CURRICULUM)))]
    assert grid.size == (sum(w for w, _ in shapes), max(h for _, h in shapes))


@pytest.mark.slow
def test_resume_before_the_switch_reaches_the_same_weights(tier_runs):
    full, resumed = tier_runs["full"], tier_runs["resumed"]
    tail = read_trace(full, 0)[3:]
    again = read_trace(resumed, 0)
    assert [(t["step"], t["label"], t["rows"]) for t in again] == [(t["step"], t["label"], t["rows"]) for t in tail]
    np.testing.assert_allclose([t["loss"] for t in again], [t["loss"] for t in tail], rtol=1e-5)
    assert max_weight_diff(full, resumed) < 1e-6


@pytest.mark.slow
def test_the_output_loads_in_stock_diffusers_at_a_non_square_bucket(tier_runs):
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tier_runs["full"]), safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a photo", height=80, width=48, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]  # 48x80: a bucket of the 64 tier
    assert image.shape == (80, 48, 3) and np.isfinite(image).all()


# ------------------------------------------------------------------------------------ slow: a tiny SD LoRA on 2 tiers
@pytest.fixture(scope="module")
def lora_tier_runs(train_assets, tmp_path_factory):
    """The curriculum run of ``tier_runs`` as a rank-4 LoRA (no validation): 8 steps, checkpoint at step 3 (before
    the switch at 4), and the run resumed from it."""
    root = tmp_path_factory.mktemp("lora_tiers")
    base = ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", train_assets["images"],
            *SD_BASE, "--rank", "4", *TIERS, *CURRICULUM, "--max_train_steps", "8", "--checkpointing_steps", "3",
            "--max_pixels_per_batch", "4096"]
    full, resumed = root / "full", root / "resumed"
    stats = run_script([*base, "--output_dir", str(full)])
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    again = run_script([*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    return {"full": full, "resumed": resumed, "stats": stats, "again": again}


def lora_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "pytorch_lora_weights.safetensors"))


@pytest.mark.slow
def test_lora_curriculum_resumes_across_the_switch_to_the_same_adapters(lora_tier_runs):
    full, resumed = lora_tier_runs["full"], lora_tier_runs["resumed"]
    assert lora_tier_runs["stats"]["lora"] is True and lora_tier_runs["stats"]["global_step"] == 8
    trace = read_trace(full, 0)
    assert [t["label"].split("@")[1] for t in trace] == ["32"] * SWITCH + ["64"] * (8 - SWITCH)
    assert [t["shape"][0] for t in trace] == [2] * SWITCH + [1] * (8 - SWITCH)  # one pixel budget, two tiers
    again = read_trace(resumed, 0)
    assert [(t["step"], t["label"], t["rows"]) for t in again] == [(t["step"], t["label"], t["rows"])
                                                                    for t in trace[3:]]
    a, b, mid = lora_weights(full), lora_weights(resumed), lora_weights(full / "checkpoint-3")
    assert a.keys() == b.keys() and all(k.startswith("unet.") for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert max(float((a[k] - mid[k]).abs().max()) for k in a) > 1e-6  # steps 3-7 (both tiers) did train
    assert not (full / "unet").exists() and not list((full / "checkpoint-3").glob("model*.safetensors"))
    card = (full / "README.md").read_text()
    assert "resolution tiers: 32, 64" in card and CURRICULUM[1] in card


@pytest.mark.slow
def test_lora_of_a_tiered_run_loads_with_stock_load_lora_weights(lora_tier_runs, train_assets):
    import torch
    from diffusers import StableDiffusionPipeline

    def generate(pipe):
        return pipe("a photo", height=80, width=48, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]  # 48x80: a bucket of the 64 tier

    pipe = StableDiffusionPipeline.from_pretrained(train_assets["sd"], safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    before = generate(pipe)
    pipe.load_lora_weights(str(lora_tier_runs["full"]))
    after = generate(pipe)
    assert after.shape == (80, 48, 3) and np.isfinite(after).all() and abs(after - before).max() > 1e-4


# ------------------------------------------------------------------------------------ slow: a tiny Flux run on 2 tiers
def transformer_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = (load_file(str(p / "transformer" / "diffusion_pytorch_model.safetensors")) for p in (a, b))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


# ------------------------------------------------------------------------------------ slow: Flux packing on 2 tiers
@pytest.mark.slow
def test_flux_packing_on_two_tiers_draws_a_tier_per_image_and_resumes(flow_assets, tmp_path):
    """``--packing`` with ``--resolution 32,64`` (``random``): every image trains at its own size capped at its drawn
    tier's tokens ((32/16)² = 4 or (64/16)² = 16), packs mix tiers, and a run resumed from the checkpoint at
    step 2 reaches the same weights."""
    from _train_fixtures import FLOW

    base = ["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", flow_assets["images"], *FLOW,
            "--full_finetune", "--learning_rate", "1e-3", *TIERS, "--packing", "--max_tokens", "40",
            "--max_train_steps", "4", "--checkpointing_steps", "2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    stats = run_script([*base, "--output_dir", str(full)])
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    run_script([*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    trace = read_trace(full, 0)
    rows = [r for t in trace if t["epoch"] == 0 for r in t["rows"]]
    assert len(rows) == len(set(rows))  # once per epoch, at one tier
    tokens = [(h // 16) * (w // 16) for t in trace for _, h, w in t["shape"]]
    assert all(sum((h // 16) * (w // 16) for _, h, w in t["shape"]) <= 40 for t in trace)
    assert max(tokens) <= 16 and min(tokens) <= 4 and max(tokens) > 4  # both tiers' caps in use
    assert "this epoch's rows per tier: 32:" in stats["log"]
    assert [t["rows"] for t in read_trace(resumed, 0)] == [t["rows"] for t in trace[2:]]
    assert transformer_diff(full, resumed) < 1e-6


@pytest.mark.slow
def test_flux_packing_on_a_curriculum_packs_one_tier_per_step_and_resumes(flow_assets, tmp_path):
    """``--packing`` with ``--resolution_schedule curriculum:0-2:32,2-:64``: one pack stream per tier, so every
    step's pack holds images of the schedule's tier only (each capped at (32/16)² = 4 tokens before the switch,
    some above 4 after it), and a run resumed from the checkpoint at step 2, the switch, reaches the same weights."""
    from _train_fixtures import FLOW

    base = ["--pretrained_model_name_or_path", flow_assets["flux"], "--train_data_dir", flow_assets["images"], *FLOW,
            "--full_finetune", "--learning_rate", "1e-3", *TIERS, "--resolution_schedule", "curriculum:0-2:32,2-:64",
            "--packing", "--max_tokens", "40", "--max_train_steps", "4", "--checkpointing_steps", "2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_script([*base, "--output_dir", str(full)])
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    run_script([*base, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    trace = read_trace(full, 0)
    tokens = [[(h // 16) * (w // 16) for _, h, w in t["shape"]] for t in trace]  # (steps, images in the pack)
    assert [t["step"] for t in trace] == [0, 1, 2, 3] and all(sum(p) <= 40 for p in tokens)
    assert all(max(p) <= 4 for p in tokens[:2]) and any(max(p) > 4 for p in tokens[2:])
    assert [t["rows"] for t in read_trace(resumed, 0)] == [t["rows"] for t in trace[2:]]
    assert transformer_diff(full, resumed) < 1e-6


# ------------------------------------------------------------------------------------ slow: 2 processes (the batch)
def check_ddp_tier_runs(batch, name: str = "tiers-sd", diff=max_weight_diff) -> None:
    """Both ranks train the same (tier, bucket) at every step with disjoint rows; the curriculum switches at step 3
    and the run crosses into epoch 1; the run resumed from checkpoint-2 replays the same batches to the same
    weights."""
    full, resumed = batch_result(batch, f"{name}-full")["out"], batch_result(batch, f"{name}-resumed")["out"]
    traces = [read_trace(full, r) for r in (0, 1)]
    for a, b in zip(*traces):
        assert (a["step"], a["label"], a["shape"]) == (b["step"], b["label"], b["shape"])
        assert not set(a["rows"]) & set(b["rows"])
    assert [t["label"].split("@")[1] for t in traces[0]] == ["32"] * 3 + ["64"] * 3
    assert traces[0][-1]["epoch"] == 1  # 5 steps per epoch: the run crosses an epoch
    for r in (0, 1):
        assert [t["rows"] for t in read_trace(resumed, r)] == [t["rows"] for t in traces[r][2:]]
    assert diff(full, resumed) < 1e-6


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_processes_train_the_same_tier_and_resume_across_the_switch(ddp_batch):
    check_ddp_tier_runs(ddp_batch)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_flux_on_two_processes_resumes_across_the_switch_and_loads_in_stock_diffusers(ddp_batch):
    """The same on a tiny Flux (``curriculum:0-3:32,3-:64``, 2 processes, from the shared batch): every rank in the
    same (tier, bucket), the switch at step 3, the run resumed from checkpoint-2 reaches the same transformer weights
    (max abs diff < 1e-6); the start-up shift table lists every (tier, bucket). Its model card's snippet loads it in
    stock diffusers (no hf_arb) and generates in tests/test_train_flow.py::test_outputs_load_in_stock_diffusers_
    without_hf_arb (one ``stock_generate`` interpreter for every Flux/SD3 output of the batch)."""
    check_ddp_tier_runs(ddp_batch, "tiers-flux", transformer_diff)
    run = batch_result(ddp_batch, "tiers-flux-full")
    table = tier_table(parse(*TIERS))
    shift_rows = run["stats"]["log"].split("Resolution shift", 1)[1].splitlines()[2 : 2 + len(table)]
    assert [tuple(map(int, r.split()[1:3])) for r in shift_rows] == [tuple(r) for r in table.resolutions.tolist()]


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_streamed_tiers_on_two_processes_switch_together_and_resume_exactly(ddp_batch):
    """``--streaming`` on 2 tiers (``curriculum:0-3:32,3-:64``, 2 processes, from the shared batch): each rank reads
    its own split, both train the same (tier, bucket) at every step with disjoint rows, the tier switches at step 3,
    and the run resumed from checkpoint-2 (each rank's tiered stream state) replays the same rows to the same
    weights."""
    full = batch_result(ddp_batch, "tiers-stream-full")["out"]
    resumed = batch_result(ddp_batch, "tiers-stream-resumed")["out"]
    traces = [read_trace(full, r) for r in (0, 1)]
    for a, b in zip(*traces):
        assert (a["step"], a["label"], a["shape"]) == (b["step"], b["label"], b["shape"])
        assert not set(a["rows"]) & set(b["rows"])
    assert [t["label"].split("@")[1] for t in traces[0]] == ["32"] * 3 + ["64"] * 3
    for r in (0, 1):
        assert [t["rows"] for t in read_trace(resumed, r)] == [t["rows"] for t in traces[r][2:]]
    assert max_weight_diff(full, resumed) < 1e-6


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_streamed_random_tiers_on_two_processes_agree_and_resume_exactly(ddp_batch):
    """``--streaming`` with the ``random`` schedule on 2 tiers (2 processes, from the shared batch): both ranks train
    the same (tier, bucket) at every step with disjoint rows, no row twice in the epoch, and the run resumed from
    checkpoint-2 (each rank's stream state with its arrival counters) replays the same rows to the same weights."""
    full = batch_result(ddp_batch, "tiers-stream-random-full")["out"]
    resumed = batch_result(ddp_batch, "tiers-stream-random-resumed")["out"]
    traces = [read_trace(full, r) for r in (0, 1)]
    for a, b in zip(*traces):
        assert (a["step"], a["label"], a["shape"]) == (b["step"], b["label"], b["shape"])
    rows = [row for t in traces for s in t for row in s["rows"]]
    assert len(rows) == len(set(rows))
    for r in (0, 1):
        assert [t["rows"] for t in read_trace(resumed, r)] == [t["rows"] for t in traces[r][2:]]
    assert max_weight_diff(full, resumed) < 1e-6


def test_the_startup_report_shows_tier_batch_sizes_readably():
    """issue 34: a tiered run printed its batch sizes as a one-line dict of every (tier, bucket), 24 entries; now one
    line when they are all equal, else a line per tier grouping the buckets by batch size."""
    table = tier_table(parse("--resolution", "32,64"))
    same = [np.full(len(b), 4) for b in table.bucket_sets]
    assert table.batch_size_lines(same) == ["Batch size per device = 4 (every bucket of every tier)"]
    budget = [np.full(len(b), 8) for b in table.bucket_sets]
    budget[1][:] = 2
    labels = table.bucket_sets[1].labels()
    square = labels.index("64x64")
    budget[1][square] = 3
    lines = table.batch_size_lines(budget)
    assert lines[0] == "Batch size per device, by tier and bucket:" and len(lines) == 3
    assert lines[1] == "  tier 32: 8 in " + ", ".join(
        [table.bucket_sets[0].labels()[i] for i in table.bucket_sets[0].portrait_to_landscape()[:4]]) + \
        f" and {len(table.bucket_sets[0]) - 4} more"
    assert lines[2].startswith("  tier 64: 3 in 64x64; 2 in ") and "{" not in "".join(lines)
