"""A collate function for streamed image rows: :class:`StreamImageCollate` fits each row's image to its bucket
and stacks the batch in the format of :func:`hf_arb.images.dataset.collate_buckets` (what the training script consumes).

Per-row randomness (crop offset, flip, caption choice) comes from ``rng.row_rng(seed, epoch, key, ROW_*)``
where ``key`` is the row's integer id column — a stream has no row index — so a resumed run renders the same
crops. :class:`~hf_arb.sampling.stream.BucketedStream` calls :meth:`StreamImageCollate.set_epoch` on its epoch.
"""

from __future__ import annotations

from typing import Any

from hf_arb import rng
from hf_arb.images.collate import collate_buckets
from hf_arb.images.fitting import fit_to_bucket, to_tensor


class StreamImageCollate:
    """Rows of one bucket (dicts from the stream) → the batch dict of :func:`hf_arb.images.dataset.collate_buckets`.

    Args:
        key_column: an integer id column of the rows (seeds each row's crop/flip/caption draws).
        image_column: the image (PIL image, bytes, ``{"bytes":..., "path":...}`` or a path).
        caption_column: a string or a list of strings (one is drawn per epoch); None for empty captions.
        seed: the run's seed.
        center_crop: center crops instead of random ones.
        random_flip: mirror half of the rows, per epoch.
    """

    def __init__(self, key_column: str, image_column: str = "image", caption_column: str | None = "text", *,
                 seed: int = 0, center_crop: bool = False, random_flip: bool = False) -> None:
        self.key_column, self.image_column, self.caption_column = key_column, image_column, caption_column
        self.seed, self.center_crop, self.random_flip = int(seed), bool(center_crop), bool(random_flip)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose per-row draws to use (called by the stream)."""
        self.epoch = int(epoch)

    def _sample(self, row: dict[str, Any]) -> dict[str, Any]:
        key = row.get(self.key_column)
        if not isinstance(key, int) or key < 0:
            raise ValueError(f"Column {self.key_column!r} must hold a non-negative integer id per row, got {key!r}; "
                             "add one when writing the shards (e.g. the row number).")
        bucket, size = int(row["bucket"]), (int(row["bucket_width"]), int(row["bucket_height"]))
        flip = self.random_flip and bool(rng.row_rng(self.seed, self.epoch, key, rng.ROW_FLIP).random() < 0.5)
        crop_rng = rng.row_rng(self.seed, self.epoch, key, rng.ROW_CROP)
        fit = fit_to_bucket(row[self.image_column], size, crop="center" if self.center_crop else "random",
                            rng=crop_rng, flip=flip)
        cap = row.get(self.caption_column) if self.caption_column else ""
        if isinstance(cap, (list, tuple)) and cap:
            cap = cap[int(rng.row_rng(self.seed, self.epoch, key, rng.ROW_CAPTION).integers(len(cap)))]
        return {"pixel_values": to_tensor(fit.image), "original_size": fit.original_size,
                "crop_top_left": fit.crop_top_left, "target_size": fit.target_size, "caption": cap or "",
                "row": key, "bucket": bucket, "epoch": self.epoch, "flipped": fit.flipped}

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_buckets([self._sample(r) for r in rows])
