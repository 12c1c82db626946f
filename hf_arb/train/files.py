"""The files a run writes beside accelerate's, by name."""

from __future__ import annotations

STATE_FILE = "hf_arb_state.json"  # our part of a checkpoint: step counters and the seed


BUCKETS_FILE = "hf_arb_buckets.json"  # the BucketSet the run trained with, saved next to the pipeline


SKIPPED_ROWS_FILE = "skipped_rows.jsonl"  # images that failed to decode while training, one JSON line per row


STATS_FILE = "hf_arb_run.json"  # what the run did (steps, cache hits), for scripts and tests
