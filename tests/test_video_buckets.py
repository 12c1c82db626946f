"""Bucket sets with a frame axis (issue 37, item 2): (k, 3) tables of (width, height, frames), one code path with the
(k, 2) image tables.

Property tests compare the vectorised matching with a brute-force loop over the table; the stored configuration
round-trips a frame axis and old 2-D configurations keep loading.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_arb import BucketSet
from hf_arb.buckets.matching import SHORT_CLIP_REASON

SIDES = st.integers(1, 40).map(lambda k: 16 * k)


@st.composite
def clip_tables(draw, max_k: int = 12) -> list[tuple[int, int, int]]:
    """A (k, 3) table: a few frame counts, each with a few (width, height) shapes."""
    counts = draw(st.lists(st.integers(1, 200), min_size=1, max_size=4, unique=True))
    rows = []
    for f in counts:
        shapes = draw(st.lists(st.tuples(SIDES, SIDES), min_size=1, max_size=max(1, max_k // len(counts)),
                               unique=True))
        rows += [(w, h, f) for w, h in shapes]
    return draw(st.permutations(rows))


def brute_force(table: np.ndarray, w: np.ndarray, h: np.ndarray, f: np.ndarray, loop: bool) -> tuple:
    """Per row: the expected frame count (0 = skipped) and the least log-aspect error among that frame's buckets."""
    counts = np.unique(table[:, 2])
    want_f, best = [], []
    for wi, hi, fi in zip(w.tolist(), h.tolist(), f.tolist()):
        fit = counts[counts <= fi]
        frame = int(fit.max()) if fit.size else (int(counts[0]) if loop else 0)
        group = table[table[:, 2] == (frame or counts[0])]
        best.append(float(np.min(np.abs(np.log(wi / hi) - np.log(group[:, 0] / group[:, 1])))))
        want_f.append(frame)
    return np.asarray(want_f), np.asarray(best)


@settings(max_examples=150, deadline=None)
@given(table=clip_tables(), loop=st.booleans(),
       rows=st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4000), st.integers(1, 400)), min_size=1,
                     max_size=40))
def test_clip_matching_is_largest_frame_count_then_nearest_aspect(table, loop, rows):
    bs = BucketSet(table, short_clips="loop" if loop else "skip")
    w, h, f = (np.asarray(c) for c in zip(*rows))
    ids, err = bs.assign(w, h, f)
    want_f, best = brute_force(bs.resolutions, w, h, f, loop)
    kept = ids >= 0
    assert np.array_equal(kept, want_f > 0)  # skipped exactly when shorter than every frame count (and not looped)
    assert np.array_equal(bs.too_short(f), want_f == 0)
    assert np.array_equal(bs.resolutions[ids[kept], 2], want_f[kept])  # the largest frame count <= the clip's
    assert np.allclose(err, best, atol=2e-5)  # and the nearest aspect among that frame count's buckets
    got = np.abs(np.log(w[kept] / h[kept]) - np.log(bs.aspects[ids[kept]]))
    assert np.allclose(got, best[kept], atol=2e-5)


@settings(max_examples=100, deadline=None)
@given(shapes=st.lists(st.tuples(SIDES, SIDES), min_size=1, max_size=15, unique=True),
       metric=st.sampled_from(["log", "linear", "linear_hw", "cross"]),
       sizes=st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 5000)), min_size=1, max_size=50))
def test_an_image_is_a_one_frame_clip(shapes, metric, sizes):
    """A clip set's 1-frame buckets take images exactly as the image set of the same shapes does (every metric)."""
    w, h = (np.asarray(c) for c in zip(*sizes))
    images = BucketSet(shapes, metric=metric)
    clips = BucketSet([(a, b, 1) for a, b in shapes] + [(a, b, 33) for a, b in shapes], metric=metric)
    ids, err = images.assign(w, h)
    cids, cerr = clips.assign(w, h)  # frames=None: images
    assert np.array_equal(ids, cids) and np.array_equal(err, cerr)
    assert np.array_equal(cids, clips.assign(w, h, np.ones_like(w))[0])
    long_ids = clips.assign(w, h, np.full_like(w, 40))[0]  # clips of 40 frames: the 33-frame copies
    assert np.array_equal(long_ids, ids + len(shapes))


