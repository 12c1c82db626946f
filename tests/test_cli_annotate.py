"""`hf-arb annotate` / `hf-arb stats` end to end on a local imagefolder, a Parquet file and a (fake) Hub push."""

from __future__ import annotations

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
from hf_arb.annotate import BUCKET_COLUMNS
from hf_arb.cli import main


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
    assert main(["annotate", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["annotate", str(tmp_path), "--output-dir", "o", "--width-column", "w"]) == 2
    assert "both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["annotate", str(tmp_path)])  # neither --output-dir nor --push-to-hub


def test_entry_point_lists_commands() -> None:
    script = Path(sys.executable).parent / "hf-arb"  # the console script pyproject installs
    if not script.exists():
        pytest.skip("hf-arb console script not installed in this environment")
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "annotate" in res.stdout and "stats" in res.stdout
