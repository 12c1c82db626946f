"""Captions: where a folder's captions come from (``.txt`` files beside the images) and how a caption varies from
epoch to epoch (kohya's tag shuffle, kept tokens, caption and tag dropout).

Every variation is a pure function of ``(seed, epoch, row)``, drawn from the row's own random streams
(:mod:`hf_arb.rng`, ``ROW_CAPTION_DROPOUT``, ``ROW_TAG_ORDER``, ``ROW_TAG_DROPOUT``): a resumed run, another worker
count or another rank trains the very same caption strings.

- :class:`CaptionOptions` — one dataset's settings, with kohya/sd-scripts' names and meanings (``shuffle_caption``,
  ``keep_tokens``, ``caption_separator``, ``caption_dropout_rate``, ``caption_tag_dropout_rate``);
- :func:`augment_caption` — the caption row ``row`` trains with in ``epoch``;
- :func:`caption_variants` — the ``K`` tag variants of a caption (what ``--caption_variants K`` cycles through);
- :class:`CaptionAugmenter` — a batch's captions, with one :class:`CaptionOptions` per dataset of the run;
- :func:`read_sidecar_captions`, :func:`add_sidecar_captions` (one dataset), :func:`with_sidecar_captions` (the
  flags) — ``--caption_extension .txt``: each image's caption file (one read per file) into the caption column.

**Variants.** With ``variants=K`` the tags of epoch ``e`` are those of variant ``e % K`` (each variant is drawn as
epoch ``e % K`` would be): a caption has at most ``K`` tag orders, so ``--cache_text_embeddings`` keeps at most ``K``
prompt embeddings per caption (diffusion-pipe's ``cache_shuffle_num``), and with ``K >= epochs`` the run is the
same as without variants. Whole-caption dropout is drawn per epoch either way (its empty prompt is one cache entry).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.rng import ROW_CAPTION_DROPOUT, ROW_TAG_DROPOUT, ROW_TAG_ORDER, row_rng

__all__ = ["CaptionAugmenter", "CaptionOptions", "SidecarCaptions", "add_sidecar_captions", "augment_caption",
           "caption_variants", "image_paths", "join_tags", "kohya_repeat_folders", "read_sidecar_captions",
           "sidecar_path", "split_tags", "tag_epoch", "with_sidecar_captions"]

logger = logging.getLogger("train_text_to_image_arb")

#: kohya joins the tags it shuffled with this, whatever the separator it split them at (sd-scripts' process_caption)
JOIN = ", "


@dataclass(frozen=True)
class CaptionOptions:
    """One dataset's caption augmentation (kohya/sd-scripts' subset options of the same names).

    Attributes:
        shuffle_caption: shuffle the caption's tags (the parts between ``caption_separator``) every epoch.
        keep_tokens: the first N tags stay in place, never shuffled or dropped (e.g. the trigger word).
        caption_separator: what separates tags (kohya's default ``","``); the augmented caption joins them
            with ``", "``, as kohya does.
        caption_dropout_rate: probability that the whole caption trains as ``""`` (per row and epoch).
        caption_tag_dropout_rate: probability that each tag after the kept ones is left out.
    """

    shuffle_caption: bool = False
    keep_tokens: int = 0
    caption_separator: str = ","
    caption_dropout_rate: float = 0.0
    caption_tag_dropout_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("caption_dropout_rate", "caption_tag_dropout_rate"):
            value = getattr(self, name)
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"CaptionOptions.{name} must be in [0, 1], got {value!r}.")
        if int(self.keep_tokens) != self.keep_tokens or self.keep_tokens < 0:
            raise ValueError(f"CaptionOptions.keep_tokens must be an integer >= 0, got {self.keep_tokens!r}.")
        if not isinstance(self.caption_separator, str) or not self.caption_separator:
            raise ValueError(f"CaptionOptions.caption_separator must be a non-empty string, got "
                             f"{self.caption_separator!r}.")

    @property
    def varies_tags(self) -> bool:
        """Whether the tags of a caption change between epochs (shuffle or tag dropout)."""
        return bool(self.shuffle_caption or self.caption_tag_dropout_rate > 0)

    @property
    def active(self) -> bool:
        """Whether any caption can change at all."""
        return self.varies_tags or self.caption_dropout_rate > 0

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> CaptionOptions:
        """From a kohya subset table (``dataset_config.toml``) or a dict: the keys of the attributes above; other
        keys are ignored here (their reader decides about them)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in options.items() if k in names})


