"""Encode a run's data once: the plan (which (row, bucket, variant) entries and captions the run's sampler asks
for), one rank's share of the shards (resumable), the per-batch function that Ray Data maps too, the fingerprint and
card written when every shard is in, and the push to the Hub.

The plan is the training run's own: :func:`plan_encode` builds the map-style data source of the run's flags
(annotation, bucket table, sampler, schedule) and asks the latent cache's :func:`~hf_arb.train.cache.caches.
planned_pairs` / :func:`~hf_arb.train.cache.caches.planned_variants`, so the entries are exactly those
``--cache_latents`` would encode, fitted by the same :class:`~hf_arb.images.dataset.BucketedImageDataset` and
encoded by the same VAE call (float32, posterior mean and std, stored float16); prompts go through the family's
own :meth:`~hf_arb.families.Family.encode_text` in float32.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from .fingerprint import INFO_FILE, run_fingerprint
from .shards import rank_shards, shard_path, shard_problem, shard_slices, write_shard

logger = logging.getLogger(__name__)

#: the key of a shard's Parquet schema metadata: its slice, its bad entries and the VAE's weights id
SHARD_META = b"hf_arb_shard"
#: the card's YAML key for the fingerprint
CARD_KEY = "hf_arb_encoded"


@dataclass
class EncodePlan:
    """What an encode writes: ``entries`` ``(n, 3)`` (row, bucket, variant) sorted; ``captions``: every distinct
    caption (and ``""``) sorted; ``ds``: the annotated dataset; ``buckets``; ``variants``; ``fingerprint``."""

    entries: np.ndarray
    captions: list[str]
    ds: Any
    buckets: Any
    variants: int
    fingerprint: dict[str, Any]


def caption_strings(values: Sequence[Any]) -> list[str]:
    """Every distinct caption a row can train with (a list column: each of its strings; None: ``""``) and ``""``
    (prompt dropout), sorted."""
    found = {""}
    for v in values:
        if isinstance(v, str):
            found.add(v)
        elif v is not None:
            found.update(str(c) for c in v)
    return sorted(found)


def plan_encode(args: argparse.Namespace, num_processes: int = 1) -> EncodePlan:
    """The entries and captions of the run that ``args`` describes, trained on ``num_processes`` processes (the
    plan of --bucket_leftover fill/catch_all and the default variant count depend on it). Before any model loads."""
    from ..cache.caches import planned_pairs, planned_variants
    from ..sources import source_class
    from ..sources.bucketed import BucketedSource

    if source_class(args) is not BucketedSource:
        raise UsageError(f"hf-arb encode writes map-style bucketed runs; this command's flags select "
                         f"{source_class(args).__name__} (streaming, packing, several tiers or reference images): "
                         "drop those flags to encode.")
    if args.seed is None:  # a training run draws a random seed; the crops and flips it trains need a known one
        if not args.center_crop or args.random_flip:
            raise UsageError("hf-arb encode needs --seed with random crops or flips (the variants are drawn from it, "
                             "and training must pass the same --seed): add --seed 0, or --center_crop without "
                             "--random_flip.")
        args = argparse.Namespace(**{**vars(args), "seed": 0})
    source = BucketedSource(args, None)
    source.start(SimpleNamespace(num_processes=num_processes, process_index=0, is_main_process=True))
    schedule = source.schedule(num_processes)
    ids = np.asarray(source.ds.with_format("numpy")["bucket"])
    variants = planned_variants(args, schedule)
    pairs = np.array(sorted(planned_pairs(args, ids, source.sampler, schedule)), np.int64).reshape(-1, 2)
    entries = np.concatenate([np.column_stack([pairs, np.full(len(pairs), v)]) for v in range(variants)])
    entries = entries[np.lexsort((entries[:, 2], entries[:, 1], entries[:, 0]))]
    kept = np.flatnonzero(ids >= 0)
    captions = caption_strings(source.ds.select_columns([args.caption_column]).select(kept)[args.caption_column])
    fp = {**run_fingerprint(args, source.buckets, variants=variants), "num_source_rows": len(source.ds)}
    return EncodePlan(entries, captions, source.ds, source.buckets, variants, fp)


# ----------------------------------------------------------------------------------- the per-batch function
class EncodeBatch:
    """The per-batch function of an encode, the same for the local loop and Ray Data's ``map_batches``: a batch of
    ``{"row", "bucket", "variant"}`` arrays → the ``latents`` table's columns; a batch of ``{"caption"}`` → the
    ``prompts`` table's. Built from the run's flags (it loads the data and the models itself, once per worker).

    Entries whose posterior is not finite, or overflows float16, are left out and listed in ``bad``
    (``(row, bucket, variant, reason)``): never written."""

    #: what the progress bar says it does
    progress_desc = "Encoding latents"

    def __init__(self, args: argparse.Namespace, ds: Any = None, buckets: Any = None, device: Any = None) -> None:
        import torch

        from ..models import load_models, place
        from ..sources.dataset import dataset_with_buckets, image_dataset

        if ds is None:
            ds, buckets = dataset_with_buckets(args, None)
        self.args = args
        self.images = image_dataset(args, ds, buckets)
        self.device = torch.device(device or "cpu")
        self.models = load_models(args)
        self.vae = place(self.models.vae, self.device, torch.float32)
        for te in self.models.text_encoders:
            place(te, self.device, torch.float32)
        self.bad: list[tuple[int, int, int, str]] = []
        self._vae_id: str | None = None

    @property
    def vae_id(self) -> str:
        """The VAE's weights fingerprint (:func:`~hf_arb.train.cache.cache_keys.vae_fingerprint`, computed once)."""
        from ..cache.cache_keys import vae_fingerprint

        if self._vae_id is None:
            self._vae_id = vae_fingerprint(self.vae)
        return self._vae_id

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.prompts(batch["caption"]) if "caption" in batch else self.latents(batch)

    def latents(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Encode the entries of ``batch`` (any buckets: grouped by bucket into VAE calls of ``batch_size``)."""
        import torch

        from ..cache.caches import posterior_stats

        rows, buckets, variants = (np.asarray(batch[k], np.int64) for k in ("row", "bucket", "variant"))
        size = int(getattr(self.args, "train_batch_size", 16))
        out: dict[str, list[Any]] = {k: [] for k in ("row", "bucket", "variant", "source_row", "caption",
                                                      "latent_stats", "latent_shape", "original_size",
                                                      "crop_top_left", "target_size")}
        for b in np.unique(buckets):
            at = np.flatnonzero(buckets == b)
            for start in range(0, len(at), size):
                chunk = at[start:start + size]
                items = [self.images[(int(rows[i]), int(b), int(variants[i]))] for i in chunk]
                col = self.images.collate(items)
                pixels = col["pixel_values"].to(self.device, torch.float32)
                stats = posterior_stats(self.vae, pixels).float().cpu().numpy()  # what the latent cache stores
                for j, i in enumerate(chunk):
                    arr = stats[j]
                    with np.errstate(over="ignore"):
                        arr16 = arr.astype(np.float16)
                    if not np.isfinite(arr).all() or not np.isfinite(arr16).all():
                        reason = "non-finite latent" if not np.isfinite(arr).all() else "overflows float16"
                        self.bad.append((int(rows[i]), int(b), int(variants[i]), reason))
                        logger.warning("Row %d, bucket %d, variant %d: %s; not written.", rows[i], b, variants[i],
                                       reason)
                        continue
                    out["row"].append(int(rows[i]))
                    out["bucket"].append(int(b))
                    out["variant"].append(int(variants[i]))
                    out["source_row"].append(int(items[j].get("row", rows[i])))
                    out["caption"].append(str(items[j]["caption"]))
                    out["latent_stats"].append(arr16.tobytes())
                    out["latent_shape"].append(list(arr16.shape))
                    for key, name in (("original_size", "original_sizes"), ("crop_top_left", "crop_top_lefts"),
                                      ("target_size", "target_sizes")):
                        out[key].append([int(x) for x in np.asarray(col[name][j])])
        order = np.lexsort((np.array(out["variant"]), np.array(out["bucket"]), np.array(out["row"])))
        return {k: [v[i] for i in order] for k, v in out.items()}

    def prompts(self, captions: Sequence[str]) -> dict[str, Any]:
        """The family's prompt embeddings of ``captions``, float32 (hidden states, pooled where it has them)."""
        import torch

        captions = [str(c) for c in captions]
        size = int(getattr(self.args, "train_batch_size", 16))  # the batches the run's memo encodes at, at most
        hs, ps = [], []
        for start in range(0, len(captions), size):  # a text encoder's last bits can depend on the batch size
            with torch.no_grad():
                h, p = self.models.family.encode_text(self.models, self.models.text_encoders,
                                                      captions[start:start + size], self.device)
            hs.append(h.detach().float().cpu().numpy())
            ps.append(None if p is None else p.detach().float().cpu().numpy())
        h = np.concatenate(hs) if hs else np.zeros((0, 0, 0), np.float32)
        p = None if not ps or ps[0] is None else np.concatenate(ps)
        return {"caption": captions, "prompt_embeds": [x.tobytes() for x in h],
                "prompt_shape": [list(x.shape) for x in h],
                "pooled_prompt_embeds": [None if p is None else x.tobytes() for x in (p if p is not None else h)],
                "pooled_shape": [None if p is None else list(x.shape) for x in (p if p is not None else h)]}


def latents_schema() -> Any:
    import pyarrow as pa

    pair = pa.list_(pa.int32())
    return pa.schema([("row", pa.int64()), ("bucket", pa.int32()), ("variant", pa.int32()),
                      ("source_row", pa.int64()), ("caption", pa.string()), ("latent_stats", pa.binary()),
                      ("latent_shape", pair), ("original_size", pair), ("crop_top_left", pair),
                      ("target_size", pair)])


def prompts_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("caption", pa.string()), ("prompt_embeds", pa.binary()), ("prompt_shape", pa.list_(pa.int32())),
                      ("pooled_prompt_embeds", pa.binary()), ("pooled_shape", pa.list_(pa.int32()))])


