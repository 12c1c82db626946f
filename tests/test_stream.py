"""BucketedStream: the global schedule, every rank's buffers simulated in one process, exact resume."""

from __future__ import annotations

import json
import re
from unittest import mock

import datasets
import numpy as np
import pytest
from datasets.distributed import split_dataset_by_node
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hf_arb
from hf_arb.sampling.streaming.plan import as_counts, stream_schedule
from hf_arb.sampling.streaming.stream import BucketedStream, BufferOverflowError, build_stream_loader


def _stream_ds(bucket_ids: np.ndarray, num_shards: int) -> datasets.IterableDataset:
    ds = datasets.Dataset.from_dict({"key": np.arange(bucket_ids.size), "bucket": bucket_ids})
    return ds.to_iterable_dataset(num_shards=num_shards)


def _counts(bucket_ids: np.ndarray) -> np.ndarray:
    return np.bincount(bucket_ids[bucket_ids >= 0], minlength=int(bucket_ids.max()) + 1)


def _run(stream: BucketedStream, state: dict | None = None, stop_after: int | None = None):
    """Iterate ``stream`` (after loading ``state``); with ``stop_after``, stop one step past it (as a prefetching
    loader does) and return the state at ``stop_after`` steps (JSON round trip)."""
    if state is not None:
        stream.load_state_dict(state)
    w, out = stream.num_replicas, []
    for item in stream:
        out.append([(int(r["key"]), int(r["bucket"])) for r in item])
        if stop_after is not None and len(out) == (stop_after + 1) * w:
            return out, json.loads(json.dumps(stream.state_dict(step=stop_after)))
    return out, None


