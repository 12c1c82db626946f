"""One rank's half of a bucketed stream: :class:`RankBuffer` reads the rank's split of the source into one
buffer per bucket and serves the scheduled bucket at each step; its state is the rows' *read indices*.

Reading: the source is read in chunks of ``snapshot_every`` rows with the public
``IterableDataset.iter(batch_size=...)`` (datasets formats a whole chunk at once, about 10× cheaper per row than
iterating rows). Each row is still decided on exactly as if read alone — buffered, or skipped as unassigned,
small-bucket or surplus — in read order. The decisions of a chunk are computed once with numpy
(:func:`accepted_rows`): a bucket's room changes only when a row is buffered, not when a full batch leaves (its
buffer and its scheduled batches drop together), so they hold until a row is evicted; a step then reads up to the
row that completes its fill or its batch at once, with identical results to reading row by row (the per-row path
stays for a full buffer, where every row waits for an eviction). With ``reader="arrow"`` the chunks come from the
source formatted as Arrow and are made python columns at once (:func:`arrow_chunks`): datasets' python formatting
builds a dict per row and then the columns, which cost about as much as the rest of the stream together; the rows,
decisions and source snapshots are the same.

What a step needs is planned per chunk or per block of steps, so that a step only hands it out: when every bucket
has room for all of the chunk's rows (the common case), the decisions need no per-bucket rank count; a step's fill
(the next accepted rows up to the fill level) is two list lookups and the appends, inline in :meth:`next_batch`; a
bucket short of a batch finds its next rows by bisect in per-bucket position lists made once per decisions; and the
pick positions of a full window are computed for :data:`PICK_BLOCK` steps at once. A buffered row is its value
tuple with its read index appended (``dict(zip(names, row))`` leaves the index out). The batches and states equal
those of the buffer of commit 83fc72e (tests/test_stream_blocks.py runs them side by side: benchmarks/_stream_v2),
whose equal the step-by-step buffer before it was.

Resume without pixels: the buffer's rows are re-read from the source on load. Before each chunk the source's own
``state_dict()`` (``datasets``' resumable ``IterableDataset``) is snapshotted, so snapshots sit every
``snapshot_every`` rows, at chunk boundaries; the state keeps the snapshots that precede a buffered row, and
loading replays chunk by chunk from those snapshots, keeping only the recorded rows and leaving the source in
the middle of the chunk where it was. Replay reads at most ``snapshot_every`` rows per snapshot it restores.

Each bucket's buffer is a list sorted by read index (rows are appended in read order and removals keep the
order), so the set of read indices fixes it exactly. A batch is drawn from the bucket's ``pick_window`` oldest
rows (bounding how long a row waits, hence how far back a resume must re-read) with ``batch_size`` uniforms per
step, drawn in blocks of :data:`PICK_BLOCK` steps from ``rng.generator(seed, epoch, STREAM_PICK, rank, block)``:
a pure function of the step, without the cost of a generator per step.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np

from hf_arb import rng

PICK_BLOCK = 1024  #: steps whose pick uniforms are drawn at once
REOPEN_ROWS = 1024  #: on load, gaps up to this many rows are read through instead of restoring a snapshot
VECTOR_ROWS = 1  #: below this many rows to buffer, rows are read one by one (1: never; the tests compare both paths)
ONE_HOT_CELLS = 1 << 16  #: chunks of rows x buckets up to this size decide through a one-hot cumsum, larger by a sort
COUNTERS = ("read", "used", "repeated", "skipped_unassigned", "skipped_small", "skipped_surplus", "evicted", "peak")


class BufferOverflowError(RuntimeError):
    """The scheduled bucket could not be filled within ``buffer_size`` rows (``on_overflow="error"``)."""


class RankBuffer:
    """The reader of one rank.

    Args:
        open_source: ``open_source(state_or_None)`` returns a fresh ``datasets.IterableDataset`` of this rank's
            split for the epoch, positioned at ``state`` (a ``state_dict()`` of it) when given.
        schedule: the epoch's global bucket schedule, shape ``(steps,)``.
        rank, batch_size, buffer_size, fill, seed, epoch: see :class:`~hf_arb.sampling.streaming.stream.BucketedStream`.
        on_overflow: ``"error"`` or ``"evict"``.
        bucket_column: the column with the bucket id.
        snapshot_every: rows between two source snapshots.
        history: steps whose state can still be produced (the loader prefetches).
        pick_window: a batch is drawn uniformly from its bucket's ``pick_window`` oldest buffered rows.
    """

    def __init__(self, open_source: Callable[[Any], Any], schedule: np.ndarray, *, rank: int, batch_size: int,
                 buffer_size: int, fill: int, seed: int, epoch: int, on_overflow: str, bucket_column: str,
                 snapshot_every: int, history: int, pick_window: int, reader: str = "source") -> None:
        self.open_source, self.schedule, self.rank, self.batch = open_source, schedule, rank, batch_size
        self.reader = reader
        self.buffer_size, self.fill, self.seed, self.epoch = buffer_size, fill, seed, epoch
        self.on_overflow, self.column, self.every = on_overflow, bucket_column, snapshot_every
        self.window = max(int(pick_window), batch_size)
        k = int(schedule.max()) + 1 if schedule.size else 0
        self.scheduled = np.bincount(schedule, minlength=k).astype(np.int64)  # (k,) batches of the epoch
        self.remaining: list[int] = self.scheduled.tolist()  # scheduled batches left per bucket, this step included
        self._left = sum(self.remaining)
        self._sched = schedule.tolist()  # the bucket of every step (a list: read once per step)
        self.buffers: dict[int, list[tuple[int, Any]]] = collections.defaultdict(list)
        self.reserve: dict[int, list[tuple[int, Any]]] = {}
        self.total = 0  # rows in self.buffers
        self.reserved = 0  # rows in self.reserve
        self.unused: set[int] = set()  # reserve rows that came from eviction and were never emitted
        self.c = dict.fromkeys(COUNTERS, 0)
        self.step = 0
        self.snapshots: dict[int, Any] = {}
        self.history: collections.deque = collections.deque(maxlen=history)
        self._block, self._uniforms = -1, np.empty((0, batch_size))
        self._prune_at = 8
        self._current: dict[str, Any] | None = None
        self.k, self._scheduled = self.scheduled.size, self.scheduled.tolist()
        self._rows: list[Any] = []  # the current chunk: its rows, their bucket ids, and the next row's position
        self.names: tuple[str, ...] | None = None  # the columns, in the order of a buffered row's values
        self._ids, self._idl, self._pos = np.empty(0, dtype=np.int64), [], 0
        self._dec: tuple[int, list[int], list[int], list[int], list[int]] | None = None  # see _decisions
        self._mine: list[list[int]] | None = None  # per bucket, its accepted rows' indices into _dec's `where`
        self._okmap = np.r_[self.scheduled > 0, False]  # bucket id (k: unassigned or unknown) -> schedulable
        self._ok = np.empty(0, dtype=bool)  # the current chunk's schedulable rows
        self._picks: list[list[int]] = []  # a full window's pick positions per step of the block (_step_uniforms)
        self.source, self.chunks = self._open(None)
        self.exhausted = False
        self.snapshots[0] = self.source.state_dict()

    # ------------------------------------------------------------------------------------------ reading
    def _open(self, state: Any) -> tuple[Any, Any]:
        """The rank's source positioned at ``state`` (None: its start) and its chunk iterator, through the
        source's own formatting (``reader="source"``) or as Arrow tables made python columns (``"arrow"``,
        :func:`arrow_chunks`)."""
        if self.reader == "arrow":
            src = arrow_source(self.open_source(None), state)
            return src, arrow_chunks(src, self.every)
        src = self.open_source(state)
        return src, src.iter(batch_size=self.every)

    def _fetch(self) -> bool:
        """Read the source's next chunk of ``snapshot_every`` rows (snapshotting its state first); False at its end."""
        idx = self.c["read"]
        if idx % self.every == 0 and idx not in self.snapshots:
            self.snapshots[idx] = self.source.state_dict()
            if len(self.snapshots) >= self._prune_at:  # amortised: prune when the count has grown fourfold
                self._prune()  # (it reads every held row's index: rarely; extra snapshots change no state)
                self._prune_at = 4 * len(self.snapshots) + 32
        try:
            chunk = next(self.chunks)
        except StopIteration:
            self.exhausted = True
            return False
        self.names, self._rows, self._ids = chunk_rows(chunk, self.column, self.names, idx)
        self._set_chunk()
        return True

    def _set_chunk(self) -> None:
        """Derive the current chunk's per-row lists and masks from its bucket ids (``self._ids``)."""
        ids, k = self._ids, self.k
        self._idl, self._pos, self._dec = ids.tolist(), 0, None
        self._ok = self._okmap[np.where((ids < 0) | (ids >= k), k, ids)] if ids.size else np.empty(0, dtype=bool)

    def _read_one(self) -> None:
        """Read one row into its bucket's buffer or a skip counter (the per-row path, for a few rows)."""
        p = self._pos
        if p == len(self._rows):
            if not self._fetch():
                return
            p = 0
        self._pos = p + 1
        idx = self.c["read"]
        self.c["read"] = idx + 1
        b = self._idl[p]
        if b < 0:
            self.c["skipped_unassigned"] += 1
        elif b >= self.k or not self._scheduled[b]:
            self.c["skipped_small"] += 1
        elif len(self.buffers[b]) >= self.remaining[b] * self.batch:
            self.c["skipped_surplus"] += 1
        else:
            self.buffers[b].append(self._rows[p])
            self.total += 1
            if self.total + self.reserved > self.c["peak"]:
                self.c["peak"] = self.total + self.reserved

    def _decisions(self) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """The current chunk's decisions from the next row on, computed once with numpy (:func:`accepted_rows`):
        ``(d0, where, accepted, unassigned, schedulable)``: ``d0`` the chunk position of the first row they cover,
        ``where`` the accepted rows' chunk positions (a list), and three prefix counts (lists with a leading 0) of the
        rows from ``d0`` that are accepted, unassigned and schedulable.

        They stay valid until a row is evicted: a bucket's room (``remaining * batch - buffered``) changes only when a
        row is buffered (what the decisions count in read order), when a full batch is emitted (``remaining`` and the
        buffer both drop by one batch: no change) or when a row is evicted (then they are computed again)."""
        if self._dec is None:
            p, ids, ok = self._pos, self._ids[self._pos:], self._ok[self._pos:]
            get = self.buffers.get
            room = np.array([r * self.batch - len(get(b, ())) for b, r in enumerate(self.remaining)], dtype=np.int64)
            if (np.bincount(ids[ok], minlength=self.k) <= room).all():  # every bucket has room for all its rows
                acc = ok
            else:
                acc = accepted_rows(ids, self.scheduled, room)[1]
            self._mine = None
            prefix = np.zeros((3, ids.size + 1), dtype=np.int64)  # one cumsum and one tolist for the three counts
            prefix[0, 1:], prefix[1, 1:], prefix[2, 1:] = acc, ids < 0, ok
            np.cumsum(prefix, axis=1, out=prefix)
            # lists: a step reads a few of their items
            self._dec = (p, (np.flatnonzero(acc) + p).tolist(), *prefix.tolist())
        return self._dec

    def _advance(self, end: int, dec: tuple[int, list[int], list[int], list[int], list[int]] | None = None) -> None:
        """Read the current chunk's rows up to position ``end`` (exclusive) with the precomputed decisions ``dec``
        (default: :meth:`_decisions`)."""
        d0, where, acc, unassigned, ok = dec or self._decisions()
        p, c = self._pos, self.c
        a, e = p - d0, end - d0
        n_acc, n_un, n_ok = acc[e] - acc[a], unassigned[e] - unassigned[a], ok[e] - ok[a]
        if n_acc != e - a:  # some rows skipped
            c["skipped_unassigned"] += n_un
            c["skipped_small"] += (e - a) - n_un - n_ok
            c["skipped_surplus"] += n_ok - n_acc
        if n_acc:
            idl, rows, buffers = self._idl, self._rows, self.buffers
            for j in where[acc[a]:acc[e]]:
                buffers[idl[j]].append(rows[j])
            self.total += n_acc
            if self.total + self.reserved > c["peak"]:
                c["peak"] = self.total + self.reserved
        c["read"] += end - p
        self._pos = end

    def _next_chunk(self) -> bool:
        """Make sure a row is left in the current chunk (reading the next one if not); False at the source's end."""
        return self._pos < len(self._rows) or self._fetch()

    def _fill(self, fill: int) -> None:
        """Read until ``fill`` rows are buffered (or the source ends): row by row below :data:`VECTOR_ROWS`, else up to
        the row that completes the fill, with the chunk's decisions computed at once (identical results)."""
        while not self.exhausted and self.total < fill:
            need = fill - self.total
            if need < VECTOR_ROWS:
                self._read_one()
                continue
            if not self._next_chunk():
                return
            dec = self._decisions()
            d0, where, acc = dec[0], dec[1], dec[2]
            k = acc[self._pos - d0] + need  # the accepted row that completes the fill, counted in the chunk
            self._advance(where[k - 1] + 1 if k <= len(where) else len(self._rows), dec)

    def _fill_bucket(self, b: int, entry: list[Any]) -> None:
        """Read until bucket ``b`` holds a batch (or the source ends). While the buffer has room, up to the row that
        completes it at once (or up to the row that fills the buffer); a full buffer evicts (or raises) before each
        further row, row by row, exactly as the per-row rule does."""
        s = self.step
        while not self.exhausted and len(self.buffers[b]) < self.batch:
            if self.total >= self.buffer_size:
                if self.on_overflow == "error" or self.total == len(self.buffers[b]):
                    sizes = {k: len(v) for k, v in self.buffers.items() if v}
                    raise BufferOverflowError(
                        f"Rank {self.rank}, step {s}: bucket {b} has {len(self.buffers[b])} of {self.batch} rows and "
                        f"the buffer is full ({self.buffer_size} rows; per bucket {sizes}). The stream is not mixed "
                        "enough for this buffer: raise `buffer_size`, shuffle the source's shards "
                        "(`ds.shuffle(seed=...)`), or pass `on_overflow='evict'` to drop buffered rows (counted).")
                _log(entry)[0].append(self._evict(b, entry))
                self._read_one()
                continue
            need = self.batch - len(self.buffers[b])
            if need < VECTOR_ROWS:
                self._read_one()
                continue
            if not self._next_chunk():
                return
            d0, where, acc, _, _ = self._decisions()
            a = acc[self._pos - d0]  # where[a:]: the accepted rows not read yet
            mine = self._bucket_rows()[b]
            i = bisect.bisect_left(mine, a) + need - 1
            end = where[mine[i]] + 1 if i < len(mine) else len(self._rows)  # the row that completes the batch
            room = self.buffer_size - self.total  # >= 1: the row that fills the buffer ends the vectorised read
            if len(where) - a >= room and where[a + room - 1] < end:
                end = where[a + room - 1] + 1
            self._advance(end)

    def _bucket_rows(self) -> list[list[int]]:
        """Per bucket, the indices into the decisions' ``where`` of its accepted rows (made once per decisions)."""
        if self._mine is None:
            where = self._dec[1]  # chunk positions
            b = self._ids[np.asarray(where, dtype=np.int64)] if where else np.empty(0, dtype=np.int64)
            order = np.argsort(b, kind="stable")
            cuts = np.searchsorted(b[order], np.arange(self.k + 1)).tolist()
            order = order.tolist()
            self._mine = [order[cuts[v]:cuts[v + 1]] for v in range(self.k)]
        return self._mine

    def _set_reserve(self, b: int, rows: list[tuple[int, Any]], entry: list[Any]) -> None:
        """Make ``rows`` bucket ``b``'s repeat reserve (an eviction's; a step's own batch is set in next_batch)."""
        old = self.reserve.get(b, ())
        _log(entry)[1].append((b, [r[-1] for r in old]))  # undo log for state_at
        self._drop_unused(old, entry)
        self.reserved += len(rows) - len(old)
        self.reserve[b] = rows

    def _drop_unused(self, old: Any, entry: list[Any]) -> None:
        """Rows of a replaced reserve leave ``unused``: an evicted row leaves the reserve unemitted, so it stays
        counted as evicted."""
        if self.unused:
            for r in old:
                i = r[-1]
                if i in self.unused:
                    self.unused.discard(i)
                    _log(entry)[2].append(("del", i))

    def _evict(self, keep: int, entry: list[Any]) -> tuple[int, int]:
        """Drop the oldest row of the fullest bucket other than ``keep``; returns its ``(read index, bucket)``."""
        # ties go to the lowest bucket id (never to dict order, which a resumed buffer does not share)
        b = max(sorted(v for v in self.buffers if v != keep and self.buffers[v]), key=lambda v: len(self.buffers[v]))
        row = self.buffers[b].pop(0)
        idx = row[-1]
        self.total -= 1
        self._dec = None  # bucket b has room for one more row: the chunk's decisions change
        self.c["evicted"] += 1
        if not self.reserve.get(b):  # keep it as the bucket's repeat source, so a later step of b can be served
            self._set_reserve(b, [row], entry)
            self.unused.add(idx)
            _log(entry)[2].append(("add", idx))
        return idx, b

    # ------------------------------------------------------------------------------------------ one step
    def next_batch(self) -> list[Any]:
        """The rows of this rank's batch at the next step (``batch_size`` rows of the scheduled bucket)."""
        s, c, batch = self.step, self.c, self.batch
        b = self._sched[s]
        # the step's undo record for state_at (see _expand): its start, its bucket, its batch's fresh rows, the
        # reserve they replace, and a log of the rarer changes (evictions, unused rows), made when needed
        entry = [s, c["read"], c.copy(), b, None, None, None]
        self._current = entry  # the step in progress: its reads may prune snapshots its state will need
        fill = self._left * batch  # never read rows no step can use
        if self.fill < fill:
            fill = self.fill
        total = self.total
        if total < fill:
            p, dec = self._pos, self._dec
            if dec is not None and p < len(self._rows):  # the common case: the chunk's decisions are known
                d0, where, acc = dec[0], dec[1], dec[2]
                ka = acc[p - d0]
                k = ka + fill - total  # the accepted row that completes the fill
                if k <= len(where):  # _advance(where[k - 1] + 1, dec), inline
                    end = where[k - 1] + 1
                    a, e = p - d0, end - d0
                    if k - ka != e - a:  # some rows skipped
                        un, ok = dec[3], dec[4]
                        n_un, n_ok = un[e] - un[a], ok[e] - ok[a]
                        c["skipped_unassigned"] += n_un
                        c["skipped_small"] += (e - a) - n_un - n_ok
                        c["skipped_surplus"] += n_ok - (k - ka)
                    idl, rows, buffers = self._idl, self._rows, self.buffers
                    for j in where[ka:k]:
                        buffers[idl[j]].append(rows[j])
                    self.total = fill
                    if fill + self.reserved > c["peak"]:
                        c["peak"] = fill + self.reserved
                    c["read"] += end - p
                    self._pos = end
                else:
                    self._fill(fill)
            else:
                self._fill(fill)
        buf = self.buffers[b]
        if len(buf) < batch:
            self._fill_bucket(b, entry)
        if s // PICK_BLOCK != self._block:
            self._step_uniforms(s)
        if len(buf) >= batch:  # sequential sampling without replacement; pop keeps the list sorted
            pop = buf.pop
            if len(buf) >= self.window:  # positions computed for the whole block at once
                fresh = rows = [pop(i) for i in self._picks[s % PICK_BLOCK]]
            else:  # the bucket's oldest rows: bounds a row's age, hence resume replay
                w, u = len(buf), self._uniforms[s % PICK_BLOCK].tolist()
                fresh = rows = [pop(int(x * m)) for x, m in zip(u, range(w, w - batch, -1))]
        else:  # the source is exhausted: complete with repeats of this bucket's rows
            fresh, self.buffers[b] = list(buf), []
            pool = fresh or self.reserve.get(b, [])
            if not pool:
                raise RuntimeError(
                    f"Rank {self.rank}, step {s}: the schedule asks for bucket {b}, but this rank's stream has no row "
                    f"of it left and never emitted one. The counts passed ({int(self.remaining[b])} batches of it "
                    "left) do not match this rank's shards: check `counts`, or use more and smaller shards "
                    "(`to_iterable_dataset(num_shards=...)`) so every rank sees every bucket.")
            u = self._uniforms[s % PICK_BLOCK].tolist()
            rows = fresh + [pool[int(u[j] * len(pool))] for j in range(len(fresh), batch)]
            for r in rows[len(fresh):]:
                i = r[-1]
                if i in self.unused:  # an evicted row emitted for the first time: used after all
                    self.unused.discard(i)
                    _log(entry)[2].append(("del", i))
                    c["used"] += 1
                    c["evicted"] -= 1
                else:
                    c["repeated"] += 1
        n = len(fresh)
        self.total -= n
        c["used"] += n
        entry[4] = fresh
        if n:  # the batch's rows become the bucket's repeat reserve
            old = entry[5] = self.reserve.get(b, ())
            if self.unused:
                self._drop_unused(old, entry)
            self.reserved += n - len(old)
            self.reserve[b] = fresh
        self.remaining[b] -= 1
        self._left -= 1
        self.step = s + 1
        self.history.append(entry)
        self._current = None
        # a row is a dict from here on (buffered: its values, then its read index, which zip leaves out)
        return list(map(dict, map(zip, repeat(self.names or ()), rows)))

    def _step_uniforms(self, step: int) -> list[float]:
        """``batch_size`` uniforms in [0, 1) for ``step``: row ``step % PICK_BLOCK`` of its block."""
        block = step // PICK_BLOCK
        if block != self._block:
            g = rng.generator(self.seed, self.epoch, rng.STREAM_PICK, self.rank, block)
            u = g.random((PICK_BLOCK, self.batch))
            # int(x * m) of a float64 x and an int m, as numpy computes it: the same product, truncated alike
            full = (u * np.arange(self.window, self.window - self.batch, -1)).astype(np.int64)
            # as lists: one conversion per block of steps, not one per step
            self._block, self._uniforms, self._picks = block, u, full.tolist()
        return self._uniforms[step % PICK_BLOCK].tolist()

    # ------------------------------------------------------------------------------------------ state
    def _prune(self) -> None:
        """Keep only the snapshots a state in the history window can need."""
        need = {r[-1] for v in self.buffers.values() for r in v}
        need |= {r[-1] for v in self.reserve.values() for r in v}
        entries = [*self.history, *([self._current] if self._current else [])]
        for e in entries:
            removed, reserve = _expand(e)[:2]
            need |= {i for i, _ in removed} | {i for _, before in reserve for i in before}
        oldest = entries[0][1] if entries else self.c["read"]
        keys = np.array(sorted(self.snapshots), dtype=np.int64)
        need_arr = np.fromiter(need | {oldest}, dtype=np.int64)
        keep = set(keys[np.searchsorted(keys, need_arr, side="right") - 1].tolist())
        for key in [k for k in keys.tolist() if k not in keep and k < oldest]:
            del self.snapshots[key]

    def state_at(self, step: int) -> dict[str, Any]:
        """The JSON-serialisable state at the start of ``step`` (at most ``history`` steps back)."""
        if step == self.step:
            read, counters, removed, reserve, unused = self.c["read"], dict(self.c), [], {}, set(self.unused)
        else:
            back = [_expand(e) for e in self.history if e[0] >= step]
            if not back or back[0][3] != step:
                raise ValueError(f"Rank {self.rank}: the state of step {step} is no longer known (produced up to step "
                                 f"{self.step}, history of {self.history.maxlen} steps); pass a later step or raise "
                                 "`history`.")
            read, counters = back[0][4], back[0][5]
            removed = [x for e in back for x in e[0]]
            reserve, unused = {}, set(self.unused)
            for e in reversed(back):  # undo the reserve changes, newest first
                for op, i in reversed(e[2]):
                    (unused.discard if op == "add" else unused.add)(i)
                for bucket, before in reversed(e[1]):
                    reserve[bucket] = before
        rows = sorted({(r[-1], b) for b, v in self.buffers.items() for r in v} | set(removed))
        rows = [[i, b] for i, b in rows if i < read]
        res = {b: [r[-1] for r in v] for b, v in self.reserve.items()}
        res.update(reserve)
        res = {str(b): v for b, v in res.items() if v}
        need = {i for i, _ in rows} | {i for v in res.values() for i in v} | {read}
        keys = np.array(sorted(self.snapshots), dtype=np.int64)
        at = np.searchsorted(keys, np.fromiter(need, dtype=np.int64), side="right") - 1
        if at.size and at.min() < 0:  # never expected: every needed row keeps the snapshot before it
            raise RuntimeError(f"Rank {self.rank}: no source snapshot precedes row {min(need)} (step {step}); please "
                               "report this with the stream's settings.")
        used = np.unique(keys[at])
        snaps = {str(k): self.snapshots[k] for k in used.tolist()}
        return {"rank": self.rank, "step": step, "read": read, "counters": counters, "buffer": rows,
                "reserve": res, "unused": sorted(unused), "snapshots": snaps}

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_at`'s output: re-read the buffered rows from the source and position it."""
        self.step, read = int(state["step"]), int(state["read"])
        self.c = {k: int(v) for k, v in state["counters"].items()}
        self.remaining = np.bincount(self.schedule[self.step:], minlength=len(self.remaining)).tolist()
        self._left = sum(self.remaining)  # (was left at the whole epoch's count: a resumed fill then read past it)
        snaps = {int(k): v for k, v in state["snapshots"].items()}
        keys = sorted(snaps)
        want_buf = {int(i): int(b) for i, b in state["buffer"]}
        want_res = {int(i): int(b) for b, v in state["reserve"].items() for i in v}
        wanted = sorted(set(want_buf) | set(want_res))
        got: dict[int, Any] = {}
        src, chunks, pos, rows = None, None, -1, []  # rows: the chunk read last, ending at row `pos`
        for target in wanted + [read]:
            base = floor_key(keys, target)
            # restoring a snapshot costs about as much as reading ~1000 rows: read on through short gaps
            if chunks is None or pos - len(rows) > target or (pos < base and target - pos > REOPEN_ROWS):
                src, chunks = self._open(snaps[base])
                pos, rows = base, []
            while pos <= target and (target < read or pos < read):
                self.names, rows, _ = chunk_rows(next(chunks), self.column, self.names, pos)
                pos += len(rows)
            if target < read:
                got[target] = rows[target - pos + len(rows)]
        self.source, self.chunks, self.exhausted = src, chunks, False
        self._rows, self._ids = chunk_rows_tail(rows, self.names, self.column, len(rows) - (pos - read))
        self._set_chunk()
        self.buffers = collections.defaultdict(list)
        for i, b in sorted(want_buf.items()):
            self.buffers[b].append(got[i])
        self.total = len(want_buf)
        self.reserve = {int(b): [got[int(i)] for i in v] for b, v in state["reserve"].items()}
        self.reserved = sum(len(v) for v in self.reserve.values())
        self.unused = {int(i) for i in state["unused"]}
        self.snapshots = dict(snaps)
        self.history.clear()


def _log(entry: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """A step record's log of its rarer changes, made on first use: ``(removed, reserve, unused)``, the evicted rows'
    ``(read index, bucket)``, the reserves evictions replaced ``(bucket, read indices before)`` and the ``unused``
    changes ``("add"|"del", read index)``, each in order."""
    if entry[6] is None:
        entry[6] = ([], [], [])
    return entry[6]


def _expand(entry: list[Any]) -> tuple[list[Any], list[Any], list[Any], int, int, dict[str, int]]:
    """A step record ``[step, read, counters, bucket, fresh, old reserve, log]`` (see :meth:`RankBuffer.next_batch`)
    as ``(removed, reserve, unused, step, read, counters)``: every row that left the buffer in the step, in order (the
    evicted ones, then the batch's fresh rows), every reserve it replaced ``(bucket, read indices before)`` in order
    (the evictions', then the batch's) and its ``unused`` changes."""
    step, read, counters, b, fresh, old, log = entry
    removed, reserve, unused = log or ((), (), ())
    removed = [*removed, *((r[-1], b) for r in fresh or ())]
    reserve = [*reserve, (b, [r[-1] for r in old])] if fresh else list(reserve)
    return removed, reserve, list(unused), step, read, counters


def arrow_source(src: Any, state: Any) -> Any:
    """``src`` (a rank's split, its epoch set) formatted as Arrow, with its epoch and positioned at ``state``
    (``with_format`` makes a new dataset, so both are set on it)."""
    fmt = src.with_format("arrow")
    fmt.set_epoch(src.epoch)
    if state is not None:
        fmt.load_state_dict(state)
    return fmt


def arrow_chunks(src: Any, every: int) -> Any:
    """The chunks of an Arrow-formatted source as dicts of python columns: ``Table.to_pydict()`` makes a chunk's
    values a column at a time in C++, what datasets' python formatting yields row by row (through a dict per row)
    for features that need no decoding (:func:`decoding_columns`)."""
    return (table.to_pydict() for table in src.iter(batch_size=every))


def decoding_columns(features: Any) -> list[str]:
    """The columns whose feature datasets decodes when it formats python rows (``Image()``, ``Audio()``, ``Video()``,
    also inside a list or a dict), read from the features' public ``decode`` flags."""
    return [name for name, f in (features or {}).items() if _decodes(f)]


def _decodes(feature: Any) -> bool:
    """Whether datasets decodes ``feature`` (a feature type, or a dict / list of them) when it formats rows."""
    if isinstance(feature, dict):
        return any(_decodes(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_decodes(f) for f in feature)
    inner = getattr(feature, "feature", None)  # Sequence / List / LargeList
    if inner is not None and not isinstance(inner, (str, bytes)):
        return _decodes(inner)
    return bool(getattr(feature, "decode", False)) and hasattr(feature, "decode_example")


def floor_key(keys: list[int], i: int) -> int:
    """The largest of the sorted ``keys`` that is ``<= i`` (there always is one: 0 is snapshotted first)."""
    return keys[bisect.bisect_right(keys, i) - 1]


def bucket_ids(values: Any, n: int) -> np.ndarray:
    """The bucket column of a chunk as ``int64`` of shape ``(n,)``; null (or a missing column) becomes ``-1``."""
    if values is None:
        return np.full(n, -1, dtype=np.int64)
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False).reshape(n)
    return np.array([-1 if v is None else int(v) for v in values], dtype=np.int64)


def chunk_rows(chunk: Any, column: str, names: tuple[str, ...] | None = None, start: int = 0
               ) -> tuple[tuple[str, ...], list[tuple[Any, ...]], np.ndarray]:
    """A batch of ``IterableDataset.iter`` (a dict of columns) as ``(names, rows, bucket ids)``: each row the tuple of
    its values in the order of ``names`` (default: the chunk's columns), then its read index (``start`` for the
    chunk's first row). A buffer holds these tuples, far smaller than dicts, and makes a row's dict when it emits it
    (``dict(zip(names, row))``: the same keys and values; zip stops before the read index)."""
    if not isinstance(chunk, dict):
        raise TypeError(f"BucketedStream reads its source with `IterableDataset.iter(batch_size=...)`, which gave a "
                        f"{type(chunk).__name__}; use a source with python (or torch/numpy) formatting, not "
                        "arrow/pandas/polars (`ds.with_format(None)`).")
    names = tuple(chunk) if names is None else names
    n = len(chunk[names[0]]) if names else 0
    rows = list(zip(*(chunk[c] for c in names), range(start, start + n)))
    return names, rows, bucket_ids(chunk.get(column), len(rows))


def chunk_rows_tail(rows: list[tuple[Any, ...]], names: tuple[str, ...] | None, column: str,
                    start: int) -> tuple[list[tuple[Any, ...]], np.ndarray]:
    """Rows ``start:`` of a chunk already split into rows (:func:`chunk_rows`), and their bucket ids."""
    rows = rows[start:]
    at = (names or ()).index(column) if column in (names or ()) else None
    return rows, bucket_ids(None if at is None else [r[at] for r in rows], len(rows))


def accepted_rows(ids: np.ndarray, scheduled: np.ndarray, room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of a chunk a rank buffers, as reading them one by one would decide.

    A row is *schedulable* when its bucket has batches in the epoch's schedule, and *accepted* when it is also
    among the first ``room[b]`` schedulable rows of its bucket ``b`` in the chunk (the rest are surplus).

    Args:
        ids: bucket ids of the chunk's rows, shape ``(n,)`` (``-1`` unassigned).
        scheduled: batches per bucket in the schedule, shape ``(k,)``.
        room: rows each bucket may still take, shape ``(k,)`` (may be negative).

    Returns:
        ``(schedulable, accepted)``, boolean arrays of shape ``(n,)``.
    """
    k = scheduled.size
    if ids.size * k <= ONE_HOT_CELLS:  # a row's rank among its bucket's rows from a cumsum of the one-hot ids
        at = np.where(ids < 0, k, np.minimum(ids, k))  # -1 and ids >= k: column k, never schedulable
        ok = np.r_[scheduled > 0, False][at]
        seen = np.cumsum(at[:, None] == np.arange(k + 1), axis=0)[np.arange(ids.size), at]  # rows so far, this one too
        return ok, ok & (seen <= np.r_[room, 0][at])
    ok = (ids >= 0) & (ids < k)
    ok[ok] = scheduled[ids[ok]] > 0
    where = np.flatnonzero(ok)
    b = ids[where]
    order = np.argsort(b, kind="stable")
    sorted_b = b[order]
    first = np.flatnonzero(np.r_[True, sorted_b[1:] != sorted_b[:-1]]) if b.size else np.empty(0, np.int64)
    starts = np.repeat(first, np.diff(np.r_[first, b.size]))
    occurrence = np.empty(b.size, dtype=np.int64)
    occurrence[order] = np.arange(b.size) - starts  # the row's rank among its bucket's rows in the chunk
    acc = np.zeros(ids.size, dtype=bool)
    acc[where[occurrence < room[b]]] = True
    return ok, acc