# ----------------------------------------------------------------------------------- one rank's share
def encode_share(args: argparse.Namespace, out_dir: str | Path, *, rank: int = 0, world: int = 1,
                 num_processes: int = 1, shard_size: int = 1000, prompt_shard_size: int = 10000,
                 device: Any = None, show_progress: bool = True, plan: EncodePlan | None = None,
                 make_batch: Any = None) -> dict[str, Any]:
    """Write rank ``rank`` of ``world``'s shards (``i % world == rank``) of the encoded dataset of ``args`` into
    ``out_dir``; finished shards are kept, missing and damaged ones (truncated, another row count) are written again.
    ``num_processes``: the processes the run will *train* on (its plan). ``make_batch``: builds the per-batch
    function (``(args, ds, buckets, device)``; default :class:`EncodeBatch`; ``--from-cache`` reads a latent cache).
    Returns the counts."""
    from tqdm.auto import tqdm

    plan = plan or plan_encode(args, num_processes)
    out = Path(out_dir)
    lat = shard_slices(len(plan.entries), shard_size)
    cap = shard_slices(len(plan.captions), prompt_shard_size)
    todo = []
    kept = redone = 0
    for table, slices in (("latents", lat), ("prompts", cap)):
        for i in rank_shards(len(slices), rank, world):
            path = shard_path(out, table, i, len(slices))
            problem = shard_check(path, slices[i])
            if problem is None:
                kept += 1
                continue
            if problem != "missing":
                redone += 1
                logger.warning("Shard %s is damaged (%s): encoding it again.", path, problem)
            todo.append((table, i, len(slices), slices[i]))
    counts = {"shards_kept": kept, "shards_redone": redone, "shards_written": len(todo), "entries_written": 0,
              "bad": []}
    if rank == 0:
        write_rows(args, plan.ds, out)
    if not todo:
        return counts
    enc = (make_batch or EncodeBatch)(args, plan.ds, plan.buckets, device)
    total = sum(stop - start for t, _, _, (start, stop) in todo if t == "latents")
    bar = tqdm(total=total, desc=f"{enc.progress_desc} (rank {rank})", unit="entry", disable=not show_progress)
    for table, i, count, (start, stop) in todo:
        t0 = time.perf_counter()
        if table == "latents":
            part = plan.entries[start:stop]
            before = len(enc.bad)
            cols = enc.latents({"row": part[:, 0], "bucket": part[:, 1], "variant": part[:, 2]})
            bad = enc.bad[before:]
            schema = latents_schema()
            bar.update(stop - start)
        else:
            cols, bad, schema = enc.prompts(plan.captions[start:stop]), [], prompts_schema()
        meta = {"start": start, "stop": stop, "bad": bad, "vae_weights": enc.vae_id}
        import pyarrow as pa

        tab = pa.table(cols, schema=schema).replace_schema_metadata({SHARD_META: json.dumps(meta).encode()})
        write_shard(tab, shard_path(out, table, i, count))
        counts["entries_written"] += len(tab) if table == "latents" else 0
        counts["bad"] += bad
        logger.debug("%s shard %d: %d rows in %.2f s", table, i, len(tab), time.perf_counter() - t0)
    bar.close()
    return counts


