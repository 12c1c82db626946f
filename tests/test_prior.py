"""Prior preservation (issue 36, item 2): upstream's flags, the pairing of instance rows with class images of their
bucket, the resumable generation of missing class images, and the loss ``instance + prior_loss_weight x class``.

Pure functions first (hypothesis over bucket tables and plans), then the loss on fixed tensors, the generation's
bookkeeping with a recording pipeline, the flag checks, and a tiny SD run on 2 processes with its resume (the shared
2-process batch; diffusers' own prior-preservation tests run against the script in
tests/upstream/test_dreambooth_lora_flux2_prior.py)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import test_train
import torch
from _train_fixtures import GROUP, batch_result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import train_text_to_image_arb as script
from hf_arb import BucketBatchSampler
from hf_arb.families.flow import flow_matching_loss
from hf_arb.families.sample_weights import SAMPLE_WEIGHTS, prior_sample_weights
from hf_arb.families.unet_loss import unet_loss
from hf_arb.sampling.pairing import class_pools, instance_ranks, paired_class_rows
from hf_arb.train.sources import source_class
from hf_arb.train.sources.prior import PriorSource, class_images

assets = test_train.assets  # the session's tiny SD and photo folder
_clean_accelerate_state = test_train._clean_accelerate_state

pytestmark = pytest.mark.filterwarnings("ignore:BucketBatchSampler:UserWarning")  # small random plans drop rows

RES = np.array([[32, 128], [48, 96], [64, 64], [96, 48], [128, 32], [80, 48]])


# ------------------------------------------------------------------------------------------ the pairing (pure)
def _keys(sampler) -> list[list[tuple[int, int, int]]]:
    return [list(b) for b in sampler]


def _pairs(keys, seed, ranks, pools) -> list[list[int]]:
    out = []
    for batch in keys:
        rows, targets, epochs = (np.array(x) for x in zip(*batch))
        assert len(set(epochs.tolist())) == 1
        out.append(paired_class_rows(rows, targets, epoch=int(epochs[0]), seed=seed, ranks=ranks,
                                     pools=pools).tolist())
    return out


bucket_column = st.lists(st.integers(-1, len(RES) - 1), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=st.lists(st.integers(0, len(RES) - 1), min_size=4, max_size=60), classes=bucket_column,
       seed=st.integers(0, 2**31), batch=st.integers(1, 3), world=st.integers(1, 3), epoch=st.integers(0, 3))
def test_every_pair_is_of_the_batch_bucket_or_its_nearest_deterministic_and_the_same_on_every_rank(
        instance, classes, seed, batch, world, epoch):
    inst, cls = np.array(instance), np.array(classes)
    if not (cls >= 0).any() or np.bincount(inst).max() < batch * world:
        return
    pools, ranks = class_pools(cls, RES), instance_ranks(inst)
    sampler = BucketBatchSampler(inst, batch, num_replicas=world, seed=seed, return_keys=True, buckets=RES,
                                 log_report=False)
    sampler.set_epoch(epoch)
    keys = _keys(sampler)
    pairs = _pairs(keys, seed, ranks, pools)
    aspect = np.log(RES[:, 0] / RES[:, 1])
    have = np.flatnonzero(np.bincount(cls[cls >= 0], minlength=len(RES)))
    for batch_keys, class_rows in zip(keys, pairs):
        target = batch_keys[0][1]
        got = {int(cls[c]) for c in class_rows}
        if target in have:
            assert got == {target}  # the batch's own bucket
        else:  # borrowed from the nearest bucket in log aspect that has class images
            (src,) = got
            assert np.isclose(abs(aspect[src] - aspect[target]), np.abs(aspect[have] - aspect[target]).min())
        pool = int(np.bincount(cls[cls >= 0], minlength=len(RES))[cls[class_rows[0]]])
        if pool >= np.bincount(inst, minlength=len(RES))[target]:
            assert len(set(class_rows)) == len(class_rows)  # distinct while the pool is large enough
    assert _pairs(keys, seed, instance_ranks(inst), class_pools(cls, RES)) == pairs  # deterministic
    # every rank pairs its own batches as the global plan does (accelerate deals batch i to rank i % world)
    for r in range(world):
        shard = BucketBatchSampler(inst, batch, num_replicas=world, seed=seed, return_keys=True, buckets=RES,
                                   log_report=False)
        shard.set_epoch(epoch)
        assert _pairs(_keys(shard.shard(r)), seed, ranks, pools) == pairs[r::world]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=st.lists(st.integers(0, len(RES) - 1), min_size=6, max_size=50), classes=bucket_column,
       seed=st.integers(0, 2**31), cut=st.integers(0, 100))
def test_a_resumed_run_pairs_exactly_as_the_uninterrupted_one(instance, classes, seed, cut):
    inst, cls = np.array(instance), np.array(classes)
    if not (cls >= 0).any() or np.bincount(inst).max() < 2:
        return
    pools, ranks = class_pools(cls, RES), instance_ranks(inst)

    def sampler():
        return BucketBatchSampler(inst, 2, num_replicas=1, seed=seed, return_keys=True, buckets=RES, log_report=False)

    full = []
    for e in range(2):
        s = sampler()
        s.set_epoch(e)
        full += _pairs(_keys(s), seed, ranks, pools)
    cut = cut % len(full)  # a checkpoint after `cut` steps (at an epoch's end too)
    first = sampler()
    done, state = [], None
    for e in range(2):
        first.set_epoch(e)
        for keys in first:
            done += _pairs([keys], seed, ranks, pools)
            if len(done) == cut:
                state = json.loads(json.dumps(first.state_dict()))
                break
        if state is not None:
            break
    if state is None:
        return
    resumed = sampler()
    resumed.load_state_dict(state)
    rest = _pairs(_keys(resumed), seed, ranks, pools)  # the rest of the epoch (the next one, at an epoch's end)
    for e in range(resumed.epoch + 1, 2):
        resumed.set_epoch(e)
        rest += _pairs(_keys(resumed), seed, ranks, pools)
    assert done + rest == full


def test_pools_borrow_the_nearest_aspect_then_area_and_refuse_when_empty():
    pools = class_pools(np.array([2, 2, 4, -1]), RES)  # class images at 64x64 and 128x32 only
    assert pools.counts.tolist() == [0, 0, 2, 0, 1, 0]
    assert pools.source.tolist() == [2, 2, 2, 2, 4, 2]  # 96x48 (aspect 2) is nearer 64x64 (1) than 128x32 (4)
    assert class_pools(np.array([-1, -1]), RES).source.tolist() == [-1] * len(RES)
    with pytest.raises(ValueError, match="No class row"):
        class_pools(np.array([-1]), RES).pool(0)


# ------------------------------------------------------------------------------------------ the loss
def _per_sample(fn, weights):
    """The per-sample losses of one draw, read through the weighted mean: weight B on sample i, 0 elsewhere."""
    n = len(weights)
    return [float(fn(torch.eye(n)[i] * n)) for i in range(n)]


@pytest.mark.parametrize("scheme", ["none", "cosmap"])
def test_flow_loss_is_instance_mean_plus_weight_times_class_mean(scheme):
    g = torch.Generator().manual_seed(0)
    pred, latents, noise = (torch.randn(4, 3, 4, 4, generator=g) for _ in range(3))
    sigmas = torch.rand(4, generator=g)
    noisy = (1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise

    def loss(w):
        return flow_matching_loss(pred, latents, noise, noisy, sigmas, scheme, False, w)

    each = _per_sample(loss, [1] * 4)
    assert float(loss(None)) == pytest.approx(np.mean(each), rel=1e-6)
    for weight in (0.0, 0.5, 1.0, 3.0):
        want = np.mean(each[:2]) + weight * np.mean(each[2:])
        assert float(loss(prior_sample_weights(2, 2, weight))) == pytest.approx(want, rel=1e-6)
    assert float(loss(prior_sample_weights(2, 2, 0.0))) == pytest.approx(np.mean(each[:2]), rel=1e-6)  # instance only


@pytest.mark.parametrize("snr_gamma", [None, 5.0])
def test_unet_loss_is_instance_mean_plus_weight_times_class_mean(snr_gamma):
    from diffusers import DDPMScheduler

    g = torch.Generator().manual_seed(1)
    stats = torch.stack([torch.randn(4, 4, 4, 4, generator=g), torch.full((4, 4, 4, 4), 0.1)], dim=1)
    batch = {"latent_stats": stats, "captions": ["a", "b", "c", "d"],
             "original_sizes": torch.full((4, 2), 32), "crop_top_lefts": torch.zeros(4, 2),
             "target_sizes": torch.full((4, 2), 32)}
    args = SimpleNamespace(noise_offset=0, timestep_bias_strategy="none", input_perturbation=0,
                           proportion_empty_prompts=0, dream_training=False, snr_gamma=snr_gamma)
    vae = SimpleNamespace(config={"scaling_factor": 1.0})

    def loss(w):
        b = dict(batch) if w is None else {**batch, SAMPLE_WEIGHTS: w}
        return unet_loss(args, DDPMScheduler(), vae, b, lambda c: (torch.zeros(len(c), 2, 8), None),
                         torch.Generator().manual_seed(7), torch.float32, lambda x, t, *_: torch.tanh(x) * 0.7)

    each = _per_sample(loss, [1] * 4)
    assert float(loss(None)) == pytest.approx(np.mean(each), rel=1e-5)
    for weight in (0.0, 1.0, 2.5):
        want = np.mean(each[:2]) + weight * np.mean(each[2:])
        assert float(loss(prior_sample_weights(2, 2, weight))) == pytest.approx(want, rel=1e-5)


def test_prior_sample_weights():
    assert prior_sample_weights(2, 2, 1.0).tolist() == [2.0, 2.0, 2.0, 2.0]
    assert prior_sample_weights(3, 1, 0.5).tolist() == pytest.approx([4 / 3] * 3 + [2.0])
    with pytest.raises(ValueError):
        prior_sample_weights(2, 0, 1.0)


# ------------------------------------------------------------------------------------------ generation
class _RecordingPipeline:
    """Stands in for the family's pipeline: records each call, returns images of the asked size."""

    def __init__(self, calls):
        self.calls = calls

    def to(self, device):
        return self

    def set_progress_bar_config(self, **kw):
        pass

    def __call__(self, prompt, height, width, generator, **kw):
        self.calls.append({"n": len(prompt), "size": (width, height), "seeds": [g.initial_seed() for g in generator],
                           **kw})
        return SimpleNamespace(images=[Image.new("RGB", (width, height), (len(self.calls), 0, 0)) for _ in prompt])


