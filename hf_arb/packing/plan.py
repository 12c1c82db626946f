"""NaViT-style packing: several images at their own resolution in one token sequence, planned per epoch.

Buckets group images by shape and crop each a little; a transformer does not need equal shapes, only a bounded
sequence. Packing ("Patch n' Pack", NaViT) concatenates the latent tokens of several images, each at its own aspect
ratio, into one sequence of at most ``max_tokens`` tokens, and masks attention so tokens attend only inside their
own image (:mod:`hf_arb.packing.model` runs SD3 and Flux that way). The pure, numpy-only parts (sizes and metadata live
in
:mod:`hf_arb.packing.layout` and are re-exported here):

* :func:`fit_sizes` — each image's own training size: scaled down (never up, unless asked) so its token count fits,
  then floored to the latent patch grid; the only crop is the remainder below one patch (< 16 px a side).
* :func:`plan_packs` — the epoch plan of packs, a pure function of ``(token counts, max_tokens, world size, seed,
  epoch)`` like :func:`~hf_arb.sampling.planning.plan.plan_epoch`: one pack per rank per step, all ranks the same
  number of steps, every row once per epoch or reported (:class:`PackReport`). Resume = recompute and start at
  ``step``.
* :func:`pack_meta` — what a model needs for one pack (:class:`PackMeta`): ``seq_lens``, ``cu_seqlens``,
  ``document_id``, latent grids, per-image ``mu`` and shifted sigmas (:mod:`hf_arb.families.shift`), text layout, loss
  mask.

Example:
    ```py
    >>> import numpy as np
    >>> from hf_arb.packing import fit_sizes, plan_packs
    >>> fit = fit_sizes([1200, 640, 1024], [800, 640, 512], max_tokens=4096)
    >>> fit.tokens.tolist()
    [3750, 1600, 2048]
    >>> plan = plan_packs(fit.tokens, max_tokens=8192, world_size=1, seed=0, epoch=0)
    >>> plan.num_steps, plan.report.rows_packed
    (1, 3)
    ```
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from hf_arb import rng

from .layout import FittedSizes, PackMeta, check_nonneg, check_positive, fit_sizes, pack_meta

__all__ = ["PackLeftover", "PackPlan", "PackReport", "first_fit_decreasing", "plan_packs"]
_REEXPORTED = (FittedSizes, PackMeta, fit_sizes, pack_meta)  # documented in hf_arb.packing.layout

PackLeftover = Literal["drop", "fill"]
DEFAULT_WINDOW = 512  # rows packed together by first-fit-decreasing before the next shuffled window


# ------------------------------------------------------------------------------------------------- packing
def first_fit_decreasing(tokens: Any, capacity: int) -> np.ndarray:
    """Pack items into bins of ``capacity`` by first-fit-decreasing; returns each item's bin, int64 ``(n,)``.

    Items are taken largest first (ties in input order) and put in the first open bin with room; bins are numbered
    in the order they are opened. Every item must be ``<= capacity``. FFD uses at most ``11/9 OPT + 6/9`` bins.
    """
    t = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
    return _ffd_windows(t, capacity)[0]


def _ffd_windows(t: np.ndarray, capacity: int) -> np.ndarray:
    """First-fit-decreasing in every row of ``t`` (``(windows, size)``, items > 0, 0 = no item) at once.

    Returns bins ``(windows, size)`` (``-1`` for no item). Vectorised over windows: step ``j`` places every
    window's ``j``-th largest item. Unopened bins have full capacity and bins open in index order, so the first bin
    with room (``argmax``) is exactly first-fit.
    """
    nw, size = t.shape
    order = np.argsort(-t, axis=1, kind="stable")
    st = np.take_along_axis(t, order, 1)
    free = np.full((nw, size + 1), capacity, dtype=np.int64)
    placed = np.empty((nw, size), dtype=np.int64)
    ar, opened = np.arange(nw), 1
    for j in range(size):
        need = st[:, j]
        b = (free[:, :opened] >= need[:, None]).argmax(1)
        free[ar, b] -= need
        placed[:, j] = b
        opened = min(size, max(opened, int(b.max()) + 2))
    bins = np.empty_like(placed)
    np.put_along_axis(bins, order, placed, 1)
    bins[t <= 0] = -1
    return bins


def _pack_windows(rows: np.ndarray, t: np.ndarray, capacity: int, window: int,
                  pool_emptiest: bool) -> tuple[list[np.ndarray], np.ndarray]:
    """FFD-pack ``rows`` in consecutive windows; returns the packs and (``pool_emptiest``) the rows of each
    window's emptiest, not full pack, left out of the packs."""
    if rows.size == 0:
        return [], rows
    nw = -(-rows.size // window)
    grid = np.full(nw * window, -1, dtype=np.int64)
    grid[:rows.size] = rows
    grid = grid.reshape(nw, window)
    bins = _ffd_windows(np.where(grid >= 0, t[np.maximum(grid, 0)], 0), capacity)
    key = np.where(bins >= 0, np.arange(nw)[:, None] * (window + 1) + bins, -1).ravel()
    keep = key >= 0
    key, flat = key[keep], grid.ravel()[keep]
    order = np.argsort(key, kind="stable")  # rows of a pack keep their (random) window order
    key, flat = key[order], flat[order]
    uniq, start = np.unique(key, return_index=True)
    fill = np.add.reduceat(t[flat], start)
    win_of = uniq // (window + 1)
    # each window's emptiest pack (if not full) goes back to the pool
    emptiest = np.zeros(uniq.size, dtype=bool)
    first = np.lexsort((fill, win_of))  # by window, then fill ascending
    firsts = first[np.r_[True, win_of[first][1:] != win_of[first][:-1]]]
    if pool_emptiest:
        emptiest[firsts[fill[firsts] < capacity]] = True
    packs = np.split(flat, start[1:])
    pool = [p for p, e in zip(packs, emptiest) if e]
    return [p for p, e in zip(packs, emptiest) if not e], (np.concatenate(pool) if pool else flat[:0])


@dataclass(frozen=True)
class PackReport:
    """What one epoch's pack plan trains and what it leaves out; JSON-serialisable via :meth:`to_dict`.

    Attributes:
        rows_total: rows given; rows_packed: distinct rows in a pack this epoch.
        rows_skipped: rows with ``tokens <= 0`` (marked not to be sampled).
        rows_oversize: rows with more tokens than ``max_tokens`` (fit them with :func:`fit_sizes`).
        rows_leftover: rows of the last packs that did not fill one pack per rank (``leftover="drop"``).
        packs, steps: packs planned and steps per rank.
        rows_repeated: rows trained a second time in the packs that complete the last step (``leftover="fill"``).
        tokens_real, tokens_total: image tokens in packs, and ``packs * max_tokens``.
        padding_fraction: ``1 - tokens_real / tokens_total``.
        mean_images_per_pack: images per pack, repeats included.
    """

    rows_total: int
    rows_packed: int
    rows_skipped: int
    rows_oversize: int
    rows_leftover: int
    packs: int
    steps: int
    rows_repeated: int
    tokens_real: int
    tokens_total: int
    padding_fraction: float
    mean_images_per_pack: float

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` for JSON reports."""
        return asdict(self)

    def text(self) -> str:
        """One line for the startup report."""
        return (f"packing: {self.rows_packed:,}/{self.rows_total:,} rows in {self.packs:,} packs "
                f"({self.steps:,} steps/rank, {self.mean_images_per_pack:.2f} images/pack), "
                f"padding {100 * self.padding_fraction:.2f}%; oversize {self.rows_oversize:,}, "
                f"leftover {self.rows_leftover:,}, repeated {self.rows_repeated:,}, skipped {self.rows_skipped:,}")


@dataclass(frozen=True)
class PackPlan:
    """One epoch's packs for all ranks.

    Pack ``p = step * world_size + rank`` holds the rows ``rows[offsets[p]:offsets[p + 1]]`` (a ragged array:
    ``rows`` int64 of shape ``(total,)``, ``offsets`` int64 of shape ``(steps * world_size + 1,)``, starting at 0).

    Attributes:
        rows, offsets: the ragged packs, step-major, rank-minor.
        world_size, num_steps, max_tokens: the plan's shape and budget.
        oversize, leftover: rows left out this epoch (int64 arrays), for the report and the caller.
        report: :class:`PackReport`.
    """

    rows: np.ndarray
    offsets: np.ndarray
    world_size: int
    num_steps: int
    max_tokens: int
    oversize: np.ndarray
    leftover: np.ndarray
    report: PackReport

    def pack(self, step: int, rank: int = 0) -> np.ndarray:
        """Rows of ``rank``'s pack at ``step`` (int64, never empty)."""
        if not (0 <= step < self.num_steps and 0 <= rank < self.world_size):
            raise IndexError(f"step {step} / rank {rank} outside the plan ({self.num_steps} steps, "
                             f"{self.world_size} ranks).")
        p = step * self.world_size + rank
        return self.rows[self.offsets[p]:self.offsets[p + 1]]

    def iter_rank(self, rank: int = 0, start_step: int = 0) -> Any:
        """Yield ``rank``'s packs from ``start_step`` on (resume: the state is ``(epoch, step)``)."""
        for s in range(start_step, self.num_steps):
            yield self.pack(s, rank)


def plan_packs(tokens: Any, max_tokens: int, world_size: int = 1, *, seed: int = 0, epoch: int = 0,
               window: int = DEFAULT_WINDOW, shuffle: bool = True, leftover: PackLeftover = "drop") -> PackPlan:
    """Plan one epoch of packs for all ranks: a pure function of its arguments.

    1. Rows with ``tokens <= 0`` are skipped, rows with ``tokens > max_tokens`` reported as oversize.
    2. The other rows are put in a random order (stream ``(seed, epoch, PLAN_PACK)``) and cut into windows of
       ``window`` rows; each window is packed by :func:`first_fit_decreasing` (vectorised over windows). The
       rows of every window's emptiest pack are pooled and packed again the same way, while that shrinks them.
       Small windows keep the order random, large ones pack tighter.
    3. All packs are put in a random order (stream ``(seed, epoch, PLAN_PACK_ORDER)``) so that no rank or step
       sees only the big or only the small images of a window; pack ``j`` goes to step ``j // world_size``,
       rank ``j % world_size``.
    4. If the packs do not divide by ``world_size``, the last ``packs % world_size`` are dropped and their rows
       reported (``leftover="drop"``), or the last step is completed with copies of the epoch's first packs
       (``leftover="fill"``: those rows are trained twice, counted in ``rows_repeated``); all ranks run the same
       number of steps, and every pack holds at least one image, either way.

    Args:
        tokens: latent tokens per row (text tokens too, if they count toward the budget), int ``(n,)``.
        max_tokens: tokens per pack = per rank per step.
        world_size: number of ranks.
        seed, epoch: the run's seed and the epoch (>= 0).
        window: rows per first-fit-decreasing window (>= 1).
        shuffle: ``False`` keeps row order (windows of consecutive rows) and the packs' order.
        leftover: ``"drop"`` or ``"fill"``, see step 4.

    Returns:
        :class:`PackPlan`.
    """
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise ValueError(f"`tokens` must be 1-D (one token count per row), got shape {t.shape}.")
    if t.size and t.dtype.kind not in "iu":
        if t.dtype.kind == "f" and np.all(t == np.round(t)):
            t = t.astype(np.int64)
        else:
            raise ValueError(f"`tokens` must be integers, got dtype {t.dtype}.")
    t = t.astype(np.int64, copy=False)
    max_tokens, world_size = check_positive("max_tokens", max_tokens), check_positive("world_size", world_size)
    window = check_positive("window", window)
    seed, epoch = check_nonneg("seed", seed), check_nonneg("epoch", epoch)
    if leftover not in ("drop", "fill"):
        raise ValueError(f"`leftover` must be 'drop' or 'fill', got {leftover!r}.")
    skipped = t <= 0
    oversize = np.flatnonzero(t > max_tokens)
    valid = np.flatnonzero(~skipped & (t <= max_tokens))
    if shuffle:
        valid = valid[rng.generator(seed, epoch, rng.PLAN_PACK).permutation(valid.size)]
    packs, pool = _pack_windows(valid, t, max_tokens, window, True)
    while pool.size > window:  # re-pack the emptiest packs of all windows together while that shrinks them
        more, rest = _pack_windows(pool, t, max_tokens, window, True)
        if rest.size >= pool.size:
            break
        packs, pool = packs + more, rest
    packs.extend(_pack_windows(pool, t, max_tokens, window, False)[0])
    if shuffle and packs:
        perm = rng.generator(seed, epoch, rng.PLAN_PACK_ORDER).permutation(len(packs))
        packs = [packs[i] for i in perm.tolist()]
    extra = len(packs) % world_size
    dropped = np.zeros(0, dtype=np.int64)
    repeated = 0
    if extra and leftover == "drop":
        dropped = np.concatenate(packs[len(packs) - extra:]).astype(np.int64)
        packs = packs[:len(packs) - extra]
    elif extra:
        copies = [packs[i % len(packs)] for i in range(world_size - extra)]
        repeated = sum(int(c.size) for c in copies)
        packs = packs + copies
    sizes = np.array([p.size for p in packs], dtype=np.int64)
    offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.concatenate(packs).astype(np.int64) if packs else np.zeros(0, dtype=np.int64)
    unique_rows = flat.size - repeated
    real = int(t[flat].sum())
    total = len(packs) * max_tokens
    report = PackReport(
        rows_total=int(t.size), rows_packed=int(unique_rows), rows_skipped=int(skipped.sum()),
        rows_oversize=int(oversize.size), rows_leftover=int(dropped.size), packs=len(packs),
        steps=len(packs) // world_size, rows_repeated=repeated, tokens_real=real, tokens_total=total,
        padding_fraction=(1 - real / total) if total else 0.0,
        mean_images_per_pack=(flat.size / len(packs)) if packs else 0.0)
    return PackPlan(flat, offsets, world_size, len(packs) // world_size, max_tokens, oversize.astype(np.int64),
                    dropped, report)


