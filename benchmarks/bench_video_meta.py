"""Header-only clip metadata (``hf_arb.video.clip_metadata``) per clip vs decoding with PyAV.

What a naive implementation does to learn a clip's size is decode its first frame (``av.open`` then
``next(container.decode(video=0))``, which is also how it learns the rotation, ``VideoFrame.rotation``); to learn its
frame count without trusting the header it decodes every frame. Both baselines run on the same files, warm in the page
cache, in this process. Also measured: :func:`hf_arb.video.clip_columns` over the same clips as one Arrow batch of
paths (the per-row cost annotation will pay).

Data: real clips encoded here with PyAV from scikit-image's photos, a window panning across the photo (motion):
H.264 in MP4 (one of them with a -90 degree display matrix, as phones write portrait video) and VP9 in WebM, at
640x360 and 1280x720, 49 frames at 24 fps; the distinct clips are copied to ``--clips`` files so each read opens a
different file. torchcodec was not measured: its PyPI wheel (0.17) is built against a CUDA torch (it links libnvrtc,
libc10_cuda) and needs the system's FFmpeg libraries, and fails to load with torch 2.13+cpu here.

Usage: ``python benchmarks/bench_video_meta.py [--quick] [--clips 200] [--cache DIR]``
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import row, save_result, timeit  # noqa: E402

#: (photo, size, suffix, display rotation) of the distinct clips
KINDS = [("coffee.png", (640, 360), ".mp4", None), ("chelsea.png", (640, 360), ".webm", None),
         ("astronaut.png", (1280, 720), ".mp4", -90), ("motorcycle_left.png", (1280, 720), ".webm", None),
         ("rocket.jpg", (1280, 720), ".mp4", None), ("hubble_deep_field.jpg", (640, 360), ".mp4", None)]


def make_clips(cache: Path, n: int, frames: int) -> list[str]:
    """``n`` clip files in ``cache``: copies of the distinct :data:`KINDS` clips (encoded once, kept)."""
    import numpy as np
    import skimage
    from PIL import Image

    from hf_arb.testing.clips import panning_frames, write_clip

    d = cache / f"clips_{frames}_v1"
    d.mkdir(parents=True, exist_ok=True)
    distinct = []
    for i, (name, (w, h), suffix, rotation) in enumerate(KINDS):
        p = d / f"kind{i}{suffix}"
        if not p.exists():
            with Image.open(Path(skimage.__file__).parent / "data" / name) as im:
                photo = np.asarray(im.convert("RGB").resize((w * 5 // 4 + frames, h * 5 // 4)))
            write_clip(p.with_suffix(".tmp" + suffix), panning_frames(photo, frames, w, h), fps=24, rotation=rotation)
            p.with_suffix(".tmp" + suffix).replace(p)
        distinct.append(p)
    paths = []
    for i in range(n):
        src = distinct[i % len(distinct)]
        p = d / f"{i:05d}{src.suffix}"
        if not p.exists():
            shutil.copyfile(src, p)
        paths.append(str(p))
    return paths


def first_frame(path: str) -> tuple[int, int]:
    import av

    with av.open(path) as c:
        f = next(c.decode(video=0))
    return (f.height, f.width) if f.rotation % 180 else (f.width, f.height)


def default_probe(path: str) -> tuple[int, int]:
    """``av.open`` with FFmpeg's default stream probe (it decodes the first frame for its pixel format), then the
    stream's header fields: the "header-only" read without :data:`hf_arb.video.metadata.PROBE_OPTIONS`."""
    import av

    with av.open(path) as c:
        s = c.streams.video[0]
        return s.codec_context.width, s.codec_context.height


def every_frame(path: str) -> int:
    import av

    with av.open(path) as c:
        return sum(1 for _ in c.decode(video=0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="24 clips of 17 frames")
    p.add_argument("--clips", type=int, default=200)
    p.add_argument("--cache", default="/tmp/hf_arb_bench_video_meta", help="where the generated clips are kept")
    args = p.parse_args()
    n, frames = (24, 17) if args.quick else (args.clips, 49)

    import av
    import pyarrow as pa

    from hf_arb.video import clip_columns, clip_metadata

    paths = make_clips(Path(args.cache), n, frames)
    ours_s, metas = timeit(lambda: [clip_metadata(q) for q in paths], 3)
    first_s, sizes = timeit(lambda: [first_frame(q) for q in paths], 3)
    assert [(m.width, m.height) for m in metas] == sizes, "header sizes differ from the decoded frames'"
    probe_s, _ = timeit(lambda: [default_probe(q) for q in paths], 3)
    every_s, counts = timeit(lambda: [every_frame(q) for q in paths], 1)
    assert [m.frames for m in metas] == counts, "header frame counts differ from the decoded ones"
    batch = pa.table({"video": paths})
    cols_s, out = timeit(lambda: clip_columns(batch, "video"), 3)
    assert out.column("skip_reason").null_count == n
    exact = sum(m.frames_exact for m in metas)
    rows = [
        row(f"clip metadata per clip ({n} clips, MP4 H.264 + WebM VP9, 640x360 and 1280x720, {frames} frames)",
            1000 * ours_s / n, 1000 * first_s / n, "ms/clip",
            note="baseline = PyAV decoding the first frame (the size and VideoFrame.rotation a naive reader uses)"),
        row(f"clip metadata per clip vs decoding every frame ({frames} frames)", 1000 * ours_s / n,
            1000 * every_s / n, "ms/clip", target=">= 50x (issue 37)",
            note="baseline = PyAV decoding every frame (a frame count that trusts no header)"),
        row("clip metadata per clip vs av.open with FFmpeg's default stream probe", 1000 * ours_s / n,
            1000 * probe_s / n, "ms/clip",
            note="baseline = av.open and the stream's fields without PROBE_OPTIONS: the probe decodes the first "
                 "frame to learn its pixel format"),
        row(f"clip_columns: one Arrow batch of {n} paths", 1000 * cols_s / n, 1000 * first_s / n, "ms/clip",
            note="the per-row cost of annotation; baseline = first-frame decode as above"),
    ]
    save_result(
        "video_meta", "Video: header-only clip metadata", rows,
        command="python benchmarks/bench_video_meta.py",
        baseline="PyAV (the same FFmpeg) decoding the first frame, and decoding every frame",
        details=(f"{n} clip files (copies of {len(KINDS)} distinct real clips encoded with PyAV {av.__version__}), "
                 f"page cache warm, best of 3 (every-frame decode: 1 run). {exact} of {n} clips carry an exact frame "
                 "count (MP4); WebM's is duration x fps, equal to the decoded count on every clip here. Sizes and "
                 "rotation equal the decoded frames' on every clip. torchcodec 0.17 not measured: its wheel needs a "
                 "CUDA torch and system FFmpeg libraries and does not load with torch 2.13+cpu."),
        extra={"clips": n, "frames": frames, "exact_counts": exact},
    )


if __name__ == "__main__":
    main()
