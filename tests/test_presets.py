"""Every model family's bucket table and matching rule, against its source.

Tables diffusers ships are imported from the installed diffusers (a diffusers change fails here); tables it does
not ship carry the upstream numbers with their source named.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from hf_arb import BucketSet
from hf_arb.buckets.presets import PRESET_INFO, PRESETS, preset_notes
from hf_arb.cli.app import main as cli_main

# OneTrainer: Nerogar/mgds src/mgds/pipelineModules/AspectBucketing.py @ 3a6994ad18a490acc4f3876658167525b7d88da7,
# AspectBucketing.__create_automatic_buckets(target_resolution, quantization), as (width, height).
ONETRAINER_UPSTREAM = {
    (512, 64): [(256, 1024), (256, 960), (320, 896), (320, 832), (384, 704), (448, 640), (448, 576), (512, 512),
                (576, 448), (640, 448), (704, 384), (832, 320), (896, 320), (960, 256), (1024, 256)],
    (1024, 64): [(512, 2048), (576, 1920), (576, 1792), (640, 1600), (704, 1472), (768, 1344), (832, 1280),
                 (896, 1152), (1024, 1024), (1152, 896), (1280, 832), (1344, 768), (1472, 704), (1600, 640),
                 (1792, 576), (1920, 576), (2048, 512)],
    (1024, 8): [(512, 2048), (544, 1912), (592, 1776), (648, 1616), (728, 1448), (776, 1352), (840, 1256),
                (912, 1144), (1024, 1024), (1144, 912), (1256, 840), (1352, 776), (1448, 728), (1616, 648),
                (1776, 592), (1912, 544), (2048, 512)],
}

# kohya-ss/sd-scripts library/model_util.py @ 48d368fa557731ad0488c07304dfeba8c07910eb,
# make_bucket_resolutions((r, r), min_size, max_size, divisible) — already (width, height), sorted.
KOHYA_UPSTREAM = {
    (512, 256, 1024, 64): [(256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640),
                           (448, 576), (512, 512), (576, 448), (640, 384), (704, 320), (768, 320), (832, 256),
                           (896, 256), (960, 256), (1024, 256)],
    (1024, 256, 2048, 64): [(256, 2048), (320, 2048), (384, 2048), (448, 2048), (512, 1856), (512, 1920),
                            (512, 1984), (512, 2048), (576, 1664), (576, 1728), (576, 1792), (640, 1536),
                            (640, 1600), (704, 1408), (704, 1472), (768, 1280), (768, 1344), (832, 1216),
                            (896, 1152), (960, 1088), (1024, 1024), (1088, 960), (1152, 896), (1216, 832),
                            (1280, 768), (1344, 768), (1408, 704), (1472, 704), (1536, 640), (1600, 640),
                            (1664, 576), (1728, 576), (1792, 576), (1856, 512), (1920, 512), (1984, 512),
                            (2048, 256), (2048, 320), (2048, 384), (2048, 448), (2048, 512)],
}


@pytest.fixture(scope="module")
def up():
    """The installed diffusers' tables and matching functions (imported once: pipelines import slowly)."""
    from diffusers import training_utils
    from diffusers.image_processor import PixArtImageProcessor
    from diffusers.pipelines.flux import pipeline_flux_kontext
    from diffusers.pipelines.hunyuandit import pipeline_hunyuandit
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_alpha, pipeline_pixart_sigma
    from diffusers.pipelines.sana import pipeline_sana

    a = pipeline_pixart_alpha
    return {
        "pixart": {256: a.ASPECT_RATIO_256_BIN, 512: a.ASPECT_RATIO_512_BIN, 1024: a.ASPECT_RATIO_1024_BIN,
                   2048: pipeline_pixart_sigma.ASPECT_RATIO_2048_BIN},
        "sana": {512: pipeline_sana.ASPECT_RATIO_512_BIN, 1024: pipeline_sana.ASPECT_RATIO_1024_BIN,
                 2048: pipeline_sana.ASPECT_RATIO_2048_BIN, 4096: pipeline_sana.ASPECT_RATIO_4096_BIN},
        "classify": PixArtImageProcessor.classify_height_width_bin,
        "hunyuan": pipeline_hunyuandit,
        "kontext": pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS,
        "tu": training_utils,
    }


