"""NaViT-style packing: several images at their own resolution in one token sequence, planned per epoch.

Buckets group images by shape and crop each a little; a transformer does not need equal shapes, only a bounded
sequence. Packing ("Patch n' Pack", NaViT) concatenates the latent tokens of several images, each at its own aspect
ratio, into one sequence of at most ``max_tokens`` tokens, and masks attention so tokens attend only inside their
own image (:mod:`hf_arb.packed` runs SD3 and Flux that way). This module holds the pure, numpy-only parts:

* :func:`fit_sizes` — each image's own training size: scaled down (never up, unless asked) so its token count fits,
  then floored to the latent patch grid; the only crop is the remainder below one patch (< 16 px a side).
* :func:`plan_packs` — the epoch plan of packs, a pure function of ``(token counts, max_tokens, world size, seed,
  epoch)`` like :func:`~hf_arb.sampling.plan.plan_epoch`: one pack per rank per step, all ranks the same number of
  steps, every row once per epoch or reported (:class:`PackReport`). Resume = recompute and start at ``step``.
* :func:`pack_meta` — what a model needs for one pack (:class:`PackMeta`): ``seq_lens``, ``cu_seqlens``,
  ``document_id``, latent grids, per-image ``mu`` and shifted sigmas (:mod:`hf_arb.shift`), text layout, loss mask.

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

from . import rng
from .shift import ShiftConfig, calculate_mu, shift_sigmas

__all__ = ["FittedSizes", "fit_sizes", "PackReport", "PackPlan", "plan_packs", "first_fit_decreasing",
           "PackMeta", "pack_meta"]

PackLeftover = Literal["drop", "empty"]
DEFAULT_WINDOW = 512  # rows packed together by first-fit-decreasing before the next shuffled window


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def _nonneg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return int(value)


# ------------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class FittedSizes:
    """Each image's own training size (all arrays shape ``(n,)``, int64 unless noted).

    Attributes:
        resize_width, resize_height: the size the image is resized to (aspect kept up to pixel rounding).
        width, height: the final size, ``resize_*`` floored to a multiple of ``vae_scale_factor × patch_size``
            (the image is centre- or randomly cropped by the remainder, less than one patch a side).
        tokens: latent tokens after patching, ``(height / step) * (width / step)``; ``<= max_tokens``.
        crop_fraction: float64, share of the resized image's area removed by flooring to the grid.
    """

    resize_width: np.ndarray
    resize_height: np.ndarray
    width: np.ndarray
    height: np.ndarray
    tokens: np.ndarray
    crop_fraction: np.ndarray


def fit_sizes(widths: Any, heights: Any, max_tokens: int, *, vae_scale_factor: int = 8, patch_size: int = 2,
              upscale: bool = False) -> FittedSizes:
    """Pick every image's own training size: its aspect ratio, at most ``max_tokens`` latent tokens, vectorised.

    The token grid is ``floor(side * s / step)`` a side with ``s = sqrt(max_tokens * step² / (w * h))`` when the
    image has more tokens than that (``s = 1`` otherwise, unless ``upscale``) and ``step = vae_scale_factor *
    patch_size``; the image is then resized (aspect kept) to the smallest size covering that grid and the
    remainder, less than one patch on one side, cropped. The only exception is an aspect ratio so extreme that one
    side would fall under one patch: that side is kept at one patch and the other cut to the budget (visible in
    ``crop_fraction``).

    Args:
        widths, heights: original sizes, shape ``(n,)``, positive.
        max_tokens: token cap per image (e.g. 4096 = 1 MP for SD3/Flux); ``>= 1``.
        vae_scale_factor, patch_size: the model's latent step (8 and 2 for SD3 and Flux).
        upscale: also enlarge images with fewer tokens than ``max_tokens`` to it.

    Returns:
        :class:`FittedSizes`.

    Raises:
        ValueError: sizes of different shapes or not positive, or a non-positive ``max_tokens``.
    """
    w = np.atleast_1d(np.asarray(widths, dtype=np.float64))
    h = np.atleast_1d(np.asarray(heights, dtype=np.float64))
    if w.shape != h.shape or w.ndim != 1:
        raise ValueError(f"`widths` and `heights` must both have shape (n,), got {w.shape} and {h.shape}.")
    if w.size and (min(w.min(), h.min()) < 1):
        i = int(np.argmin(np.minimum(w, h)))
        raise ValueError(f"Image sizes must be >= 1 pixel, got {w[i]:g}x{h[i]:g} at row {i}; drop or fix that row.")
    max_tokens = _positive("max_tokens", max_tokens)
    step = _positive("vae_scale_factor", vae_scale_factor) * _positive("patch_size", patch_size)
    scale = np.sqrt(max_tokens * step * step / (w * h))
    if not upscale:
        scale = np.minimum(scale, 1.0)
    rw = np.maximum(np.floor(w * scale + 1e-9), 1).astype(np.int64)
    rh = np.maximum(np.floor(h * scale + 1e-9), 1).astype(np.int64)
    tw, th = np.maximum(rw // step, 1), np.maximum(rh // step, 1)
    # extreme aspect ratios: one side kept at >= one patch, the other cut to the budget
    tw = np.minimum(tw, max_tokens // th)  # th >= 1, so tw <= max_tokens and tw >= 1 after this
    th = np.minimum(th, max_tokens // np.maximum(tw, 1))
    tw = np.maximum(tw, 1)
    fw, fh = tw * step, th * step
    cover = np.maximum(fw / w, fh / h)  # <= scale: the smallest resize that covers the grid (aspect kept)
    # ceil keeps the grid covered; the clamp (< 1 px of aspect) keeps the crop under one patch
    rw = np.clip(np.ceil(w * cover - 1e-6).astype(np.int64), fw, np.maximum(fw + step - 1, np.floor(w * cover)))
    rh = np.clip(np.ceil(h * cover - 1e-6).astype(np.int64), fh, np.maximum(fh + step - 1, np.floor(h * cover)))
    crop = 1.0 - (fw * fh) / (rw * rh).astype(np.float64)
    return FittedSizes(rw, rh, fw, fh, tw * th, crop)


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
        rows_total: rows given; rows_packed: rows in a pack this epoch.
        rows_skipped: rows with ``tokens <= 0`` (marked not to be sampled).
        rows_oversize: rows with more tokens than ``max_tokens`` (fit them with :func:`fit_sizes`).
        rows_leftover: rows of the last packs that did not fill one pack per rank (``leftover="drop"``).
        packs, steps, empty_packs: packs planned, steps per rank, and all-padding packs (``leftover="empty"``).
        tokens_real, tokens_total: image tokens in packs, and ``packs * max_tokens``.
        padding_fraction: ``1 - tokens_real / tokens_total``.
        mean_images_per_pack: ``rows_packed / packs``.
    """

    rows_total: int
    rows_packed: int
    rows_skipped: int
    rows_oversize: int
    rows_leftover: int
    packs: int
    steps: int
    empty_packs: int
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
                f"leftover {self.rows_leftover:,}, skipped {self.rows_skipped:,}")


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
        """Rows of ``rank``'s pack at ``step`` (int64, possibly empty for ``leftover="empty"`` packs)."""
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
       reported (``leftover="drop"``) or every rank gets a pack and the missing ones are empty (all padding,
       ``leftover="empty"``), so all ranks run the same number of steps either way.

    Args:
        tokens: latent tokens per row (text tokens too, if they count toward the budget), int ``(n,)``.
        max_tokens: tokens per pack = per rank per step.
        world_size: number of ranks.
        seed, epoch: the run's seed and the epoch (>= 0).
        window: rows per first-fit-decreasing window (>= 1).
        shuffle: ``False`` keeps row order (windows of consecutive rows) and the packs' order.
        leftover: ``"drop"`` or ``"empty"``, see step 4.

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
    max_tokens, world_size = _positive("max_tokens", max_tokens), _positive("world_size", world_size)
    window = _positive("window", window)
    seed, epoch = _nonneg("seed", seed), _nonneg("epoch", epoch)
    if leftover not in ("drop", "empty"):
        raise ValueError(f"`leftover` must be 'drop' or 'empty', got {leftover!r}.")
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
    empty = 0
    if extra and leftover == "drop":
        dropped = np.concatenate(packs[len(packs) - extra:]).astype(np.int64)
        packs = packs[:len(packs) - extra]
    elif extra:
        empty = world_size - extra
        packs = packs + [np.zeros(0, dtype=np.int64)] * empty
    sizes = np.array([p.size for p in packs], dtype=np.int64)
    offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.concatenate(packs).astype(np.int64) if packs else np.zeros(0, dtype=np.int64)
    real = int(t[flat].sum())
    total = len(packs) * max_tokens
    report = PackReport(
        rows_total=int(t.size), rows_packed=int(flat.size), rows_skipped=int(skipped.sum()),
        rows_oversize=int(oversize.size), rows_leftover=int(dropped.size), packs=len(packs),
        steps=len(packs) // world_size, empty_packs=empty, tokens_real=real, tokens_total=total,
        padding_fraction=(1 - real / total) if total else 0.0,
        mean_images_per_pack=(flat.size / len(packs)) if packs else 0.0)
    return PackPlan(flat, offsets, world_size, len(packs) // world_size, max_tokens, oversize.astype(np.int64),
                    dropped, report)


