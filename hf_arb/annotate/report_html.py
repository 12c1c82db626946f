"""The HTML of :mod:`hf_arb.annotate.report`: one self-contained page (inline CSS and SVG, images as ``data:`` URIs, no
script, no link to anything), so it opens offline from disk and can sit next to a dataset card."""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from hf_arb.wording import count, percent

#: the flag (training script, then ``hf-arb annotate``) that changes what the leftover policy does
LEFTOVER_FLAGS = {
    "drop": "--bucket_leftover fill (repeat rows to complete the last batch) or catch_all (pool leftovers)",
    "fill": "--bucket_leftover drop (train each row once, drop incomplete batches)",
    "catch_all": "--bucket_leftover fill (repeat rows instead of pooling them)",
}
#: skip reason (the part before ":") → what to do about it
SKIP_FLAGS = {
    "upscale": "--max-upscale (annotate) keeps it when raised; the image is smaller than its bucket",
    "too_small": "--min-size (annotate) keeps it when lowered",
    "aspect": "--max-aspect-error / --aspect-range (annotate; --max_aspect_error in training) keep it when widened",
    "missing": "the size column is empty: fill it, or annotate from the images (--image-column)",
    "invalid_size": "the size column holds a bad value: fix the metadata",
    "unreadable": "the file is not an image: fix or remove it",
    "truncated": "the file is cut short (an interrupted download): fetch it again",
    "undecodable": "the image data is broken: re-encode or remove it",
    "too_few_frames": "the clip is shorter than the smallest frame bucket: add a shorter frame count (--frames) or "
                      "loop short clips (--short-clips loop)",
}
#: what finds every image that annotation kept from its header but that does not decode (a truncated JPEG)
VERIFY_HINT = ("hf-arb annotate DATASET --output-dir DIR --verify decodes every image and skips these (skip_reason "
               "'truncated' / 'undecodable'), so training never meets them; or fix or remove the files")


def decode_problems(rep: Any) -> str | None:
    """One line, for the console, on the kept images that could not be decoded for a thumbnail (a truncated JPEG
    whose header reads), with the ``--verify`` hint; ``None`` when every drawn image decoded. Only the thumbnails'
    images are decoded here, so there may be more: the hint finds them all."""
    bad = rep.failed_thumbnails
    if not bad:
        return None
    names = ", ".join(n for n, _ in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (f"problem: {len(bad)} kept {'image' if len(bad) == 1 else 'images'} could not be decoded ({names}): "
            f"{VERIFY_HINT}")


def _problems_html(rep: Any, e: Any) -> list[str]:
    """The page's Problems section: kept images that do not decode, named, with the ``--verify`` hint."""
    if not rep.failed_thumbnails:
        return []
    n = len(rep.failed_thumbnails)
    return ["<h2 id='problems'>Problems</h2>",
            f"<p class='error'><b>{n} kept {'image' if n == 1 else 'images'} could not be decoded</b> (the header "
            f"reads, so annotation kept {'it' if n == 1 else 'them'}; training would fail on or replace "
            f"{'it' if n == 1 else 'them'}). Only the thumbnails' images were decoded here: there may be more. "
            f"<code>{e(VERIFY_HINT)}</code>.</p>",
            "<table id='problems-table'><tr><th class='l'>file</th><th class='l'>error</th></tr>",
            *[f"<tr><td class='l'>{e(name)}</td><td class='l'>{e(why)}</td></tr>" for name, why in
              rep.failed_thumbnails],
            "</table>"]


def _svg_bars(values: list[float], labels: list[str], *, title: str, xlabel: str, width: int = 720,
              height: int = 220, color: str = "#4C72B0") -> str:
    """A bar chart as inline SVG (no script): one bar per value, each with a <title> tooltip."""
    n = max(1, len(values))
    top = max(values) if values and max(values) > 0 else 1.0
    pad_l, pad_b, pad_t = 50, 60, 24
    bw = (width - pad_l - 10) / n
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{width / 2}" y="14" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - 10}" y2="{height - pad_b}" stroke="#333"/>',
             f'<text x="4" y="{pad_t + 8}" font-size="10">{top:,.0f}</text>']
    for i, (v, lab) in enumerate(zip(values, labels)):
        bh = (height - pad_b - pad_t) * (v / top)
        x = pad_l + i * bw
        parts.append(f'<rect x="{x + 1:.1f}" y="{height - pad_b - bh:.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{bh:.1f}" fill="{color}"><title>{html.escape(lab)}: {v:,.0f}</title></rect>')
        if n <= 48:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{height - pad_b + 8}" font-size="8" text-anchor="end" '
                         f'transform="rotate(-60 {x + bw / 2:.1f} {height - pad_b + 8})">{html.escape(lab)}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 4}" text-anchor="middle" font-size="11">'
                 f'{html.escape(xlabel)}</text></svg>')
    return "".join(parts)