# ------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("order", ["arrival", "shuffle"])
def test_schedule_is_pure_and_proportional(order):
    counts = np.array([1000, 370, 0, 80, 640])
    s = stream_schedule(counts, 8, seed=3, epoch=1, order=order, batch_size=4)
    assert np.array_equal(s, stream_schedule(counts, 8, seed=3, epoch=1, order=order, batch_size=4))
    assert np.bincount(s, minlength=5).tolist() == (counts // 8).tolist()
    assert not np.array_equal(s, stream_schedule(counts, 8, seed=3, epoch=2, order=order, batch_size=4))
    if order == "arrival":  # every bucket's batches spread over the epoch: each half holds 30-70% of them
        first = np.bincount(s[: s.size // 2], minlength=5)[[0, 1, 3, 4]]
        assert ((first >= 0.3 * counts[[0, 1, 3, 4]] // 8) & (first <= 0.7 * counts[[0, 1, 3, 4]] // 8)).all()


def test_arrival_schedule_keeps_rare_buckets_within_a_small_buffer():
    """NovelAI-like proportions in random order: the arrival order needs no eviction where a shuffle does."""
    p = np.array([.41, .12, .11, .08, .08, .05, .04, .04, .03, .01, .01, .005, .003, .003, .002, .001])
    ids = np.random.default_rng(0).choice(p.size, size=20_000, p=p / p.sum())
    ds = _stream_ds(ids, 4)
    evicted = {}
    for order in ("arrival", "shuffle"):
        stream = BucketedStream(ds, 4, counts=_counts(ids), num_replicas=2, seed=0, buffer_size=600,
                                on_overflow="evict", schedule=order)
        _run(stream)
        evicted[order] = stream.report().rows_evicted
    assert evicted["arrival"] == 0 < evicted["shuffle"]


def test_as_counts_forms():
    buckets = hf_arb.BucketSet([(64, 64), (96, 48)])
    assert as_counts({1: 5, 0: 2}).tolist() == [2, 5]
    assert as_counts({"counts": {"96x48": 7, "64x64": 1}}, buckets).tolist() == [1, 7]
    with pytest.raises(ValueError, match="need `buckets`"):
        as_counts({"96x48": 7})
    with pytest.raises(ValueError, match=">= 0"):
        as_counts([3, -1])


# ------------------------------------------------------------------------------------------ simulation of W ranks
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # each example streams; shrinking would be slow
@given(weights=st.lists(st.integers(1, 20), min_size=1, max_size=5), unassigned=st.integers(0, 3),
       n=st.integers(60, 500), world=st.integers(1, 3), batch=st.integers(1, 4), buffer_mult=st.integers(1, 40),
       shards=st.integers(1, 7), seed=st.integers(0, 3), cut=st.floats(0, 1), window=st.integers(1, 12),
       order=st.sampled_from(["arrival", "shuffle"]))
def test_simulated_ranks(weights, unassigned, n, world, batch, buffer_mult, shards, seed, cut, window, order):
    p = np.array([unassigned] + weights, dtype=float)
    ids = np.random.default_rng(seed).choice(np.arange(-1, len(weights)), size=n, p=p / p.sum())
    if (ids < 0).all():
        ids[0] = 0
    ds = _stream_ds(ids, shards)
    kw = dict(counts=_counts(ids), num_replicas=world, seed=seed, buffer_size=batch * buffer_mult,
              on_overflow="evict", snapshot_every=7, pick_window=batch * window, schedule=order)
    stream = BucketedStream(ds, batch, **kw)
    try:
        out, _ = _run(stream)
    except RuntimeError as err:  # documented limit: a rank whose split has no row of a scheduled bucket
        found = re.search(r"Rank (\d+), step \d+: the schedule asks for bucket (\d+)", str(err))
        assert found, err
        rank, bucket = map(int, found.groups())
        assert bucket not in {row["bucket"] for row in split_dataset_by_node(ds, rank=rank, world_size=world)}
        return
    steps = stream.steps_per_epoch
    assert len(out) == steps * world  # every rank gets the same number of batches
    sched = stream.schedule
    for s in range(steps):  # every rank serves the scheduled bucket at every step, full batches
        for r in range(world):
            assert len(out[s * world + r]) == batch
            assert {b for _, b in out[s * world + r]} == {int(sched[s])}
    rep = stream.report()
    keys = [k for item in out for k, _ in item]
    assert len(set(keys)) == rep.rows_used  # no row twice, except the counted repeat slots
    assert len(keys) == rep.rows_used + rep.rows_repeated
    assert rep.rows_read == (rep.rows_used + rep.rows_buffered + rep.rows_skipped_unassigned + rep.rows_skipped_small
                             + rep.rows_skipped_surplus + rep.rows_evicted)  # every row read is emitted or reported
    assert rep.rows_read - rep.rows_skipped_unassigned + rep.rows_unread == (ids >= 0).sum()  # or reported unread
    assert rep.peak_buffered <= kw["buffer_size"] + len(weights) * batch
    if steps:  # resume mid-epoch equals the uninterrupted run
        k = min(int(cut * steps), steps - 1)
        _, state = _run(BucketedStream(ds, batch, **kw), stop_after=k)
        if state is not None:
            rest, _ = _run(BucketedStream(ds, batch, **kw), state)
            assert rest == out[k * world:]


@pytest.mark.parametrize("reopen_rows", [0, 1024])  # 0: restore a snapshot for every buffered row's group
def test_resume_at_several_points_and_report_survives(monkeypatch, reopen_rows):
    from hf_arb.sampling.streaming import buffer as stream_buffer

    monkeypatch.setattr(stream_buffer, "REOPEN_ROWS", reopen_rows)
    ids = np.random.default_rng(0).choice([-1, 0, 1, 2, 3], size=900, p=[.05, .5, .3, .14, .01])
    ds = _stream_ds(ids, 4)
    kw = dict(counts=_counts(ids), num_replicas=2, seed=1, buffer_size=200, snapshot_every=16)
    full_stream = BucketedStream(ds, 3, **kw)
    full, _ = _run(full_stream)
    for k in (0, 1, 40, full_stream.steps_per_epoch - 1):
        _, state = _run(BucketedStream(ds, 3, **kw), stop_after=k)
        resumed = BucketedStream(ds, 3, **kw)
        rest, _ = _run(resumed, state)
        assert rest == full[2 * k:], k
        assert resumed.report() == full_stream.report()


def test_resume_at_step_0_after_snapshots_were_pruned_during_step_0():
    """Step 0 reads a whole fill, taking (and pruning) many snapshots: the one at row 0 must survive."""
    ids = np.random.default_rng(5).choice([-1, 0, 1], size=400, p=[.1, .6, .3])
    ids[:12] = -1  # no buffered row needs snapshot 0: only the step's start does
    ds = _stream_ds(ids, 7)  # 7 shards over 3 ranks: rows split one in three
    kw = dict(counts=_counts(ids), num_replicas=3, seed=2, buffer_size=150, snapshot_every=1, on_overflow="evict")
    full, _ = _run(BucketedStream(ds, 3, **kw))
    for k in (0, 1):
        _, state = _run(BucketedStream(ds, 3, **kw), stop_after=k)
        assert k or all("0" in r["snapshots"] for r in state["ranks"].values())
        rest, _ = _run(BucketedStream(ds, 3, **kw), state)
        assert rest == full[3 * k:], k


def test_epochs_differ_and_set_epoch_keeps_a_resumed_position():
    ids = np.random.default_rng(1).integers(0, 3, size=300)
    ds = _stream_ds(ids, 3)
    stream = BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=64)
    e0, _ = _run(stream)
    stream.set_epoch(1)
    e1, _ = _run(stream)
    assert e0 != e1 and sorted(map(tuple, e0)) != []
    _, state = _run(BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=64), stop_after=5)
    again = BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=64)
    again.load_state_dict(state)
    again.set_epoch(0)  # what accelerate does at the start of iteration: must not rewind
    assert _run(again)[0] == e0[5:]


# ------------------------------------------------------------------------------------------ errors
def test_overflow_raises_a_clear_error():
    ids = np.array([0] * 200 + [1] * 8)  # bucket 1 only at the very end of the stream
    ds = _stream_ds(ids, 1)
    stream = BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=16, schedule="shuffle")
    with pytest.raises(BufferOverflowError, match="buffer_size"):
        _run(stream)
    evict = BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=16, on_overflow="evict", schedule="shuffle")
    out, _ = _run(evict)
    assert len(out) == evict.steps_per_epoch and evict.report().rows_evicted > 0