# ------------------------------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class PackMeta:
    """What a model needs to run one pack (numpy; :func:`hf_arb.packed.to_torch` moves it to tensors).

    ``m`` images, ``L = max_tokens`` image-token slots, ``Lt`` text-token slots. Image tokens of image ``i`` are
    ``[cu_seqlens[i], cu_seqlens[i + 1])`` in row-major order of its latent grid; slots after ``cu_seqlens[-1]``
    are padding.

    Attributes:
        grids: int64 ``(m, 2)``, each image's latent token grid ``(h, w)`` (after patching) for position ids.
        seq_lens: int32 ``(m,)``, ``h * w``.
        cu_seqlens: int32 ``(m + 1,)``, cumulative ``seq_lens`` starting at 0 (varlen attention layout).
        max_seqlen: largest ``seq_lens`` (0 for an empty pack).
        document_id: int32 ``(L,)``, the image of each token slot, ``-1`` for padding.
        positions: int64 ``(L, 2)``, each token's ``(row, col)`` inside its own image (0 for padding).
        text_lens, text_cu_seqlens, text_document_id: the same for the text tokens (``(m,)``, ``(m + 1,)``,
            ``(Lt,)``); image ``i``'s text is ``[text_cu_seqlens[i], text_cu_seqlens[i + 1])``.
        mu: float64 ``(m,)``, each image's resolution shift (:func:`hf_arb.shift.calculate_mu` of its tokens).
        sigmas: float64 ``(m,)``, each image's shifted sigma from its sampled ``t`` (``None`` if no ``t``).
        loss_mask: bool ``(L,)``, ``document_id >= 0``.
    """

    grids: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    document_id: np.ndarray
    positions: np.ndarray
    text_lens: np.ndarray
    text_cu_seqlens: np.ndarray
    text_document_id: np.ndarray
    mu: np.ndarray
    sigmas: np.ndarray | None
    loss_mask: np.ndarray

    @property
    def num_images(self) -> int:
        """Images in the pack."""
        return int(self.seq_lens.size)

    @property
    def padding_fraction(self) -> float:
        """Share of the ``L`` image-token slots that are padding."""
        n = self.document_id.size
        return float(1 - self.seq_lens.sum() / n) if n else 0.0