def shard_check(path: Path, span: tuple[int, int], *, full: bool = False) -> str | None:
    """None when the shard at ``path`` holds its slice ``span`` (less its bad entries), else why not."""
    import pyarrow.parquet as pq

    meta = read_shard_meta(path)
    if meta is None:
        return shard_problem(path, -1) or "no hf_arb shard metadata"
    if (meta["start"], meta["stop"]) != tuple(span):
        return f"holds entries {meta['start']}..{meta['stop']}, expected {span[0]}..{span[1]}"
    problem = shard_problem(path, span[1] - span[0] - len(meta["bad"]), full=full)
    if problem is None and pq.ParquetFile(path).metadata.num_rows == 0 and span[1] > span[0] + len(meta["bad"]):
        return "empty"
    return problem


def read_shard_meta(path: Path) -> dict[str, Any] | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).schema_arrow.metadata or {}
        return json.loads(meta[SHARD_META]) if SHARD_META in meta else None
    except Exception:  # noqa: BLE001  (missing or truncated: shard_problem says which)
        return None


def write_rows(args: argparse.Namespace, ds: Any, out: Path) -> None:
    """The ``rows`` table: every source row's bucket columns and caption (no image), written once."""
    import os

    from hf_arb.buckets.schema import BUCKET_COLUMNS

    path = shard_path(out, "rows", 0, 1)
    if shard_problem(path, len(ds)) is None:
        return
    cols = [c for c in BUCKET_COLUMNS if c in ds.column_names] + [args.caption_column]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    ds.select_columns(cols).to_parquet(str(tmp))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------- finish, card, push
