"""``hf-arb annotate --engine ray|spark``: annotate Parquet on a cluster engine and write Parquet.

The output folder holds ``part-*.parquet`` files whose schema metadata carries the ``datasets`` features (the
BucketSet rides in the ``bucket`` feature) and a ``README.md`` dataset card with the ``hf_arb`` YAML block, so
``datasets.load_dataset("parquet", data_dir=OUT)`` and ``BucketSet.from_dataset`` read it back exactly. Ray connects to
``RAY_ADDRESS`` when set (else starts a local cluster); Spark uses the session ``spark-submit`` configured (else
``local[*]``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hf_arb.buckets.sets import BucketSet


def parquet_files(source: str) -> list[str]:
    """The Parquet files ``source`` names: one ``.parquet`` file, or every ``*.parquet`` under a folder (sorted)."""
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".parquet":
        return [str(path)]
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.parquet") if not any(part.startswith(("_", ".")) for part in
                                                                        p.relative_to(path).parts))
        if files:
            return files
    raise ValueError(f"--engine ray/spark reads Parquet: {source} is not a .parquet file or a folder with .parquet "
                     "files. Convert other sources first, or use the default --engine datasets.")


def run_engine(args: argparse.Namespace, buckets: BucketSet, reference_buckets: BucketSet | None = None) -> int:
    """Annotate ``args.source`` with ``args.engine`` into ``args.output_dir``; print the engine-side summary.

    With ``--reference-column`` (``args.reference_columns``) the engine runs the same Arrow-batch function with the
    references as the ``datasets`` path (``reference_buckets``: the references' BucketSet under ``own``)."""
    import datasets
    import pyarrow.parquet as pq

    if not args.output_dir:
        from .buckets import UsageError

        raise UsageError(f"--engine {args.engine} writes Parquet to --output-dir; push that folder afterwards with "
                         "`hf upload-large-folder REPO OUT --repo-type dataset`.")
    files = parquet_files(args.source)
    features = datasets.Features.from_arrow_schema(pq.read_schema(files[0]))
    kwargs: dict[str, Any] = dict(image_column=None if args.width_column else args.image_column,
                                  width_column=args.width_column, height_column=args.height_column,
                                  max_upscale=args.max_upscale, min_size=args.min_size)
    video = getattr(args, "video_column", None)
    if video is None and buckets.has_frames and not args.width_column:  # a clip dataset, as the datasets path detects
        from hf_arb.annotate.clips import detect_video_column

        video = detect_video_column(features, list(features), args.image_column)
    if video is not None:
        kwargs.update(image_column=None, video_column=video, target_fps=getattr(args, "target_fps", None),
                      frame_sampling=getattr(args, "frame_sampling", None),
                      slide_stride=getattr(args, "slide_stride", None))
    refs: dict[str, Any] = {}
    if getattr(args, "reference_columns", None):
        refs = dict(reference_columns=tuple(args.reference_columns), reference_policy=args.reference_policy,
                    reference_buckets=reference_buckets)
    out = str(Path(args.output_dir).resolve())
    if args.engine == "ray":
        import ray

        from hf_arb.annotate.engines import ray as engine

        owned = not ray.is_initialized()  # reuse a running driver (e.g. in a notebook); else connect or start
        if owned:
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
        try:
            annotated = engine.add_bucket_columns(ray.data.read_parquet(files), buckets, features=features, **kwargs,
                                               **refs)
            annotated.write_parquet(out)
            summary = engine.summarize(ray.data.read_parquet(out), buckets)
        finally:
            if owned:
                ray.shutdown()
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        from pyspark.sql import SparkSession

        from hf_arb.annotate.engines import spark as engine_spark

        active = SparkSession.getActiveSession()
        spark = active or SparkSession.builder.appName("hf-arb annotate").getOrCreate()  # spark-submit's master
        try:
            df = engine_spark.add_bucket_columns(spark.read.parquet(*files), buckets, **kwargs, **refs)
            engine_spark.write_parquet(df, out, buckets, features=features, **refs)
            summary = engine_spark.summarize(spark.read.parquet(out), buckets)
        finally:
            if active is None:
                spark.stop()
    # The dataset card (README.md) with the hf_arb YAML block: `hf upload-large-folder` pushes it with the files.
    from hf_arb.annotate.hub import update_card_text

    card = Path(out) / "README.md"
    card.write_text(update_card_text(card.read_text(encoding="utf-8") if card.exists() else None, Path(out).name,
                                     buckets, {"default": {"train": summary.to_dict()}}, None), encoding="utf-8")
    print(summary)
    print(f"saved Parquet to {out} (load it with datasets.load_dataset('parquet', data_dir={out!r}))")
    return 0
