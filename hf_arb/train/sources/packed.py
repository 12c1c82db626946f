"""``--packing``: every image at its own size, packed into sequences of ``--max_tokens`` tokens
(:class:`~hf_arb.PackBatchSampler`), on one tier or several (:class:`TieredPackedSource`). A pack is not one
bucket: the loss is the packed flow-matching step, and each epoch packs differently (its own length)."""

from __future__ import annotations

from typing import Any

from .bucketed import BucketedSource
from .loaders import make_pack_sampler
from .reports import packed_report
from .tiers import make_tier_pack_sampler


class PackedSource(BucketedSource):
    """Packs of images at their own size (at most ``(--resolution/16)²`` tokens each)."""

    varied_epochs = True
    fixed_batches = False

    def start(self, accelerator: Any) -> None:
        self.sampler = make_pack_sampler(self.args, self.ds, accelerator)

    def check_model(self, models: Any) -> str | None:
        return None  # no bucket shapes to check: every image keeps its own size (cropped to the patch grid)

    def model(self, models: Any) -> Any:
        from hf_arb.packing.loss import PackedFlowModel

        return PackedFlowModel(models.unet)  # DDP synchronises the packed computation

    def report(self, accelerator: Any, schedule: Any, models: Any) -> None:
        packed_report(accelerator, self, schedule, models)

    def epoch_begins(self, accelerator: Any, epoch: int) -> None:
        if accelerator.is_main_process:  # each epoch packs differently: its padding and leftovers
            print(f"epoch {epoch} {self.sampler.report(epoch).text()}", flush=True)

    def batch_bucket(self, batch: dict[str, Any]) -> int:
        return -1

    def stats(self, micro_step: int) -> dict[str, Any]:
        last_epoch = self.locate(max(micro_step - 1, 0))[0]  # the epoch of the last trained pack
        return {**super().stats(micro_step),
                "pack_reports": {e: self.sampler.report(e).to_dict() for e in range(last_epoch + 1)}}


class TieredPackedSource(PackedSource):
    """Packs over several tiers: a tier is a token cap per image (``random``: drawn per row and epoch, packs mix
    tiers; a step schedule: one pack stream per tier)."""

    def start(self, accelerator: Any) -> None:
        self.sampler = make_tier_pack_sampler(self.args, self.ds, self.buckets, accelerator)


__all__ = ["PackedSource", "TieredPackedSource"]