def _sizes(n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Image sizes over a wide aspect range (1:6 … 6:1) and sizes, integer like real images."""
    rng = np.random.default_rng(seed)
    area = rng.uniform(64**2, 4096**2, n)
    aspect = np.exp(rng.uniform(np.log(1 / 6), np.log(6), n))
    w = np.maximum(1, np.round(np.sqrt(area * aspect))).astype(np.int64)
    h = np.maximum(1, np.round(np.sqrt(area / aspect))).astype(np.int64)
    return w, h


def _clear(dist: np.ndarray, tol: float = 1e-5) -> np.ndarray:
    """Rows whose best and second-best reference distance differ by more than ``tol`` (assign is float32)."""
    s = np.sort(dist, axis=1)
    return s[:, 1] - s[:, 0] > tol if s.shape[1] > 1 else np.ones(len(s), bool)


@pytest.mark.parametrize("name", ["pixart", "sana"])
def test_pixart_and_sana_tables_equal_diffusers_bins(up, name):
    for res, bins in up[name].items():
        bs = BucketSet.preset(name, resolution=res)
        assert [tuple(r) for r in bs] == [(int(w), int(h)) for h, w in bins.values()]  # [h, w] → (w, h), same order
        assert BucketSet.preset(name, resolution=res, metric="native").match_aspects.tolist() == pytest.approx(
            [1 / float(k) for k in bins])


@pytest.mark.parametrize("name, res", [("pixart", 256), ("pixart", 1024), ("pixart", 2048), ("sana", 4096)])
def test_pixart_native_matching_equals_classify_height_width_bin(up, name, res):
    bins = up[name][res]
    bs = BucketSet.preset(name, resolution=res, metric="native")
    w, h = _sizes()
    ids, _ = bs.assign(w, h)
    keys = np.array([float(k) for k in bins])
    clear = _clear(np.abs(keys[None, :] - (h / w)[:, None]))
    assert clear.mean() > 0.99
    for i in np.flatnonzero(clear):
        bh, bw = up["classify"](int(h[i]), int(w[i]), bins)
        assert bs[ids[i]] == (bw, bh), (w[i], h[i])


def test_hunyuan_dit_table_and_ratio_then_area_matching(up):
    hy = up["hunyuan"]
    bs = BucketSet.preset("hunyuan_dit", metric="native")
    assert [tuple(r) for r in bs] == [tuple(s) for s in hy.SUPPORTED_SHAPE]
    assert bs.nearest_area
    w, h = _sizes(seed=1)
    ids, _ = bs.assign(w, h)
    clear = _clear(np.abs(hy.STANDARD_RATIO[None, :] - (w / h)[:, None]))
    assert clear.mean() > 0.99
    for i in np.flatnonzero(clear):
        assert bs[ids[i]] == tuple(int(x) for x in hy.map_to_standard_shapes(int(w[i]), int(h[i])))


def test_flux_kontext_table_and_matching(up):
    bs = BucketSet.preset("flux_kontext", metric="native")
    assert [tuple(r) for r in bs] == list(up["kontext"])
    w, h = _sizes(seed=2)
    ids, _ = bs.assign(w, h)
    ref = np.array([bw / bh for bw, bh in up["kontext"]])
    clear = _clear(np.abs(ref[None, :] - (w / h)[:, None]))
    for i in np.flatnonzero(clear):  # the pipeline's own expression (pipeline_flux_kontext.py, _auto_resize)
        aspect = w[i] / h[i]
        _, bw, bh = min((abs(aspect - a / b), a, b) for a, b in up["kontext"])
        assert bs[ids[i]] == (bw, bh)


@pytest.mark.parametrize("res, div", [(1024, 16), (512, 16), (768, 64), (1000, 8), (64, 32)])
def test_diffusers_ladder_and_find_nearest_bucket(up, res, div):
    tu = up["tu"]
    ref = tu.generate_aspect_ratio_buckets(res, divisibility=div)
    bs = BucketSet.preset("diffusers", resolution=res, step=div, metric="native")
    assert [tuple(r) for r in bs] == [(w, h) for h, w in ref]
    w, h = _sizes(1500, seed=3)
    w = np.concatenate([w, [1000, 3, 1024, 16]])  # plus exact ties (a square between equals, ...)
    h = np.concatenate([h, [1000, 4, 1024, 9]])
    ids, err = bs.assign(w, h)
    expect = [tu.find_nearest_bucket(int(hh), int(ww), ref) for ww, hh in zip(w, h)]
    assert ids.tolist() == expect  # integer-exact, ties to the last bucket like its `<=`
    np.testing.assert_allclose(err, np.abs(h / w - bs.resolutions[ids, 1] / bs.resolutions[ids, 0]), rtol=1e-5)


def test_from_string_swaps_axes_and_matches_like_diffusers(up):
    tu = up["tu"]
    text = "1024,1024; 768,1360;1360,768;512,2048"
    bs = BucketSet.from_string(text)
    assert [tuple(r) for r in bs] == [(w, h) for h, w in tu.parse_buckets_string(text)]
    assert bs[1] == (1360, 768) and bs.metric == "cross"
    w, h = _sizes(500, seed=4)
    ids, _ = bs.assign(w, h)
    ref = tu.parse_buckets_string(text)
    assert ids.tolist() == [tu.find_nearest_bucket(int(hh), int(ww), ref) for ww, hh in zip(w, h)]
    assert BucketSet.from_string(text, metric="log").metric == "log"


@pytest.mark.parametrize("text", ["", "1024x1024", "1024,1024;0,512", "1024,-8", "a,b"])
def test_from_string_errors_name_the_bucket(text):
    with pytest.raises(ValueError, match="height,width"):
        BucketSet.from_string(text)


@pytest.mark.parametrize("key", sorted(ONETRAINER_UPSTREAM))
def test_onetrainer_table_and_matching(key):
    res, q = key
    bs = BucketSet.preset("onetrainer", resolution=res, step=q, metric="native")
    assert sorted(bs) == sorted(ONETRAINER_UPSTREAM[key])
    w, h = _sizes(seed=5)
    ids, _ = bs.assign(w, h)
    d = np.abs(bs.resolutions[:, 1] / bs.resolutions[:, 0] - (h / w)[:, None])  # mgds __get_bucket: on h/w
    clear = _clear(d)
    np.testing.assert_array_equal(ids[clear], d[clear].argmin(1))


def test_onetrainer_rounds_to_nearest_unlike_budget():
    ot, budget = set(BucketSet.preset("onetrainer")), set(BucketSet.from_budget(1024))
    assert len(ot) == len(budget) == 17 and len(ot - budget) == 8  # the count
    assert max(w * h for w, h in ot) > 1024**2  # nearest rounding may exceed the budget


@pytest.mark.parametrize("key", sorted(KOHYA_UPSTREAM))
def test_kohya_table_and_matching(key):
    res, lo, hi, step = key
    bs = BucketSet.preset("kohya", resolution=res, step=step, min_side=lo, max_side=hi, metric="native")
    assert [tuple(r) for r in bs] == KOHYA_UPSTREAM[key]  # same order: select_bucket's argmin ties agree
    w, h = _sizes(seed=6)
    ids, _ = bs.assign(w, h)
    d = np.abs(bs.aspects[None, :] - (w / h)[:, None])  # BucketManager.select_bucket on w/h
    clear = _clear(d)
    np.testing.assert_array_equal(ids[clear], d[clear].argmin(1))


def test_kohya_needs_max_side_at_least_resolution():
    with pytest.raises(ValueError, match="max_side=2048"):
        BucketSet.preset("kohya", resolution=2048)


def test_table_parameters_reach_the_table_and_others_the_constructor():
    nai = BucketSet.preset("novelai", max_area=256 * 384, max_side=512, min_side=128, max_aspect_error=0.2)
    assert nai == BucketSet.novelai(max_area=256 * 384, max_side=512, min_side=128, max_aspect_error=0.2)
    assert BucketSet.preset("budget", resolution=512, aspects=[1.0, 2.0]) == BucketSet.from_budget(512, [1.0, 2.0])
    with pytest.raises(TypeError):
        BucketSet.preset("pixart", min_side=256)  # not a table parameter of pixart, nor a constructor argument


def test_every_preset_builds_and_round_trips():
    for name in PRESETS:
        for metric in ("log", "native"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bs = BucketSet.preset(name, metric=metric)
            back = BucketSet.from_dict(json.loads(json.dumps(bs.to_dict())))
            assert back == bs and back.fingerprint == bs.fingerprint, name
            assert (back.match_aspects is None) == (bs.match_aspects is None), name
            if bs.match_aspects is not None:
                np.testing.assert_array_equal(back.match_aspects, bs.match_aspects)
            assert len(bs) >= 9, name


def test_fixed_presets_say_they_ignore_resolution():
    for name, info in PRESET_INFO.items():
        assert bool(preset_notes(name, resolution=768)) == (info.default_resolution is None), name
    with pytest.warns(UserWarning, match="'sdxl' ignores resolution=768"):
        BucketSet.preset("sdxl", resolution=768)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BucketSet.preset("sdxl")  # no resolution given: nothing to say
    with pytest.raises(ValueError, match=r"resolution \[256, 512, 1024, 2048\], got 768"):
        BucketSet.preset("pixart", resolution=768)


def test_plain_sets_keep_their_fingerprint_fields():
    d = BucketSet.novelai().to_dict()
    assert set(d) == {"format", "resolutions", "metric", "max_aspect_error", "aspect_range"}


def test_cli_lists_model_presets(capsys):
    assert cli_main(["buckets", "--preset", "pixart", "--resolution", "512"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 33 and {(int(r[1]), int(r[2])) for r in rows} >= {(256, 1024), (512, 512), (1024, 256)}
    assert cli_main(["buckets", "--preset", "hunyuan_dit", "--resolution", "768"]) == 0
    assert "ignores resolution=768" in capsys.readouterr().out
    assert cli_main(["buckets", "--aspect-ratio-buckets", "1024,768;768,1024", "--metric", "native"]) == 0
    out = capsys.readouterr().out
    assert "0    768    1024" in out and "metric='cross'" in out  # height first in the string, (w, h) printed


def test_native_sets_annotate_a_dataset_and_travel_with_it(tmp_path):
    import datasets

    from hf_arb import add_bucket_columns

    w, h = _sizes(300, seed=7)
    ds = datasets.Dataset.from_dict({"width": w.tolist(), "height": h.tolist()})
    for bs in (BucketSet.preset("hunyuan_dit", metric="native"), BucketSet.from_string("1024,1024;768,1360;1360,768")):
        out = add_bucket_columns(ds, bs, width_column="width", height_column="height")
        np.testing.assert_array_equal(np.asarray(out["bucket"]), bs.assign(w, h)[0])
        out.save_to_disk(tmp_path / bs.fingerprint)
        back = BucketSet.from_dataset(datasets.load_from_disk(tmp_path / bs.fingerprint))
        assert back == bs and back.nearest_area == bs.nearest_area and back.metric == bs.metric


def test_replace_keeps_the_matching_rule_unless_told():
    hy = BucketSet.preset("hunyuan_dit", metric="native")
    r = hy.replace(aspect_range=(0.5, 2.0))
    assert r.aspect_range == (0.5, 2.0) and r.nearest_area and np.array_equal(r.match_aspects, hy.match_aspects)
    assert r != hy and r.replace(aspect_range=None) == hy
    cross = hy.replace(metric="cross")
    assert cross.metric == "cross" and cross.match_aspects is None and not cross.nearest_area
