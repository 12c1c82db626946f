"""The pictures `make demo` draws (matplotlib, labelled, upscaled so that tiny images are visible).

* :func:`crop_figure` — each demo photo, what a centre square keeps (diffusers' default) and what its bucket keeps;
* :func:`bucket_loss_figure` — the training loss of every bucket shape, per model, from the ``--log_batches`` traces;
* :func:`sample_figure` — generated images at every bucket shape, before and after training, with prompt, size
  and step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

UPSCALE = 3  # tiny models make tiny images: show them 3× larger, pixels as squares (nearest neighbour)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def centre_square(im: Image.Image, side: int) -> Image.Image:
    """What diffusers' ``train_text_to_image.py`` does: resize the short side to ``side``, centre-crop a square."""
    s = side / min(im.size)
    im = im.resize((max(side, round(im.width * s)), max(side, round(im.height * s))), Image.Resampling.LANCZOS)
    left, top = (im.width - side) // 2, (im.height - side) // 2
    return im.crop((left, top, left + side, top + side))


def _kept_box(size: tuple[int, int], target: tuple[int, int]) -> tuple[float, float, float, float]:
    """The centred box of the original ``(w, h)`` that a resize-to-cover of ``target`` ``(tw, th)`` keeps."""
    w, h = size
    tw, th = target
    s = max(tw / w, th / h)
    kw, kh = tw / s, th / s
    return (w - kw) / 2, (h - kh) / 2, kw, kh


def crop_figure(photos: list[tuple[str, Image.Image]], buckets: Any, side: int, path: Path) -> Path:
    """One row per photo: the photo with both crops outlined, the centre square, the bucket fit (all labelled).

    Args:
        photos: ``(caption, image)`` pairs, one per aspect ratio.
        buckets: the :class:`~hf_arb.BucketSet` the demo trains with.
        side: the square side diffusers would train at (the bucket budget's side).
        path: PNG to write.
    """
    from matplotlib.patches import Rectangle

    from hf_arb import fit_to_bucket

    plt = _pyplot()
    fig, axes = plt.subplots(len(photos), 3, figsize=(11, 2.6 * len(photos)),
                             gridspec_kw={"width_ratios": [1.4, 1, 1.2]})
    for (caption, im), ax in zip(photos, axes):
        (bid,), (err,) = buckets.assign([im.width], [im.height])
        bw, bh = buckets[int(bid)]
        fit = fit_to_bucket(im, (bw, bh), crop="center")
        sq_box = _kept_box(im.size, (side, side))
        b_box = _kept_box(im.size, (bw, bh))
        kept_sq = sq_box[2] * sq_box[3] / (im.width * im.height)
        kept_b = b_box[2] * b_box[3] / (im.width * im.height)
        ax[0].imshow(im)
        ax[0].add_patch(Rectangle(sq_box[:2], *sq_box[2:], fill=False, ec="red", lw=2, ls="--"))
        ax[0].add_patch(Rectangle(b_box[:2], *b_box[2:], fill=False, ec="lime", lw=2))
        ax[0].set_title(f"{caption}\n{im.width}×{im.height}, aspect {im.width / im.height:.2f}", fontsize=9)
        ax[1].imshow(centre_square(im, side), interpolation="nearest")
        ax[1].set_title(f"centre square {side}×{side} (red)\nkeeps {100 * kept_sq:.0f}% of the photo", fontsize=9,
                        color="darkred")
        ax[2].imshow(fit.image, interpolation="nearest")
        ax[2].set_title(f"hf_arb bucket {bw}×{bh} (green)\nkeeps {100 * kept_b:.0f}% (aspect error {err:.3f})",
                        fontsize=9, color="darkgreen")
        for a in ax:
            a.set_xticks([])
            a.set_yticks([])
    fig.suptitle("What the model is shown: a centre square cuts heads, feet and sides; a bucket keeps the picture",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def read_trace(model_dir: Path) -> list[dict[str, Any]]:
    """All ranks' ``--log_batches`` records of a training run (``batches/rank*.jsonl``)."""
    recs = []
    for trace in sorted((model_dir / "batches").glob("rank*.jsonl")):
        recs += [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return recs


def bucket_loss_figure(runs: dict[str, Path], path: Path) -> Path:
    """One panel per training run: the loss of each bucket shape over the steps (moving mean), labelled ``WxH``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.2), squeeze=False)
    for ax, (name, model_dir) in zip(axes[0], runs.items()):
        recs = read_trace(model_dir)
        labels = sorted({r["label"] for r in recs}, key=lambda s: int(s.split("x")[0]) / int(s.split("x")[1]))
        for label in labels:
            by_step: dict[int, list[float]] = {}
            for r in recs:  # every rank trains the same bucket at a step: average the ranks' losses
                if r["label"] == label:
                    by_step.setdefault(int(r["step"]), []).append(float(r["loss"]))
            steps = np.array(sorted(by_step), dtype=np.float64)
            loss = np.array([np.mean(by_step[s]) for s in sorted(by_step)], dtype=np.float64)
            k = max(1, min(15, loss.size // 4))
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], smooth, marker="." if smooth.size < 20 else None,
                    label=f"{label} ({loss.size} steps)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (moving mean)")
        ax.set_title(f"{name}: loss per bucket shape, portrait → landscape")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def sample_figure(rows: list[tuple[str, list[tuple[str, Image.Image]]]], title: str, path: Path) -> Path:
    """A labelled grid: one row per ``(row label, [(column label, image), ...])``, images upscaled 3× (nearest).

    Column ``c`` is as wide as its widest image; each image sits at the top left of its cell, at its own size, so
    the shapes compare at a glance.
    """
    from PIL import ImageDraw

    pad, label_w, head, line = 12, 300, 40, 18
    cols = max(len(cells) for _, cells in rows)
    col_w = [max(cells[c][1].width for _, cells in rows if c < len(cells)) * UPSCALE for c in range(cols)]
    row_h = [max(im.height for _, im in cells) * UPSCALE for _, cells in rows]
    width = label_w + sum(col_w) + pad * (cols + 1)
    height = head + sum(h + line + pad for h in row_h) + pad
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, 8), title, fill="black", font=_font(20))
    y = head
    for (label, cells), h in zip(rows, row_h):
        for i, text in enumerate(label.split("\n")):
            draw.text((pad, y + line + 4 + i * line), text, fill="black", font=_font(14))
        x = label_w + pad
        for (name, im), w in zip(cells, col_w):
            draw.text((x, y), name, fill="dimgray", font=_font(14))
            canvas.paste(im.resize((im.width * UPSCALE, im.height * UPSCALE), Image.Resampling.NEAREST),
                         (x, y + line))
            x += w + pad
        y += h + line + pad
    canvas.save(path)
    return path