def test_bad_inputs():
    ids = np.zeros(40, dtype=int)
    ds = _stream_ds(ids, 2)
    with pytest.raises(TypeError, match="IterableDataset"):
        BucketedStream(datasets.Dataset.from_dict({"bucket": ids}), 4, counts=[40])
    with pytest.raises(ValueError, match="'bucket' column"):
        BucketedStream(ds.remove_columns("bucket"), 4, counts=[40])
    with pytest.raises(ValueError, match="at least one batch"):
        BucketedStream(ds, 4, counts=[40], buffer_size=2)
    state = BucketedStream(ds, 4, counts=[40]).state_dict()
    with pytest.raises(ValueError, match="same world size"):
        BucketedStream(ds, 2, counts=[40]).load_state_dict(state)
    with pytest.raises(ValueError, match="version 1 .*restart the epoch"):  # row-by-row snapshots: refused
        BucketedStream(ds, 4, counts=[40]).load_state_dict({**state, "version": 1})
    with pytest.raises(TypeError, match="with_format"):  # chunks must be dicts of columns
        list(BucketedStream(ds.with_format("arrow"), 4, counts=[40]))


# ------------------------------------------------------------------------------------------ chunked reading
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-1, 5), min_size=1, max_size=60), room=st.lists(st.integers(-2, 6), min_size=5,
       max_size=5), scheduled=st.lists(st.integers(0, 2), min_size=5, max_size=5))
