"""--verify: images with an intact header and a broken body are skipped as truncated / undecodable.

Every row is kept in the output (rows in = rows out) with a reason; without ``verify`` the header-only path keeps
them (training then replaces them, see test_fault_train.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import pytest
from _photos import encode, photo

from hf_arb import BucketSet, add_bucket_columns
from hf_arb.annotate.map import BUCKET_COLUMNS
from hf_arb.cli.app import main
from hf_arb.images.sizes import ImageSizeError, verify_image

IMG = photo("coffee.png", (240, 160))


def _corrupt_middle(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes(255 - b for b in data[mid:mid + 200]) + data[mid + 200:]


def _files() -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, expected skip_reason category with --verify)."""
    files: dict[str, tuple[bytes, str | None]] = {}
    for fmt, ext in (("JPEG", "jpg"), ("PNG", "png"), ("GIF", "gif"), ("TIFF", "tif"), ("BMP", "bmp")):
        data = encode(IMG.convert("P") if fmt == "GIF" else IMG, fmt)
        files[f"ok.{ext}"] = (data, None)
        files[f"cut.{ext}"] = (data[: int(len(data) * 0.7)], "truncated")
    files["ok.webp"] = (encode(IMG, "WEBP"), None)
    files["garbled.jpg"] = (_corrupt_middle(encode(IMG, "JPEG")), "undecodable")
    files["garbled.png"] = (_corrupt_middle(encode(IMG, "PNG")), "undecodable")
    return files


FILES = _files()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("faulty")
    for name, (data, _) in FILES.items():
        (d / name).write_bytes(data)
    return d


def _ds(folder: Path, embed: bool) -> datasets.Dataset:
    names = sorted(FILES)
    image = [{"bytes": FILES[n][0], "path": n} if embed else str(folder / n) for n in names]
    return datasets.Dataset.from_dict({"image": image, "name": names},
                                      features=datasets.Features({"image": datasets.Image(),
                                                                  "name": datasets.Value("string")}))


@pytest.mark.parametrize("route", ["paths", "bytes", "bytes_num_proc_2", "streaming"])
def test_verify_skips_broken_bodies_with_a_reason(route: str, folder: Path) -> None:
    ds = _ds(folder, embed=route != "paths")
    if route == "streaming":
        ds = ds.to_iterable_dataset()
    out = add_bucket_columns(ds, BucketSet.from_budget(256, step=32), verify=True, batch_size=4, show_summary=False,
                             num_proc=2 if route.endswith("num_proc_2") else None)
    rows = list(out.select_columns(["name", *BUCKET_COLUMNS]))
    assert len(rows) == len(FILES)  # rows in = rows out
    got = {r["name"]: (r["skip_reason"] or "").split(":")[0] or None for r in rows}
    assert got == {n: expected for n, (_, expected) in FILES.items()}
    for r in rows:
        assert (r["bucket"] >= 0) == (r["skip_reason"] is None)


def test_header_only_keeps_them(folder: Path) -> None:
    out = add_bucket_columns(_ds(folder, embed=True), BucketSet.from_budget(256, step=32), show_summary=False)
    assert out["skip_reason"] == [None] * len(FILES)


def test_verify_image_reasons(folder: Path) -> None:
    verify_image(folder / "ok.jpg")
    verify_image({"bytes": FILES["ok.png"][0], "path": None})
    with pytest.raises(ImageSizeError, match="truncated") as err:
        verify_image(FILES["cut.png"][0])
    assert err.value.reason == "truncated"
    with pytest.raises(ImageSizeError) as err:
        verify_image(str(folder / "garbled.jpg"))
    assert err.value.reason == "undecodable" and "garbled.jpg" in str(err.value)


def test_cli_verify(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "annotated"
    assert main(["annotate", str(folder), "--output-dir", str(out), "--preset", "novelai", "--verify"]) == 0
    printed = capsys.readouterr().out
    n_bad = sum(1 for _, e in FILES.values() if e)
    assert f"skipped: {n_bad}" in printed and "truncated 5" in printed and "undecodable 2" in printed
    named = [
        line
        for line in printed.splitlines()
        if line.startswith("  row ") and ": truncated: OSError: image file is truncated" in line
    ]
    assert len(named) == 5 and all(f"({folder}{os.sep}cut." in line for line in named), printed  # the files, named
    back = datasets.load_from_disk(str(out))["train"]
    assert back.num_rows == len(FILES) and back["bucket"].count(-1) == n_bad
