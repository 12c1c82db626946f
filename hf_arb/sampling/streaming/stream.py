"""Bucketed batches from a streaming ``datasets.IterableDataset``: :class:`BucketedStream` and
:func:`build_stream_loader`.

Each rank reads its own split of the source (``datasets.distributed.split_dataset_by_node``) into one buffer
per bucket; a global bucket schedule, the same on every rank (:func:`~hf_arb.sampling.streaming.plan.stream_schedule`),
says which bucket every rank serves at each step. Like :class:`~hf_arb.BucketBatchSampler`, the stream yields
the global sequence step-major, rank-minor — ``W`` items per step, item ``r`` is rank ``r``'s batch — so a plain
``accelerator.prepare`` hands each rank its own batch:

- ``dispatch_batches=False`` (recommended): accelerate wraps the stream in ``IterableDatasetShard``, which keeps
  item ``process_index`` of every ``W`` items. Built with ``rank=process_index``, the stream reads only that
  rank's split and yields ``None`` in the other ranks' slots, which the shard discards unread.
- ``dispatch_batches=True`` (accelerate's default for iterable datasets): only the main process iterates; built
  with ``rank=None`` it reads every rank's split and the dispatcher concatenates and slices the ``W`` batches
  (the collate function must return tensors; they have equal shapes, being of one bucket).

``split_batches=True`` is not supported (a rank's batch is one item).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .buffer import COUNTERS, BufferOverflowError, RankBuffer, decoding_columns
from .plan import StreamReport, as_counts, stream_schedule

__all__ = ["BucketedStream", "BufferOverflowError", "build_stream_loader", "shuffle_shards"]
#: 2: the source is read in chunks of ``snapshot_every`` rows (``IterableDataset.iter``), so the source snapshots
#: in a state are those of a chunked read; version 1 snapshots were taken reading row by row.
STATE_VERSION = 2
_EXPECTED = "a stream state (the dict `stream.state_dict(step=...)` returned, or its JSON text)"
_RANK_FIELDS = ("step", "read", "counters", "snapshots", "buffer", "reserve")


def check_stream_state(state: Any) -> Mapping[str, Any]:
    """A stream state's shape, checked before anything is restored: a mapping with ``version``, ``config``
    (mapping), ``epoch`` and ``step`` (ints >= 0) and ``ranks`` (rank → mapping with the buffer fields).
    Garbage (None, a list, text that is not JSON, a dict of other fields) is refused naming what was expected."""
    if isinstance(state, (str, bytes, bytearray)):
        try:
            state = json.loads(state)
        except json.JSONDecodeError as e:
            raise ValueError(f"BucketedStream.load_state_dict expected {_EXPECTED}, got a string that is not JSON "
                             f"({e.msg} at position {e.pos}): {str(state)[:60]!r}.") from None
    if not isinstance(state, Mapping):
        raise TypeError(f"BucketedStream.load_state_dict expected {_EXPECTED}, got {type(state).__name__}: "
                        f"{repr(state)[:60]}. Pass the rank's saved `stream.state_dict(step=...)`.")
    if state.get("version") not in (1, STATE_VERSION):
        return state  # the version message (below, in load_state_dict) names the expected version
    if state.get("version") == 1:
        return state
    fields = {"config": Mapping, "epoch": int, "step": int, "ranks": Mapping}
    for name, kind in fields.items():
        value = state.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            what = "a mapping" if kind is Mapping else "an int >= 0"
            raise ValueError(f"Stream state field `{name}` should be {what}, got {value!r}"[:200] +
                             f" (expected {_EXPECTED}).")
    for r, rank_state in state["ranks"].items():
        missing = [f for f in _RANK_FIELDS if not isinstance(rank_state, Mapping) or f not in rank_state]
        if missing:
            raise ValueError(f"Stream state field `ranks.{r}` lacks {missing} (expected {_EXPECTED}).")
    return state


def shuffle_shards(dataset: Any, seed: int) -> Any:
    """Shuffle a streaming dataset's shard order only, reading one shard at a time.

    ``dataset.shuffle(seed=seed, buffer_size=1, max_buffer_input_shards=1)``: no row buffer (datasets does not
    restore its shuffle buffer on resume; the stream's own buffer mixes the rows), and no interleaving of shards
    (with several shards open at once, datasets reads them through a thread pool and sleeps 5 s, pyarrow issue
    45214, each time that reader closes, i.e. at the end of every pass of every rank). A datasets release without
    ``max_buffer_input_shards`` gets the first two arguments only.

    Args:
        dataset: a ``datasets.IterableDataset`` (several shards: many files, or
        ``to_iterable_dataset(num_shards=...)``). seed: the run's seed (``set_epoch`` on the dataset reshuffles per
        epoch, as datasets does).
    """
    import inspect

    kwargs: dict[str, Any] = {"seed": seed, "buffer_size": 1}
    if "max_buffer_input_shards" in inspect.signature(dataset.shuffle).parameters:
        kwargs["max_buffer_input_shards"] = 1
    return dataset.shuffle(**kwargs)


def check_reader(reader: Any, dataset: Any) -> None:
    """Refuse a ``reader`` other than ``"source"``/``"arrow"``, and ``"arrow"`` over a column datasets decodes (its
    python rows would hold the decoded values, which the Arrow reader does not make)."""
    if reader not in ("source", "arrow"):
        raise ValueError(f"`reader` must be 'source' or 'arrow', got {reader!r}.")
    decoded = decoding_columns(dataset.features) if reader == "arrow" else []
    if decoded:
        raise ValueError(f"reader='arrow' yields undecoded values, but datasets decodes the column(s) {decoded} of "
                         "this stream; stream them undecoded (`ds.cast_column(name, datasets.Image(decode=False))`) "
                         "and decode in `collate_fn`, or use reader='source'.")


class BucketedStream(torch.utils.data.IterableDataset):
    """Full one-bucket batches from a streaming dataset, the same bucket on every rank at every step.

    Args:
        dataset: an annotated ``datasets.IterableDataset`` (its ``bucket_column``; see ``add_bucket_columns``).
            Use a source with several shards (``to_iterable_dataset(num_shards=...)``, many parquet files), and
            shuffle shard order with :func:`shuffle_shards` rather than datasets' row buffer: datasets does not
            restore its shuffle buffer on resume.
        batch_size: rows per batch per rank.
        counts: rows per bucket over the whole split (array, ``{id: rows}``, an annotation summary or the card's
            stats, see :func:`~hf_arb.sampling.streaming.plan.as_counts`); they fix the schedule.
        buckets: the BucketSet, only for counts keyed by ``"WxH"``.
        num_replicas: ranks (``accelerator.num_processes``).
        rank: the rank whose split this process reads, or None to read every rank's split here (single-process
            simulation, or accelerate's ``dispatch_batches=True``).
        seed: the run's seed (schedule and buffer picks; no global RNG is touched).
        buffer_size: most rows a rank holds in its bucket buffers (the repeat reserve, at most one batch per
            bucket, comes on top).
        shuffle_rows: rows a rank keeps buffered ahead (default ``buffer_size // 2``): the window rows are picked
            from at random, so larger means better mixing within a bucket.
        on_overflow: what happens when the scheduled bucket cannot be filled without exceeding ``buffer_size``:
            ``"error"`` raises :class:`BufferOverflowError`; ``"evict"`` drops the oldest row of the fullest other
            bucket (counted in ``report().rows_evicted``).
        bucket_column: the column with the bucket id (``-1``/null rows are skipped and counted).
        collate_fn: turns a rank's list of rows into its batch (default: the list of row dicts).
        snapshot_every: rows between two snapshots of the source's ``state_dict()`` (bounds replay on resume); the
            source is read in chunks of this many rows (``dataset.iter(batch_size=snapshot_every)``), which is
            much faster than row by row: keep it at 64 or more unless resume replay must be tiny.
        history: steps back that :meth:`state_dict` can describe (the loader runs ahead of training by 1–2 steps).
        schedule: the order of the buckets' batches, see :func:`~hf_arb.sampling.streaming.plan.stream_schedule`:
            ``"arrival"`` (each bucket's batches spread evenly, placed after their rows can have arrived) or
            ``"shuffle"`` (uniform, as the map-style plan; needs a much larger buffer for rare buckets).
        pick_window: a batch is drawn uniformly from its bucket's ``pick_window`` oldest buffered rows (default
            ``8 * batch_size``): larger mixes more, but rows wait longer in the buffer and a resume re-reads more.
        epoch_dataset: ``epoch_dataset(epoch)`` is the ``IterableDataset`` read in that epoch instead of ``dataset``
            (the same columns and the rows ``counts`` counts, e.g. the epoch's crop variant of an encoded dataset);
            it must return the same dataset for the same epoch, since a resume re-reads it.
        reader: how a chunk of the source is read. ``"source"`` (default): ``dataset.iter(batch_size=...)`` through
            the dataset's own formatting (python, numpy or torch). ``"arrow"``: the dataset read as Arrow tables
            (``with_format("arrow")``), each chunk made python columns at once (``Table.to_pydict()``), for an
            unformatted source (python rows) whose columns need no decoding: the same rows and batches as
            ``"source"`` gives such a source, at a fraction of the reading cost (datasets' python formatting goes
            through a dict per row); a source's numpy/torch formatting is not applied. The two readers' states are
            the same (read indices, counters, the dataset's own snapshots): a state saved with one resumes with the
            other, so a checkpoint from before a switch of reader resumes.
    """

    def __init__(self, dataset: Any, batch_size: int, *, counts: Any, buckets: Any = None, num_replicas: int = 1,
                 rank: int | None = None, seed: int = 0, buffer_size: int = 2048, shuffle_rows: int | None = None,
                 on_overflow: str = "error", bucket_column: str = "bucket",
                 collate_fn: Callable[[list[Any]], Any] | None = None, snapshot_every: int = 256,
                 history: int = 8, pick_window: int | None = None, schedule: str = "arrival",
                 epoch_dataset: Callable[[int], Any] | None = None, reader: str = "source") -> None:
        import datasets

        if not isinstance(dataset, datasets.IterableDataset):
            raise TypeError(f"BucketedStream needs a datasets.IterableDataset, got {type(dataset).__name__}; for a "
                            "map-style Dataset use hf_arb.BucketBatchSampler (or "
                            "`ds.to_iterable_dataset(num_shards=N)`).")
        names = dataset.column_names
        if names is not None and bucket_column not in names:
            raise ValueError(f"The stream has no {bucket_column!r} column (columns: {names}). Annotate it first with "
                             "`hf_arb.add_bucket_columns(ds, buckets)`.")
        for name, v in (("batch_size", batch_size), ("num_replicas", num_replicas), ("buffer_size", buffer_size),
                        ("snapshot_every", snapshot_every), ("history", history)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {v!r}.")
        if buffer_size < batch_size:
            raise ValueError(f"`buffer_size` ({buffer_size}) must hold at least one batch ({batch_size} rows).")
        if rank is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be None or in [0, {num_replicas}), got {rank!r}.")
        if on_overflow not in ("error", "evict"):
            raise ValueError(f"`on_overflow` must be 'error' or 'evict', got {on_overflow!r}.")
        check_reader(reader, dataset)
        shuffle_rows = buffer_size // 2 if shuffle_rows is None else int(shuffle_rows)
        if not 0 <= shuffle_rows <= buffer_size:
            raise ValueError(f"`shuffle_rows` must be in [0, buffer_size={buffer_size}], got {shuffle_rows}.")
        self.dataset, self.batch_size, self.num_replicas, self.rank = dataset, int(batch_size), int(num_replicas), rank
        self.counts = as_counts(counts, buckets)
        self.seed, self.buffer_size, self.shuffle_rows = int(seed), int(buffer_size), shuffle_rows
        self.on_overflow, self.bucket_column, self.collate_fn = on_overflow, bucket_column, collate_fn
        self.epoch_dataset, self.reader = epoch_dataset, reader
        self.snapshot_every, self.history = int(snapshot_every), int(history)
        self.pick_window = 8 * self.batch_size if pick_window is None else int(pick_window)
        if self.pick_window < self.batch_size:
            raise ValueError(f"`pick_window` must be >= batch_size ({self.batch_size}), got {pick_window}.")
        self.epoch = 0
        if schedule not in ("arrival", "shuffle"):
            raise ValueError(f"`schedule` must be 'arrival' or 'shuffle', got {schedule!r}.")
        self.schedule_order = schedule
        self._schedule = self._make_schedule()
        self._engines: dict[int, RankBuffer] | None = None

    # ------------------------------------------------------------------------------------------ shape
    @property
    def global_batch_size(self) -> int:
        """Rows per step over all ranks."""
        return self.num_replicas * self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps every rank takes per epoch (the same on all ranks)."""
        return int(self._schedule.size)

    @property
    def schedule(self) -> np.ndarray:
        """The bucket of every step of the current epoch, shape ``(steps_per_epoch,)`` (a copy)."""
        return self._schedule.copy()

    @property
    def ranks(self) -> list[int]:
        """The ranks whose split this process reads."""
        return list(range(self.num_replicas)) if self.rank is None else [self.rank]

    @property
    def step(self) -> int:
        """Steps of the current epoch produced so far (the loader may be one or two ahead of training)."""
        return 0 if not self._engines else next(iter(self._engines.values())).step

    def __len__(self) -> int:
        """Items per epoch: ``steps_per_epoch * num_replicas`` (one per rank and step)."""
        return self.steps_per_epoch * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step; a no-op when it is the current epoch (so a resumed position is
        kept when accelerate calls ``set_epoch`` at the start of iteration)."""
        if hasattr(self.collate_fn, "set_epoch"):  # e.g. StreamImageCollate: per-row draws follow the epoch
            self.collate_fn.set_epoch(int(epoch))
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._schedule = self._make_schedule()
            self._engines = None

    def _make_schedule(self) -> np.ndarray:
        return stream_schedule(self.counts, self.global_batch_size, self.seed, self.epoch, order=self.schedule_order,
                               batch_size=self.batch_size)

    # ------------------------------------------------------------------------------------------ iteration
    def _open(self, rank: int, epoch: int, state: Any) -> Any:
        from datasets.distributed import split_dataset_by_node

        # a new IterableDataset even for one rank: loading a state must never touch the caller's dataset
        dataset = self.dataset if self.epoch_dataset is None else self.epoch_dataset(epoch)
        src = split_dataset_by_node(dataset, rank=rank, world_size=self.num_replicas)
        src.set_epoch(epoch)
        if state is not None:
            src.load_state_dict(state)
        return src

    def _make_engines(self) -> dict[int, RankBuffer]:
        return {r: RankBuffer(lambda st, r=r, e=self.epoch: self._open(r, e, st), self._schedule, rank=r,
                              batch_size=self.batch_size, buffer_size=self.buffer_size, fill=self.shuffle_rows,
                              seed=self.seed, epoch=self.epoch, on_overflow=self.on_overflow,
                              bucket_column=self.bucket_column, snapshot_every=self.snapshot_every,
                              history=self.history, pick_window=self.pick_window, reader=self.reader)
                for r in self.ranks}

    def __iter__(self) -> Iterator[Any]:
        """The rest of the epoch: per step, one item per rank (``None`` for ranks this process does not read)."""
        if self._engines is None or self.step >= self.steps_per_epoch:
            self._engines = self._make_engines()
        engines = self._engines
        collate = self.collate_fn or (lambda rows: rows)
        for _ in range(self.step, self.steps_per_epoch):
            for r in range(self.num_replicas):
                yield collate(engines[r].next_batch()) if r in engines else None

    def rank_batches(self) -> Iterator[Any]:
        """Only this process's rank's batches (plain DDP without accelerate; needs ``rank`` set)."""
        if self.rank is None:
            raise ValueError("rank_batches() needs the stream built with `rank=`; with rank=None iterate the stream.")
        yield from (item for i, item in enumerate(self) if i % self.num_replicas == self.rank)

    # ------------------------------------------------------------------------------------------ state
    def _config(self) -> dict[str, Any]:
        digest = hashlib.sha1(self.counts.tobytes()).hexdigest()[:16]
        return {"num_replicas": self.num_replicas, "batch_size": self.batch_size, "seed": self.seed,
                "pick_window": self.pick_window, "buffer_size": self.buffer_size, "shuffle_rows": self.shuffle_rows,
                "on_overflow": self.on_overflow, "schedule": self.schedule_order,
                "counts_sha1": digest, "bucket_column": self.bucket_column}  # not the reader: states are the same

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The JSON-serialisable position: config, epoch, step and, per rank read here, its buffered rows' read
        indices, repeat reserve, counters and the source snapshots needed to re-read them.

        Args:
            step: steps of the current epoch the training loop has *finished* (the prepared loader prefetches, so
                the stream's own position is ahead); default: :attr:`step`.
        """
        step = self.step if step is None else int(step)
        if not 0 <= step <= self.step:
            raise ValueError(f"`step` must be in [0, {self.step}] (steps produced so far this epoch), got {step}.")
        ranks = {} if not self._engines else {str(r): e.state_at(step) for r, e in self._engines.items()}
        return {"version": STATE_VERSION, "config": self._config(), "epoch": self.epoch, "step": step, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the remaining batches equal an uninterrupted run's.

        Raises:
            TypeError: ``state`` is not a mapping (or its JSON text).
            ValueError: the state was saved with another configuration, lacks a field (named) or a rank this
                process reads.
        """
        state = check_stream_state(state)
        if state.get("version") == 1:
            raise ValueError("This stream state has version 1 (saved by an hf_arb that read the source row by row); "
                             f"this version reads it in chunks and needs version {STATE_VERSION}. Resume with the "
                             "hf_arb that saved it, or restart the epoch (`stream.set_epoch(epoch)` without loading).")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Unsupported stream state version {state.get('version')!r} (expected {STATE_VERSION}).")
        if state["config"] != self._config():
            raise ValueError(f"The stream state was saved with {state['config']}, but this stream has "
                             f"{self._config()}; resume with the same world size, batch size, seed, counts and buffer "
                             f"settings.")
        self.set_epoch(int(state["epoch"]))
        self._engines = None
        if not state["ranks"]:
            return
        missing = [r for r in self.ranks if str(r) not in state["ranks"]]
        if missing:
            raise ValueError(f"The state has ranks {sorted(state['ranks'])} but this process reads {missing}; save "
                             "each rank's `state_dict()` separately and load the file of the same rank.")
        self._engines = self._make_engines()
        for r, e in self._engines.items():
            e.load(state["ranks"][str(r)])

    def report(self) -> StreamReport:
        """Rows read, used, repeated, buffered and skipped so far this epoch (summed over :attr:`ranks`)."""
        engines = list((self._engines or {}).values())
        c = {k: sum(e.c[k] for e in engines) for k in COUNTERS}
        labels, n = np.unique(self._schedule, return_counts=True)
        return StreamReport(
            epoch=self.epoch, steps=self.steps_per_epoch, step=self.step, num_replicas=self.num_replicas,
            batch_size=self.batch_size, ranks=self.ranks, rows_expected=int(self.counts.sum()), rows_read=c["read"],
            rows_used=c["used"], rows_repeated=c["repeated"], rows_buffered=sum(e.total for e in engines),
            rows_skipped_unassigned=c["skipped_unassigned"], rows_skipped_small=c["skipped_small"],
            rows_skipped_surplus=c["skipped_surplus"], rows_evicted=c["evicted"],
            peak_buffered=max((e.c["peak"] for e in engines), default=0),
            rows_unread=None if self.rank is not None and self.num_replicas > 1 else
            int(self.counts.sum()) - (c["read"] - c["skipped_unassigned"]),
            batches_per_bucket={int(b): int(k) for b, k in zip(labels.tolist(), n.tolist())},
        )


def _only_item(items: list[Any]) -> Any:
    return items[0]


def build_stream_loader(dataset: Any, batch_size: int, *, counts: Any, accelerator: Any = None,
                        **stream_kwargs: Any) -> tuple[torch.utils.data.DataLoader, BucketedStream]:
    """A ``DataLoader`` over a :class:`BucketedStream` set up for ``accelerator`` (or one process), to pass to
    ``accelerator.prepare``.

    With ``dispatch_batches=False`` each process reads only its own split; otherwise (accelerate's default for
    iterable datasets) the main process reads every split. Keep ``num_workers=0``: the stream's position lives
    in this process.

    Args:
        dataset, batch_size, counts: see :class:`BucketedStream` (``batch_size`` per rank).
        accelerator: an ``accelerate.Accelerator``, or None for one process.
        **stream_kwargs: the other :class:`BucketedStream` arguments (``seed``, ``buffer_size``, ``collate_fn``…).

    Returns:
        ``(loader, stream)``; keep ``stream`` for ``state_dict(step)``/``load_state_dict``/``report``.

    Raises:
        ValueError: the accelerator uses ``split_batches=True``.
    """
    world, rank = 1, None
    if accelerator is not None:
        world = int(accelerator.num_processes)
        if accelerator.split_batches:
            raise ValueError("build_stream_loader does not support split_batches=True: give each rank its own batch "
                             "(DataLoaderConfiguration(split_batches=False)) with the per-rank `batch_size`.")
        dispatch = accelerator.dataloader_config.dispatch_batches
        rank = accelerator.process_index if (world > 1 and dispatch is False) else None
    stream = BucketedStream(dataset, batch_size, counts=counts, num_replicas=world, rank=rank, **stream_kwargs)
    return torch.utils.data.DataLoader(stream, batch_size=1, collate_fn=_only_item, num_workers=0), stream
