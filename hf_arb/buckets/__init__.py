"""Floor 1, ``buckets/``: what a bucket is and how a row is matched to one. Pure numpy/pyarrow, no torch.

- :mod:`~hf_arb.buckets.sets` — :class:`BucketSet`, the immutable table and its vectorised ``assign``;
- :mod:`~hf_arb.buckets.presets` — every named table (ours and each model family's own), exactly;
  :mod:`~hf_arb.buckets.preset_sources` where each comes from; :mod:`~hf_arb.buckets.family_tables` the tables
  model families and trainers publish; :mod:`~hf_arb.buckets.resolve` the BucketSet a command line describes;
- :mod:`~hf_arb.buckets.matching` — nearest-aspect lookup without an ``(images, buckets)`` matrix (clips: the frame
  count first, then the aspect);
- :mod:`~hf_arb.buckets.frames` — the video VAEs' ``step * k + 1`` frame rules a clip set's frame axis follows;
- :mod:`~hf_arb.buckets.assignment` — validated size arrays and :class:`AssignmentSummary`;
- :mod:`~hf_arb.buckets.fit` — bucket tables fitted to a dataset's sizes (``BucketSet.fit``);
- :mod:`~hf_arb.buckets.stored` — reading a stored bucket configuration back (features, card, columns);
- :mod:`~hf_arb.buckets.schema` — the bucket columns of an annotated dataset and the BucketSet it carries;
- :mod:`~hf_arb.buckets.references` — reference-image columns (edit models), their policy, the composite batch key.

May import: the ground floor (:mod:`hf_arb.checks`, :mod:`hf_arb.rng`) and nothing else of hf_arb.
"""

from .assignment import AssignmentSummary
from .family_tables import ONETRAINER_ASPECTS, SDXL_TABLE
from .presets import PRESETS
from .sets import BucketSet

__all__ = ["ONETRAINER_ASPECTS", "PRESETS", "SDXL_TABLE", "AssignmentSummary", "BucketSet"]
