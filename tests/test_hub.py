"""The bucket configuration travels: disk, Parquet, CSV (columns only) and a Hub push at the HfApi boundary."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from _fake_hub import FakeHub
from _photos import save_photo
from huggingface_hub import CommitOperationAdd
from PIL import Image

import hf_arb
import hf_arb.annotate.hub
import hf_arb.annotate.plot
from hf_arb import BucketSet, add_bucket_columns
from hf_arb.annotate.hub import CARD_KEY, CHART_PATH_IN_REPO
from hf_arb.annotate.map import BUCKET_COLUMNS
from hf_arb.buckets.schema import bucket_table_from_columns, buckets_from_card, buckets_from_columns

# A configuration with every field set, so a lost field would show.
CONFIG = BucketSet.novelai(metric="linear", max_aspect_error=0.4, aspect_range=(0.3, 3.5))


@pytest.fixture(scope="module")
def annotated(tmp_path_factory: pytest.TempPathFactory) -> datasets.Dataset:
    d = tmp_path_factory.mktemp("hubimgs")
    specs = [("coffee.png", None, 1), ("chelsea.png", None, 6), ("rocket.jpg", None, 1), ("coffee.png", (1000, 120), 1),
             ("motorcycle_left.png", None, 8), ("cell.png", None, 1), ("astronaut.png", None, 1)]
    for i, (name, size, o) in enumerate(specs):
        save_photo(d / f"{i:02d}.jpg", name, "JPEG", o, size=size, quality=85)
    (d / "99_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    ds = datasets.load_dataset("imagefolder", data_dir=str(d), split="train")
    rng = np.random.default_rng(0)
    ds = ds.add_column("caption", [f"photo {i} {rng.integers(1000)}" for i in range(ds.num_rows)])
    return add_bucket_columns(ds, CONFIG, show_summary=False)


def _table(ds: datasets.Dataset) -> dict:
    return ds.remove_columns("image").to_dict()


def test_save_to_disk_round_trip(annotated: datasets.Dataset, tmp_path: Path) -> None:
    annotated.save_to_disk(str(tmp_path / "saved"))
    back = datasets.load_from_disk(str(tmp_path / "saved"))
    restored = BucketSet.from_dataset(back)
    assert restored == CONFIG and restored.to_dict() == CONFIG.to_dict()
    assert _table(back) == _table(annotated)


def test_parquet_round_trip(annotated: datasets.Dataset, tmp_path: Path) -> None:
    path = tmp_path / "annotated.parquet"
    annotated.to_parquet(str(path))
    back = datasets.load_dataset("parquet", data_files=str(path), split="train")
    assert BucketSet.from_dataset(back) == CONFIG
    assert _table(back) == _table(annotated)
    assert isinstance(back[0]["image"], Image.Image)
    streamed = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
    assert BucketSet.from_dataset(streamed) == CONFIG


def test_columns_alone_give_the_resolution_table(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    bs = BucketSet.from_budget(512, step=32, metric="linear")
    # sizes drawn around every bucket so that every id has rows
    res = np.repeat(bs.resolutions, 20, axis=0).astype(np.float64)
    w = res[:, 0] * rng.uniform(0.5, 3, len(res))
    h = res[:, 1] * (w / res[:, 0]) * rng.uniform(0.97, 1.03, len(res))
    ds = datasets.Dataset.from_dict({"w": w.round(), "h": h.round()})
    out = add_bucket_columns(ds, bs, image_column=None, width_column="w", height_column="h", show_summary=False)
    assert len(set(out["bucket"])) == len(bs)
    # CSV keeps no feature metadata: only the columns travel
    out.to_csv(str(tmp_path / "a.csv"), index=False)
    csv = datasets.load_dataset("csv", data_files=str(tmp_path / "a.csv"), split="train")
    assert hf_arb.annotate.hub.buckets_from_features(csv.features) is None
    rebuilt = BucketSet.from_dataset(csv)
    assert np.array_equal(rebuilt.resolutions, bs.resolutions)
    assert rebuilt.metric == "linear"  # inferred from aspect_error vs original sizes
    assert rebuilt == bs
    # a log-metric dataset is recognised as such
    out_log = add_bucket_columns(ds, BucketSet(bs.resolutions.tolist()), image_column=None, width_column="w",
                                 height_column="h", show_summary=False)
    stripped = out_log.cast_column("bucket", datasets.Value("int32"))
    assert buckets_from_columns(stripped).metric == "log"


def test_columns_with_empty_buckets_raise_and_partial_table(annotated: datasets.Dataset) -> None:
    stripped = annotated.cast_column("bucket", datasets.Value("int32"))  # drop the stored configuration
    with pytest.raises(ValueError, match="have no rows"):
        BucketSet.from_dataset(stripped)
    table = bucket_table_from_columns(stripped)
    assert table and all(CONFIG[i] == wh for i, wh in table.items())
    with pytest.raises(ValueError, match="(?i)annotate it"):
        BucketSet.from_dataset(annotated.remove_columns(list(BUCKET_COLUMNS)))


def test_pruned_rows_warn_that_thresholds_are_lost() -> None:
    ds = datasets.Dataset.from_dict({"w": [512, 768, 5000], "h": [512, 512, 100]})
    bs = BucketSet([(512, 512), (768, 512)], max_aspect_error=0.2)
    out = add_bucket_columns(ds, bs, image_column=None, width_column="w", height_column="h", show_summary=False)
    with pytest.warns(UserWarning, match="threshold"):
        rebuilt = buckets_from_columns(out)
    assert rebuilt.max_aspect_error is None and np.array_equal(rebuilt.resolutions, bs.resolutions)


def _front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n", 2)[1])


def test_hub_round_trip(annotated: datasets.Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    commit = hf_arb.push_to_hub(annotated, "me/photos", private=True)
    assert commit.oid == hub.heads["me/photos"]
    # what crossed the HfApi boundary: datasets' upload commit, then our card commit
    assert [c["message"] for c in hub.commits] == ["Upload dataset",
                                                   "Add the hf_arb bucket configuration to the dataset card"]
    paths = [op.path_in_repo for op in hub.operations("me/photos")]
    assert paths[0].startswith("data/train-") and paths[0].endswith(".parquet")
    assert {CHART_PATH_IN_REPO, "README.md"} <= set(paths)
    assert all(isinstance(op, CommitOperationAdd) for op in hub.operations())

    repo = hub.repo_dir("me/photos")
    back = datasets.load_dataset(str(repo), split="train")
    assert back.column_names == annotated.column_names
    assert _table(back) == _table(annotated)
    assert [im.size for im in back["image"][:3]] == [im.size for im in annotated["image"][:3]]
    assert BucketSet.from_dataset(back) == CONFIG

    readme = (repo / "README.md").read_text()
    meta = _front_matter(readme)
    assert "configs" in meta and "dataset_info" in meta  # datasets' own card metadata kept
    card = meta[CARD_KEY]
    assert card["fingerprint"] == CONFIG.fingerprint
    assert BucketSet.from_dict(card["buckets"]) == CONFIG
    assert card["buckets"]["metric"] == "linear" and card["buckets"]["max_aspect_error"] == 0.4
    stats = card["stats"]["default"]["train"]
    kept = sum(b >= 0 for b in annotated["bucket"])
    assert stats["rows"] == annotated.num_rows and stats["kept"] == kept == sum(stats["counts"].values())
    assert stats["skipped"]["unreadable"] == 1
    assert buckets_from_card(readme) == CONFIG
    assert "## Aspect-ratio buckets" in readme and readme.count("<!-- hf_arb:begin -->") == 1
    for label, count in stats["counts"].items():
        w, h = label.split("x")
        if count:
            assert f"| {w} | {h} |" in readme
    chart = Image.open(io.BytesIO((repo / CHART_PATH_IN_REPO).read_bytes()))
    assert chart.format == "PNG" and chart.width >= 600 and chart.height >= 300

    # pushing again (another split) keeps one section and both splits' stats
    hf_arb.push_to_hub(annotated.select(range(3)), "me/photos", split="test")
    meta = _front_matter((repo / "README.md").read_text())
    assert set(meta[CARD_KEY]["stats"]["default"]) == {"train", "test"}
    assert (repo / "README.md").read_text().count("<!-- hf_arb:begin -->") == 1
    both = datasets.load_dataset(str(repo))
    assert both["test"].num_rows == 3 and BucketSet.from_dataset(both) == CONFIG


def test_hub_dataset_dict_and_checks(annotated: datasets.Dataset, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    dd = datasets.DatasetDict({"train": annotated, "validation": annotated.select([0, 1])})
    with pytest.raises(ValueError, match="differs"):
        hf_arb.push_to_hub(dd, "me/dd", buckets=BucketSet.sdxl())
    assert not hub.commits
    # without matplotlib: the push still works, the card has no chart
    monkeypatch.setattr(hf_arb.annotate.plot, "_pyplot", lambda: (_ for _ in ()).throw(ImportError("no matplotlib")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_arb.push_to_hub(dd, "me/dd")
    assert any("chart" in str(w.message) for w in caught)
    assert CHART_PATH_IN_REPO not in [op.path_in_repo for op in hub.operations()]
    back = datasets.load_dataset(str(hub.repo_dir("me/dd")))
    assert set(back) == {"train", "validation"} and BucketSet.from_dataset(back) == CONFIG
    meta = _front_matter((hub.repo_dir("me/dd") / "README.md").read_text())
    assert meta[CARD_KEY]["stats"]["default"]["validation"]["rows"] == 2


def test_push_writes_the_config_into_a_stripped_dataset(annotated: datasets.Dataset, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    stripped = annotated.cast_column("bucket", datasets.Value("int32"))
    hf_arb.push_to_hub(stripped, "me/stripped", buckets=CONFIG, chart=False)
    back = datasets.load_dataset(str(hub.repo_dir("me/stripped")), split="train")
    assert hf_arb.annotate.hub.buckets_from_features(back.features) == CONFIG


def test_push_streaming_dataset(annotated: datasets.Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    hf_arb.push_to_hub(annotated.to_iterable_dataset(), "me/stream")
    repo = hub.repo_dir("me/stream")
    back = datasets.load_dataset(str(repo), split="train")
    assert _table(back) == _table(annotated)
    meta = _front_matter((repo / "README.md").read_text())
    assert BucketSet.from_dict(meta[CARD_KEY]["buckets"]) == CONFIG == BucketSet.from_dataset(back)
    assert meta[CARD_KEY]["stats"] == {}  # a stream is not read twice just to count


def test_a_mistyped_dataset_path_fails_at_once_and_a_hub_id_costs_one_request(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              capsys: pytest.CaptureFixture) -> None:
    """Issue 34, item 5: `--dataset_name my_photoz-arb` / `hf-arb annotate my_photoz` were tried as Hub ids, with
    26-32 s of retries and a traceback. A name that cannot be a Hub id, or a path whose parent exists, fails with no
    request; a possible Hub id costs one metadata request (none offline, none when cached), as model ids do."""
    import huggingface_hub.constants

    from hf_arb.annotate.hub import hub_dataset_problem
    from hf_arb.cli.app import main as hf_arb_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "photos").mkdir()
    hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    hub.heads["me/photos"] = "0" * 40
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("./my_photoz", "~/no/such/photoz", "data/my_photoz", "a/b/c", "photoz/", "my--photoz"):
        assert hub_dataset_problem(name).endswith("; not a Hub id either."), name
        assert "no such folder" in hub_dataset_problem(name)
    assert hub.calls == []  # not one request for any of them
    for fine in ("photos", "imagefolder", "parquet", "me/photos"):  # a folder, packaged builders, a Hub dataset
        assert hub_dataset_problem(fine) is None, fine
    assert hub.calls == ["repo_info"]
    problem = hub_dataset_problem("me/photoz")
    assert "no such folder" in problem and "no such dataset on the Hub" in problem and hub.calls == ["repo_info"] * 2
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set" in hub_dataset_problem("my_photoz-arb") and len(hub.calls) == 2
    # hf-arb annotate: the same sentence as its one error line, before any dataset is loaded
    with pytest.raises(SystemExit) as exit_:
        hf_arb_main(["annotate", "data/my_photoz", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"hf-arb annotate: error: data/my_photoz: no such folder {tmp_path / 'data' / 'my_photoz'}; "
                       "not a Hub id either.")
