"""The bucket chart: rows per bucket (portrait → landscape) and the distribution of aspect errors; the tier chart:
rows per (tier, bucket) of a multi-resolution run (:func:`plot_tier_chart`); the composite chart: rows per composite
(target + reference) bucket of an edit dataset (:func:`plot_composite_chart`).

matplotlib is optional (the ``plot`` extra: ``pip install "hf_arb[plot]"``); it is imported only when a
chart is drawn, with the non-interactive ``Agg`` backend, so this works on headless machines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.buckets.sets import BucketSet


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "Drawing the bucket chart needs matplotlib, which is not installed. "
            'Install the plot extra: pip install "hf_arb[plot]" (or pip install matplotlib).'
        ) from e
    matplotlib.use("Agg", force=False)  # headless; respects a backend the caller already chose
    import matplotlib.pyplot as plt

    return plt


def plot_bucket_chart(
    buckets: BucketSet,
    bucket_ids: Any,
    aspect_errors: Any,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Draw the bucket chart to a PNG file.

    Left: rows per bucket as bars, labelled ``"WxH"`` and ordered portrait to landscape
    (:meth:`BucketSet.portrait_to_landscape`). Right: histogram of the aspect error of the kept rows.

    Args:
        buckets: the BucketSet the ids refer to.
        bucket_ids: bucket id per row, shape ``(n,)``; ``-1`` (skipped) rows are left out of both panels.
        aspect_errors: aspect error per row, shape ``(n,)``; NaN/None ignored.
        path: where to write the PNG.
        title: figure title (default: the number of rows kept and buckets).
        dpi: resolution of the PNG.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is missing; the message says how to install it.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    ids = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)  # (n,)
    err = np.asarray([np.nan if e is None else e for e in aspect_errors] if isinstance(aspect_errors, list)
                     else aspect_errors, dtype=np.float64).reshape(-1)  # (n,)
    if ids.shape != err.shape:
        raise ValueError(f"`bucket_ids` and `aspect_errors` must have the same length, got {ids.size} and {err.size}.")
    kept = ids >= 0
    if (ids >= len(buckets)).any():
        raise ValueError(f"Bucket id {int(ids.max())} is out of range for a BucketSet of {len(buckets)} buckets.")
    counts = np.bincount(ids[kept], minlength=len(buckets))  # (k,)
    order = buckets.portrait_to_landscape()  # (k,)
    labels = [buckets.labels()[i] for i in order]

    k = len(buckets)
    fig, (ax_b, ax_e) = plt.subplots(1, 2, figsize=(max(8.0, 4.0 + 0.32 * k), 4.5),
                                     gridspec_kw={"width_ratios": [max(2.0, k / 8), 1.0]})
    try:
        x = np.arange(k)
        ax_b.bar(x, counts[order], color="#4C72B0")
        ax_b.set_xticks(x)
        ax_b.set_xticklabels(labels, rotation=90, fontsize=7 if k > 24 else 8)
        ax_b.set_ylabel("rows")
        ax_b.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax_b.set_xlabel("bucket (width x height), portrait → landscape")
        ax_b.set_title("rows per bucket")
        e = err[kept & np.isfinite(err)]
        if e.size:
            ax_e.hist(e, bins=min(50, max(5, int(np.sqrt(e.size)))), color="#DD8452")
            ax_e.axvline(float(np.median(e)), color="k", linestyle="--", linewidth=1,
                         label=f"median {np.median(e):.4f}")
            ax_e.legend(fontsize=8)
        else:
            ax_e.text(0.5, 0.5, "no kept rows", ha="center", va="center", transform=ax_e.transAxes)
        ax_e.set_xlabel(f"aspect error ({buckets.metric})")
        ax_e.set_ylabel("rows")
        ax_e.set_title("aspect error of kept rows")
        fig.suptitle(title or f"{int(kept.sum()):,} of {ids.size:,} rows in {k} buckets")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return out


def plot_tier_chart(
    tiers: Any,
    counts: Any,
    path: str | os.PathLike[str],
    *,
    rows_total: int | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Draw rows per (tier, bucket) to a PNG file: one panel per tier, side by side.

    Each panel shows the rows whose bucket in that tier is ``"WxH"``, bars ordered portrait to landscape; its
    title gives the tier's resolution and its eligible rows. A row counts in every tier it is eligible for.

    Args:
        tiers: the :class:`~hf_arb.sampling.tiered.plan.Tiers` (a BucketSet per tier).
        counts: rows per bucket of each tier, a sequence of ``T`` int arrays ``(k_t,)``
            (:func:`~hf_arb.sampling.tiered.report.tier_row_counts`).
        path: where to write the PNG.
        rows_total: the dataset's rows (for the default title).
        title: figure title (default: rows per tier).
        dpi: resolution of the PNG.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is missing; the message says how to install it.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    sets = list(tiers.bucket_sets)
    per_tier = [np.asarray(c, dtype=np.int64).reshape(-1) for c in counts]  # T × (k_t,)
    if len(per_tier) != len(sets) or any(c.size != len(b) for c, b in zip(per_tier, sets)):
        raise ValueError(f"`counts` must hold one array per tier of its bucket count {[len(b) for b in sets]}, got "
                         f"{[c.size for c in per_tier]}.")
    widths = [max(2.0, len(b) / 8) for b in sets]
    fig, axes = plt.subplots(1, len(sets), figsize=(max(8.0, 2.0 + 0.3 * sum(len(b) for b in sets)), 4.5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    try:
        for ax, res, bs, c in zip(axes[0], tiers.resolutions, sets, per_tier):
            order = bs.portrait_to_landscape()  # (k_t,)
            x = np.arange(len(bs))
            ax.bar(x, c[order], color="#4C72B0")
            ax.set_xticks(x)
            ax.set_xticklabels([bs.labels()[i] for i in order], rotation=90, fontsize=7 if len(bs) > 24 else 8)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"tier {res}: {int(c.sum()):,} rows in {int((c > 0).sum())} buckets", fontsize=10)
            ax.set_xlabel("bucket (width x height)")
        axes[0][0].set_ylabel("rows")
        total = f" of {rows_total:,}" if rows_total is not None else ""
        fig.suptitle(title or f"rows per tier and bucket{total} (max upscale {float(tiers.max_upscale):g}x)")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return out


def plot_composite_chart(counts: dict[str, int], path: str | os.PathLike[str], *, names: tuple[str, ...] = (),
                         title: str | None = None, dpi: int = 100) -> Path:
    """Draw rows per composite bucket of an edit dataset to a PNG file: one bar per composite, most populous first,
    labelled ``"WxH + WxH…"`` (target, then each reference), with its share of the kept rows.

    Args:
        counts: ``{label: rows}`` (:func:`~hf_arb.buckets.references.composite_label_counts`).
        path: where to write the PNG.
        names: the reference columns (for the axis label).
        title: figure title (default: the kept rows and composite buckets).
        dpi: resolution of the PNG.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is missing; the message says how to install it.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    items = sorted(counts.items(), key=lambda kv: -kv[1])
    c = np.asarray([v for _, v in items], dtype=np.int64)  # (m,)
    total = max(int(c.sum()), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 + 0.45 * len(items)), 4.5))
    try:
        x = np.arange(len(items))
        ax.bar(x, c, color="#55A868")
        for i, v in enumerate(c.tolist()):
            ax.text(i, v, f"{100 * v / total:.1f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels([k for k, _ in items], rotation=90, fontsize=8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("rows")
        ax.set_xlabel("composite bucket (target" + "".join(f" + {n}" for n in names) + ")")
        fig.suptitle(title or f"{int(c.sum()):,} rows in {len(items)} composite buckets")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return out