def split_tags(caption: str, separator: str = ",") -> list[str]:
    """The caption's tags: split at ``separator``, each stripped, empty ones left out (``"a, b,"`` → ``[a, b]``)."""
    return [t for t in (part.strip() for part in caption.strip().split(separator)) if t]


def join_tags(tags: Sequence[str]) -> str:
    """Tags back into a caption, joined with ``", "`` (kohya's join)."""
    return JOIN.join(tags)


def tag_epoch(epoch: int, variants: int | None) -> int:
    """The epoch whose tag draws epoch ``epoch`` uses: itself, or ``epoch % variants`` with ``variants``."""
    return int(epoch) if variants is None else int(epoch) % int(variants)


def _vary_tags(caption: str, options: CaptionOptions, *, seed: int, epoch: int, row: int) -> str:
    tags = split_tags(caption, options.caption_separator)
    fixed, flex = tags[:options.keep_tokens], tags[options.keep_tokens:]
    if options.shuffle_caption and len(flex) > 1:
        order = row_rng(seed, epoch, row, ROW_TAG_ORDER).permutation(len(flex))
        flex = [flex[i] for i in order]
    if options.caption_tag_dropout_rate > 0 and flex:
        keep = row_rng(seed, epoch, row, ROW_TAG_DROPOUT).random(len(flex)) >= options.caption_tag_dropout_rate
        flex = [t for t, k in zip(flex, keep.tolist()) if k]
    return join_tags(fixed + flex)


def augment_caption(caption: str, options: CaptionOptions, *, seed: int, epoch: int, row: int,
                    variants: int | None = None) -> str:
    """The caption row ``row`` trains with in ``epoch``, as kohya's ``process_caption``: dropped to ``""`` with
    ``caption_dropout_rate``; else, where tags vary, split at ``caption_separator``, the first ``keep_tokens`` kept in
    place, the rest shuffled (``shuffle_caption``) and each left out with ``caption_tag_dropout_rate``, joined with
    ``", "``; else the caption as it is.

    Args:
        caption: the row's caption (already chosen where a row has several).
        options: the row's dataset's options.
        seed, epoch, row: the run's seed, the epoch and the dataset row (all >= 0).
        variants: ``K``: the tags of variant ``epoch % K`` (see the module docstring); None: of ``epoch``.
    """
    if options.caption_dropout_rate > 0 and (
            row_rng(seed, epoch, row, ROW_CAPTION_DROPOUT).random() < options.caption_dropout_rate):
        return ""
    if not options.varies_tags:
        return caption
    return _vary_tags(caption, options, seed=seed, epoch=tag_epoch(epoch, variants), row=row)


def caption_variants(caption: str, options: CaptionOptions, *, seed: int, row: int, variants: int) -> list[str]:
    """The ``variants`` tag variants of one caption (variant ``v`` is what epoch ``v`` draws): the strings a run with
    ``--caption_variants K`` trains, besides ``""`` where the caption is dropped."""
    if not options.varies_tags:
        return [caption] * int(variants)
    return [_vary_tags(caption, options, seed=seed, epoch=v, row=row) for v in range(int(variants))]