def test_image_set_is_unchanged_and_refuses_clips():
    bs = BucketSet.novelai()
    assert bs.resolutions.shape == (19, 2) and not bs.has_frames
    assert bs.frames.tolist() == [1] * 19 and bs.frame_counts.tolist() == [1]
    assert np.array_equal(bs.volumes, bs.areas)
    assert "short_clips" not in bs.to_dict()  # the fingerprints of earlier releases stay
    assert bs.assign([600], [400], [1])[0].tolist() == bs.assign([600], [400])[0].tolist()
    with pytest.raises(ValueError, match="no frame axis"):
        bs.assign([600], [400], [81])
    with pytest.raises(ValueError, match="frame axis"):
        BucketSet([(512, 512)], short_clips="loop")
    assert not bs.too_short([1, 81]).any()


def test_clip_set_basics():
    bs = BucketSet([(832, 480, 81), (480, 832, 81), (1280, 720, 1), (1024, 1024, 17)])
    assert bs.has_frames and bs.frames.tolist() == [81, 81, 1, 17] and bs.frame_counts.tolist() == [1, 17, 81]
    assert bs.labels() == ["832x480x81", "480x832x81", "1280x720x1", "1024x1024x17"]
    assert bs[0] == (832, 480, 81) and list(bs)[2] == (1280, 720, 1)
    assert bs.volumes.tolist() == [832 * 480 * 81, 480 * 832 * 81, 1280 * 720, 1024 * 1024 * 17]
    assert bs.index((480, 832, 81)) == 1
    with pytest.raises(ValueError, match="pass 3 numbers"):
        bs.index((480, 832))
    # 100 frames -> 81; 20 -> 17 (the only 17-frame bucket); 1 -> the image bucket
    ids, _ = bs.assign([1920, 1080, 640], [1080, 1920, 480], [100, 20, 1])
    assert ids.tolist() == [0, 3, 2]
    assert "frames" in bs.table() and "area x frames" in bs.table()
    summary = bs.summarize(*bs.assign([1920, 1080], [1080, 1920], [81, 90]))
    assert summary.to_dict()["counts"] == {"832x480x81": 1, "480x832x81": 1, "1280x720x1": 0, "1024x1024x17": 0}
    assert "x 81" in str(summary)


def test_short_clips_skip_or_loop():
    table = [(832, 480, 17), (832, 480, 33)]
    skip, loop = BucketSet(table), BucketSet(table, short_clips="loop")
    frames = np.asarray([1, 16, 17, 32, 33, 500])
    w, h = np.full(6, 1920), np.full(6, 1080)
    assert skip.assign(w, h, frames)[0].tolist() == [-1, -1, 0, 0, 1, 1]
    assert skip.too_short(frames).tolist() == [True, True, False, False, False, False]
    assert loop.assign(w, h, frames)[0].tolist() == [0, 0, 0, 0, 1, 1]
    assert not loop.too_short(frames).any()
    assert SHORT_CLIP_REASON == "too_few_frames"
    assert skip != loop and "short_clips='loop'" in repr(loop)


@settings(max_examples=50, deadline=None)
@given(table=clip_tables(), loop=st.booleans(), err=st.none() | st.floats(0, 1))
def test_clip_set_dict_round_trip(table, loop, err):
    bs = BucketSet(table, short_clips="loop" if loop else "skip", max_aspect_error=err)
    back = BucketSet.from_json(bs.to_json())
    assert back == bs and back.fingerprint == bs.fingerprint
    assert np.array_equal(back.resolutions, bs.resolutions) and back.short_clips == bs.short_clips
    assert bs.replace(max_aspect_error=0.5).resolutions.shape == (len(table), 3)


