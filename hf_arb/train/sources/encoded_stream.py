"""``--encoded_dataset --streaming``: a bucketed stream (:class:`~hf_arb.BucketedStream`) over an encoded dataset's
``latents`` shards, read as they lie (nothing converted or copied), each rank its own split; epoch ``e`` reads the
entries of crop/flip variant ``e % variants``, each source row once, at its own bucket. Batches are what the
map-style :class:`~hf_arb.train.sources.encoded.EncodedSource` gives for the same ``(row, bucket, epoch)`` keys: the
stored posteriors and, for the loss, the prompt embeddings of the ``prompts`` table (no VAE call, no text encoder).

The stream's rows are the ``latents`` table's, so its per-rank state (``stream_rank{i}.json``) positions that table;
the ``rows`` (bucket columns, captions) and ``prompts`` tables are read map-style, as the map-style source does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from ..schedule import Schedule
from .encoded import EncodedSource, check_vae_weights, checked_buckets
from .streamed import StreamSource


class EncodedStreamCollate:
    """Rows of the ``latents`` table (one bucket) → the batch :class:`~hf_arb.train.encoded.reader.EncodedLatents`
    collates for the same ``(row, bucket, epoch)`` keys: the epoch's caption pick of each source row included
    (:func:`~hf_arb.images.collate.choose_caption`). :class:`~hf_arb.BucketedStream` sets its epoch.

    Args:
        captions: the caption of every source row (the ``rows`` table's caption column).
        seed: the run's seed (caption choice).
    """

    def __init__(self, captions: Any, seed: int) -> None:
        self.captions, self.seed, self.epoch = captions, int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from hf_arb.images.collate import choose_caption
        from hf_arb.train.encoded.reader import EncodedLatents, entry_item

        return EncodedLatents.collate([entry_item(r, choose_caption(self.captions[int(r["row"])], seed=self.seed,
                                                                      epoch=self.epoch, row=int(r["row"])))
                                       for r in rows])


def latent_files(root: Path) -> list[str]:
    """The ``latents`` shards of an encoded dataset, in order."""
    return sorted(str(p) for p in (Path(root) / "data" / "latents").glob("*.parquet"))


def outside_entries(name: str, files: list[str], own: np.ndarray, variants: int, num_buckets: int) -> np.ndarray:
    """Keys (``row * num_buckets + bucket``) of the entries a stream skips: those at a bucket other than their row's
    own (``--bucket_leftover fill/catch_all`` encodes them for the map-style plan). Refuses (one line) a dataset
    that lacks a kept row's own entry of some variant (vectorised: the ``row``, ``bucket``, ``variant`` columns).

    Args:
        name: the ``--encoded_dataset`` value (for the message). files: its ``latents`` shards.
        own: every source row's own bucket (``-1``: skipped at annotation), shape ``(rows,)``.
        variants: the dataset's crop/flip variants. num_buckets: the size of its bucket table.
    """
    import pyarrow.parquet as pq

    cols = ["row", "bucket", "variant"]
    parts = [pq.read_table(f, columns=cols) for f in files]
    row, bucket, variant = (np.concatenate([p.column(c).to_numpy() for p in parts]).astype(np.int64) if parts
                            else np.empty(0, np.int64) for c in cols)
    mine = (row >= 0) & (row < own.size)
    mine[mine] = own[row[mine]] == bucket[mine]
    kept = np.flatnonzero(own >= 0)
    have = np.zeros((own.size, variants), bool)
    ok = mine & (variant >= 0) & (variant < variants)
    have[row[ok], variant[ok]] = True
    missing = ~have[kept]
    if missing.any():
        rows = kept[missing.any(axis=1)]
        raise UsageError(f"--encoded_dataset {name} --streaming: {int(missing.sum()):,} of {missing.size:,} (row, "
                         f"variant) entries at the rows' own buckets are missing ({rows.size:,} rows, e.g. row "
                         f"{int(rows[0])}): encode them (hf-arb encode OUT -- <this run's flags> without "
                         "--streaming).")
    return np.unique(row[~mine] * num_buckets + bucket[~mine])


def variant_stream(files: list[str], variant: int, outside: np.ndarray, num_buckets: int, seed: int,
                   cache_dir: str | None = None) -> Any:
    """The ``latents`` shards streamed (``datasets`` streaming, row groups as shards, their order shuffled with the
    seed) with only variant ``variant``'s entries at their rows' own buckets: a pyarrow filter applied as Arrow
    reads each row group, so the other entries never reach Python."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc

    from hf_arb.sampling.streaming.stream import shuffle_shards

    keep = pc.field("variant") == int(variant)
    if outside.size:
        key = pc.field("row") * num_buckets + pc.field("bucket")
        keep = keep & ~pc.is_in(key, value_set=pa.array(outside, pa.int64()))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True, filters=keep,
                               cache_dir=cache_dir)
    return shuffle_shards(ds, seed)


