"""Floor 4, ``annotate/``: bucket columns for a whole dataset, from image or clip headers only, and what they say.

- :mod:`~hf_arb.annotate.map` — :func:`add_bucket_columns`, the ``datasets`` map (map-style and streaming);
- :mod:`~hf_arb.annotate.arrow_batch` — the pure Arrow-batch function every engine runs;
  :mod:`~hf_arb.annotate.core` — :func:`annotate_sizes`, sizes to bucket columns, vectorised;
  :mod:`~hf_arb.annotate.references` — the reference images' columns (``strict`` / ``own``), vectorised;
  :mod:`~hf_arb.annotate.clips` — a clip column's (width, height, frames) bucket columns from container headers;
- :mod:`~hf_arb.annotate.engines` — the same function on Ray Data and Spark;
- :mod:`~hf_arb.annotate.summary` — :class:`AnnotationSummary` (rows per bucket, skips and their files);
- :mod:`~hf_arb.annotate.hub` — :func:`push_to_hub` with the bucket configuration in the card;
- :mod:`~hf_arb.annotate.report` (+ ``report_html``) — the self-contained HTML dataset report;
  :mod:`~hf_arb.annotate.plot` — the bucket chart.

May import: the ground floor, :mod:`hf_arb.buckets`, :mod:`hf_arb.images`, :mod:`hf_arb.video` (clip headers; the
report's frame strips) and :mod:`hf_arb.sampling` (the report shows the epoch plan the sampler would make).
"""

from hf_arb.images.values import decoding_images

from .core import annotate_sizes
from .map import add_bucket_columns
from .summary import AnnotationSummary, summarize_annotation

__all__ = ["AnnotationSummary", "add_bucket_columns", "annotate_sizes", "decoding_images", "summarize_annotation"]