def test_old_two_d_config_keeps_loading():
    """A configuration stored by an earlier release (no frame axis, no short_clips) loads as the same image set."""
    old = {"format": 1, "resolutions": [[512, 768], [768, 512]], "metric": "log", "max_aspect_error": None,
           "aspect_range": None}
    bs = BucketSet.from_dict(old)
    assert bs.resolutions.shape == (2, 2) and bs.to_dict() == old


def _annotated(bs: BucketSet, w, h, f):
    import datasets

    ids, err = bs.assign(w, h, f)
    res = bs.resolutions[ids]
    return datasets.Dataset.from_dict({
        "bucket": ids.tolist(), "bucket_width": res[:, 0].tolist(), "bucket_height": res[:, 1].tolist(),
        "bucket_frames": res[:, 2].tolist(), "original_width": list(w), "original_height": list(h),
        "aspect_error": err.tolist(), "skip_reason": [None] * len(w),
    })


def test_stored_clip_set_round_trips_through_the_bucket_feature(tmp_path):
    import datasets

    from hf_arb.buckets.schema import read_resolutions, with_stored_buckets

    bs = BucketSet([(832, 480, 81), (480, 832, 81), (640, 640, 1)], short_clips="loop")
    w, h, f = [1920, 1080, 500, 800], [1080, 1920, 500, 800], [90, 81, 1, 1]
    ds = with_stored_buckets(_annotated(bs, w, h, f), bs)
    ds.save_to_disk(str(tmp_path / "ds"))
    back = datasets.load_from_disk(str(tmp_path / "ds"))
    assert BucketSet.from_dataset(back) == bs and BucketSet.from_dataset(back).short_clips == "loop"
    assert json.loads(back.features["bucket"].id.split(":", 1)[1])["resolutions"][0] == [832, 480, 81]
    assert read_resolutions(back).tolist() == bs.resolutions.tolist()


def test_clip_set_rebuilt_from_columns():
    """Without the stored feature, the bucket_frames column gives the (k, 3) table back."""
    from hf_arb.buckets.schema import read_resolutions
    from hf_arb.buckets.stored import bucket_table_from_columns

    bs = BucketSet([(832, 480, 81), (480, 832, 81), (640, 640, 1)])
    ds = _annotated(bs, [1920, 1080, 500], [1080, 1920, 500], [90, 81, 1])
    assert BucketSet.from_dataset(ds).resolutions.tolist() == bs.resolutions.tolist()
    assert bucket_table_from_columns(ds) == {0: (832, 480, 81), 1: (480, 832, 81), 2: (640, 640, 1)}
    assert read_resolutions(ds).shape == (3, 3)
    # an image dataset without the column keeps its (k, 2) table
    images = ds.remove_columns("bucket_frames")
    assert read_resolutions(images).tolist() == [[832, 480], [480, 832], [640, 640]]