class EncodedStreamSource(StreamSource):
    """An encoded dataset streamed: the stream's counts are the source rows per bucket (the ``rows`` table), its rows
    the epoch's variant of the ``latents`` table, its batches the map-style encoded source's, its prompt embeddings
    the ``prompts`` table's. The fingerprint is checked as the map-style source checks it, before any model loads
    (the variant count once the stream's schedule is known; the VAE's weights when the models load)."""

    data: Any = None
    text_encoder = EncodedSource.text_encoder  # the prompts table, as the map-style source reads it
    frozen_parts = EncodedSource.frozen_parts  # no VAE and no text encoder: the dataset holds what they compute

    def load(self, accelerator: Any) -> None:
        from hf_arb.train.encoded.reader import open_encoded

        a = self.args
        self.data = open_encoded(a.encoded_dataset, getattr(a, "cache_dir", None), tables=("prompts", "rows"))
        self.buckets = checked_buckets(a, self.data)
        own = np.asarray(self.data.rows.with_format("numpy")["bucket"], dtype=np.int64)
        self.counts = np.bincount(own[own >= 0], minlength=len(self.buckets)).astype(np.int64)
        if self.counts.sum() == 0:
            raise UsageError(f"--encoded_dataset {a.encoded_dataset}: no row is assigned to a bucket, nothing to "
                             "train: encode an annotated dataset.")
        self.variants = int(self.data.fingerprint["variants"])
        self.files = latent_files(self.data.root)
        self.outside = outside_entries(a.encoded_dataset, self.files, own, self.variants, len(self.buckets))
        self._streams: dict[int, Any] = {}
        self.ds = self.variant(0)

    def variant(self, v: int) -> Any:
        """The stream of variant ``v`` (built once: a resume re-reads the same dataset)."""
        if v not in self._streams:
            self._streams[v] = variant_stream(self.files, v, self.outside, len(self.buckets), self.args.seed,
                                              getattr(self.args, "cache_dir", None))
        return self._streams[v]

    def start(self, accelerator: Any) -> None:
        import hf_arb
        from hf_arb.train.cache.caches import planned_variants
        from hf_arb.train.encoded.fingerprint import check_fingerprint
        from hf_arb.train.encoded.reader import LazyColumn

        a = self.args
        collate = EncodedStreamCollate(LazyColumn(self.data.rows, self.data.info["caption_column"]), a.seed)
        self.dataloader, self.sampler = hf_arb.build_stream_loader(
            self.ds, a.train_batch_size, counts=self.counts, accelerator=accelerator, seed=a.seed,
            buffer_size=a.stream_buffer_size, on_overflow=a.stream_on_overflow, collate_fn=collate,
            epoch_dataset=lambda epoch: self.variant(epoch % self.variants), reader="arrow")  # Arrow chunks
        world = 1 if accelerator is None else accelerator.num_processes
        check_fingerprint(self.data.fingerprint, {"variants": planned_variants(a, self.schedule(world))},
                          a.encoded_dataset)

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        check_vae_weights(self.args, self.data, models)
        return self.dataloader


__all__ = ["EncodedStreamCollate", "EncodedStreamSource", "latent_files", "outside_entries", "variant_stream"]
