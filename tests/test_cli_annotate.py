"""`hf-arb annotate` / `hf-arb stats` end to end on a local imagefolder, a Parquet file and a (fake) Hub push."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from _fake_hub import FakeHub
from _photos import save_photo
from PIL import Image

from hf_arb import BucketSet
from hf_arb.annotate.map import BUCKET_COLUMNS
from hf_arb.cli.app import main


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("my_images")
    specs = [("coffee.png", None, 1), ("chelsea.png", None, 6), ("rocket.jpg", (427, 900), 1),
             ("motorcycle_left.png", None, 1), ("hubble_deep_field.jpg", (1200, 500), 1), ("cell.png", None, 8)]
    for i, (name, size, o) in enumerate(specs):
        save_photo(d / f"img{i}.jpg", name, "JPEG", o, size=size, quality=85)
    save_photo(d / "sub" / "img_png.png", "horse.png", "PNG")
    (d / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe1 not really a jpeg")
    return d


def _assert_real_chart(path: Path) -> None:
    assert path.is_file()
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert 600 <= im.width <= 4000 and 300 <= im.height <= 2000
        px = np.asarray(im.convert("L"))
    assert px.std() > 5, "the chart is blank"
    assert (px < 100).mean() > 0.001, "no dark ink (bars, text) on the chart"


def test_annotate_imagefolder_to_disk_then_stats(image_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "annotated"
    rc = main(["annotate", str(image_dir), "--output-dir", str(out), "--preset", "novelai", "--max-upscale", "3"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "rows: 8" in printed and "unreadable 1" in printed and "512 x 768" in printed
    _assert_real_chart(out / "bucket_chart.png")
    back = datasets.load_from_disk(str(out))
    train = back["train"]
    assert set(BUCKET_COLUMNS) <= set(train.column_names)
    assert BucketSet.from_dataset(back) == BucketSet.novelai()
    assert train.num_rows == 8 and train["bucket"].count(-1) == 1

    plot = tmp_path / "stats.png"
    rc = main(["stats", str(out), "--plot", str(plot)])
    assert rc == 0
    stats_out = capsys.readouterr().out
    assert "rows: 8  kept: 7  skipped: 1" in stats_out
    _assert_real_chart(plot)


def test_annotate_parquet_metadata_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    n = 2000
    ds = datasets.Dataset.from_dict({"url": [f"https://example.com/{i}.jpg" for i in range(n)],
                                     "WIDTH": rng.integers(200, 4000, n), "HEIGHT": rng.integers(200, 4000, n)})
    src = tmp_path / "laion.parquet"
    ds.to_parquet(str(src))
    out = tmp_path / "laion_annotated"
    rc = main(["annotate", str(src), "--output-dir", str(out), "--preset", "sdxl", "--width-column", "WIDTH",
               "--height-column", "HEIGHT", "--aspect-range", "0.5", "2.0", "--split", "train"])
    assert rc == 0
    back = datasets.load_from_disk(str(out))
    assert isinstance(back, datasets.Dataset)
    bs = BucketSet.sdxl(aspect_range=(0.5, 2.0))
    assert BucketSet.from_dataset(back) == bs
    ids, _ = bs.assign(back["WIDTH"], back["HEIGHT"])
    assert back["bucket"] == ids.tolist()
    assert "aspect" in capsys.readouterr().out


def test_annotate_push_to_hub(image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    rc = main(["annotate", str(image_dir), "--push-to-hub", "me/my-data", "--preset", "budget", "--resolution", "512"])
    assert rc == 0
    repo = hub.repo_dir("me/my-data")
    back = datasets.load_dataset(str(repo))
    assert BucketSet.from_dataset(back) == BucketSet.from_budget(512)
    assert (repo / "hf_arb" / "bucket_chart.png").is_file()
    rc = main(["stats", str(repo), "--split", "train"])
    assert rc == 0


def test_annotate_streaming_to_disk(image_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "streamed"
    rc = main(["annotate", str(image_dir), "--output-dir", str(out), "--preset", "novelai", "--streaming",
               "--split", "train"])
    assert rc == 0
    streamed = datasets.load_from_disk(str(out))
    assert BucketSet.from_dataset(streamed) == BucketSet.novelai() and streamed.num_rows == 8
    assert streamed["skip_reason"].count("unreadable: truncated or corrupt JPEG header") == 1
    good = streamed.filter(lambda r: r >= 0, input_columns="bucket")
    sizes = [im.size for im in good["image"]]  # images still decode after the streaming copy
    assert sizes == list(zip(good["original_width"], good["original_height"]))


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["annotate", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")])
    assert exc.value.code == 2 and "no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["annotate", str(tmp_path)])  # neither --output-dir nor --push-to-hub


@pytest.fixture(scope="module")
def outlier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real photos plus the two outliers of issue 17: a 2000×100 banner and a 32×48 thumbnail."""
    d = tmp_path_factory.mktemp("outliers")
    save_photo(d / "banner.jpg", "coffee.png", "JPEG", size=(2000, 100))
    save_photo(d / "thumb.jpg", "chelsea.png", "JPEG", size=(32, 48))
    save_photo(d / "rocket.jpg", "rocket.jpg", "JPEG")
    save_photo(d / "astronaut.png", "astronaut.png", "PNG")
    save_photo(d / "cell.png", "cell.png", "PNG")
    return d