# ------------------------------------------------------------------------------------------- presets and budget
def _pipeline(name: str):
    """A diffusers video pipeline with every component None (its __init__ falls back to its own defaults)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, name)
    required = {p: None for p, v in inspect.signature(cls.__init__).parameters.items()
                if p != "self" and v.default is inspect.Parameter.empty}
    return cls(**required)


def _defaults(fn, *names: str) -> tuple:
    import inspect

    params = inspect.signature(fn).parameters
    return tuple(params[n].default for n in names)


def _check_inputs(pipe, width: int, height: int) -> None:
    """The pipeline's own check_inputs on one bucket's size (prompt given, everything else None)."""
    import inspect

    params = inspect.signature(pipe.check_inputs).parameters
    pipe.check_inputs(prompt="a clip", height=height, width=width,
                      **{k: None for k, v in params.items()
                         if v.default is inspect.Parameter.empty and k not in ("prompt", "height", "width")})


@pytest.mark.parametrize("name, pipeline", [("wan", "WanPipeline"), ("ltx", "LTXPipeline"),
                                            ("hunyuan_video", "HunyuanVideoPipeline")])
def test_video_presets_follow_their_pipelines(name: str, pipeline: str) -> None:
    """Each preset's budget is its pipeline's default clip, which is a bucket; every bucket passes the pipeline's own
    check_inputs, has a frame count its VAE encodes, and costs at most the budget in pixels x frames."""
    import diffusers

    from hf_arb.buckets.frames import FRAME_RULES
    from hf_arb.buckets.presets import VIDEO_PRESET_INFO

    info, rule, bs = VIDEO_PRESET_INFO[name], FRAME_RULES[name], BucketSet.preset(name)
    height, width, frames = _defaults(getattr(diffusers, pipeline).__call__, "height", "width", "num_frames")
    assert info.default == (width, height, frames) and pipeline in rule.pipelines
    assert (width, height, frames) in list(bs)
    assert bs.has_frames and all(rule.is_valid(int(f)) for f in bs.frame_counts)
    assert bs.frame_counts.tolist() == list(info.frames) and max(info.frames) == frames
    assert (bs.volumes <= width * height * frames).all() and (bs.areas <= info.max_pixels).all()
    pipe = _pipeline(pipeline)
    for w, h in {(w, h) for w, h, _ in bs}:
        _check_inputs(pipe, w, h)
    with pytest.raises(ValueError, match="divisible"):  # and the check does refuse what it should
        _check_inputs(pipe, width + info.step // 2, height)


def test_other_pipeline_defaults_fit_the_presets() -> None:
    """LTX-2's default frame (768x512 at its 121 latent-preparation frames) is an ltx bucket; HunyuanVideo 1.5's default
    clip (its 16:9 frame at target size 640, 121 frames) fits the hunyuan_video step and frame rule."""
    import diffusers
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    from hf_arb.buckets.frames import FRAME_RULES

    h, w = _defaults(diffusers.LTX2Pipeline.__call__, "height", "width")
    (f,) = _defaults(diffusers.LTX2Pipeline.prepare_latents, "num_frames")
    assert (w, h, f) in list(BucketSet.preset("ltx"))
    _check_inputs(_pipeline("LTXPipeline"), w, h)
    (spatial,) = _defaults(diffusers.AutoencoderKLHunyuanVideo15.__init__, "spatial_compression_ratio")
    h15, w15 = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial).calculate_default_height_width(9, 16, 640)
    (f15,) = _defaults(diffusers.HunyuanVideo15Pipeline.__call__, "num_frames")
    assert w15 % 16 == 0 and h15 % 16 == 0 and FRAME_RULES["hunyuan_video"].is_valid(f15)
    ids, _ = BucketSet.preset("hunyuan_video").assign([w15], [h15], [f15])
    assert BucketSet.preset("hunyuan_video").resolutions[ids[0]].tolist() == [1280, 720, 97]


def test_video_preset_options_and_refusals() -> None:
    from hf_arb.buckets.presets import PRESETS, VIDEO_PRESETS
    from hf_arb.checks import UsageError

    assert VIDEO_PRESETS == ("wan", "ltx", "hunyuan_video") and not set(VIDEO_PRESETS) & set(PRESETS)
    bs = BucketSet.preset("wan", frames=[1, 41, 81, 121])  # longer clips: lower resolutions, the same budget
    assert bs.frame_counts.tolist() == [1, 41, 81, 121]
    assert (bs.volumes <= 832 * 480 * 121).all() and bs.areas[bs.frames == 121].max() < 832 * 480
    with pytest.raises(UsageError, match=r"40 frames do not fit the wan VAE rule \(4k\+1 frames\): use 37 or 41"):
        BucketSet.preset("wan", frames=[1, 40])
    with pytest.raises(UsageError, match="multiples of 32"):
        BucketSet.preset("ltx", step=16)
    assert BucketSet.preset("ltx", step=64).resolutions[:, :2].max() % 64 == 0
    big = BucketSet.preset("wan", resolution=1024)  # 1024² frames at 81 frames: the cap rises with it
    assert [1024, 1024, 81] in big.resolutions.tolist()
    with pytest.raises(ValueError, match="Unknown bucket preset 'wan2'.*'hunyuan_video'"):
        BucketSet.preset("wan2")
    assert BucketSet.from_dict(bs.to_dict()) == bs


@settings(max_examples=80, deadline=None)
@given(side=st.integers(8, 64).map(lambda k: 16 * k), counts=st.lists(st.integers(0, 40), min_size=1, max_size=5,
                                                                      unique=True),
       step=st.sampled_from([16, 32, 64]), cap=st.none() | st.integers(1, 16))
def test_budget_in_pixels_times_frames(side, counts, step, cap):
    """Every bucket costs at most the budget (resolution² x the longest frame count) in pixels x frames and at most
    max_pixels per frame; a frame count that the cap does not bind uses at least 3/4 of its share of the budget
    (unless the step grid has nothing that large), and a longer clip never has a larger frame."""
    frames = sorted(4 * k + 1 for k in counts)
    max_pixels = None if cap is None else cap * side * side
    try:
        bs = BucketSet.from_budget(side, [16 / 9, 1.0, 3 / 4], step=step, frames=frames, max_pixels=max_pixels,
                                   frame_rule="wan")
    except ValueError as e:  # a budget that leaves less than one step² per frame at the longest count
        assert "less than one" in str(e) or "must not exceed" in str(e)
        return
    budget = side * side * max(frames)
    per_frame = np.minimum(4 * side * side if max_pixels is None else max_pixels, budget // bs.frames)
    assert (bs.volumes <= budget).all() and (bs.areas <= per_frame).all()
    assert bs.frame_counts.tolist() == frames
    largest = {int(f): int(bs.areas[bs.frames == f].max()) for f in bs.frame_counts}
    assert all(largest[a] >= largest[b] for a, b in zip(frames, frames[1:]))
    roomy = per_frame >= 4 * step * step * 4
    assert (bs.areas[roomy] >= 0.75 * per_frame[roomy] - 1e-9).all() or step > side // 4


def test_from_budget_refusals() -> None:
    from hf_arb.checks import UsageError

    with pytest.raises(UsageError, match="8 frames do not fit the ltx rule"):
        BucketSet.from_budget(512, frames=[1, 8], frame_rule="ltx")
    with pytest.raises(ValueError, match="pass `frames` too"):
        BucketSet.from_budget(512, max_pixels=10)
    with pytest.raises(ValueError, match="distinct positive frame counts"):
        BucketSet.from_budget(512, frames=[0, 5])


# ------------------------------------------------------------------------------------------- batch sizes, sampler
MIXED = [(640, 640, 1), (832, 480, 1), (480, 832, 1), (640, 640, 17), (832, 480, 17), (480, 832, 33),
         (832, 480, 33)]


def test_tokens_and_batch_sizes_per_bucket() -> None:
    from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_pixels, batch_sizes_for_tokens, tokens_per_sample

    bs = BucketSet(MIXED)
    tokens = tokens_per_sample(bs, spatial=16, frame_step=4)
    w, h, f = bs.resolutions.T
    assert tokens.tolist() == ((w // 16) * (h // 16) * ((f - 1) // 4 + 1)).tolist()
    # the pipelines' own count: Wan's latent (num_frames - 1) // 4 + 1 frames of (h / 8 / 2) x (w / 8 / 2) patches
    assert tokens_per_sample([(832, 480, 81)], spatial=16, frame_step=4)[0] == 21 * 30 * 52
    assert tokens_per_sample([(704, 512, 161)], spatial=32, frame_step=8, patch_t=2)[0] == 22 * 16 * 11  # ceil(21 / 2)
    sizes = batch_sizes_for_tokens(bs, 32768, frame_step=4)
    assert (sizes * tokens <= 32768).all() and ((sizes + 1) * tokens > 32768).all()  # the most that fit
    images = batch_sizes_for_tokens(bs, 32768, frame_step=4, image_batch_size=3, max_batch_size=4)
    assert images[f == 1].tolist() == [3, 3, 3] and images[f > 1].tolist() == np.minimum(sizes[f > 1], 4).tolist()
    with pytest.raises(ValueError, match=r"cannot hold one sample of bucket 5 \(480x832x33"):
        batch_sizes_for_tokens(bs, 10_000, frame_step=4)
    # a pixel budget counts pixels x frames for clips
    assert batch_sizes_for_pixels(bs, 832 * 480 * 33).tolist() == (832 * 480 * 33 // bs.volumes).tolist()


def _rank_steps(ids, batch_size, world: int, epoch: int, **kw) -> list[list[list[int]]]:
    from hf_arb import BucketBatchSampler

    out = []
    for r in range(world):
        s = BucketBatchSampler(ids, batch_size, num_replicas=world, rank=r, log_report=False, **kw)
        s.set_epoch(epoch)
        out.append([list(b) for b in s.shard()])
    return out


@settings(max_examples=25, deadline=None)
@given(data=st.data(), world=st.integers(1, 4), seed=st.integers(0, 2**31), leftover=st.sampled_from(["drop", "fill"]),
       merge=st.booleans(), image_bs=st.none() | st.integers(1, 6), budget=st.sampled_from([16384, 32768, 65536]))
@pytest.mark.filterwarnings("ignore:BucketBatchSampler drops", "ignore:BucketBatchSampler repeats")
def test_batches_never_mix_images_and_clips(data, world, seed, leftover, merge, image_bs, budget) -> None:
    """Every rank simulated over a dataset that mixes images and clips: at each step every rank trains one bucket,
    so one frame count (an image never shares a batch with a clip, nor a 17-frame clip with a 33-frame one), with
    that bucket's batch size from the token budget (or the image batch size), also when small buckets merge."""
    from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_tokens

    bs = BucketSet(MIXED)
    n = data.draw(st.integers(200, 600))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    frames = np.where(rng.random(n) < 0.4, 1, rng.integers(17, 60, n))  # 40 % images, the rest clips
    w, h = rng.integers(300, 2000, n), rng.integers(300, 2000, n)
    ids, _ = bs.assign(w, h, frames)
    sizes = batch_sizes_for_tokens(bs, budget, frame_step=4, image_batch_size=image_bs)
    kw = dict(buckets=bs, seed=seed, leftover=leftover, merge_small=merge)
    per_rank = _rank_steps(ids, dict(enumerate(sizes.tolist())), world, 1, **kw)
    assert len({len(r) for r in per_rank}) == 1
    for s in range(len(per_rank[0])):
        rows = np.asarray([per_rank[r][s] for r in range(world)])  # (world, b)
        bucket_frames = bs.frames[ids[rows]]
        assert np.unique(bucket_frames).size == 1, "a batch mixes frame counts"
        assert np.unique(frames[rows] == 1).size == 1, "a batch mixes images and clips"
        if not merge:
            assert np.unique(ids[rows]).size == 1 and rows.shape[1] == sizes[ids[rows[0, 0]]]
    with pytest.raises(ValueError, match="catch_all' would put rows of different frame counts"):
        _rank_steps(ids, dict(enumerate(sizes.tolist())), 1, 1, buckets=bs, leftover="catch_all")


