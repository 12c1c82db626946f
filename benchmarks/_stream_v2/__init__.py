"""Frozen copy of ``hf_arb.sampling.streaming.buffer`` at commit 83fc72e (a chunk's decisions and a step's
fill planned per chunk, pick positions per block of steps, a row held as its value tuple), kept as the reference of
the differential test (tests/test_stream_blocks.py) and the "before" side of ``benchmarks/bench_stream.py``. Not part
of the package and not maintained. :class:`BucketedStreamV2` is today's :class:`~hf_arb.BucketedStream` with these
rank buffers."""

from __future__ import annotations

from typing import Any

from hf_arb.sampling.streaming.stream import BucketedStream

from .buffer import RankBuffer

__all__ = ["BucketedStreamV2", "RankBuffer"]


class BucketedStreamV2(BucketedStream):
    """BucketedStream whose ranks are the frozen block-planned :class:`RankBuffer` (same arguments, same batches)."""

    def _make_engines(self) -> dict[int, Any]:
        return {r: RankBuffer(lambda st, r=r, e=self.epoch: self._open(r, e, st), self._schedule, rank=r,
                              batch_size=self.batch_size, buffer_size=self.buffer_size, fill=self.shuffle_rows,
                              seed=self.seed, epoch=self.epoch, on_overflow=self.on_overflow,
                              bucket_column=self.bucket_column, snapshot_every=self.snapshot_every,
                              history=self.history, pick_window=self.pick_window) for r in self.ranks}