def test_accepted_rows_decides_as_row_by_row(ids, room, scheduled):
    from hf_arb.sampling.streaming import buffer

    for cells in (buffer.ONE_HOT_CELLS, 0):  # both ways of ranking a row in its bucket: one-hot cumsum, sort
        with mock.patch.object(buffer, "ONE_HOT_CELLS", cells):
            ok, acc = buffer.accepted_rows(np.array(ids), np.array(scheduled), np.array(room))
        left = list(room)
        for j, b in enumerate(ids):  # the per-row rule of RankBuffer._read_one
            assert ok[j] == (0 <= b < 5 and scheduled[b] > 0)
            assert acc[j] == (ok[j] and left[b] > 0)
            if acc[j]:
                left[b] -= 1


@pytest.mark.parametrize("fmt", ["numpy", "torch"])
def test_formatted_sources_give_the_same_batches(fmt):
    ids = np.random.default_rng(0).integers(-1, 2, 200)
    ds = _stream_ds(ids, 2)
    plain, _ = _run(BucketedStream(ds, 4, counts=_counts(ids), buffer_size=40))
    formatted, _ = _run(BucketedStream(ds.with_format(fmt), 4, counts=_counts(ids), buffer_size=40))
    assert formatted == plain


def test_numpy_fill_equals_row_by_row_fill_and_states(monkeypatch):
    """The vectorised fill and the per-row path give the same batches, states and report."""
    from hf_arb.sampling.streaming import buffer as stream_buffer

    ids = np.random.default_rng(3).choice([-1, 0, 1, 2, 3], size=700, p=[.05, .5, .3, .14, .01])
    ds = _stream_ds(ids, 3)
    kw = dict(counts=_counts(ids), num_replicas=2, seed=2, buffer_size=120, snapshot_every=32, on_overflow="evict")
    got = {}
    for rows in (1, 10**9):  # 1: every fill through numpy; 10**9: every row alone
        monkeypatch.setattr(stream_buffer, "VECTOR_ROWS", rows)
        stream = BucketedStream(ds, 3, **kw)
        out, state = _run(stream, stop_after=30)
        full, _ = _run(BucketedStream(ds, 3, **kw))
        got[rows] = (out, state, full, stream.report())
    assert got[1] == got[10**9]


def test_build_stream_loader_through_accelerate_one_process():
    from accelerate import Accelerator

    ids = np.random.default_rng(2).integers(0, 3, size=200)
    ds = _stream_ds(ids, 2)
    import torch

    def collate(rows):  # accelerate's default for iterable datasets (dispatch_batches) needs tensors
        return {"key": torch.tensor([r["key"] for r in rows])}

    acc = Accelerator(cpu=True)
    loader, stream = build_stream_loader(ds, 4, counts=_counts(ids), accelerator=acc, seed=0, buffer_size=64,
                                         collate_fn=collate)
    prepared = acc.prepare(loader)
    batches = [b["key"].tolist() for b in prepared]
    assert len(batches) == len(prepared) == stream.steps_per_epoch
    plain, _ = _run(BucketedStream(ds, 4, counts=_counts(ids), seed=0, buffer_size=64))
    assert batches == [[k for k, _ in item] for item in plain]


def test_counts_from_card():
    import yaml
    from huggingface_hub import DatasetCard

    from hf_arb.sampling.streaming.plan import counts_from_card

    buckets = hf_arb.BucketSet([(64, 64), (96, 48), (48, 96)])
    meta = {"hf_arb": {"buckets": buckets.to_dict(), "stats": {"train": {"counts": {"48x96": 4, "64x64": 9}}}}}
    card = DatasetCard("---\n" + yaml.safe_dump(meta) + "---\n# photos\n")
    assert counts_from_card(card, "train").tolist() == [9, 0, 4]
    with pytest.raises(ValueError, match="no `hf_arb.stats.test`"):
        counts_from_card(card, "test")