class CaptionAugmenter:
    """A batch's captions, each augmented with its row's dataset's :class:`CaptionOptions`.

    Args:
        options: one :class:`CaptionOptions` per dataset of the run (one for a single dataset).
        seed: the run's seed.
        variants: ``K`` tag variants per caption (``--caption_variants``), or None for new tags every epoch.
        dataset_of_row: ``(rows,)`` integer array, the dataset (index into ``options``) of every row; None: all rows
            are the first dataset's.
    """

    def __init__(self, options: Sequence[CaptionOptions] | CaptionOptions, seed: int, variants: int | None = None,
                 dataset_of_row: np.ndarray | None = None) -> None:
        self.options = (options,) if isinstance(options, CaptionOptions) else tuple(options)
        if not self.options:
            raise ValueError("CaptionAugmenter needs at least one CaptionOptions.")
        if variants is not None and int(variants) < 1:
            raise ValueError(f"variants must be >= 1 or None, got {variants!r}.")
        self.seed, self.variants = int(seed), None if variants is None else int(variants)
        self.dataset_of_row = None if dataset_of_row is None else np.asarray(dataset_of_row, dtype=np.int64)
        if self.dataset_of_row is not None and self.dataset_of_row.size and (
                self.dataset_of_row.min() < 0 or self.dataset_of_row.max() >= len(self.options)):
            raise ValueError(f"dataset_of_row holds indices outside the {len(self.options)} CaptionOptions.")

    @property
    def active(self) -> bool:
        """Whether any row's caption can change (else :meth:`__call__` returns the batch as it is)."""
        return any(o.active for o in self.options)

    def options_of(self, row: int) -> CaptionOptions:
        """The options of ``row``'s dataset."""
        return self.options[0] if self.dataset_of_row is None else self.options[int(self.dataset_of_row[row])]

    def captions(self, captions: Sequence[str], rows: Sequence[int], epoch: int) -> list[str]:
        """Each caption augmented for its row in ``epoch``."""
        return [augment_caption(c, self.options_of(int(r)), seed=self.seed, epoch=epoch, row=int(r),
                                variants=self.variants) for c, r in zip(captions, rows)]

    def __call__(self, batch: dict[str, Any], epoch: int) -> dict[str, Any]:
        """The batch with its ``captions`` augmented (``rows`` gives each caption's row); the batch itself when no
        option is on."""
        if not self.active:
            return batch
        rows = batch["rows"].tolist() if hasattr(batch["rows"], "tolist") else list(batch["rows"])
        return {**batch, "captions": self.captions(batch["captions"], rows, epoch)}


# ------------------------------------------------------------------------------------- caption files
@dataclass(frozen=True)
class SidecarCaptions:
    """What :func:`read_sidecar_captions` found: one caption per image (None where it has no caption file) and the
    images without one, or with an empty one."""

    captions: list[str | None]
    missing: list[str]  # image paths without a caption file
    empty: list[str]  # caption files whose first line is empty

    def summary(self, extension: str, fallback: str, shown: int = 10) -> str | None:
        """One line naming the images without a caption file and the empty caption files (the first ``shown`` of
        each), or None when every image has a caption."""
        parts = []
        for what, paths, trains in (("no caption file", self.missing, fallback),
                                    ("an empty caption file", self.empty, 'the empty caption ""')):
            if paths:
                names = ", ".join(Path(p).name for p in paths[:shown])
                more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
                parts.append(f"{len(paths)} of {len(self.captions)} images have {what} ({names}{more}) and train "
                             f"with {trains}")
        return f"--caption_extension {extension}: " + "; ".join(parts) + "." if parts else None


def sidecar_path(image_path: str, extension: str) -> str:
    """kohya's caption file of an image: its path without the image's extension, plus ``extension``
    (``a/b.png`` + ``.txt`` → ``a/b.txt``)."""
    return os.path.splitext(image_path)[0] + extension


def read_sidecar_captions(image_paths: Sequence[str | None], extension: str) -> SidecarCaptions:
    """Each image's caption file (:func:`sidecar_path`): its first line, stripped, as kohya reads it (later lines are
    not read). An image without a path (bytes only) or without the file gets None and is named in ``missing``.

    Raises:
        UnicodeDecodeError: a caption file that is not UTF-8 (the caller names it).
    """
    captions: list[str | None] = []
    missing: list[str] = []
    empty: list[str] = []
    for path in image_paths:
        if not path:
            captions.append(None)
            missing.append("<image without a path>")
            continue
        file = Path(sidecar_path(str(path), extension))
        try:
            with file.open("r", encoding="utf-8") as f:
                first = f.readline().strip()
        except FileNotFoundError:
            captions.append(None)
            missing.append(str(path))
            continue
        if not first:
            empty.append(str(file))
        captions.append(first)
    return SidecarCaptions(captions, missing, empty)


