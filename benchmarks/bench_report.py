"""``hf-arb report`` on 10⁶ rows: the cost is the metadata pass plus ``k × buckets`` thumbnail decodes.

An annotated dataset of 10⁶ rows whose ``image`` column holds paths to 300 real JPEG files (crops of scikit-image's
photos at sizes drawn from the photo mixture of ``bench_preset_crop``; each row's ``original_width/height`` is its
file's), annotated to the ``budget`` preset from the size columns. Measured: :func:`hf_arb.annotate.report.build_report`
+
:func:`~hf_arb.annotate.report.render_html` with ``k = 4``, next to its baseline, the two parts it cannot avoid measured
alone: the metadata pass (:func:`hf_arb.summarize_annotation`, the annotate summary over the same columns) plus
decoding the same ``k × buckets`` files to thumbnails.

Usage: ``python benchmarks/bench_report.py [--quick]``
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import peak_rss_mb, row, save_result  # noqa: E402
from bench_preset_crop import photo_sizes  # noqa: E402

K = 4


def make_files(folder: Path, n_files: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    import skimage
    from PIL import Image

    data = Path(skimage.__file__).parent / "data"
    photos = [Image.open(data / p).convert("RGB") for p in ("astronaut.png", "chelsea.png", "coffee.png",
                                                            "rocket.jpg", "motorcycle_left.png")]
    w, h = photo_sizes(n_files, seed=7)
    scale = 1200 / np.maximum(w, h)  # long side 1200 px: real JPEGs of a realistic size to decode
    w, h = np.maximum(8, (w * scale).astype(np.int64)), np.maximum(8, (h * scale).astype(np.int64))
    paths = []
    for i in range(n_files):
        p = folder / f"{i:04d}.jpg"
        photos[i % len(photos)].resize((int(w[i]), int(h[i]))).save(p, quality=85)
        paths.append(str(p))
    return paths, w, h


def main() -> None:
    import datasets

    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.annotate.report import THUMBNAIL_SIZE, build_report, render_html
    from hf_arb.annotate.summary import summarize_annotation

    quick = "--quick" in sys.argv
    n = 100_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        paths, fw, fh = make_files(Path(tmp), 300)
        pick = np.random.default_rng(0).integers(0, len(paths), n)  # (n,) file of each row
        ds = datasets.Dataset.from_dict({"image": [paths[i] for i in pick], "width": fw[pick], "height": fh[pick]})
        bs = BucketSet.preset("budget")
        ds = add_bucket_columns(ds, bs, width_column="width", height_column="height", show_summary=False)
        ds = ds.flatten_indices()

        t0 = time.perf_counter()
        rep = build_report(ds, k=K, batch_size=4, num_processes=2)
        page = render_html(rep)
        t_report = time.perf_counter() - t0
        rss = peak_rss_mb()

        t0 = time.perf_counter()
        summarize_annotation(ds, bs)
        t_meta = time.perf_counter() - t0
        rows = [s.row for samples in rep.samples.values() for s in samples]
        t0 = time.perf_counter()
        from PIL import Image

        for r in rows:
            with Image.open(paths[pick[r]]) as im:
                im.draft("RGB", (THUMBNAIL_SIZE, THUMBNAIL_SIZE))
                im = im.convert("RGB")
                im.thumbnail((THUMBNAIL_SIZE, THUMBNAIL_SIZE))
        t_decode = time.perf_counter() - t0
    base = t_meta + t_decode
    save_result(
        "report", f"hf-arb report on {n:,} rows (k = {K} thumbnails per bucket)",
        [row(f"report on {n:,} rows, {rep.decoded} thumbnails ({len(bs)} buckets)", t_report, base, "s",
             note=f"baseline = metadata pass (summarize_annotation) {t_meta:.2f} s + {len(rows)} thumbnail decodes "
                  f"{t_decode:.2f} s; page {len(page) / 1e6:.2f} MB; peak RSS {rss:.0f} MB")],
        command="python benchmarks/bench_report.py",
        baseline="the metadata pass plus the same k × buckets decodes, each measured alone",
        details=(f"{n:,} annotated rows pointing at 300 real JPEGs (long side 1200 px); report with "
                 f"--train_batch_size 4 on 2 processes, k = {K}. The report reads the bucket columns once (Arrow, "
                 "vectorised), asks the sampler for its plan report, and decodes only the thumbnails."),
        extra={"rows": n, "report_seconds": t_report, "metadata_seconds": t_meta, "decode_seconds": t_decode,
               "thumbnails": rep.decoded},
    )


if __name__ == "__main__":
    main()