def test_stream_image_collate_fits_rows_to_their_bucket():
    import io

    from PIL import Image

    from hf_arb.sampling.streaming.collate import StreamImageCollate

    sizes = {0: (32, 32), 1: (48, 16)}
    rng = np.random.default_rng(0)
    rows = {"key": [], "image": [], "text": [], "bucket": [], "bucket_width": [], "bucket_height": []}
    for i in range(24):
        b = i % 2
        buf = io.BytesIO()
        w, h = (40, 38) if b == 0 else (90, 33)
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        for k, v in zip(rows, (i, buf.getvalue(), [f"a {i}", f"b {i}"], b, *sizes[b])):
            rows[k].append(v)
    ds = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=2)
    collate = StreamImageCollate("key", seed=3, random_flip=True)
    stream = BucketedStream(ds, 4, counts=[12, 12], seed=0, buffer_size=24, collate_fn=collate)
    batches = list(stream)
    assert len(batches) == 6
    for batch in batches:
        b = int(batch["buckets"][0])
        assert (batch["buckets"] == b).all()
        assert tuple(batch["pixel_values"].shape) == (4, 3, sizes[b][1], sizes[b][0])
        assert all(c.split()[1] == str(int(r)) for c, r in zip(batch["captions"], batch["rows"]))
    stream.set_epoch(1)
    assert collate.epoch == 1
    again = list(BucketedStream(ds, 4, counts=[12, 12], seed=0, buffer_size=24,
                                collate_fn=StreamImageCollate("key", seed=3, random_flip=True)))
    assert all(torch_equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(batches, again))


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_one_rank_reads_only_its_split_and_matches_the_simulation():
    ids = np.random.default_rng(4).integers(0, 3, size=240)
    ds = _stream_ds(ids, 4)
    kw = dict(counts=_counts(ids), num_replicas=2, seed=5, buffer_size=80)
    everyone, _ = _run(BucketedStream(ds, 3, **kw))
    mine = BucketedStream(ds, 3, rank=1, **kw)
    got = [[(int(r["key"]), int(r["bucket"])) for r in b] for b in mine.rank_batches()]
    assert got == everyone[1::2]
    assert mine.report().rows_unread is None  # unknowable from one rank
    with pytest.raises(ValueError, match="needs the stream built with `rank=`"):
        next(BucketedStream(ds, 3, **kw).rank_batches())


def _jpeg(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "JPEG")
    return buf.getvalue()