def finish(args: argparse.Namespace, out_dir: str | Path, plan: EncodePlan, *, shard_size: int = 1000,
           prompt_shard_size: int = 10000) -> dict[str, Any]:
    """After every rank's share: check every shard is in (else a :class:`UsageError` naming how many are missing
    and the command that finishes them), then write the fingerprint (``hf_arb_encoded.json``) and the card."""
    from .weights import run_vae_files_hash

    out = Path(out_dir)
    problems, bad, vae_ids = [], [], set()
    for table, slices in (("latents", shard_slices(len(plan.entries), shard_size)),
                          ("prompts", shard_slices(len(plan.captions), prompt_shard_size))):
        for i, span in enumerate(slices):
            path = shard_path(out, table, i, len(slices))
            problem = shard_check(path, span)
            if problem:
                problems.append(f"{path.name} ({problem})")
                continue
            meta = read_shard_meta(path) or {}
            bad += meta.get("bad", [])
            vae_ids.add(meta.get("vae_weights"))
    if problems:
        raise UsageError(f"The encoded dataset {out} is not complete: {len(problems)} shard(s) missing or damaged "
                         f"({', '.join(problems[:3])}{', ...' if len(problems) > 3 else ''}); run the same hf-arb "
                         "encode command again to write them (finished shards are kept).")
    if len(vae_ids) != 1:
        raise UsageError(f"The shards of {out} were encoded by {len(vae_ids)} different VAEs: delete {out} and encode "
                         "again.")
    info = {"fingerprint": plan.fingerprint, "vae_weights": vae_ids.pop(), "entries": len(plan.entries) - len(bad),
            "captions": len(plan.captions), "bad_entries": bad, "caption_column": args.caption_column,
            "model": args.pretrained_model_name_or_path, "vae_files": run_vae_files_hash(args)}
    (out / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
    (out / "README.md").write_text(card_text(info, out.name))
    if bad:
        logger.warning("%d entries were not written (a NaN or float16-overflowing latent): %s", len(bad),
                       ", ".join(f"row {r} bucket {b} variant {v} ({why})" for r, b, v, why in bad[:5]))
    return info


def card_text(info: dict[str, Any], name: str) -> str:
    """The dataset card: the three configs, the fingerprint in the YAML, and how to train from it."""
    import yaml

    fp = info["fingerprint"]
    meta = {"configs": [{"config_name": t, "data_files": f"data/{t}/*.parquet", **({"default": True}
                                                                                   if t == "latents" else {})}
                        for t in ("latents", "prompts", "rows")],
            "tags": ["hf-arb", "latents", "text-embeddings"], CARD_KEY: {**fp, "vae_weights": info["vae_weights"]}}
    fit = fp["fit"]
    return (f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n# {name}: encoded latents and prompt embeddings\n\n"
            f"Encoded by [hf_arb](https://github.com/) `hf-arb encode` from `{info['model']}` ({fp['family']}): "
            f"{info['entries']:,} (image, bucket, crop variant) entries (VAE posterior mean and std, float16) and "
            f"{info['captions']:,} prompt embeddings (float32).\n\n"
            f"- buckets: {len(fp['buckets'].get('resolutions', []))} at resolution {fp['buckets'].get('resolution')}\n"
            f"- fit: center_crop={fit['center_crop']}, random_flip={fit['random_flip']}, "
            f"interpolation={fit['interpolation']}; {fp['variants']} crop/flip variant(s) per image\n"
            f"- VAE weights: `{info['vae_weights']}`; format version {fp['format_version']}\n"
            f"- entries left out (NaN latents): {len(info['bad_entries'])}\n\n"
            "## Train from it\n\n```bash\naccelerate launch train_text_to_image_arb.py \\\n"
            f"  --pretrained_model_name_or_path {info['model']} --encoded_dataset REPO_OR_FOLDER \\\n"
            "  <the flags it was encoded with> --output_dir out\n```\n\n"
            "The run checks this fingerprint before any model loads and refuses other flags in one line.\n")


def push_encoded(folder: str | Path, repo_id: str, *, token: str | None = None, private: bool | None = None,
                 api: Any = None) -> Any:
    """Upload a finished encoded dataset folder (shards, ``hf_arb_encoded.json``, card) as a dataset repository;
    returns the commit."""
    from huggingface_hub import CommitOperationAdd, HfApi

    root = Path(folder)
    if not (root / INFO_FILE).exists():
        raise UsageError(f"{root} is not a finished encoded dataset (no {INFO_FILE}): run hf-arb encode to the end "
                         "first.")
    api = api or HfApi(token=token)
    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    ops = [CommitOperationAdd(path_in_repo=p.relative_to(root).as_posix(), path_or_fileobj=str(p)) for p in files]
    return api.create_commit(repo_id, operations=ops, commit_message="Upload an hf_arb encoded dataset",
                             repo_type="dataset")


# ----------------------------------------------------------------------------------- runners
def encode_dataset(args: argparse.Namespace, out_dir: str | Path, *, num_processes: int | None = None,
                   shard_size: int = 1000, prompt_shard_size: int = 10000, accelerator: Any = None,
                   show_progress: bool = True) -> dict[str, Any] | None:
    """Encode on every process of an accelerate launch (``accelerate launch -m hf_arb.cli encode ...``; one process
    without a launcher): each rank its share of the shards, then the main process writes the fingerprint and the
    card. ``num_processes``: the processes the run will train on (default: this launch's). Returns the info on the
    main process."""
    if accelerator is None:
        from ..environment import one_process

        if one_process():  # no launcher: no process-wide accelerate state left behind for a later run
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device(device),
                                          is_local_main_process=True, is_main_process=True,
                                          wait_for_everyone=lambda: None)
        else:
            from accelerate import Accelerator

            accelerator = Accelerator()
    plan = plan_encode(args, num_processes or accelerator.num_processes)
    counts = encode_share(args, out_dir, rank=accelerator.process_index, world=accelerator.num_processes,
                          num_processes=num_processes or accelerator.num_processes, shard_size=shard_size,
                          prompt_shard_size=prompt_shard_size, device=accelerator.device,
                          show_progress=show_progress and accelerator.is_local_main_process, plan=plan)
    accelerator.wait_for_everyone()
    info, error = None, None
    if accelerator.is_main_process:
        try:
            info = finish(args, out_dir, plan, shard_size=shard_size, prompt_shard_size=prompt_shard_size)
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks are released
            error = err
    # every rank returns once the fingerprint is written: a script that goes on to train from the dataset in the same
    # processes (a rank that left at the first barrier opened it before the main process had finished it)
    accelerator.wait_for_everyone()
    if error is not None:
        raise error
    if info is None:
        return None
    return {**info, **{k: v for k, v in counts.items() if k != "bad"}}