def _generate(folder, calls, *, rank=0, world=1, num=5, instance=(2, 2, 3, 0)):
    family = SimpleNamespace(build_pipeline=lambda *a, **k: _RecordingPipeline(calls))
    accelerator = SimpleNamespace(is_main_process=rank == 0, is_local_main_process=rank == 0, process_index=rank,
                                  num_processes=world, device=torch.device("cpu"), wait_for_everyone=lambda: None)
    args = SimpleNamespace(class_data_dir=str(folder), num_class_images=num, class_prompt="a dog", seed=3,
                           sample_batch_size=2, prior_generation_precision=None, text_encoder_out_layers=None)
    buckets = SimpleNamespace(resolutions=RES)
    return class_images.generate_class_images(args, accelerator, SimpleNamespace(family=family, unet=None), buckets,
                                              np.array(instance), num_inference_steps=2)


def test_generation_completes_the_folder_keeps_what_is_there_and_resumes(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    Image.new("RGB", (40, 30)).save(folder / "mine.jpg")  # the user's own class image
    Image.new("RGB", (30, 40)).save(folder / "class-000001.png")  # left by an interrupted run
    (folder / ".class-000002.png.tmp").write_bytes(b"half")  # an unfinished write: not an image, not counted
    (folder / "notes.txt").write_text("not an image")
    calls: list[dict] = []
    counts = _generate(folder, calls)
    assert (counts.reused, counts.generated) == (2, 3)
    names = [p.name for p in class_images.class_image_files(folder)]
    assert names == ["class-000000.png", "class-000001.png", "class-000002.png", "class-000003.png", "mine.jpg"]
    assert sum(c["n"] for c in calls) == 3 and all(c["n"] <= 2 and c["num_inference_steps"] == 2 for c in calls)
    # each image's seed is a function of (seed, k) only, and its shape the instance buckets' (here 64x64, 96x48)
    assert sorted(s for c in calls for s in c["seeds"]) == sorted(class_images.image_seed(3, k) for k in (0, 2, 3))
    assert {c["size"] for c in calls} <= {tuple(RES[b]) for b in (0, 2, 3)}
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    calls.clear()
    again = _generate(folder, calls)  # a rerun: nothing missing, nothing touched
    assert (again.reused, again.generated, calls) == (5, 0, [])
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_every_process_generates_its_own_share(tmp_path):
    seeds = []
    for rank in (0, 1):
        calls: list[dict] = []
        counts = _generate(tmp_path / "c", calls, rank=rank, world=2, num=5)
        assert counts.generated == 5 - rank * 3  # rank 1 runs after rank 0 here: it finds rank 0's 3 images
        seeds.append(sorted(s for c in calls for s in c["seeds"]))
    assert seeds[0] == sorted(class_images.image_seed(3, k) for k in (0, 2, 4))  # k % 2 == 0 of the 5 missing


def test_missing_names_and_generation_buckets_are_pure():
    assert class_images.missing_names(["class-000001.png", "x.jpg"], 4) == [(0, "class-000000.png"),
                                                                             (2, "class-000002.png")]
    assert class_images.missing_names(["a.png"] * 3, 2) == []
    b = class_images.generation_buckets(np.arange(8), 8, np.array([0, 0, 0, 0, 3, 3, -1, 5, 5]))
    assert np.bincount(b, minlength=6).tolist() == [4, 0, 0, 2, 0, 2]


# ------------------------------------------------------------------------------------------ flags
BASE = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", "d", "--instance_prompt", "p", "--rank", "4"]
PRIOR = ["--with_prior_preservation", "--class_data_dir", "c", "--class_prompt", "a dog"]


@pytest.mark.parametrize("extra, message", [
    (["--with_prior_preservation", "--class_prompt", "x"], "--with_prior_preservation needs --class_data_dir"),
    (["--with_prior_preservation", "--class_data_dir", "c"], "--with_prior_preservation needs --class_prompt"),
    ([*PRIOR, "--num_class_images", "0"], "--num_class_images must be >= 1"),
    ([*PRIOR, "--sample_batch_size", "0"], "--sample_batch_size must be >= 1"),
    ([*PRIOR, "--prior_loss_weight", "-1"], "--prior_loss_weight must be >= 0"),
    ([*PRIOR, "--cache_latents"], "does not combine with --cache_latents yet"),
    ([*PRIOR, "--resolution", "512,1024"], "does not combine with several tiers"),
])
def test_prior_flag_mistakes_are_one_line(extra, message):
    with pytest.raises(script.UsageError, match=message) as err:
        script.parse_args([*BASE, *extra])
    assert "\n" not in str(err.value)


def test_prior_flags_parse_with_upstream_defaults_and_pick_the_prior_source(caplog):
    args = script.parse_args([*BASE, *PRIOR])
    assert (args.num_class_images, args.prior_loss_weight, args.sample_batch_size) == (100, 1.0, 4)
    assert source_class(args) is PriorSource
    assert source_class(script.parse_args(BASE)) is not PriorSource
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        script.parse_args([*BASE, "--class_data_dir", "c", "--prior_loss_weight", "2"])
    assert "--class_data_dir, --prior_loss_weight: no effect without --with_prior_preservation" in caplog.text


def test_a_resume_that_drops_or_adds_prior_preservation_is_refused_naming_the_flag():
    from hf_arb.train.flags.resume_flags import flag_differences, shaping_flags

    prior, plain = shaping_flags(script.parse_args([*BASE, *PRIOR])), shaping_flags(script.parse_args(BASE))
    assert flag_differences(prior, prior) == [] and flag_differences({"rank": 4}, prior) == []  # older records
    assert any("--with_prior_preservation" in line for line in flag_differences(prior, plain))
    assert any("--with_prior_preservation" in line for line in flag_differences(plain, prior))


def test_generation_precision_is_upstreams():
    assert class_images.generation_dtype(None, torch.device("cpu")) == torch.float32
    assert class_images.generation_dtype("no", SimpleNamespace(type="cuda")) == torch.float16
    assert class_images.generation_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(SystemExit):
        script.parse_args([*BASE, *PRIOR, "--prior_generation_precision", "fp8"])


def test_the_prior_source_answers_as_the_map_style_sources_before_the_models(assets, tmp_path):
    """Before any model loads, a prior run's source plans the instance rows as a plain one (the same sampler, epochs,
    checkpoints); only its loader and its statistics differ."""
    from hf_arb.train.sources import build_source

    argv = ["--pretrained_model_name_or_path", assets["sd"], "--instance_data_dir", assets["images"],
            "--instance_prompt", "p", "--output_dir", str(tmp_path), "--resolution", "64", "--bucket_step", "16",
            "--train_batch_size", "2", "--rank", "4", "--seed", "0"]
    one = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True, is_local_main_process=True)
    plain, prior = (build_source(script.parse_args([*argv, *extra]), None) for extra in ([], PRIOR))
    assert type(prior) is PriorSource
    for s in (plain, prior):
        s.start(one)
    assert prior.sampler.state_dict() == plain.sampler.state_dict() and prior.schedule(1) == plain.schedule(1)
    assert [list(b) for b in prior.sampler] == [list(b) for b in plain.sampler]
    assert {"class_images_generated", "class_images_reused", "latents_encoded"} <= set(prior.stats(0))