def test_streamed_bad_image_is_replaced_counted_and_logged_or_raises(tmp_path):
    """--on_bad_image replace under --streaming: a body-truncated image trains the batch's next good row instead, is
    counted and listed in skipped_rows.jsonl once; "error" raises (#24 audit: the flag was not read by the stream)."""
    from hf_arb.images.bad_images import read_bad_rows
    from hf_arb.sampling.streaming.collate import StreamImageCollate

    good, other = _jpeg(40, 30, (200, 10, 10)), _jpeg(40, 30, (10, 200, 10))
    rows = [{"id": i, "image": {"bytes": b, "path": None}, "text": f"r{i}", "bucket": 0, "bucket_width": 32,
             "bucket_height": 24} for i, b in enumerate([good, good[: len(good) // 3], other])]
    log = tmp_path / "skipped_rows.jsonl"
    collate = StreamImageCollate("id", on_bad_image="replace", bad_image_log=log)
    batch = collate(rows)
    assert batch["pixel_values"].shape == (3, 3, 24, 32)
    assert batch["rows"].tolist() == [0, 2, 2]  # row 1 is bad: the batch's next good row trains in its place
    assert collate.bad_images.count == 1 and [r["row"] for r in read_bad_rows(log)] == [1]
    collate(rows)
    assert collate.bad_images.count == 2 and len(read_bad_rows(log)) == 1  # counted again, listed once
    with pytest.raises(OSError):
        StreamImageCollate("id", on_bad_image="error")(rows)
    with pytest.raises(ValueError, match="Every image of this streamed batch"):
        collate([rows[1]])


def test_shuffle_shards_reads_one_shard_at_a_time_in_a_seeded_order(tmp_path) -> None:
    """``shuffle_shards``: parquet shards come whole, one after the other (no row buffer, no interleaving of open
    shards, whose reader datasets closes with a 5 s sleep), in a shard order that depends on the seed and only on
    it; every row once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hf_arb.sampling import shuffle_shards

    for shard in range(6):
        pq.write_table(pa.table({"shard": [shard] * 7, "row": list(range(shard * 7, shard * 7 + 7))}),
                       tmp_path / f"part-{shard}.parquet")
    ds = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in tmp_path.glob("*.parquet")),
                               split="train", streaming=True)
    assert ds.num_shards == 6

    def order(seed: int) -> tuple[list[int], list[int]]:
        rows = list(shuffle_shards(ds, seed))
        return [r["shard"] for r in rows], [r["row"] for r in rows]

    shards, rows = order(0)
    assert sorted(rows) == list(range(42))
    runs = [s for i, s in enumerate(shards) if i == 0 or s != shards[i - 1]]
    assert sorted(runs) == list(range(6))  # each shard one contiguous run: never interleaved
    assert rows == [r for s in runs for r in range(s * 7, s * 7 + 7)]  # a shard's rows in file order
    assert order(0) == (shards, rows) and {tuple(order(seed)[0]) for seed in range(1, 6)} != {tuple(shards)}


def test_arrow_reader_refuses_what_it_cannot_read_the_same():
    """reader='arrow' is refused, naming the column and the fix, where datasets would decode a column (the python
    rows hold decoded images, Arrow's the bytes); an unknown reader is refused; a formatted source read as Arrow
    yields python rows (the formatting is not applied, as documented), with the same keys and buckets."""
    ids = np.random.default_rng(0).integers(-1, 2, 120)
    with pytest.raises(ValueError, match="'source' or 'arrow'"):
        BucketedStream(_stream_ds(ids, 2), 4, counts=_counts(ids), reader="python")
    img = datasets.Dataset.from_dict({"image": [None] * 4, "bucket": [0] * 4},
                                     features=datasets.Features({"image": datasets.Image(),
                                                                 "bucket": datasets.Value("int64")}))
    with pytest.raises(ValueError, match=r"\['image'\].*decode=False"):
        BucketedStream(img.to_iterable_dataset(), 4, counts=[4], reader="arrow")
    BucketedStream(img.cast_column("image", datasets.Image(decode=False)).to_iterable_dataset(), 4, counts=[4],
                   reader="arrow")  # undecoded bytes: fine
    plain, _ = _run(BucketedStream(_stream_ds(ids, 2), 4, counts=_counts(ids), buffer_size=40))
    rows = list(BucketedStream(_stream_ds(ids, 2).with_format("numpy"), 4, counts=_counts(ids), buffer_size=40,
                               reader="arrow"))
    assert [[(r["key"], r["bucket"]) for r in item] for item in rows] == plain
    assert all(type(r["key"]) is int for item in rows for r in item)


def test_decoding_columns_are_the_columns_datasets_decodes():
    """The Arrow reader's refusal reads the features' public ``decode`` flags: the same columns as datasets' own
    (internal) ``require_decoding``, nested lists and dicts included."""
    import datasets
    from datasets.features.features import require_decoding

    from hf_arb.sampling.streaming.buffer import decoding_columns

    feats = datasets.Features({
        "a": datasets.Image(), "b": datasets.Image(decode=False), "c": datasets.Value("int32"),
        "d": datasets.Sequence(datasets.Image()), "e": {"x": datasets.Audio(), "y": datasets.Value("string")},
        "f": [datasets.Image()], "g": datasets.List(datasets.Value("float32")), "h": datasets.ClassLabel(names=["a"]),
        "j": datasets.Sequence({"z": datasets.Image(decode=False)}), "k": datasets.LargeList(datasets.Image())})
    want = [name for name, f in feats.items() if require_decoding(f)]
    assert want == ["a", "d", "e", "f", "k"]
    assert decoding_columns(feats) == want