def _annotate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["annotate", *argv]) == 0
    return capsys.readouterr().out


def test_summary_warns_about_outliers_and_the_flags_skip_them(outlier_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = _annotate([str(outlier_dir), "--output-dir", str(tmp_path / "a"), "--preset", "novelai"], capsys)
    assert "rows: 5  kept: 5  skipped: 0" in out
    assert "warning: 1 kept row has an aspect error above 0.25 (worst 1.609): cropped far from its shape" in out
    assert "2000x100 -> bucket 1024x256 (aspect error 1.609)" in out and "--max-aspect-error 0.25" in out
    assert "warning: 2 kept rows must be upscaled more than 2x to cover their bucket (worst 16.0x)" in out
    assert "32x48 -> bucket 512x768 (16.0x)" in out and "--max-upscale 2 or --min-size" in out
    # issue 34: the examples name the files, not only row numbers
    examples = {line.split(": ")[1]: line for line in out.splitlines() if line.startswith("  e.g. row ")}
    assert "banner.jpg" in examples["2000x100 -> bucket 1024x256 (aspect error 1.609)"], examples
    assert "thumb.jpg" in examples["32x48 -> bucket 512x768 (16.0x)"], examples

    out = _annotate([str(outlier_dir), "--output-dir", str(tmp_path / "b"), "--preset", "novelai",
                     "--max-aspect-error", "0.25", "--max-upscale", "2"], capsys)
    assert "rows: 5  kept: 3  skipped: 2" in out and "skipped by reason: aspect 1, upscale 1" in out
    assert "warning" not in out  # both skipped, recorded and counted
    back = datasets.load_from_disk(str(tmp_path / "b"))["train"]
    reasons = dict(zip(back["original_width"], back["skip_reason"]))
    assert reasons[2000] == "aspect" and reasons[32] == "upscale" and back["bucket"].count(-1) == 2

    out = _annotate([str(outlier_dir), "--output-dir", str(tmp_path / "c"), "--preset", "novelai",
                     "--min-size", "64"], capsys)
    assert "skipped by reason: too_small 1" in out and "aspect error above 0.25" in out
    assert "upscaled more than 2x" in out and "(16.0x)" not in out  # the banner (2.6x) still warns, not the thumb


@pytest.mark.parametrize("extra, message", [
    (["--image-column", "img"], "--image-column 'img': the dataset has no such column; its columns are ['image']"),
    (["--width-column", "w", "--height-column", "h"], "--width-column 'w': the dataset has no such column"),
    (["--width-column", "w"], "pass both --width-column and --height-column, or neither"),
    (["--split", "test"], "--split 'test': "),
    (["--max-upscale", "0"], "argument --max-upscale: must be a finite number > 0, got 0"),
    (["--min-size", "-1"], "argument --min-size: must be >= 0 pixels, got -1"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
    (["--num-proc", "x"], "argument --num-proc: expected a positive integer, got 'x'"),
    (["--aspect-range", "2", "1"], "--aspect-range must be (min, max)"),
    (["--preset", "pixart", "--resolution", "100"], "got 100. Pass one of those as --resolution."),
])
def test_annotate_errors_are_argparse_errors_in_flags(outlier_dir: Path, tmp_path: Path, extra: list[str],
                                                      message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["annotate", str(outlier_dir), "--output-dir", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exc.value.code == 2 and last.startswith("hf-arb annotate: error: ") and message in last, err
    assert "Traceback" not in err and "`" not in last
    assert not any(f"{p}=" in last for p in ("image_column", "width_column", "height_column", "max_upscale",
                                             "min_size", "aspect_range")), "Python argument names leaked"


def test_non_numeric_size_column_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "meta.csv"
    src.write_text("url,W,H\na.jpg,512,512\nb.jpg,wide,300\n")
    with pytest.raises(SystemExit) as exc:
        main(["annotate", str(src), "--output-dir", str(tmp_path / "o"), "--width-column", "W", "--height-column", "H"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "Size column 'W' must hold numbers" in last and "'wide'" in last
    assert "--image-column instead" in last and "image_column=" not in last


def test_entry_point_lists_commands() -> None:
    script = Path(sys.executable).parent / "hf-arb"  # the console script pyproject installs
    if not script.exists():
        pytest.skip("hf-arb console script not installed in this environment")
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "annotate" in res.stdout and "stats" in res.stdout


def test_stats_on_an_unannotated_dataset_says_the_command_to_run(image_dir: Path, tmp_path: Path, capsys):
    """In commands, not Python arguments (issue 24, item 7): no "pass the bucket ids as an array"."""
    import datasets

    raw = tmp_path / "raw"
    datasets.load_dataset("imagefolder", data_dir=str(image_dir), split="train").save_to_disk(str(raw))
    with pytest.raises(SystemExit) as exit_:
        main(["stats", str(raw)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and f"{raw} has no bucket columns" in err
    assert f"hf-arb annotate {raw} --output-dir {raw}-arb" in err and "array" not in err and "`" not in err


# ------------------------------------------------------------------ stats --resolution: rows per tier and bucket
def _tier_lines(text: str) -> dict[int, dict[str, int]]:
    """``{resolution: {"WxH": rows}}`` from the printed tier table (one split)."""
    out: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        if line.startswith("tier ") and " row" in line:
            current = out.setdefault(int(line.split()[1].rstrip(":")), {})
        elif line.startswith("  ") and "x" in line and out:
            label, rows = line.split()
            current[label] = int(rows.replace(",", ""))
    return out


def test_stats_rows_per_tier_and_bucket_match_the_sampler_and_draw_the_chart(
        image_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_arb.sampling import TieredBatchSampler
    from hf_arb.sampling.tiered.plan import Tiers

    out = tmp_path / "annotated"
    assert main(["annotate", str(image_dir), "--output-dir", str(out)]) == 0
    capsys.readouterr()
    chart = tmp_path / "tiers.png"
    assert main(["stats", str(out), "--resolution", "256,512", "--chart", str(chart)]) == 0
    printed = capsys.readouterr().out
    assert "rows: 8  in no tier: 1" in printed  # the broken JPEG has no size: eligible nowhere
    # issue 34: the rows in no tier are named by file, not only counted
    named = [line for line in printed.splitlines() if line.startswith("  row ")]
    assert len(named) == 1 and named[0].endswith("broken.jpg): no size (skipped at annotation)"), named
    table = _tier_lines(printed)
    assert sorted(table) == [256, 512]
    train = datasets.load_from_disk(str(out))["train"]
    w = np.array([np.nan if v is None else v for v in train["original_width"]], float)
    h = np.array([np.nan if v is None else v for v in train["original_height"]], float)
    for r in (256, 512):  # a row is in tier r iff it covers its bucket there without upscaling
        bs = BucketSet.preset("budget", r)
        ok = np.isfinite(w)
        ids, _ = bs.assign(w[ok], h[ok])
        size = bs.resolutions[ids]
        covers = (w[ok] >= size[:, 0]) & (h[ok] >= size[:, 1])
        labels = bs.labels()
        want: dict[str, int] = {}
        for b in ids[covers].tolist():
            want[labels[b]] = want.get(labels[b], 0) + 1
        assert table[r] == want, r
    assert sum(table[256].values()) == 7 and 0 < sum(table[512].values()) < 7  # small photos skip 512
    # the same rows per (tier, bucket) as the sampler the training script builds from those flags
    tiers = Tiers.preset("budget", [256, 512])
    report = TieredBatchSampler.from_dataset(train, tiers, "mix:256:1,512:1", batch_size=1, num_replicas=1).report()
    for t, r in enumerate((256, 512)):
        labels = tiers.bucket_sets[t].labels()
        assert {labels[b]: v["rows"] for b, v in report.tiers[t]["buckets"].items()} == table[r]
    _assert_real_chart(chart)

    # --max-upscale lets every readable photo serve the 512 tier
    assert main(["stats", str(out), "--resolution", "256,512", "--max-upscale", "4", "--split", "train"]) == 0
    assert sum(_tier_lines(capsys.readouterr().out)[512].values()) == 7


@pytest.mark.parametrize("extra, message", [
    (["--max-upscale", "2"], "--max-upscale describes the tiers, but no --resolution is given"),
    (["--preset", "budget"], "--preset describes the tiers, but no --resolution is given"),
    (["--resolution", "256,512", "--preset", "sdxl"], "--preset sdxl is a fixed table"),
    (["--resolution", "256,256"], "the tiers must be distinct sides"),
    (["--resolution", "256,512", "--max-upscale", "0"], "must be a finite number > 0"),
])
def test_stats_tier_flags_are_refused_in_flags(image_dir: Path, extra: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["stats", str(image_dir), *extra])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and message in last, last


def test_stats_imports_no_torch(image_dir: Path, tmp_path: Path) -> None:
    """issue 34: `hf-arb stats` on 40 rows took 8-10 s, about 4 s of it importing torch, which it never uses (the tier
    table imported hf_arb.sampling before it knew there were tiers). A fresh interpreter runs it and reports."""
    out = tmp_path / "annotated"
    assert main(["annotate", str(image_dir), "--output-dir", str(out)]) == 0
    code = ("import sys\nfrom hf_arb.cli.app import main\nrc = main(['stats', sys.argv[1]])\n"
            "print('torch imported:', 'torch' in sys.modules)\nsys.exit(rc)")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "rows: 8  kept: 7" in res.stdout and "torch imported: False" in res.stdout, res.stdout[-1000:]


def test_rows_in_no_tier_are_named_with_why() -> None:
    """The lines under "in no tier": a row too small for every tier (its size) and one without a size."""
    from hf_arb.cli.tier_stats import format_tier_counts, no_tier_examples, stored_sizes
    from hf_arb.sampling.tier_plan import Tiers, tier_bucket_ids
    from hf_arb.sampling.tier_report import tier_row_counts

    ds = datasets.Dataset.from_dict({"original_width": [40, 600, None], "original_height": [30, 400, None]})
    tiers = Tiers.preset("budget", [256, 512])
    ids = tier_bucket_ids(*stored_sizes(ds), tiers)
    examples = no_tier_examples(ds, ids)
    assert examples == ("row 0: 40x30, too small for every tier", "row 2: no size (skipped at annotation)")
    counts, no_tier = tier_row_counts(ids, tiers.num_buckets)
    text = format_tier_counts(tiers, counts, no_tier, 3, examples[:1])
    assert "in no tier: 2" in text and "  row 0: 40x30" in text and "  ... and 1 more" in text
    assert "tier 256: 1 row (33%)" in text  # not "1 rows"


def test_training_annotation_note_names_outlier_files_in_its_image_column(outlier_dir: Path) -> None:
    """The training script's annotation note (a raw dataset annotated at start-up) names the outliers' files from
    --image_column, whatever its name."""
    from hf_arb import add_bucket_columns
    from hf_arb.train.data import annotation_note

    ds = datasets.load_dataset("imagefolder", data_dir=str(outlier_dir), split="train").rename_column("image", "photo")
    bs = BucketSet.novelai()
    note = annotation_note(add_bucket_columns(ds, bs, image_column="photo", show_summary=False), bs, "photo")
    thumb = [line for line in note.splitlines() if "32x48 -> bucket 512x768" in line]
    assert len(thumb) == 1 and "thumb.jpg" in thumb[0] and "--max-upscale 2" in note, note
