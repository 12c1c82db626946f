"""hf-arb report: the offline HTML report (hf_arb/report.py), its CLI, push_to_hub(report=True) and buckets --fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
from _fake_hub import FakeHub
from _photos import save_photo

import hf_arb
import hf_arb.images.fitting
from hf_arb import BucketBatchSampler, BucketedImageDataset, BucketSet, add_bucket_columns
from hf_arb.annotate.report import build_report, cover_crop, render_html
from hf_arb.cli.app import main as cli_main
from hf_arb.images.geometry import plan_fit

# real photos: landscape, portrait (EXIF-rotated), a banner, a thumbnail, a broken file
SPECS = [("coffee.png", None, 1), ("chelsea.png", None, 6), ("rocket.jpg", None, 1), ("coffee.png", (1000, 120), 1),
         ("motorcycle_left.png", None, 8), ("cell.png", None, 1), ("astronaut.png", None, 1),
         ("hubble_deep_field.jpg", (60, 40), 1), ("astronaut.png", (300, 310), 1), ("rocket.jpg", (640, 400), 1)]
BUCKETS = BucketSet.preset("budget", resolution=512)


def make_photo_folder(d: Path) -> Path:
    for i, (name, size, o) in enumerate(SPECS):
        save_photo(d / f"{i:02d}_{name.split('.')[0]}.jpg", name, "JPEG", o, size=size, quality=85)
    (d / "99_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    return d


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("report_photos"))


@pytest.fixture(scope="module")
def raw(folder: Path) -> datasets.Dataset:
    return datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")


@pytest.fixture(scope="module")
def annotated(raw: datasets.Dataset) -> datasets.Dataset:
    return add_bucket_columns(raw, BUCKETS, show_summary=False, max_upscale=6.0)


def _ids(ds: datasets.Dataset) -> np.ndarray:
    return np.asarray(ds["bucket"], dtype=np.int64)


@pytest.mark.filterwarnings("ignore:BucketBatchSampler drops:UserWarning")
@pytest.mark.parametrize("leftover,batch,procs", [("drop", 2, 1), ("fill", 1, 2), ("catch_all", 2, 1)])
def test_plan_numbers_are_the_samplers_report(annotated, leftover, batch, procs):
    rep = build_report(annotated, k=0, batch_size=batch, num_processes=procs, leftover=leftover)
    ids = _ids(annotated)
    plan = BucketBatchSampler(ids, batch, num_replicas=procs, rank=0, leftover=leftover, buckets=BUCKETS,
                              log_report=False).report()
    assert rep.plan == plan
    assert rep.counts.tolist() == np.bincount(ids[ids >= 0], minlength=len(BUCKETS)).tolist()
    assert {b: int(s) for b, s in enumerate(rep.steps) if s} == plan.batches_per_bucket
    assert int(rep.steps.sum()) == plan.steps
    if leftover == "drop":
        assert int(rep.dropped.sum()) == plan.rows_dropped > 0 and int(rep.repeated.sum()) == 0
    elif leftover == "fill":
        assert int(rep.repeated.sum()) == plan.rows_repeated > 0 and int(rep.dropped.sum()) == 0
    page = render_html(rep)
    flag = {"drop": "--bucket_leftover fill", "fill": "--bucket_leftover drop", "catch_all": "--bucket_leftover fill"}
    assert flag[leftover] in page


def test_thumbnails_show_trainings_crop_and_decode_only_k_per_bucket(annotated, monkeypatch):
    opened = []
    real_open = hf_arb.images.fitting.open_image
    monkeypatch.setattr(hf_arb.images.fitting, "open_image", lambda src: opened.append(src) or real_open(src))
    rep = build_report(annotated, k=1, seed=3)
    nonempty = int((rep.counts > 0).sum())
    assert len(opened) == rep.decoded == nonempty  # one decode per non-empty bucket, none for the metadata pass
    data = BucketedImageDataset(annotated, caption_column=None, seed=3, check_sizes=False)
    flipping = BucketedImageDataset(annotated, caption_column=None, seed=3, check_sizes=False, random_flip=True)
    ids = _ids(annotated)
    w = np.asarray(annotated["original_width"], dtype=object)
    h = np.asarray(annotated["original_height"], dtype=object)
    for b, samples in rep.samples.items():
        assert len(samples) == 1
        s = samples[0]
        assert ids[s.row] == b
        # the crop training draws (epoch 0, --seed 3); a flip mirrors pixels, not where the crop sits
        assert s.crop_box == data.fit_row(s.row).source_box == flipping.fit_row(s.row).source_box
        bw, bh = BUCKETS[b]
        assert s.crop_fraction == pytest.approx(float(cover_crop(w[s.row], h[s.row], bw, bh)[0]))
        assert s.uri.startswith("data:image/jpeg;base64,")
    centre = build_report(annotated, k=1, center_crop=True)
    some = next(iter(centre.samples.values()))[0]
    assert some.crop_box == plan_fit(some.size, BUCKETS[int(ids[some.row])], crop="center").source_box


def test_page_is_self_contained_and_names_outliers_and_skips(annotated):
    page = render_html(build_report(annotated, k=2))
    assert "<script" not in page.lower()
    # nothing fetched from anywhere: every src/href is a data: URI
    refs = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)""", page)
    assert refs and all(r.startswith("data:") for r in refs)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert page.count("<svg") == 3  # bucket chart, crop-fraction and aspect-error histograms
    # skipped files with their reasons and the flag; outliers with file names and flags
    assert "99_bad.jpg" in page and "unreadable" in page and "fix or remove it" in page
    assert "07_hubble_deep_field.jpg" in page and "--max-upscale" in page  # 60x40 thumbnail: skipped as upscale
    assert "03_coffee.jpg" in page and "--aspect-range" in page  # the 1000x120 banner: the most extreme aspect
    assert "--max-aspect-error" in page