def _values_svg(hist: tuple[tuple[str, int], ...], title: str, xlabel: str) -> str:
    """A histogram of ``(label, rows)`` bars (frames, fps) as inline SVG."""
    return _svg_bars([float(c) for _, c in hist], [lab for lab, _ in hist], title=title, xlabel=xlabel, width=460,
                     color="#55A868")


def _hist_svg(hist: tuple[np.ndarray, np.ndarray] | None, title: str, xlabel: str, pct: bool) -> str:
    if hist is None:
        return "<p>no kept rows</p>"
    c, edges = hist
    labels = [(f"{100 * a:.1f}–{100 * b:.1f}%" if pct else f"{a:.3f}–{b:.3f}") for a, b in zip(edges[:-1], edges[1:])]
    return _svg_bars([float(x) for x in c], labels, title=title, xlabel=xlabel, width=460, color="#DD8452")


#: outlier kind → the flags that handle it
OUTLIER_FLAGS = {
    "largest upscale": "--max-upscale F or --min-size PX (annotate): skip images blown up this much",
    "most extreme aspect": "--aspect-range MIN MAX (annotate): skip aspects outside the range",
    "most cropped": "--max-aspect-error E (annotate) / --max_aspect_error (training): skip images cut this much; "
                    "or more buckets (hf-arb buckets --fit)",
}

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}
.thumbs{display:flex;flex-wrap:wrap;gap:8px}.thumbs figure{margin:0;font-size:11px;max-width:200px}
.thumbs img{display:block;border:1px solid #999}.note{color:#555;font-size:13px}h2{margin-top:1.4em}
.charts{display:flex;flex-wrap:wrap;gap:20px}.error{color:#b00020}"""


def render_html(rep: Any) -> str:
    """The page: self-contained (inline CSS, SVG and ``data:`` images; no script, no link to anything)."""
    e = html.escape
    p, bs = rep.plan, rep.buckets
    kept = int(rep.counts.sum())
    order = bs.portrait_to_landscape().tolist()
    labels = bs.labels()
    clip = bs.has_frames
    leftover_note = ("catch-all batches pool the leftovers of every bucket: see the totals above"
                     if rep.leftover == "catch_all" else "")
    out = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(rep.title)}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{e(rep.title)}</h1>",
           "<p class='note'>Written by <code>hf-arb report</code>: what aspect-ratio bucketing will do to this "
           "dataset before you train. Red box: the crop training uses (epoch 0, "
           f"{'--center_crop' if rep.center_crop else f'random crop, --seed {rep.seed}'}"
           "); shaded: what is cut off.</p>",
           "<h2>Plan</h2><table id='summary'>",
           f"<tr><th class='l'>rows</th><td data-field='rows'>{rep.rows:,}</td></tr>",
           f"<tr><th class='l'>kept (in a bucket)</th><td data-field='kept'>{kept:,}</td></tr>",
           f"<tr><th class='l'>skipped at annotation</th><td data-field='skipped'>{rep.rows - kept:,}</td></tr>",
           f"<tr><th class='l'>buckets</th><td data-field='buckets'>{len(bs)}</td></tr>",
           (f"<tr><th class='l'>--train_batch_size × processes</th><td>{rep.batch_size} × {rep.num_processes} = "
            f"<span data-field='global_batch'>{rep.batch_size * rep.num_processes}</span></td></tr>"
            if rep.max_pixels_per_batch is None else
            f"<tr><th class='l'>--max_pixels_per_batch (batch per bucket, at most --train_batch_size "
            f"{rep.batch_size}) × processes</th><td>{rep.max_pixels_per_batch:,} px × {rep.num_processes}</td></tr>"),
           *([] if p is None else [
               f"<tr><th class='l'>steps per epoch (batches per process, before --gradient_accumulation_steps)</th>"
               f"<td data-field='steps'>{p.steps:,}</td></tr>",
               f"<tr><th class='l'>rows trained per epoch</th><td data-field='rows_used'>{p.rows_used:,}</td></tr>",
               f"<tr><th class='l'>rows dropped per epoch</th><td data-field='rows_dropped'>{p.rows_dropped:,}"
               "</td></tr>",
               f"<tr><th class='l'>rows repeated per epoch</th><td data-field='rows_repeated'>{p.rows_repeated:,}"
               "</td></tr>",
               f"<tr><th class='l'>rows in catch-all batches</th><td data-field='rows_catch_all'>"
               f"{p.rows_catch_all:,}</td></tr>"]),
           f"<tr><th class='l'>leftover policy</th><td data-field='leftover'>{e(rep.leftover)}</td></tr>",
           f"<tr><th class='l'>mean crop (kept rows)</th><td data-field='mean_crop'>"
           f"{percent(rep.mean_crop, 2)}</td></tr></table>",
           f"<p class='note'>Leftover policy <b>{e(rep.leftover)}</b>: change it with "
           f"<code>{e(LEFTOVER_FLAGS[rep.leftover])}</code>. {e(leftover_note)}</p>",
           *([] if p is not None else [f"<p class='error' id='plan-error'><b>No training plan:</b> {e(rep.plan_error)}"
                                       "</p>"]),
           *_problems_html(rep, e),
           "<h2>Buckets</h2><table id='buckets'><tr><th>id</th><th>bucket</th>"
           + ("<th>frames</th>" if clip else "") + "<th>aspect</th><th>rows</th>"
           "<th>share</th><th>batch</th><th>steps / epoch</th><th>dropped</th><th>repeated</th></tr>"]
    def batch_of(b: int) -> str:
        if p is None:
            return "—"
        return str(p.batch_size_per_bucket.get(b, "—") if p.batch_size_per_bucket else p.batch_size)

    for b in order:
        w, h = bs[b][:2]
        share = rep.counts[b] / kept if kept else 0.0
        dropped = "—" if rep.dropped[b] < 0 else f"{int(rep.dropped[b]):,}"
        frames = f"<td data-field='frames'>{bs[b][2]}</td>" if clip else ""
        out.append(f"<tr data-bucket='{b}'><td>{b}</td><td class='l'>{labels[b]}</td>{frames}<td>{w / h:.3f}</td>"
                   f"<td data-field='rows'>{int(rep.counts[b]):,}</td><td>{100 * share:.1f}%</td>"
                   f"<td data-field='batch'>{batch_of(b)}</td>"
                   f"<td data-field='steps'>{int(rep.steps[b]):,}</td><td data-field='dropped'>{dropped}</td>"
                   f"<td data-field='repeated'>{int(rep.repeated[b]):,}</td></tr>")
    out.append("</table>")
    out.append("<div class='charts'>" + _svg_bars([float(rep.counts[b]) for b in order], [labels[b] for b in order],
                                                    title="rows per bucket ("
                                                    + ("by frames, then " if clip else "") + "portrait → landscape)",
                                                    xlabel="bucket (width x height" + (" x frames)" if clip else ")"))
               + "</div>")
    if rep.frames_hist:
        out.append("<div class='charts' id='clip-histograms'>"
                   + _values_svg(rep.frames_hist, "rows per clip length (images: 1 frame)", "frames")
                   + _values_svg(rep.fps_hist, "rows per frame rate (images: 0)", "frames per second") + "</div>")
    out.append("<div class='charts'>" + _hist_svg(rep.crop_hist, "crop fraction (share of area cut off)",
                                                  "crop fraction", True)
               + _hist_svg(rep.error_hist, f"aspect error ({bs.metric})", "aspect error", False) + "</div>")
    out.append("<h2>Samples</h2>")
    if rep.failed_thumbnails:
        out.append("<p>Thumbnails that could not be drawn (see Problems above): " + ", ".join(
            f"<code>{e(n)}</code>" for n, _ in rep.failed_thumbnails) + "</p>")
    for b in order:
        samples = rep.samples.get(b, [])
        if not samples:
            continue
        out.append(f"<h3>{labels[b]} — {count(int(rep.counts[b]), 'row')}</h3><div class='thumbs'>")
        for s in samples:
            if s.window is not None:  # a clip: the strip of the frames it trains on, its one crop on each
                start, stride, n = s.window
                out.append(f"<figure class='strip' style='max-width:none'><img src='{s.uri}' alt='{e(s.name)}' "
                           f"data-row='{s.row}' data-frames='{','.join(map(str, s.frames))}'><figcaption>"
                           f"{e(s.name)}: {s.size[0]}x{s.size[1]}, crop {percent(s.crop_fraction)}; trains frames "
                           f"{start}, {start + stride}, … {start + (n - 1) * stride} ({n} frames, stride {stride}); "
                           f"shown: {', '.join(map(str, s.frames))}</figcaption>"
                           "</figure>")
                continue
            out.append(f"<figure><img src='{s.uri}' alt='{e(s.name)}' data-row='{s.row}'><figcaption>"
                       f"{e(s.name)}<br>{s.size[0]}x{s.size[1]}, crop {percent(s.crop_fraction)}</figcaption>"
                       "</figure>")
        out.append("</div>")
    out.append("<h2>Outliers</h2>")
    for kind in OUTLIER_FLAGS:
        items = rep.outliers.get(kind)
        if not items:
            continue
        flag = OUTLIER_FLAGS[kind]
        out.append(f"<h3>{e(kind)}</h3><p class='note'>handled by <code>{e(flag)}</code></p><table>"
                   "<tr><th class='l'>file</th><th class='l'>size → bucket</th><th>value</th></tr>")
        out += [f"<tr><td class='l'>{e(n)}</td><td class='l'>{e(sz)}</td><td>{e(v)}</td></tr>" for n, sz, v in items]
        out.append("</table>")
    out.append("<h3>skipped files</h3>")
    if rep.skipped:
        out.append("<table id='skipped'><tr><th class='l'>reason</th><th>rows</th><th class='l'>what to do</th></tr>")
        for reason, c in sorted(rep.skipped.items()):
            out.append(f"<tr><td class='l'>{e(reason)}</td><td data-field='skipped'>{c:,}</td><td class='l'>"
                       f"{e(SKIP_FLAGS.get(reason, 'see the skip_reason column'))}</td></tr>")
        out.append("</table><table><tr><th class='l'>file</th><th class='l'>skip_reason</th></tr>")
        out += [f"<tr><td class='l'>{e(n)}</td><td class='l'>{e(str(r))}</td></tr>" for n, r in rep.skipped_examples]
        out.append("</table>")
    else:
        out.append("<p>none</p>")
    out.append(f"<p class='note'>Bucket set fingerprint {bs.fingerprint}; {rep.decoded} "
               f"{'images and clip frames' if clip else 'images'} decoded for thumbnails.</p></body></html>")
    return "\n".join(out)


__all__ = ["LEFTOVER_FLAGS", "OUTLIER_FLAGS", "SKIP_FLAGS", "VERIFY_HINT", "decode_problems", "render_html"]