def _ragged_ids(lens: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    cu = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    doc = np.full(total, -1, dtype=np.int32)
    doc[:cu[-1]] = np.repeat(np.arange(lens.size, dtype=np.int32), lens)
    return cu, doc


def pack_meta(grids: Any, max_tokens: int, *, text_lens: Any = None, max_text_tokens: int | None = None,
              t: Any = None, shift_config: ShiftConfig | None = None) -> PackMeta:
    """Build one pack's :class:`PackMeta` from its images' latent token grids.

    Args:
        grids: ``(m, 2)`` latent token grids ``(h, w)`` after patching (``height / (vae × patch)``, ...).
        max_tokens: image-token slots of the pack (the planner's budget); must hold all images.
        text_lens: text tokens of each image, ``(m,)`` (0 if ``None``).
        max_text_tokens: text-token slots (default: ``sum(text_lens)``, no text padding).
        t: each image's sampled time in ``(0, 1]`` (``(m,)``); with it, ``sigmas = shift_sigmas(t, mu, cfg)``.
        shift_config: the scheduler's shift (default :class:`~hf_arb.shift.ShiftConfig` with its defaults).

    Raises:
        ValueError: grids of the wrong shape or not positive, or images / texts over their slots.
    """
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 2)
    if g.size and g.min() < 1:
        raise ValueError(f"Latent grids must be >= 1 token a side, got {g[np.argmin(g.min(1))].tolist()}.")
    max_tokens = _nonneg("max_tokens", max_tokens)
    lens = (g[:, 0] * g[:, 1]).astype(np.int32)
    if int(lens.sum()) > max_tokens:
        raise ValueError(f"The pack's images have {int(lens.sum())} tokens, more than `max_tokens`={max_tokens}; "
                         "plan packs with `plan_packs` using the same budget.")
    cu, doc = _ragged_ids(lens, max_tokens)
    pos = np.zeros((max_tokens, 2), dtype=np.int64)
    if lens.size:
        local = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
        width = np.repeat(g[:, 1], lens)
        pos[:cu[-1], 0], pos[:cu[-1], 1] = local // width, local % width
    tl = np.zeros(lens.size, dtype=np.int32) if text_lens is None else np.asarray(text_lens, dtype=np.int32)
    if tl.shape != lens.shape or (tl.size and tl.min() < 0):
        raise ValueError(f"`text_lens` must be non-negative with shape {lens.shape} (one per image), got {tl}.")
    lt = int(tl.sum()) if max_text_tokens is None else _nonneg("max_text_tokens", max_text_tokens)
    if int(tl.sum()) > lt:
        raise ValueError(f"The pack's texts have {int(tl.sum())} tokens, more than `max_text_tokens`={lt}.")
    tcu, tdoc = _ragged_ids(tl, lt)
    cfg = shift_config or ShiftConfig()
    mu = np.atleast_1d(calculate_mu(lens.astype(np.int64), cfg))
    sig = None
    if t is not None:
        tt = np.asarray(t, dtype=np.float64).reshape(-1)
        if tt.shape != lens.shape or (tt.size and (tt.min() <= 0 or tt.max() > 1)):
            raise ValueError(f"`t` must be in (0, 1] with shape {lens.shape} (one per image), got {tt}.")
        sig = np.asarray(shift_sigmas(tt, mu, cfg), dtype=np.float64)
    return PackMeta(g, lens, cu, int(lens.max()) if lens.size else 0, doc, pos, tl, tcu, tdoc, mu, sig, doc >= 0)
