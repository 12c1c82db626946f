"""A collate function for streamed image rows: :class:`StreamImageCollate` fits each row's image to its bucket
and stacks the batch in the format of :func:`hf_arb.images.dataset.collate_buckets` (what the training script consumes).

Per-row randomness (crop offset, flip, caption choice) comes from ``rng.row_rng(seed, epoch, key, ROW_*)``
where ``key`` is the row's integer id column — a stream has no row index — so a resumed run renders the same
crops. :class:`~hf_arb.sampling.streaming.stream.BucketedStream` calls :meth:`StreamImageCollate.set_epoch` on its
epoch.
"""

from __future__ import annotations

from typing import Any

from hf_arb import rng
from hf_arb.images.bad_images import BAD_IMAGE_POLICIES, BadImageLog
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
        on_bad_image: a row whose image fails to decode: ``"replace"`` (the training script's default) trains the
            batch's next good row in its place (a stream has no other row of the bucket at hand), counted and
            logged once in ``bad_image_log``; ``"error"`` raises.
        bad_image_log: the JSON-lines file of bad rows (``<output_dir>/skipped_rows.jsonl``), or None.
    """

    def __init__(self, key_column: str, image_column: str = "image", caption_column: str | None = "text", *,
                 seed: int = 0, center_crop: bool = False, random_flip: bool = False, on_bad_image: str = "error",
                 bad_image_log: Any = None) -> None:
        if on_bad_image not in BAD_IMAGE_POLICIES:
            raise ValueError(f"on_bad_image must be one of {BAD_IMAGE_POLICIES}, got {on_bad_image!r}.")
        self.key_column, self.image_column, self.caption_column = key_column, image_column, caption_column
        self.seed, self.center_crop, self.random_flip = int(seed), bool(center_crop), bool(random_flip)
        self.on_bad_image, self.bad_images = on_bad_image, BadImageLog(bad_image_log)
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
        samples: list[dict[str, Any] | None] = []
        for r in rows:
            try:
                samples.append(self._sample(r))
            except (OSError, SyntaxError, ValueError) as e:  # Pillow's decode failures (a bad key id is re-raised)
                if self.on_bad_image == "error" or str(e).startswith(f"Column {self.key_column!r}"):
                    raise
                self.bad_images.record(r.get(self.key_column, -1), f"{type(e).__name__}: {e}"[:200],
                                       bucket=int(r["bucket"]), epoch=self.epoch)
                samples.append(None)
        good = [i for i, s in enumerate(samples) if s is not None]
        if not good:
            raise ValueError(f"Every image of this streamed batch (rows {[r.get(self.key_column) for r in rows]}) "
                             "failed to decode; see the log above. Re-annotate the shards with `hf-arb annotate "
                             "--verify` to drop unreadable images up front.")
        # a bad row trains the batch's next good row instead (every row of a batch shares its bucket)
        return collate_buckets([s if s is not None else samples[next((g for g in good if g > i), good[0])]
                                for i, s in enumerate(samples)])