def encode_with_ray(args: argparse.Namespace, out_dir: str | Path, *, num_processes: int = 1,
                    shard_size: int = 1000, prompt_shard_size: int = 10000, concurrency: int = 1,
                    threads: int | None = None, **map_batches_kwargs: Any) -> dict[str, Any]:
    """Encode on Ray Data: every missing shard is one ``map_batches`` batch of :class:`EncodeBatch` (the same
    per-batch function as the local loop; one actor per ``concurrency``), written here as it comes back.

    ``threads``: torch's CPU threads in each actor (Ray starts workers with one). A CPU convolution's last bits
    depend on the thread count, so an encode is bit-identical to a local one (and to the run's own cache) only with
    the same count: pass ``torch.get_num_threads()`` of the training machine for that."""
    import pyarrow as pa
    import ray.data

    plan = plan_encode(args, num_processes)
    out = Path(out_dir)
    write_rows(args, plan.ds, out)
    for table, slices, schema in (("latents", shard_slices(len(plan.entries), shard_size), latents_schema()),
                                  ("prompts", shard_slices(len(plan.captions), prompt_shard_size), prompts_schema())):
        todo = [i for i, span in enumerate(slices) if shard_check(shard_path(out, table, i, len(slices)), span)]
        if not todo:
            continue
        if table == "latents":
            items = [{"shard": i, "row": int(r), "bucket": int(b), "variant": int(v)}
                     for i in todo for r, b, v in plan.entries[slices[i][0]:slices[i][1]]]
        else:
            items = [{"shard": i, "caption": c} for i in todo for c in plan.captions[slices[i][0]:slices[i][1]]]
        ds = ray.data.from_items(items).repartition(len(todo))
        result = ds.map_batches(_RayShard, fn_constructor_args=(args, threads), batch_size=None,
                                concurrency=concurrency,
                                batch_format="numpy", **map_batches_kwargs)
        parts: dict[int, list[Any]] = {}
        bad: dict[int, list[Any]] = {}
        vae: dict[int, str] = {}
        for batch in result.iter_batches(batch_size=None, batch_format="pyarrow"):  # a shard may span blocks
            for i in sorted(set(batch.column("shard").to_pylist())):
                part = batch.filter(pa.compute.equal(batch.column("shard"), i))
                for m in map(json.loads, set(part.column("_meta").to_pylist())):
                    bad.setdefault(i, []).extend(m["bad"])
                    vae[i] = m["vae_weights"]
                parts.setdefault(i, []).append(pa.table({n: part.column(n) for n in schema.names}).cast(schema))
                start, stop = slices[i]
                if sum(len(t) for t in parts[i]) + len(bad.get(i, [])) == stop - start:  # the whole shard is in
                    meta = {"start": start, "stop": stop, "bad": bad.get(i, []), "vae_weights": vae[i]}
                    tab = pa.concat_tables(parts.pop(i)).sort_by([(n, "ascending") for n in schema.names[:3]
                                                                  if table == "latents"] or [("caption", "ascending")])
                    write_shard(tab.replace_schema_metadata({SHARD_META: json.dumps(meta).encode()}),
                                shard_path(out, table, i, len(slices)))
    return finish(args, out, plan, shard_size=shard_size, prompt_shard_size=prompt_shard_size)


class _RayShard:
    """A Ray actor around :class:`EncodeBatch`: one call per shard; the shard's slice and bad entries travel in a
    ``_meta`` column."""

    def __init__(self, args: argparse.Namespace, threads: int | None = None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.enc = EncodeBatch(args)
        self.args = args

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        shards = np.asarray(batch["shard"])
        out: dict[str, list[Any]] = {}
        for i in np.unique(shards):
            at = shards == i
            before = len(self.enc.bad)
            cols = self.enc({k: np.asarray(v)[at] for k, v in batch.items() if k != "shard"})
            span = {"bad": [list(b) for b in self.enc.bad[before:]], "vae_weights": self.enc.vae_id}
            n = len(next(iter(cols.values())))
            for k, v in {**cols, "shard": [int(i)] * n, "_meta": [json.dumps(span)] * n}.items():
                out.setdefault(k, []).extend(v)
        return out


__all__ = ["EncodeBatch", "EncodePlan", "caption_strings", "encode_dataset", "encode_share", "encode_with_ray",
           "finish", "plan_encode", "push_encoded", "shard_check"]
