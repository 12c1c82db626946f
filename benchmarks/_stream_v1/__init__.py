"""Frozen copy of ``hf_arb.sampling.streaming.buffer`` at commit 692dad9 (one step per call: the fill, the
bucket fill and the pick decided step by step), kept as the reference of the differential test
(tests/test_stream_blocks.py) and the "before" side of ``benchmarks/bench_stream.py``. Not part of the package and
not maintained. :class:`BucketedStreamV1` is today's :class:`~hf_arb.BucketedStream` with these rank buffers."""

from __future__ import annotations

from typing import Any

from hf_arb.sampling.streaming.stream import BucketedStream

from .buffer import RankBuffer

__all__ = ["BucketedStreamV1", "RankBuffer"]


class BucketedStreamV1(BucketedStream):
    """BucketedStream whose ranks are the frozen step-by-step :class:`RankBuffer` (same arguments, same batches)."""

    def _make_engines(self) -> dict[int, Any]:
        return {r: RankBuffer(lambda st, r=r, e=self.epoch: self._open(r, e, st), self._schedule, rank=r,
                              batch_size=self.batch_size, buffer_size=self.buffer_size, fill=self.shuffle_rows,
                              seed=self.seed, epoch=self.epoch, on_overflow=self.on_overflow,
                              bucket_column=self.bucket_column, snapshot_every=self.snapshot_every,
                              history=self.history, pick_window=self.pick_window) for r in self.ranks}
