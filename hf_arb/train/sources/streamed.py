"""``--streaming``: bucketed batches from a streamed dataset (:class:`~hf_arb.BucketedStream`), each rank reading
its own split; on several tiers one stream per tier or one over every (tier, bucket) (:class:`TieredStreamSource`).
accelerate does not checkpoint a stream: every rank writes its own state file beside accelerate's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..schedule import Schedule
from .base import Source
from .stream import (
    build_stream_dataloader,
    restore_stream,
    stream_print,
    stream_startup_report,
    stream_state_path,
    streaming_dataset,
)


class StreamSource(Source):
    """A streamed dataset with bucket columns; rows per bucket from the card, the shards or ``--stream_counts``."""

    fixed_batches = False  # the stream checks its own state per rank
    dataloader: Any = None

    @classmethod
    def accelerator_kwargs(cls) -> dict[str, Any]:
        from accelerate.utils import DataLoaderConfiguration

        return {"dataloader_config": DataLoaderConfiguration(dispatch_batches=False)}  # every rank its own split

    @classmethod
    def checkpoint_files(cls, required: tuple[str, ...]) -> tuple[str, ...]:
        """No sampler state (accelerate's ``custom_checkpoint_*``): the stream's per-rank files instead."""
        return tuple(f for f in required if not f.startswith("custom_checkpoint")) + ("stream_rank0.json",)

    def load(self, accelerator: Any) -> None:
        self.ds, self.buckets, self.counts = streaming_dataset(self.args)

    def start(self, accelerator: Any) -> None:
        self.dataloader, self.sampler = build_stream_dataloader(self.args, accelerator, self.ds, self.counts)

    def locate(self, micro_step: int) -> tuple[int, int]:
        epoch, left = 0, int(micro_step)
        while left >= self.steps_in(epoch):
            left, epoch = left - self.steps_in(epoch), epoch + 1
        return epoch, left

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        return self.dataloader

    def bucket_rows(self) -> Any:
        """The stream's rows per bucket (the card's, the shards' or ``--stream_counts``)."""
        return self.counts

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        stream_startup_report(accelerator, self.buckets, self.counts, self.sampler, schedule, self.args)

    def restore(self, accelerator: Any, resume_dir: Path | None, progress: Any) -> None:
        if resume_dir is not None:
            restore_stream(accelerator, self.sampler, resume_dir, progress)

    def resume(self, accelerator: Any, dataloader: Any, micro_step: int) -> tuple[Any, int]:
        stream = self.sampler  # resumed by load_state_dict; set_epoch keeps its position within the same epoch
        first_epoch = stream.epoch + (stream.step >= stream.steps_per_epoch)
        dataloader.set_epoch(first_epoch)
        return dataloader, first_epoch

    def epoch_begins(self, accelerator: Any, epoch: int) -> None:
        stream_print(accelerator, self.sampler, f"epoch {epoch} start")

    def epoch_ends(self, accelerator: Any, epoch: int) -> None:
        stream_print(accelerator, self.sampler, f"epoch {epoch} end")

    def rank_files(self, accelerator: Any, micro_step: int, epoch: int) -> dict[str, Any]:
        in_epoch = micro_step - self.epoch_start(epoch)  # micro-batches trained this epoch
        return {stream_state_path("", accelerator).name: self.sampler.state_dict(step=in_epoch)}

    def stats(self, micro_step: int) -> dict[str, Any]:
        return {**super().stats(micro_step), "stream_report": self.sampler.report().to_dict()}


class TieredStreamSource(StreamSource):
    """Several tiers streamed: a step schedule runs one stream per tier; ``random`` one stream over every (tier,
    bucket), each image drawing its tier per epoch (epochs of their own length)."""

    varied_epochs = True


__all__ = ["StreamSource", "TieredStreamSource"]