def test_merge_small_buckets_stays_within_a_frame_count() -> None:
    from hf_arb.sampling.planning.plan import merge_small_buckets

    counts = np.array([100, 2, 100, 3])
    aspects = np.array([1.0, 1.002, 1.02, 0.5])
    frames = np.array([1, 17, 17, 1])
    assert merge_small_buckets(counts, aspects, 10).tolist() == [0, 0, 2, 0]  # across frame counts: 1 -> 0
    assert merge_small_buckets(counts, aspects, 10, frames).tolist() == [0, 2, 2, 0]


# ------------------------------------------------------------------------------------------- flow shift
def test_clip_shift_counts_latent_frames_as_ltx_does() -> None:
    """mu per clip bucket equals LTXPipeline's: calculate_shift(latent_frames x latent_h x latent_w, ...)."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    from hf_arb.buckets.frames import FRAME_RULES
    from hf_arb.families.shift import ShiftConfig, bucket_shift_table, check_latent_sizes, shift_table_text

    cfg = ShiftConfig(base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                      use_dynamic_shifting=True)
    bs = BucketSet.preset("ltx")
    table = bucket_shift_table(bs, cfg, vae_scale_factor=32, patch_size=1, frame_step=FRAME_RULES["ltx"].step)
    for (w, h, f), n, mu in zip(bs, table["image_seq_len"].tolist(), table["mu"].tolist()):
        seq = ((f - 1) // 8 + 1) * (h // 32) * (w // 32)  # pipeline_ltx.py's video_sequence_length
        assert n == seq
        assert mu == pytest.approx(calculate_shift(seq, 1024, 4096, 0.95, 2.05), rel=1e-12)
    assert "frames" in shift_table_text(bs, cfg, 32, 1, frame_step=8)
    with pytest.raises(ValueError, match="pass frame_step"):
        bucket_shift_table(bs, cfg, 32, 1)
    # a (k, 3) table is read as rows of three, not reflowed into pairs: 48x40x17 is not a multiple of 32
    with pytest.raises(ValueError, match="48x40"):
        check_latent_sizes(np.array([[64, 64, 17], [48, 40, 17]]), 32, 1)
    image = bucket_shift_table(BucketSet([(1024, 1024)]), cfg, 8, 2)  # image tables: as before
    assert image["image_seq_len"].tolist() == [4096]


def test_fit_with_a_frame_axis() -> None:
    """BucketSet.fit(frames=...): the aspects fitted to the sizes, at every frame count, under the pixels x frames
    budget; a clip then goes to the largest frame count <= its own."""
    from hf_arb.checks import UsageError

    sizes = [(4000, 3000)] * 6 + [(3000, 4000)] * 3 + [(1080, 1920)]
    images = BucketSet.fit(sizes, 3, step=16, max_pixels=832 * 480)
    clips = BucketSet.fit(sizes, 3, step=16, max_pixels=832 * 480, frames=[1, 41, 81], frame_rule="wan")
    assert clips.frame_counts.tolist() == [1, 41, 81] and len(clips) == 9
    assert (clips.volumes <= 832 * 480 * 81).all() and (clips.areas <= 4 * 832 * 480).all()
    for f in (1, 41, 81):  # the same three aspects at every frame count, to the step's rounding
        got = np.sort(clips.aspects[clips.frames == f])
        assert np.allclose(got, np.sort(images.aspects), rtol=0.03), (f, got)
    ids, _ = clips.assign([1920, 1080], [1080, 1920], [60, 200])
    assert clips.frames[ids].tolist() == [41, 81]
    with pytest.raises(UsageError, match="42 frames do not fit the wan rule"):
        BucketSet.fit(sizes, 3, frames=[1, 42], frame_rule="wan")


def test_video_presets_table_in_video_md_is_current() -> None:
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "docs"))
    import gen_reference

    doc = (root / "docs" / "video.md").read_text()
    assert gen_reference.video_md(doc) == doc, "docs/video.md video presets table is stale: run docs/gen_reference.py"


def test_one_frame_count_is_refused_naming_the_list() -> None:
    """The habit from diffusers' num_frames=81: frames is a list of frame counts (diffusion-pipe's frame_buckets)."""
    from hf_arb.checks import UsageError

    for call in (lambda: BucketSet.preset("wan", frames=81), lambda: BucketSet.from_budget(512, frames=17),
                 lambda: BucketSet.fit([(640, 480)], 1, frames=33)):
        with pytest.raises(UsageError, match=r"list of frame counts.*frame_buckets.*pass \[\d+\]"):
            call()
    assert BucketSet.preset("wan", frames=[81]).frame_counts.tolist() == [81]
