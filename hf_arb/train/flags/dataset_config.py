"""``--dataset_config FILE``: several datasets in one run, read from TOML (``tomllib``) or YAML, in hf_arb's own
layout or in the subset of kohya sd-scripts' ``dataset_config.toml`` this package trains.

hf_arb's layout, one ``[[datasets]]`` table per dataset::

    [[datasets]]
    train_data_dir = "data/dogs"          # or dataset_name = "user/hub-id" / a save_to_disk folder
    caption_extension = ".txt"           # or caption_column = "text", or prompt = "a photo of sks dog"
    repeats = 4                          # or weight = 0.25 (every dataset the same kind)
    resolution = 512                     # or bucket_preset = "sdxl"
    loss_weight = 1.0

kohya's layout (``[general]``, ``[[datasets]]`` with ``[[datasets.subsets]]``): every subset is one dataset here,
with its own and its parents' options (subset over dataset over general, as kohya reads them).

The result is a list of :class:`DatasetSpec`, pure data: parsing never opens an image or a dataset. Mistakes raise
:class:`~hf_arb.checks.UsageError` naming the file, the table, the key and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError

#: the caption options handed to the caption functions (``captions`` helper: ``CaptionOptions``) unchanged
CAPTION_KEYS = ("shuffle_caption", "keep_tokens", "caption_dropout_rate", "caption_tag_dropout_rate",
                "caption_separator", "keep_tokens_separator", "secondary_separator", "caption_prefix",
                "caption_suffix", "enable_wildcard", "caption_dropout_every_n_epochs")

#: the keys of hf_arb's own layout (besides CAPTION_KEYS)
OWN_KEYS = ("name", "dataset_name", "dataset_config_name", "train_data_dir", "image_dir", "image_column",
            "caption_column", "caption_extension", "prompt", "class_tokens", "repeats", "num_repeats", "weight",
            "resolution", "bucket_preset", "loss_weight", "regularization", "is_reg", "batch_size", "flip_aug")

#: kohya keys that change nothing here when they hold this value (hf_arb always buckets; the crop is under a step)
HARMLESS = {"enable_bucket": True, "color_aug": False, "random_crop": False,
            "bucket_no_upscale": False, "cache_info": None, "face_crop_aug_range": None}

#: kohya keys refused, each with what to do instead
REFUSED = {
    "metadata_file": "kohya's fine-tuning metadata JSON is not read: write the captions to a metadata.jsonl (or "
                     ".txt files) in the image folder and name it with image_dir",
    "alpha_mask": "masked loss is a run flag here: drop alpha_mask and pass --masked_loss",
    "conditioning_data_dir": "ControlNet datasets are not trained by this script: drop the subset",
    "enable_bucket": "hf_arb always buckets by aspect ratio: drop enable_bucket = false",
    "color_aug": "color augmentation is not implemented: drop color_aug",
    "random_crop": "the bucket crop is already random (under one bucket step): drop random_crop",
    "bucket_no_upscale": "skip upscaled images when annotating: hf-arb annotate DIR --max-upscale 1 --output-dir OUT, "
                         "then name OUT with dataset_name",
    "face_crop_aug_range": "face crops are not implemented: drop face_crop_aug_range",
    "min_bucket_reso": "pass --bucket_preset kohya --bucket_min_side N on the command line instead",
    "max_bucket_reso": "pass --bucket_preset kohya --bucket_max_side N on the command line instead",
    "bucket_reso_steps": "pass --bucket_step N on the command line instead",
    "resize_interpolation": "pass --image_interpolation_mode on the command line instead",
    "token_warmup_min": "token warm-up is not implemented: drop it",
    "token_warmup_step": "token warm-up is not implemented: drop it",
    "validation_seed": "validation is a run flag here (--validation_prompt): drop it",
    "validation_split": "validation is a run flag here (--validation_prompt): drop it",
}

#: kohya's own keys: where each may be written ("g" [general], "d" [[datasets]], "s" [[datasets.subsets]])
KOHYA_DATASET_KEYS = ("resolution", "batch_size", "enable_bucket", "bucket_no_upscale", "bucket_reso_steps",
                      "min_bucket_reso", "max_bucket_reso", "validation_seed", "validation_split")
KOHYA_SUBSET_KEYS = ("image_dir", "num_repeats", "caption_extension", "is_reg", "class_tokens", "cache_info",
                     "color_aug", "flip_aug", "random_crop", "face_crop_aug_range", "metadata_file", "alpha_mask",
                     "conditioning_data_dir", "resize_interpolation", "token_warmup_min", "token_warmup_step",
                     *CAPTION_KEYS)

#: what a regularization dataset cannot carry: its images are paired with the instance batches, not planned
REG_RULE = ("a regularization dataset's images are paired with the instance batches by bucket (prior preservation, "
            "weighted by --prior_loss_weight), not planned as rows of the epoch")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of a ``--dataset_config`` file, as parsed (nothing loaded).

    Attributes:
        name: the label of the report and the model card.
        dataset_name / dataset_config_name / train_data_dir: where the rows come from, as the flags of that name
            (a Hub id or a ``save_to_disk`` / data-files folder; an image folder).
        image_column, caption_column: the columns (None: the run's ``--image_column`` / ``--caption_column``).
        caption_extension: read each image's caption from the file beside it with this extension (``.txt``).
        prompt: every row's caption (a dreambooth instance prompt); with ``caption_extension``: the caption of
            images without a caption file (kohya's ``class_tokens``).
        repeats: every row this many times per epoch; weight: this share of the epoch (one kind per file).
        resolution, bucket_preset: this dataset's bucket table (None: the run's flags).
        loss_weight: the factor on this dataset's rows' loss.
        regularization: class images for prior preservation (kohya's ``is_reg``): paired with the instance
            batches by bucket, as ``--with_prior_preservation`` pairs ``--class_data_dir``'s images.
        batch_size: kohya's per-dataset batch size (one per run here).
        random_flip: kohya's ``flip_aug`` (one per run here: ``--random_flip``).
        caption_options: ``{key: value}`` of :data:`CAPTION_KEYS` given for this dataset, for the caption functions.
        where: the file and table, for messages.
    """

    name: str
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    train_data_dir: str | None = None
    image_column: str | None = None
    caption_column: str | None = None
    caption_extension: str | None = None
    prompt: str | None = None
    repeats: int | None = None
    weight: float | None = None
    resolution: int | None = None
    bucket_preset: str | None = None
    loss_weight: float = 1.0
    regularization: bool = False
    batch_size: int | None = None
    random_flip: bool | None = None
    caption_options: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's mapping: TOML (``.toml``) with ``tomllib``, YAML (``.yaml``/``.yml``) with PyYAML, JSON (kohya
    accepts it too)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--dataset_config {path}: no such file; write a TOML or YAML file with [[datasets]] tables "
                         "(docs/training.md, 'Several datasets').")
    text = p.read_text(encoding="utf-8")
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".json":
            import json

            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - any syntax error becomes one line naming the file
        raise UsageError(f"--dataset_config {path}: cannot parse it as {suffix.lstrip('.') or 'toml'}: "
                         f"{str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("datasets"), list) or not data["datasets"]:
        raise UsageError(f"--dataset_config {path}: expected a list of datasets ([[datasets]] tables in TOML, a "
                         "'datasets:' list in YAML).")
    return data


def parse_dataset_config(path: str | Path) -> list[DatasetSpec]:
    """The datasets of ``path``, kohya's layout (any ``subsets``) or hf_arb's; checks every key and value."""
    data = read_config_file(path)
    kohya = "general" in data or any(isinstance(d, dict) and "subsets" in d for d in data["datasets"])
    specs = kohya_specs(data, str(path)) if kohya else own_specs(data, str(path))
    check_specs(specs, str(path))
    return specs


def _refuse_key(key: str, value: Any, where: str) -> None:
    """Refuse ``key`` unless :data:`HARMLESS` at ``value``: one line naming it and what to do."""
    if key in HARMLESS and (HARMLESS[key] is None or value == HARMLESS[key]):
        return
    fix = REFUSED.get(key, "not a key hf_arb reads: remove it (keys: " + ", ".join(OWN_KEYS + CAPTION_KEYS) + ")")
    raise UsageError(f"{where}: {key} = {value!r}: {fix}.")


def own_specs(data: dict[str, Any], path: str) -> list[DatasetSpec]:
    """hf_arb's layout: one ``[[datasets]]`` table per dataset."""
    extra = sorted(set(data) - {"datasets"})
    if extra:
        raise UsageError(f"--dataset_config {path}: unknown top-level key {extra[0]!r}: only [[datasets]] tables "
                         "(or kohya's [general] with [[datasets.subsets]]).")
    specs = []
    for i, entry in enumerate(data["datasets"]):
        where = f"--dataset_config {path} [[datasets]] {i + 1}"
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: expected a table of keys, got {entry!r}.")
        for key, value in entry.items():
            if key not in OWN_KEYS and key not in CAPTION_KEYS:
                _refuse_key(key, value, where)
        specs.append(make_spec(entry, where, default_name=f"dataset{i + 1}"))
    return specs


def kohya_specs(data: dict[str, Any], path: str) -> list[DatasetSpec]:
    """kohya's layout: each ``[[datasets.subsets]]`` is one dataset, its options over its dataset's over
    ``[general]``'s."""
    extra = sorted(set(data) - {"general", "datasets"})
    if extra:
        raise UsageError(f"--dataset_config {path}: unknown top-level key {extra[0]!r} in a kohya dataset_config: "
                         "only [general] and [[datasets]].")
    general = data.get("general") or {}
    known = set(KOHYA_DATASET_KEYS) | set(KOHYA_SUBSET_KEYS)
    for key, value in general.items():
        if key not in known or key in ("image_dir", "is_reg", "class_tokens", "metadata_file"):
            _refuse_key(key, value, f"--dataset_config {path} [general]")
    specs = []
    for i, ds in enumerate(data["datasets"]):
        dwhere = f"--dataset_config {path} [[datasets]] {i + 1}"
        if not isinstance(ds, dict) or not ds.get("subsets"):
            raise UsageError(f"{dwhere}: a kohya dataset needs [[datasets.subsets]] tables with image_dir.")
        for key, value in ds.items():
            if key != "subsets" and (key not in known or key in ("image_dir", "is_reg", "class_tokens")):
                _refuse_key(key, value, dwhere)
        for j, sub in enumerate(ds["subsets"]):
            where = f"{dwhere} [[datasets.subsets]] {j + 1}"
            for key, value in sub.items():
                if key not in KOHYA_SUBSET_KEYS:
                    _refuse_key(key, value, where)
            merged = {**general, **{k: v for k, v in ds.items() if k != "subsets"}, **sub}
            for key, value in merged.items():  # harmless values pass; the others name their fix
                if key in REFUSED:
                    _refuse_key(key, value, where)
            if "image_dir" not in merged:
                raise UsageError(f"{where}: image_dir is required (the folder of this subset's images).")
            entry: dict[str, Any] = {k: merged[k] for k in ("resolution", "batch_size", "caption_extension",
                                                            "is_reg", "flip_aug") if k in merged}
            entry["train_data_dir"] = merged["image_dir"]
            entry["repeats"] = merged.get("num_repeats", 1)
            if "class_tokens" in merged:
                entry["prompt"] = merged["class_tokens"]
            entry.update({k: merged[k] for k in CAPTION_KEYS if k in merged})
            if "caption_extension" not in entry and "class_tokens" not in merged:
                entry["caption_extension"] = ".caption"  # kohya's default caption file
            folder = str(merged["image_dir"]).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
            name = folder if all(s.name != folder for s in specs) else f"{folder}@{i + 1}.{j + 1}"
            specs.append(make_spec(entry, where, default_name=name))
    return specs


def _number(entry: dict[str, Any], key: str, where: str, kind: type, low: float, inclusive: bool = True) -> Any:
    value = entry.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or (value < low if inclusive else value <= low):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        raise UsageError(f"{where}: {key} = {value!r}: expected {'an integer' if kind is int else 'a number'} "
                         f"{bound}.")
    return kind(value)


def _resolution(value: Any, where: str) -> int | None:
    """kohya's ``resolution``: ``512`` or ``[512, 512]``; a non-square ``[w, h]`` is its area's side."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        side = math.isqrt(value[0] * value[1])
        if side * side != value[0] * value[1]:
            raise UsageError(f"{where}: resolution = {list(value)}: the bucket budget is one side here (about "
                             f"side² pixels); write resolution = {side} (or a square [w, w]).")
        value = side
    if not isinstance(value, int) or isinstance(value, bool) or value < 8:
        raise UsageError(f"{where}: resolution = {value!r}: expected a side in pixels (e.g. 512) or [w, h].")
    return value


def make_spec(entry: dict[str, Any], where: str, default_name: str) -> DatasetSpec:
    """One :class:`DatasetSpec` from a table of hf_arb keys (kohya's already translated), values checked."""
    sources = [k for k in ("dataset_name", "train_data_dir", "image_dir") if entry.get(k)]
    if len(sources) != 1:
        raise UsageError(f"{where}: name the data with exactly one of dataset_name (a Hub id or a saved dataset "
                         f"folder) or train_data_dir (an image folder); got {sources or 'none'}.")
    regularization = bool(entry.get("regularization") or entry.get("is_reg"))
    if regularization:
        for key in ("weight", "loss_weight"):
            if key in entry:
                raise UsageError(f"{where}: {key} = {entry[key]!r} on a regularization dataset: {REG_RULE}; drop "
                                 f"{key} (the class loss's weight is --prior_loss_weight).")
        given = entry.get("repeats", entry.get("num_repeats"))
        if given not in (None, 1):
            raise UsageError(f"{where}: repeats = {given!r} on a regularization dataset: {REG_RULE}, so repeats "
                             "change nothing; drop it (or set 1).")
    repeats = _number({**entry, "repeats": entry.get("repeats", entry.get("num_repeats"))}, "repeats", where, int, 1)
    weight = _number(entry, "weight", where, float, 0.0, inclusive=False)
    if repeats is not None and weight is not None:
        raise UsageError(f"{where}: repeats and weight both given: repeats trains every row N times per epoch, weight "
                         "gives the dataset a share of the epoch; keep one.")
    captions = [k for k in ("caption_column", "caption_extension") if entry.get(k)]
    if len(captions) > 1:
        raise UsageError(f"{where}: caption_column and caption_extension both given: captions come from a column or "
                         "from the files beside the images; keep one (prompt is the caption of images without one).")
    ext = entry.get("caption_extension")
    if ext is not None and (not isinstance(ext, str) or not ext.startswith(".")):
        raise UsageError(f"{where}: caption_extension = {ext!r}: expected an extension with its dot, e.g. '.txt'.")
    for key in ("prompt", "class_tokens", "caption_column", "image_column", "bucket_preset", "name"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise UsageError(f"{where}: {key} = {entry[key]!r}: expected a string.")
    if entry.get("bucket_preset") is not None:
        from hf_arb.buckets.presets import PRESET_INFO

        if entry["bucket_preset"] not in PRESET_INFO:
            raise UsageError(f"{where}: bucket_preset = {entry['bucket_preset']!r} is not one of: "
                             f"{', '.join(PRESET_INFO)}.")
    source = entry.get("train_data_dir") or entry.get("image_dir")
    from hf_arb.train.captions import CaptionOptions

    for key in CAPTION_KEYS:  # kohya's caption keys this run cannot apply: refused, never dropped silently
        if key in entry and key not in CaptionOptions.__dataclass_fields__:
            raise UsageError(f"{where}: {key} = {entry[key]!r}: kohya's {key} is not implemented here; the caption "
                             f"keys applied per dataset are {', '.join(CaptionOptions.__dataclass_fields__)}. "
                             f"Drop {key} (or write the captions out in full).")
    return DatasetSpec(
        name=str(entry.get("name") or default_name), dataset_name=entry.get("dataset_name"),
        dataset_config_name=entry.get("dataset_config_name"), train_data_dir=None if source is None else str(source),
        image_column=entry.get("image_column"), caption_column=entry.get("caption_column"), caption_extension=ext,
        prompt=entry.get("prompt", entry.get("class_tokens")), repeats=repeats, weight=weight,
        resolution=_resolution(entry.get("resolution"), where), bucket_preset=entry.get("bucket_preset"),
        loss_weight=_number(entry, "loss_weight", where, float, 0.0) if "loss_weight" in entry else 1.0,
        batch_size=_number(entry, "batch_size", where, int, 1),
        random_flip=None if entry.get("flip_aug") is None else bool(entry["flip_aug"]),
        caption_options={k: entry[k] for k in CAPTION_KEYS if k in entry}, regularization=regularization,
        where=where)


def check_specs(specs: list[DatasetSpec], path: str) -> None:
    """What must hold across the datasets: one kind of share (repeats or weight), one batch size, unique names; with
    regularization datasets, at least one instance dataset and nothing per dataset the pairing cannot carry yet."""
    instances, regs = [s for s in specs if not s.regularization], [s for s in specs if s.regularization]
    if not instances:
        raise UsageError(f"--dataset_config {path}: every dataset is a regularization dataset (is_reg); add the images "
                         "to train on (a dataset without is_reg / regularization).")
    if regs:
        for s in instances:
            if s.loss_weight != 1.0:
                raise UsageError(f"{s.where}: loss_weight = {s.loss_weight:g} with a regularization dataset in the "
                                 "file: a paired batch weighs its instance and class halves by --prior_loss_weight "
                                 "only (yet); drop loss_weight, or the regularization dataset.")
    kinds = {s.weight is not None for s in instances}
    if len(kinds) > 1:
        raise UsageError(f"--dataset_config {path}: some datasets give weight and others repeats (or neither): give "
                         "every dataset a weight (shares of the epoch) or none (repeats, default 1).")
    sizes = sorted({s.batch_size for s in specs if s.batch_size is not None})
    if len(sizes) > 1:
        raise UsageError(f"--dataset_config {path}: batch_size {sizes}: one global plan trains one batch size per "
                         f"step here; give every dataset the same batch_size, or drop it and pass --train_batch_size.")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"--dataset_config {path}: two datasets are named {dup[0]!r}: give each a name = '...'.")


__all__ = ["CAPTION_KEYS", "DatasetSpec", "parse_dataset_config", "read_config_file"]


#: run flags that name one dataset, or a mode one global plan over several datasets does not have yet
CONFLICTS = (("dataset_name", "the datasets are the file's"), ("train_data_dir", "the datasets are the file's"),
             ("instance_data_dir", "the datasets are the file's"),
             ("instance_prompt", "give the dataset prompt = '...' in the file"),
             ("streaming", "several datasets are map-style here"),
             ("packing", "several datasets are planned in buckets"),
             ("reference_image_column", "edit pairs are one dataset"))


def check_dataset_config(args: Any, default_batch_size: int | None = None) -> None:
    """``--dataset_config``: parse the file into ``args.dataset_specs`` and refuse what it cannot train with, each
    in one line naming the fix; kohya's ``batch_size`` / ``flip_aug`` set the run's, as kohya's config wins over its
    command line (said in the log)."""
    import logging

    path = getattr(args, "dataset_config", None)
    if not path:
        return
    for flag, why in CONFLICTS:
        if getattr(args, flag, None):
            raise UsageError(f"--dataset_config {path} with --{flag}: {why}; drop --{flag}.")
    if getattr(args, "repeats", 1) != 1:
        raise UsageError(f"--dataset_config {path} with --repeats {args.repeats}: give each dataset repeats = N in the "
                         "file; drop --repeats.")
    if len(getattr(args, "resolutions", None) or []) > 1:
        raise UsageError(f"--dataset_config {path} with several --resolution tiers: give each dataset its resolution "
                         "in the file, and one --resolution.")
    specs = parse_dataset_config(path)
    log = logging.getLogger("train_text_to_image_arb")
    sizes = {s.batch_size for s in specs if s.batch_size is not None}
    if sizes and (size := sizes.pop()) != args.train_batch_size:
        if default_batch_size is not None and args.train_batch_size != default_batch_size:
            raise UsageError(f"--dataset_config {path}: batch_size = {size} and --train_batch_size "
                             f"{args.train_batch_size} disagree: drop one of them.")
        log.info("--dataset_config: batch_size = %d sets --train_batch_size (kohya's config wins).", size)
        args.train_batch_size = size
    flips = {s.random_flip for s in specs if s.random_flip is not None}
    if len(flips) > 1:
        raise UsageError(f"--dataset_config {path}: flip_aug differs between datasets; flips are one run flag here "
                         "(--random_flip): give every dataset the same flip_aug, or drop it.")
    if flips == {True} and not args.random_flip:
        log.info("--dataset_config: flip_aug = true sets --random_flip.")
        args.random_flip = True
    elif flips == {False} and args.random_flip:
        raise UsageError(f"--dataset_config {path}: flip_aug = false but --random_flip: drop one of them.")
    if any(s.regularization for s in specs):  # prior preservation from the file's class images
        if getattr(args, "with_prior_preservation", False) or getattr(args, "class_data_dir", None):
            raise UsageError(f"--dataset_config {path} holds a regularization dataset and --with_prior_preservation / "
                             "--class_data_dir name class images too: keep one of them.")
        from .prior_flags import NOT_WITH_PRIOR

        for flag, why in NOT_WITH_PRIOR.items():
            if getattr(args, flag, None):
                raise UsageError(f"--dataset_config {path} with a regularization dataset and --{flag}: {why}; drop "
                                 f"--{flag}.")
    args.dataset_specs = specs


__all__ += ["check_dataset_config"]


def check_spec_sources(specs: list[DatasetSpec]) -> None:
    """Every dataset's folder exists, every Hub id answers (as ``--train_data_dir`` / ``--dataset_name`` are checked),
    before anything loads."""
    from pathlib import Path

    from hf_arb.checks import UsageFileError

    for spec in specs:
        if spec.train_data_dir is not None and not Path(spec.train_data_dir).is_dir():
            raise UsageFileError(f"{spec.where}: {spec.train_data_dir}: no such folder.")
        if spec.dataset_name is not None:
            from hf_arb.annotate.hub import hub_dataset_problem

            if problem := hub_dataset_problem(spec.dataset_name):
                raise UsageFileError(f"{spec.where}: dataset_name {spec.dataset_name}: {problem}")


__all__ += ["check_spec_sources"]
