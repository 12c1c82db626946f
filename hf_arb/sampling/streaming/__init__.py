"""Bucketed batches from a streaming ``datasets.IterableDataset``: the pure schedule, one rank's buffer, the stream
and the collate that fits streamed images to their bucket.

- :mod:`~hf_arb.sampling.streaming.plan` — per-bucket counts, the global bucket schedule, :class:`StreamReport`;
- :mod:`~hf_arb.sampling.streaming.buffer` — :class:`RankBuffer`, one rank's buffers and its resume state;
- :mod:`~hf_arb.sampling.streaming.stream` — :class:`BucketedStream` and :func:`build_stream_loader`;
- :mod:`~hf_arb.sampling.streaming.collate` — :class:`StreamImageCollate`.

Imports nothing of :mod:`hf_arb.sampling` outside this folder.
"""
