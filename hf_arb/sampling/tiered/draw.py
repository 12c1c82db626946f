"""The ``random`` schedule's epoch in ``O(groups)``: OneTrainer's per-row tier draw without a pass over the rows.

**Groups.** Two rows with the same bucket in every tier (``-1`` where not eligible, so also the same set of eligible
tiers) are interchangeable for the draw: they may train at the same tiers, and at each tier in the same bucket.
Such a class is a *group*: ``G`` of them, a few hundred in practice (a row's buckets in the tiers all follow from
its aspect ratio, so ``G`` is about the number of aspect intervals that the tiers' bucket bounds cut, times the
eligibility patterns; 87 for the ``budget`` preset at 512/768/1024 on 10⁸ sizes uniform in [256, 2048]). The
groups are found once, at construction, with the rows of each group in a
:class:`~hf_arb.sampling.planning.index.RowIndex` keyed by group (4 bytes per row, built in chunks, shareable as a node
file: :func:`~hf_arb.sampling.tiered.files.random_groups`).

**One epoch** (seed ``s``, epoch ``e``), for every group ``g`` of ``n_g`` rows and ``m_g`` eligible tiers:

1. the counts per eligible tier ``(c_{g,t})`` are one multinomial draw ``Mult(n_g; 1/m_g, ..., 1/m_g)``, all groups
   from one generator keyed ``(s, e, TIER_GROUP_COUNTS)`` (:func:`draw_tier_counts`, ``O(G × T)``);
2. the group's rows are put in a keyed pseudo-random order ``φ_g`` (a
   :class:`~hf_arb.sampling.planning.feistel.FeistelPermutation` of ``[0, n_g)``, key ``(s, e, TIER_GROUP_ORDER, g)``);
   positions ``[0, c_0)`` of that order train at its first eligible tier, the next ``c_1`` at the second, and so on.

**What holds.** Drawing each row's tier independently and uniformly among its ``m_g`` eligible tiers gives, per
group, counts with exactly the law of step 1, and, given the counts, every assignment of the group's rows with
those counts equally likely. Step 1 is that law exactly (to the generator's floating point), independently across
groups; step 2 makes the assignment given the counts the one of a uniformly random permutation to the extent that
``φ_g`` is indistinguishable from one (the premise of the whole plan, tested in ``tests/test_sampler.py``). So the
epoch's assignment is the independent per-row draw in law, up to ``φ_g`` being pseudo-random: each row is uniform
over its eligible tiers, rows are independent, epochs are independent (new keys). It is *not* the same draw as the
per-row hash :func:`~hf_arb.sampling.tiered.plan.random_tier_ids` (the packing sampler's).

**The rows of a (tier, bucket).** Tier ``t``'s bucket ``b`` (combined id ``c = offsets[t] + b``) receives the slice
``[start_{g,t}, start_{g,t} + c_{g,t})`` of ``φ_g`` of every group ``g`` whose bucket at ``t`` is ``b``
(``start_{g,t}``: the counts of ``g``'s earlier tiers). :class:`RandomEpochIndex` lists these *parts*, in group
order, as one virtual row list per ``c`` and answers ``rows(c, q)`` — the interface of a
:class:`~hf_arb.sampling.planning.index.RowIndex` that :class:`~hf_arb.sampling.planning.sync.SyncLayout` plans over —
with one ``searchsorted`` over the ``P <= G × T`` parts, the group's permutation and the group index. An epoch's plan is
``O(G × T)`` numbers; any step's rows ``O(batch)`` (plus one permutation key per group it touches).

The counts use ``numpy.random.Generator.multinomial``: the same numpy version on every rank and across a resume
(numpy keeps ``Generator`` streams stable in practice but does not promise it across versions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_arb.rng import generator

from ..planning.feistel import FeistelPermutation
from ..planning.index import CHUNK, RowIndex

TIER_GROUP_COUNTS = 32  #: stream tag of the per-group tier counts (hf_arb.rng's tags are < 30; tiers use 30+)
TIER_GROUP_ORDER = 33  #: stream tag of a group's row order (extra: group)
MAX_GROUPS = 2**15 - 2  #: the group index keys rows by int16 group ids
_DENSE_KEYS = 1 << 16  #: below this many possible keys, groups are found with a bincount instead of a sort


def key_radix(num_buckets: np.ndarray) -> np.ndarray:
    """Place values of a row's group key ``Σ_t (id_t + 1) · radix_t``: int64 ``(T,)`` (``num_buckets``: ``(T,)``)."""
    base = np.asarray(num_buckets, np.int64) + 1  # (T,) an id of tier t is in [-1, k_t)
    if float(np.prod(base.astype(np.float64))) >= 2.0**62:
        raise ValueError(f"The tiers' bucket counts {base - 1} give more than 2^62 bucket combinations: the "
                         f"`random` schedule cannot key its row groups. Use fewer tiers or smaller bucket sets.")
    return np.concatenate([[1], np.cumprod(base[:-1])]).astype(np.int64)