def image_paths(ds: Any, image_column: str) -> list[str | None]:
    """The file path of every row's image, read from the Arrow column without decoding an image (an ``Image``
    feature cast to ``decode=False``: ``{"bytes", "path"}``; a string column: the strings)."""
    import datasets
    import pyarrow as pa

    view = ds.select_columns([image_column])
    if isinstance(view.features[image_column], datasets.Image):
        view = view.cast_column(image_column, datasets.Image(decode=False))
    column = view.with_format("arrow")[:].column(image_column).combine_chunks()
    if pa.types.is_struct(column.type):
        column = column.field("path")
    return column.to_pylist()


def add_sidecar_captions(ds: Any, extension: str, *, image_column: str = "image", caption_column: str = "text",
                         fallback: str | None = None) -> tuple[Any, SidecarCaptions]:
    """``ds`` with ``caption_column`` read from each image's caption file (:func:`read_sidecar_captions`), one dataset
    at a time (a ``--dataset_config`` subset's ``caption_extension`` too).

    Args:
        ds: a ``datasets.Dataset`` whose ``image_column`` records file paths (a folder's imagefolder).
        extension: the caption files' extension, with its dot (``.txt``).
        image_column, caption_column: the columns to read paths from and to write captions to.
        fallback: the caption of an image without a file; None keeps its ``caption_column`` value (``""`` where the
            dataset has no such column).

    Returns:
        ``(dataset, what was found)``; the second names the images without a caption file.

    Raises:
        UnicodeDecodeError: a caption file that is not UTF-8.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    found = read_sidecar_captions(image_paths(ds, image_column), extension)
    sidecars = pa.array(found.captions, pa.string())
    if fallback is not None or caption_column not in ds.column_names:
        other: Any = pa.scalar("" if fallback is None else fallback, pa.string())
    else:
        other = ds.select_columns([caption_column]).with_format("arrow")[:].column(caption_column).combine_chunks()
        other = other.cast(pa.string())
    captions = pc.if_else(pc.is_null(sidecars), other, sidecars)
    if caption_column in ds.column_names:
        ds = ds.remove_columns(caption_column)
    return ds.add_column(caption_column, captions), found


def kohya_repeat_folders(folder: str | Path) -> list[str]:
    """The subfolders of ``folder`` named as kohya's DreamBooth folders, ``<repeats>_<class>`` (``10_sks dog``)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and re.match(r"^\d+_.", d.name))


def with_sidecar_captions(args: Any, ds: Any) -> Any:
    """``--caption_extension EXT``: the caption column (``--caption_column``) holds each image's caption file; an
    image without one keeps what it would have had without the flag (``--instance_prompt``, else its
    ``metadata.jsonl`` caption, else ``""``), and one warning counts and names those images. Without the flag,
    ``ds`` as it is.

    Raises:
        UsageError: a caption file that is not UTF-8 (named).
    """
    extension = getattr(args, "caption_extension", None)
    if not extension:
        return ds
    from hf_arb.checks import UsageError

    column = args.caption_column
    if args.instance_prompt is not None and not getattr(args, "caption_column_given", False):
        fallback, said = args.instance_prompt, f"--instance_prompt {args.instance_prompt!r}"
    elif column in ds.column_names:
        fallback, said = None, f"their metadata.jsonl caption (column {column!r})"
    else:
        fallback, said = None, 'the empty caption ""'
    try:
        ds, found = add_sidecar_captions(ds, extension, image_column=args.image_column, caption_column=column,
                                         fallback=fallback)
    except UnicodeDecodeError as e:
        raise UsageError(f"--caption_extension {extension}: a caption file is not UTF-8 text ({e.reason} at byte "
                         f"{e.start}); save the caption files as UTF-8.") from None
    line = found.summary(extension, said)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        if line:
            logger.warning("%s", line)
        folder = args.instance_data_dir if getattr(args, "instance_data_dir", None) else args.train_data_dir
        kohya = kohya_repeat_folders(folder) if folder else []
        if kohya:
            logger.warning("%s: subfolders named as kohya's <repeats>_<class> (%s): their repeats are not read "
                           "here, every image trains once per epoch (x --repeats %d); give each folder its "
                           "num_repeats in a --dataset_config file.", folder, ", ".join(kohya[:5]),
                           getattr(args, "repeats", 1))
        logger.info("--caption_extension %s: %d of %d captions read from caption files.", extension,
                    len(found.captions) - len(found.missing), len(found.captions))
    return ds
