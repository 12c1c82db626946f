"""Cost of ``add_bucket_columns(..., verify=True)`` (``hf-arb annotate --verify``) per image vs header-only.

``verify`` decodes every image whose header reads, to catch bodies cut short by an interrupted download (JPEGs at
1/8 scale through the DCT, which still reads every byte of the scan). Measured on the same ``Dataset`` of paths,
files warm in the page cache: header-only annotation, annotation with ``verify``, and as the baseline a
``datasets.map`` that decodes every image at full size (what checking by decoding costs without the reduced-size
decode). Data: real-size JPEGs as in ``bench_annotate.py`` (0.5–12 MP) and PNGs (0.5–4 MP) from the same photos.

Also: the cost of verifying a latent cache entry (shape, dtype, CRC-32, finite) that training pays per reused
entry at start, against the bare existence test.

Usage: ``python benchmarks/bench_verify.py [--quick] [--cache DIR]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402
from bench_annotate import SOURCES, _plan, decode_sizes, make_images  # noqa: E402


def make_pngs(cache: Path, n: int) -> list[str]:
    import skimage
    from PIL import Image

    d = cache / f"png_{n}_v1"
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (src, w, h, _) in enumerate(_plan(n, 0.5, 4.0, seed=1)):
        p = d / f"{i:05d}.png"
        if not p.exists():
            with Image.open(Path(skimage.__file__).parent / "data" / SOURCES[src]) as im:
                im.convert("RGB").resize((w, h), Image.Resampling.BILINEAR).save(str(p) + ".tmp", "PNG")
            os.replace(str(p) + ".tmp", p)
        paths.append(str(p))
    return paths


def _latent_check_row(n: int) -> dict:
    """Verifying a latent cache entry (what every start does for each reused entry) vs only testing it exists."""
    import tempfile

    import numpy as np

    from hf_arb.train.cache.latents import LatentCache

    with tempfile.TemporaryDirectory() as d:
        cache = LatentCache(d)
        rng = np.random.default_rng(0)
        keys = [f"{i:032x}" for i in range(n)]
        for k in keys:  # SDXL at 1024x1024: (2, 4, 128, 128) float16 = 256 KiB
            cache.write(k, rng.normal(size=(2, 4, 128, 128)).astype(np.float32), {"original_size": [1024, 1024]})
        check_s, _ = timeit(lambda: [cache.check(k) for k in keys], 2)
        has_s, _ = timeit(lambda: [cache.has(k) for k in keys], 2)
    return row(f"latent cache: verify one 256 KiB entry (SDXL 1024², {n} entries, page cache)", 1000 * check_s / n,
               1000 * has_s / n, "ms/entry",
               note="baseline column = the existence test used before entries were verified (stat only); the check "
                    "reads the .json and .npy, compares shape/dtype, CRC-32 and looks for inf/NaN")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="40 small JPEGs and 10 PNGs")
    p.add_argument("--cache", default="/tmp/hf_arb_bench_verify", help="where the generated images are kept")
    args = p.parse_args()

    import datasets

    from hf_arb import BucketSet, add_bucket_columns

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    n_jpeg, n_png = (40, 10) if args.quick else (400, 60)
    jpegs, _, jpeg_bytes = make_images(Path(args.cache), n_jpeg, 0.5, 2.0 if args.quick else 12.0, os.cpu_count() or 1)
    pngs = make_pngs(Path(args.cache), n_png)
    bs = BucketSet.sdxl()
    rows = []
    for kind, paths in (("JPEG", jpegs), ("PNG", pngs)):
        for path in paths:
            Path(path).read_bytes()  # page cache
        ds = datasets.Dataset.from_dict({"image": paths}).cast_column("image", datasets.Image())
        n = len(paths)
        head_s, head = timeit(lambda: add_bucket_columns(ds, bs, show_summary=False, load_from_cache_file=False), 3)
        ver_s, ver = timeit(lambda: add_bucket_columns(ds, bs, show_summary=False, load_from_cache_file=False,
                                                       verify=True), 2)
        ver2_s, ver2 = timeit(lambda: add_bucket_columns(ds, bs, show_summary=False, load_from_cache_file=False,
                                                         verify=True, num_proc=2), 2)
        t0 = time.perf_counter()
        ds.map(decode_sizes, batched=True, batch_size=50, remove_columns=["image"], load_from_cache_file=False)
        full_s = time.perf_counter() - t0
        if not (head["bucket"] == ver["bucket"] == ver2["bucket"]) or any(ver["skip_reason"]):
            raise SystemExit("verify changed the result on intact images")
        ms = lambda s: 1000 * s / n  # noqa: E731
        rows += [
            row(f"{kind}: header-only annotation ({n} images, 1 process)", ms(head_s), None, "ms/image",
                note=f"{head_s:.2f} s in all"),
            row(f"{kind}: --verify ({n} images, 1 process)", ms(ver_s), ms(full_s), "ms/image",
                note=f"{ms(ver_s) / ms(head_s):.0f}× header-only; baseline: datasets.map decoding every image at full "
                     f"size ({full_s:.1f} s)"),
            row(f"{kind}: --verify, num_proc=2", ms(ver2_s), ms(ver_s), "ms/image",
                note=f"baseline column = --verify in 1 process; {os.cpu_count()} cores, process start-up included"),
        ]
    rows.append(_latent_check_row(100 if args.quick else 1000))
    save_result(
        "verify", "Annotation with --verify (full decode) vs header-only", rows,
        command="python benchmarks/bench_verify.py",
        baseline="datasets.map decoding every image at full size (for --verify); header-only has no baseline",
        details=(f"Same `Dataset` of paths for every line, files in the page cache. JPEGs: {n_jpeg} photos resampled "
                 f"to 0.5–12 MP ({jpeg_bytes / 2**20:.0f} MiB), decoded by --verify at 1/8 scale (every byte still "
                 f"read); PNGs: {n_png} at 0.5–4 MP, no reduced decode exists. Header-only is what annotation costs "
                 f"without --verify. Load average when the run ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
                 "cores: a machine shared with other jobs, so the figures vary between runs (num_proc=2 by the most)."),
    )


if __name__ == "__main__":
    main()
