"""Push an annotated dataset to the Hub with a card that carries its bucket configuration.

Reading the configuration back (from the ``bucket`` feature, the card or the columns) is
:mod:`hf_arb.buckets.schema`'s job; its readers are re-exported here for compatibility.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from huggingface_hub import CommitOperationAdd, DatasetCard, HfApi
from huggingface_hub.errors import EntryNotFoundError

from hf_arb import __version__
from hf_arb.buckets.schema import (
    BUCKET_COLUMNS,
    CLIP_BUCKET_COLUMNS,
    buckets_from_dataset,
    buckets_from_features,
    read_ids_and_errors,
    with_stored_buckets,
)
from hf_arb.buckets.sets import BucketSet
from hf_arb.buckets.stored import CARD_KEY

from .summary import AnnotationSummary, summarize_annotation

#: Path of the bucket chart inside the Hub repository.
CHART_PATH_IN_REPO = "hf_arb/bucket_chart.png"
#: Path of the HTML report (``push_to_hub(..., report=True)``), next to the dataset card.
REPORT_PATH_IN_REPO = "report.html"
_BEGIN = "<!-- hf_arb:begin -->"
_END = "<!-- hf_arb:end -->"


# ----------------------------------------------------------------------------------- card
def _stats(ds: Any, buckets: BucketSet) -> AnnotationSummary | None:
    import datasets

    if isinstance(ds, datasets.Dataset) and all(c in ds.column_names for c in ("bucket", "aspect_error",
                                                                               "skip_reason")):
        return summarize_annotation(ds, buckets)
    return None  # streaming: counting would mean reading the whole dataset


def card_metadata(buckets: BucketSet, stats: dict[str, dict[str, Any]], chart: str | None) -> dict[str, Any]:
    """The ``hf_arb`` YAML block: bucket table, metric, thresholds, fingerprint, counts per split."""
    return {
        "version": __version__,
        "fingerprint": buckets.fingerprint,
        "buckets": buckets.to_dict(),
        "columns": list(BUCKET_COLUMNS) + (list(CLIP_BUCKET_COLUMNS) if buckets.has_frames else []),
        "chart": chart,
        "stats": stats,
    }


def card_section(repo_id: str, buckets: BucketSet, stats: dict[str, dict[str, Any]], chart: str | None) -> str:
    """The readable Markdown section: how to load, the bucket table with counts, the chart."""
    splits = [(cfg, split) for cfg, per in stats.items() for split in per]
    clip = buckets.has_frames
    columns = (*BUCKET_COLUMNS, *(CLIP_BUCKET_COLUMNS if clip else ()))
    header_cells = ["id", "width", "height", *(["frames"] if clip else []), "aspect"] + [
        f"rows ({split})" if cfg == "default" else f"rows ({cfg}/{split})" for cfg, split in splits]
    lines = [
        _BEGIN,
        "## Aspect-ratio buckets",
        "",
        f"Every row carries bucket columns written by `hf_arb` {__version__}: "
        + ", ".join(f"`{c}`" for c in columns) + ". `bucket = -1` marks a skipped row; `skip_reason` says why.",
        "",
        f"- buckets: {len(buckets)}, metric `{buckets.metric}`, max aspect error `{buckets.max_aspect_error}`, "
        f"aspect range `{buckets.aspect_range}`, fingerprint `{buckets.fingerprint}`",
    ]
    for cfg, split in splits:
        s = stats[cfg][split]
        skipped = ", ".join(f"{k} {v:,}" for k, v in s["skipped"].items()) or "none"
        e = s["aspect_error"]
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(f"- `{cfg}/{split}`: {s['rows']:,} rows, {s['kept']:,} kept; skipped: {skipped}; aspect error "
                     f"mean {fmt(e['mean'])}, median {fmt(e['median'])}, max {fmt(e['max'])}")
    lines += [
        "",
        "```python",
        "from datasets import load_dataset",
        "from hf_arb import BucketSet",
        "",
        f'ds = load_dataset("{repo_id}", split="train")',
        "buckets = BucketSet.from_dataset(ds)  # the exact bucket configuration below",
        "```",
        "",
        "| " + " | ".join(header_cells) + " |",
        "|" + "---|" * len(header_cells),
    ]
    labels = buckets.labels()
    for i in buckets.portrait_to_landscape().tolist():
        w, h = buckets[i][:2]
        sides = f"| {i} | {w} | {h} | " + (f"{buckets[i][2]} | " if clip else "") + f"{w / h:.3f} |"
        counts = " | ".join(f"{stats[c][s]['counts'].get(labels[i], 0):,}" for c, s in splits)
        lines.append(f"{sides} {counts} |" if splits else sides)
    if chart:
        lines += ["", f"![rows per bucket and aspect error]({chart})"]
    lines.append(_END)
    return "\n".join(lines)


def update_card_text(text: str | None, repo_id: str, buckets: BucketSet, stats: dict[str, dict[str, Any]],
                     chart: str | None) -> str:
    """Add (or replace) the ``hf_arb`` YAML key and the readable section in a README's text.

    Stats for other configs/splits already on the card are kept when their fingerprint matches.
    """
    card = DatasetCard(text if text else "---\n{}\n---\n")
    old = card.data.get(CARD_KEY)
    merged: dict[str, dict[str, Any]] = {}
    if isinstance(old, dict) and old.get("fingerprint") == buckets.fingerprint and isinstance(old.get("stats"), dict):
        merged = {c: dict(v) for c, v in old["stats"].items() if isinstance(v, dict)}
    for cfg, per in stats.items():
        merged.setdefault(cfg, {}).update(per)
    card.data[CARD_KEY] = card_metadata(buckets, merged, chart)
    body = card.text or ""
    section = card_section(repo_id, buckets, merged, chart)
    if _BEGIN in body and _END in body:
        pre, rest = body.split(_BEGIN, 1)
        post = rest.split(_END, 1)[1]
        body = pre + section + post
    else:
        body = body.rstrip("\n") + ("\n\n" if body.strip() else "\n") + section + "\n"
    card.text = body
    return str(card)


# ----------------------------------------------------------------------------------- push
def push_to_hub(ds: Any, repo_id: str, buckets: BucketSet | None = None, *, chart: bool = True,
                report: bool | dict[str, Any] = False, **kwargs: Any) -> Any:
    """Push an annotated dataset with ``datasets``' own ``push_to_hub``, then write the bucket card.

    The card gets YAML metadata under ``hf_arb`` (bucket table, metric, thresholds, fingerprint, counts per split),
    a readable section with the bucket table and counts, and the bucket chart image (``hf_arb/bucket_chart.png``,
    when matplotlib is installed).

    Args:
        ds: annotated ``Dataset``, ``DatasetDict``, ``IterableDataset`` or ``IterableDatasetDict``.
        repo_id: ``"user/name"``.
        buckets: the BucketSet; default: ``BucketSet.from_dataset(ds)``. When given, it must agree with the one
            stored in the dataset (if any), and it is written into the ``bucket`` feature before pushing.
        chart: draw and upload the chart (skipped with a warning when matplotlib is missing).
        report: also upload ``report.html`` next to the card (:func:`hf_arb.annotate.report.write_report` of the first
            split pushed); a dict gives its options (``batch_size``, ``num_processes``, ``leftover``, ``k``, ...).
            Needs a map-style dataset (a stream is not read twice).
        **kwargs: passed to ``ds.push_to_hub`` (``split``, ``config_name``, ``private``, ``token``, ``revision``,
            ``create_pr``, ``max_shard_size``, ``num_proc``, ...).

    Returns:
        The ``huggingface_hub.CommitInfo`` of the card commit.

    Example:
        ```py
        >>> import hf_arb
        >>> hf_arb.push_to_hub(annotated, "me/my-data", private=True)
        >>> # elsewhere
        >>> ds = load_dataset("me/my-data", split="train"); bs = hf_arb.BucketSet.from_dataset(ds)
        ```
    """
    import datasets

    stored_ds = ds
    if buckets is None:
        buckets = buckets_from_dataset(ds)
    else:
        feats = ds[next(iter(ds))].features if isinstance(ds, (datasets.DatasetDict,
                                                               datasets.IterableDatasetDict)) else ds.features
        stored = buckets_from_features(feats)
        if stored is not None and stored != buckets:
            raise ValueError(
                f"`buckets` (fingerprint {buckets.fingerprint}) differs from the BucketSet the dataset was "
                f"annotated with ({stored.fingerprint}). Re-annotate, or pass buckets=None."
            )
        if stored is None:
            stored_ds = with_stored_buckets(ds, buckets)
    config_name = kwargs.get("config_name", "default")
    parts = stored_ds.items() if isinstance(stored_ds, (datasets.DatasetDict, datasets.IterableDatasetDict)) else [
        (kwargs.get("split") or (str(stored_ds.split) if stored_ds.split is not None else "train"), stored_ds)]
    stats: dict[str, dict[str, Any]] = {config_name: {}}
    ids_all: list[np.ndarray] = []
    err_all: list[np.ndarray] = []
    for split, part in parts:
        s = _stats(part, buckets)
        if s is not None:
            stats[config_name][str(split)] = s.to_dict()
            ids, err = read_ids_and_errors(part)
            ids_all.append(ids)
            err_all.append(err)
    if not stats[config_name]:
        stats = {}

    if isinstance(stored_ds, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        from .map import decoding_images

        stored_ds = decoding_images(stored_ds)  # an annotated stream's images are undecoded; the Hub copy decodes
    commit = stored_ds.push_to_hub(repo_id, **kwargs)

    api = HfApi(token=kwargs.get("token"))
    pr_revision = getattr(commit, "pr_revision", None)
    target_revision = pr_revision or kwargs.get("revision")
    read_revision = getattr(commit, "oid", None) or target_revision
    try:
        readme = Path(api.hf_hub_download(repo_id, "README.md", repo_type="dataset",
                                          revision=read_revision)).read_text(encoding="utf-8")
    except (EntryNotFoundError, FileNotFoundError):  # a missing card is not fatal: we write a fresh one
        readme = None

    operations = []
    chart_path: str | None = None
    with tempfile.TemporaryDirectory() as tmp:
        if chart and ids_all:
            try:
                from .plot import plot_bucket_chart

                png = plot_bucket_chart(buckets, np.concatenate(ids_all), np.concatenate(err_all),
                                        Path(tmp) / "chart.png",
                                        title=f"{repo_id}: rows per bucket")
                operations.append(CommitOperationAdd(path_in_repo=CHART_PATH_IN_REPO, path_or_fileobj=png.read_bytes()))
                chart_path = CHART_PATH_IN_REPO
            except ImportError as e:
                warnings.warn(f"No bucket chart on the card: {e}", stacklevel=2)
        if report:
            parts_list = list(parts)
            if not parts_list or not isinstance(parts_list[0][1], datasets.Dataset):
                raise ValueError("push_to_hub(report=True) needs a map-style Dataset or DatasetDict: a streaming "
                                 "dataset is not read twice. Push with report=False and run hf-arb report on it.")
            from .report import write_report

            first = parts_list[0][1]
            options = {"title": f"{repo_id}: what bucketing does",
                       "image_column": "image" if "image" in first.column_names else None,
                       **(report if isinstance(report, dict) else {})}
            page = write_report(first, Path(tmp) / "report.html", buckets, **options)
            operations.append(CommitOperationAdd(path_in_repo=REPORT_PATH_IN_REPO, path_or_fileobj=page.read_bytes()))
        text = update_card_text(readme, repo_id, buckets, stats, chart_path)
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=text.encode("utf-8")))
        return api.create_commit(
            repo_id, operations=operations, repo_type="dataset", revision=target_revision,
            commit_message="Add the hf_arb bucket configuration to the dataset card",
        )


def hub_model_problem(repo_id: str, revision: str | None = None, timeout: float = 10.0) -> str | None:
    """Why ``repo_id`` (a Hub model id) cannot be loaded, in one sentence, or ``None`` when it can (or may).

    A model in the local Hugging Face cache is fine without asking the Hub. Otherwise one metadata request (``timeout``
    seconds) tells a mistyped id or an unreachable Hub apart before any download retries: the training script calls
    this before it reads the dataset, instead of failing minutes later after diffusers' retries. Gated models pass
    (``from_pretrained`` explains the login they need).
    """
    from huggingface_hub import is_offline_mode, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    for name in ("model_index.json", "config.json"):  # a pipeline, or a single model (a VAE)
        if isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str):
            return None
    if is_offline_mode():
        return ("not a local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE is set: download it first "
                f"(hf download {repo_id}) or pass a local folder.")
    try:
        model_info(repo_id, revision=revision, timeout=timeout)
    except GatedRepoError:
        return None
    except RevisionNotFoundError:
        return f"the Hub has no revision {revision!r} of this model; check --revision."
    except RepositoryNotFoundError:
        return ("no such model on the Hub (check the spelling; a private model needs `hf auth login`), and no such "
                "local folder.")
    except Exception as e:  # noqa: BLE001 - any transport failure means the same thing here: no Hub, no cached copy
        return (f"the Hub cannot be reached ({type(e).__name__}) and the model is not in the local cache: pass a local "
                "folder, or download it where the Hub is reachable (hf download) and set HF_HUB_OFFLINE=1.")
    return None


def hub_dataset_problem(name: str, timeout: float = 10.0) -> str | None:
    """Why ``name`` (where a local dataset folder or a Hub dataset id may stand) names neither, in one sentence, or
    ``None`` when it is a local path, a packaged ``datasets`` builder (``imagefolder``, ``parquet``, …) or a Hub
    dataset that is (or may be) there.

    A string that cannot be a Hub repo id (``./photos``, ``~/photos``, ``a/b/c``, ``photos/``), or that looks like a
    path whose parent folder exists (``data/photoz`` where ``data/`` does), fails at once. Otherwise a dataset in the
    local Hugging Face cache passes, and one metadata request (``timeout`` seconds, no retries) tells a mistyped name
    or an unreachable Hub apart, as :func:`hub_model_problem` does for models: ``load_dataset`` would retry for half a
    minute and end in a traceback.
    """
    import pkgutil

    from huggingface_hub import constants, is_offline_mode
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    path = Path(name).expanduser()
    if path.exists():
        return None
    import datasets.packaged_modules

    if name in {m.name for m in pkgutil.iter_modules(datasets.packaged_modules.__path__)}:
        return None  # load_dataset("imagefolder", data_dir=...), as diffusers' scripts allow
    try:
        validate_repo_id(name)
        hub_id = name.count("/") <= 1 and not name.startswith(("/", ".", "~")) and not name.endswith("/")
    except HFValidationError:
        hub_id = False
    if not hub_id or (path.parent != Path(".") and path.parent.is_dir()):
        return f"no such folder {path.absolute()}; not a Hub id either."
    if (Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}").is_dir():
        return None
    if is_offline_mode():
        return (f"no such folder {path.absolute()}, and no Hub dataset {name!r} in the local Hugging Face cache while "
                f"HF_HUB_OFFLINE is set: check the path, or download it first (hf download {name} --repo-type "
                "dataset).")
    try:
        HfApi().repo_info(name, repo_type="dataset", timeout=timeout)
    except GatedRepoError:
        return None  # load_dataset explains the login it needs
    except RepositoryNotFoundError:
        return (f"no such folder {path.absolute()}, and no such dataset on the Hub (check the spelling; a private "
                "dataset needs `hf auth login`).")
    except Exception as e:  # noqa: BLE001 - any transport failure means the same thing here: no Hub, no cached copy
        return (f"no such folder {path.absolute()}, and the Hub cannot be reached ({type(e).__name__}) to look for a "
                "dataset of that name: check the path, or pass a local folder.")
    return None