def test_raw_dataset_is_annotated_on_the_fly_like_annotate(raw, annotated):
    a = build_report(raw, BUCKETS, k=0, max_upscale=6.0)
    b = build_report(annotated, k=0)
    assert a.counts.tolist() == b.counts.tolist() and a.skipped == b.skipped == {"upscale": 1, "unreadable": 1}
    with pytest.raises(ValueError, match=r"image_column='img'.*columns are"):
        build_report(raw, image_column="img")


def test_cli_report_from_folder_parquet_and_saved_dataset(folder, annotated, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert cli_main(["report", str(folder), "--out", str(out), "--train_batch_size", "2", "-k", "1"]) == 0
    page = out.read_text()
    assert "data:image/jpeg;base64," in page and "steps per epoch" in page
    annotated.save_to_disk(str(tmp_path / "saved"))
    annotated.to_parquet(str(tmp_path / "a.parquet"))
    for src in (tmp_path / "saved", tmp_path / "a.parquet"):
        assert cli_main(["report", str(src), "--out", str(tmp_path / "s.html"), "-k", "1"]) == 0
        # the annotated dataset's own BucketSet, not the default preset
        assert f"fingerprint {BUCKETS.fingerprint}" in (tmp_path / "s.html").read_text()
    with pytest.raises(SystemExit):
        cli_main(["report", str(tmp_path / "nope"), "--out", str(out)])
    assert "no such folder" in capsys.readouterr().err


def test_push_to_hub_puts_the_report_next_to_the_card(annotated, tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    hf_arb.push_to_hub(annotated, "me/photos", report={"k": 1, "batch_size": 2})
    repo = hub.repo_dir("me/photos")
    assert (repo / "README.md").is_file()
    page = (repo / "report.html").read_text()
    assert "me/photos" in page and page.count("data:image/jpeg;base64,") >= 1
    assert f"fingerprint {BUCKETS.fingerprint}" in page


def test_cli_buckets_fit(folder, annotated, tmp_path, capsys):
    saved = tmp_path / "fit.json"
    assert cli_main(["buckets", "--fit", str(folder), "--n-buckets", "3", "--resolution", "512", "--step", "32",
                     "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    bs = BucketSet.from_json(saved.read_text())
    assert 1 <= len(bs) <= 3 and (bs.resolutions % 32 == 0).all() and (bs.areas <= 512 * 512).all()
    assert "1 row skipped or without a size left out" in out and "--aspect_ratio_buckets" in out
    # the string it prints trains/annotates with exactly this table
    spec = re.search(r'--aspect_ratio_buckets "([^"]+)"', out).group(1)
    assert BucketSet.from_string(spec, metric="log") == bs
    # the same table from the annotated copy (sizes read from its columns) and from the Python API
    annotated.save_to_disk(str(tmp_path / "saved"))
    assert cli_main(["buckets", "--fit", str(tmp_path / "saved"), "--n-buckets", "3", "--resolution", "512",
                     "--step", "32", "--save", str(tmp_path / "fit2.json")]) == 0
    w = [int(x) for x in annotated["original_width"] if x]
    h = [int(x) for x in annotated["original_height"] if x]
    assert BucketSet.fit((np.array(w), np.array(h)), 3, step=32, max_pixels=512 * 512) == bs
    assert json.loads((tmp_path / "fit2.json").read_text())["resolutions"] == bs.resolutions.tolist()
    with pytest.raises(SystemExit):
        cli_main(["buckets", "--fit", str(folder), "--n-buckets", "1", "--max-crop", "0.01"])
    assert "--max-crop 0.01 cannot be met" in capsys.readouterr().err


def test_a_plan_without_a_step_is_shown_not_raised(annotated):
    """A global batch larger than every bucket: training would stop with the sampler's error; the report shows it."""
    rep = build_report(annotated, k=0, batch_size=8, num_processes=2)
    assert rep.plan is None and "zero batches" in rep.plan_error
    with pytest.raises(ValueError, match="zero batches") as err:
        BucketBatchSampler(_ids(annotated), 8, num_replicas=2, rank=0, buckets=BUCKETS)
    page = render_html(rep)
    assert "id='plan-error'" in page and str(err.value).split(";")[0].replace("'", "&#x27;") in page
    assert "Remedies" in page and (rep.steps == 0).all()


@pytest.mark.parametrize("flags,message", [
    (["--metric", "linear"], "--fit minimises the crop of the 'log' assignment"),
    (["--resolution", "1048576"], "--resolution 1048576 looks like a pixel count (1024²); pass the side"),
    (["--preset", "sdxl"], "--fit makes its own table"),
    (["--scheduler", "x"], "fit first, then run hf-arb buckets --aspect-ratio-buckets"),
])
def test_cli_buckets_fit_refuses_flags_it_would_ignore(folder, flags, message, capsys):
    """Every bucket flag `hf-arb buckets` takes either shapes the fit or stops it with the fix, never ignored."""
    with pytest.raises(SystemExit) as e:
        cli_main(["buckets", "--fit", str(folder), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_annotation_options_on_an_annotated_dataset_fail_loudly(annotated, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"annotated already, so \['max_upscale'\] would change nothing"):
        build_report(annotated, max_upscale=2.0)
    # with a bucket set given, the dataset is annotated again here and the option applies
    again = build_report(annotated, BUCKETS, k=0, max_upscale=2.0)
    assert again.skipped["upscale"] > build_report(annotated, k=0).skipped["upscale"]
    annotated.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(SystemExit):
        cli_main(["report", str(tmp_path / "saved"), "--out", str(tmp_path / "r.html"), "--min-size", "100"])
    assert "annotated already" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:BucketBatchSampler drops:UserWarning")
def test_pixel_budget_batches_are_the_samplers(annotated):
    """--max_pixels_per_batch: a batch size per bucket; per-bucket drops still add up to the sampler's report."""
    budget = 2 * 384 * 640  # two 384x640 images; one of the larger 448x576 and 512x512
    rep = build_report(annotated, k=0, batch_size=3, max_pixels_per_batch=budget)
    plan = BucketBatchSampler(_ids(annotated), 3, rank=0, num_replicas=1, buckets=BUCKETS, log_report=False,
                              max_pixels_per_batch=budget).report()
    assert rep.plan == plan and len(set(plan.batch_size_per_bucket.values())) > 1
    assert int(rep.dropped.sum()) == plan.rows_dropped and int(rep.steps.sum()) == plan.steps
    page = render_html(rep)
    assert "--max_pixels_per_batch" in page
    for b, size in plan.batch_size_per_bucket.items():
        assert re.search(rf"<tr data-bucket='{b}'>.*?<td data-field='batch'>{size}</td>", page)


def test_a_truncated_jpeg_is_a_problem_with_the_verify_hint(tmp_path, capsys):
    """issue 34: a JPEG cut short (its header reads, so annotation keeps it) was listed only under "thumbnails that
    could not be drawn": it is a problem, named on the page and in the console, with the --verify hint."""
    d = tmp_path / "photos"
    save_photo(d / "good.jpg", "coffee.png", "JPEG", quality=85)
    save_photo(d / "cut.jpg", "chelsea.png", "JPEG", quality=85)
    data = (d / "cut.jpg").read_bytes()
    (d / "cut.jpg").write_bytes(data[: len(data) // 3])  # an interrupted download
    out = tmp_path / "r.html"
    assert cli_main(["report", str(d), "--out", str(out), "-k", "2"]) == 0
    said = capsys.readouterr().out
    problem = [line for line in said.splitlines() if line.startswith("problem:")]
    assert len(problem) == 1 and "1 kept image could not be decoded (cut.jpg)" in problem[0], said
    assert "--verify" in problem[0]
    page = out.read_text()
    section = page[page.index("<h2 id='problems'>Problems</h2>"):page.index("<h2>Buckets</h2>")]
    assert "cut.jpg" in section and "--verify" in section and "good.jpg" not in section


def test_an_exact_fit_crops_zero_not_minus_zero(tmp_path):
    """issue 34: a photo of its bucket's exact shape showed "crop -0.0%" (1 - 1.0000000000000002); and a bucket
    with one row said "1 rows"."""
    from hf_arb.wording import count, percent

    assert cover_crop(np.array([70.0]), np.array([70.0]), np.array([512.0]), np.array([512.0]))[0][0] == 0.0
    assert percent(-2.220446049250313e-16) == "0.0%" and percent(-0.0, 2) == "0.00%" and percent(-0.05) == "-5.0%"
    assert count(1, "row") == "1 row" and count(1200, "row") == "1,200 rows" and count(0, "row") == "0 rows"
    d = tmp_path / "photos"
    save_photo(d / "square.jpg", "coffee.png", "JPEG", size=(70, 70))  # 512x512 at the budget table: exact
    save_photo(d / "wide.jpg", "rocket.jpg", "JPEG", size=(640, 400))
    page = render_html(build_report(datasets.load_dataset("imagefolder", data_dir=str(d), split="train"), BUCKETS,
                                    k=1, max_upscale=10.0))
    assert "crop 0.0%" in page and "-0.0" not in page
    assert re.search(r"<h3>\d+x\d+ — 1 row</h3>", page) and "1 rows" not in page