# ------------------------------------------------------------------------------------------ 2 processes

@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
def test_two_ranks_generate_their_shares_and_a_resume_trains_the_same_pairs(ddp_batch):
    """The shared 2-process batch (tests/_train_fixtures.py, "prior-sd"): 4 class images generated by 2 ranks, 4
    steps with a checkpoint at 2, then a resume of checkpoint-2 that finds the images and trains exactly steps 2-3."""
    full, resumed = batch_result(ddp_batch, "prior-sd-full"), batch_result(ddp_batch, "prior-sd-resumed")
    assert (full["stats"]["class_images_generated"], full["stats"]["class_images_reused"]) == (4, 0)
    assert (resumed["stats"]["class_images_generated"], resumed["stats"]["class_images_reused"]) == (0, 4)
    traces = {}
    for name, run in (("full", full), ("resumed", resumed)):
        traces[name] = [[json.loads(line) for line in (run["out"] / "batches" / f"rank{r}.jsonl").read_text()
                         .splitlines()] for r in (0, 1)]
    r0, r1 = traces["full"]
    assert [t["bucket"] for t in r0] == [t["bucket"] for t in r1] and len(r0) == 4  # one bucket per step
    assert all(t["shape"][0] == 4 for t in r0 + r1)  # 2 instance + 2 class images per rank
    for rank in (0, 1):
        after = [t for t in traces["full"][rank] if t["step"] >= 2]
        again = traces["resumed"][rank]
        assert [(t["step"], t["rows"], t["shape"]) for t in again] == [(t["step"], t["rows"], t["shape"])
                                                                       for t in after]
        assert [t["loss"] for t in again] == pytest.approx([t["loss"] for t in after], rel=1e-6)
