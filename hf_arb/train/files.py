"""The files a run writes beside accelerate's, by name."""

from __future__ import annotations

import logging
from typing import Any



from hf_arb.lazy import LazyModule

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


STATE_FILE = "hf_arb_state.json"  # our part of a checkpoint: step counters and the seed


BUCKETS_FILE = "hf_arb_buckets.json"  # the BucketSet the run trained with, saved next to the pipeline


SKIPPED_ROWS_FILE = "skipped_rows.jsonl"  # images that failed to decode while training, one JSON line per row


STATS_FILE = "hf_arb_run.json"  # what the run did (steps, cache hits), for scripts and tests