def row_keys(ids: np.ndarray, radix: np.ndarray) -> np.ndarray:
    """Group key of every row of a chunk: ``ids`` int ``(T, m)`` (tier columns) → int64 ``(m,)`` (0: no tier)."""
    return ((np.asarray(ids, np.int64) + 1) * radix[:, None]).sum(axis=0)


def find_groups(tier_ids: np.ndarray, num_buckets: np.ndarray) -> np.ndarray:
    """The distinct bucket tuples of the rows eligible somewhere: int16 ``(G, T)``, sorted by key, ``-1`` where the
    group is not eligible. ``tier_ids``: int16 ``(T, n)`` (:func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`),
    read in chunks."""
    radix = key_radix(num_buckets)
    space = int(radix[-1] * (int(num_buckets[-1]) + 1))
    seen = np.zeros(space, bool) if space <= _DENSE_KEYS else None
    keys: set[int] = set()
    for c0 in range(0, tier_ids.shape[1], CHUNK):
        k = row_keys(tier_ids[:, c0 : c0 + CHUNK], radix)
        if seen is not None:
            seen[k] = True
        else:
            keys.update(np.unique(k).tolist())
    found = np.flatnonzero(seen) if seen is not None else np.array(sorted(keys), np.int64)
    found = found[found > 0]
    if found.size > MAX_GROUPS:
        raise ValueError(f"The rows fall in {found.size} distinct (bucket in every tier) groups, more than the "
                         f"{MAX_GROUPS} the `random` schedule supports: use fewer tiers or smaller bucket sets.")
    base = np.asarray(num_buckets, np.int64) + 1
    return ((found[:, None] // radix[None, :]) % base[None, :] - 1).astype(np.int16)  # (G, T)


class GroupColumn:
    """Every row's group id as a read-only column computed per slice from the tier columns (no ``O(n)`` array):
    ``column[c0:c1]`` is int16 ``(c1 - c0,)``, ``-1`` for rows eligible nowhere. What
    :func:`~hf_arb.sampling.planning.index.build_index` and :func:`~hf_arb.sampling.planning.index.count_blocks` read in
    chunks.

    Args:
        tier_ids: int16 ``(T, n)``.
        groups: :func:`find_groups` of those columns, int16 ``(G, T)``.
        num_buckets: buckets per tier, ``(T,)``.
    """

    def __init__(self, tier_ids: np.ndarray, groups: np.ndarray, num_buckets: np.ndarray) -> None:
        self.tier_ids, self.radix = tier_ids, key_radix(num_buckets)
        self.keys = row_keys(groups.T, self.radix)  # (G,) ascending
        self.size = int(tier_ids.shape[1])
        space = int(self.radix[-1] * (int(np.asarray(num_buckets)[-1]) + 1))
        self.table = None  # key -> group id, int16 (space,), when the key space is small
        if space <= _DENSE_KEYS:
            self.table = np.full(space, -1, np.int16)
            self.table[self.keys] = np.arange(self.keys.size)

    def __getitem__(self, sl: slice) -> np.ndarray:
        k = row_keys(self.tier_ids[:, sl], self.radix)  # (m,)
        if self.table is not None:
            return self.table[k]
        g = np.searchsorted(self.keys, k)
        return np.where(k > 0, g, -1).astype(np.int16)


@dataclass
class RowGroups:
    """The ``random`` schedule's row groups.

    Attributes:
        buckets: int16 ``(G, T)``: each group's bucket in every tier, ``-1`` where it is not eligible.
        index: the rows grouped by group id (``index.count``: ``(G,)`` rows per group).
        offsets: first combined (tier, bucket) id of each tier, int64 ``(T + 1,)``.
    """

    buckets: np.ndarray
    index: RowIndex
    offsets: np.ndarray

    def __post_init__(self) -> None:
        g, t = np.nonzero(self.buckets >= 0)  # every (group, eligible tier): the parts of an epoch
        comb = self.offsets[t] + self.buckets[g, t]
        order = np.lexsort((g, comb))  # by combined id, then group
        #: int64 ``(P,)`` each: group, tier and combined id of every part, sorted by (combined id, group)
        self.part_group, self.part_tier, self.part_comb = g[order], t[order], comb[order]

    @property
    def num_groups(self) -> int:
        """``G``."""
        return int(self.buckets.shape[0])


def draw_tier_counts(sizes: np.ndarray, eligible: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Rows of each group drawn for each tier in ``epoch``: int64 ``(G, T)``.

    Args:
        sizes: rows per group, int ``(G,)``.
        eligible: bool ``(G, T)``, at least one True per group.
        seed, epoch: key of the draw (generator ``(seed, epoch, TIER_GROUP_COUNTS)``).

    Row ``g`` is ``Mult(sizes[g]; 1/m_g on each of its m_g eligible tiers)``: the counts of ``sizes[g]``
    independent uniform draws among the eligible tiers. Zero where not eligible.
    """
    p = eligible / eligible.sum(axis=1, keepdims=True)  # (G, T)
    if not sizes.size:
        return np.zeros(eligible.shape, np.int64)
    return generator(seed, epoch, TIER_GROUP_COUNTS).multinomial(np.asarray(sizes, np.int64), p).astype(np.int64)


class RandomEpochIndex:
    """The rows drawn for every (tier, bucket) in one epoch, as a virtual
    :class:`~hf_arb.sampling.planning.index.RowIndex` over the ``K`` combined ids (``count`` and ``rows``: what
    :class:`~hf_arb.sampling.planning.sync.SyncLayout` reads).

    Args:
        groups: the :class:`RowGroups`.
        seed, epoch: key of the draw.

    State: ``O(G × T)`` numbers and, once used, one permutation key per group.
    """

    def __init__(self, groups: RowGroups, seed: int, epoch: int) -> None:
        self.groups, self.key = groups, (int(seed), int(epoch))
        #: int64 ``(G, T)``: rows of each group drawn for each tier this epoch
        self.tier_counts = draw_tier_counts(groups.index.count, groups.buckets >= 0, seed, epoch)
        self.tier_start = np.cumsum(self.tier_counts, axis=1) - self.tier_counts  # (G, T) first position in φ_g
        width = self.tier_counts[groups.part_group, groups.part_tier]  # (P,)
        self.part_end = np.cumsum(width)  # (P,) end of each part in the concatenation over combined ids
        self.part_start = self.part_end - width
        K = int(groups.offsets[-1])
        #: int64 ``(K,)``: rows drawn for each (tier, bucket)
        self.count = np.bincount(groups.part_comb, weights=width, minlength=K).astype(np.int64)
        self.comb_start = np.cumsum(self.count) - self.count  # (K,)
        self._perms: dict[int, FeistelPermutation] = {}

    def _perm(self, g: int) -> FeistelPermutation:
        perm = self._perms.get(g)
        if perm is None:
            perm = self._perms[g] = FeistelPermutation(int(self.groups.index.count[g]),
                                                       (*self.key, TIER_GROUP_ORDER, g))
        return perm

    def rows(self, comb: int, q: np.ndarray) -> np.ndarray:
        """Rows at positions ``q`` (int array of any shape, in ``[0, count[comb])``) of combined id ``comb``: int64,
        the shape of ``q``. Position ``q`` is in the part holding ``comb_start[comb] + q``."""
        u = self.comb_start[comb] + np.asarray(q, np.int64)
        p = np.searchsorted(self.part_end, u, side="right")  # part of each position (empty parts are skipped)
        g = self.groups.part_group[p]
        pos = self.tier_start[g, self.groups.part_tier[p]] + (u - self.part_start[p])  # position in φ_g
        out = np.empty(u.shape, np.int64)
        for gg in np.unique(g).tolist():
            sel = g == gg
            out[sel] = self.groups.index.rows(gg, self._perm(gg)(pos[sel]))
        return out

    def combined_ids(self, n: int) -> np.ndarray:
        """Combined (tier, bucket) id of each of the ``n`` rows this epoch, ``-1`` where eligible nowhere: int64
        ``(n,)``. ``O(rows)``: for tests and small reports, never used by the plan."""
        out = np.full(int(n), -1, np.int64)
        for c, k in enumerate(self.count.tolist()):
            out[self.rows(c, np.arange(k))] = c
        return out


__all__ = ["MAX_GROUPS", "TIER_GROUP_COUNTS", "TIER_GROUP_ORDER", "GroupColumn", "RandomEpochIndex", "RowGroups",
           "draw_tier_counts", "find_groups", "key_radix", "row_keys"]
