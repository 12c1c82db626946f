"""Reading an encoded dataset (a folder or a Hub dataset id): its fingerprint, its three tables as memory-mapped
``datasets`` datasets, the latents keyed like the per-file cache's dataset, and the prompt embeddings by caption."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.images.collate import choose_caption

from .fingerprint import FORMAT_VERSION, INFO_FILE
from .shards import TABLES, entry_keys, find_entries

logger = logging.getLogger(__name__)


@dataclass
class EncodedData:
    """An opened encoded dataset: ``info`` (``hf_arb_encoded.json``: the fingerprint, counts, bad entries) and the
    ``latents``, ``prompts`` and ``rows`` tables (``datasets.Dataset``)."""

    root: Path
    info: dict[str, Any]
    latents: Any
    prompts: Any
    rows: Any

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.info["fingerprint"]


def resolve(name: str, cache_dir: str | None = None) -> Path:
    """A local folder as is; a Hub dataset id downloaded (``snapshot_download``, kept in the Hub cache)."""
    local = Path(name)
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, repo_type="dataset", cache_dir=cache_dir))
    except Exception as e:  # noqa: BLE001  (offline, not found, gated: one line with the reason)
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        raise UsageError(f"--encoded_dataset {name}: neither a folder nor a reachable Hub dataset ({why}). Pass the "
                         "folder hf-arb encode wrote, or its Hub id.") from None


def open_encoded(name: str, cache_dir: str | None = None, tables: Sequence[str] = TABLES) -> EncodedData:
    """Open an encoded dataset; refuses (one line) one that is unfinished or of another format version. Only
    ``tables`` are loaded (map-style); the others are None (a stream reads the ``latents`` shards itself)."""
    import datasets

    root = resolve(name, cache_dir)
    info_path = root / INFO_FILE
    if not info_path.exists():
        raise UsageError(f"--encoded_dataset {name}: no {INFO_FILE} in {root}; the encode did not finish. Run the "
                         "same hf-arb encode command again (finished shards are kept).")
    info = json.loads(info_path.read_text())
    version = info.get("fingerprint", {}).get("format_version")
    if version != FORMAT_VERSION:
        raise UsageError(f"--encoded_dataset {name}: format_version: encoded {version}, this hf_arb reads "
                         f"{FORMAT_VERSION}: encode it again with this hf_arb (hf-arb encode).")
    loaded = {}
    for table in TABLES:
        files = sorted(str(p) for p in (root / "data" / table).glob("*.parquet"))
        if not files:
            raise UsageError(f"--encoded_dataset {name}: no {table} shards under {root / 'data' / table}.")
        loaded[table] = (datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache_dir)
                         if table in tables else None)
    return EncodedData(root, info, loaded["latents"], loaded["prompts"], loaded["rows"])


def decode(data: bytes, shape: Sequence[int], dtype: Any) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(tuple(int(s) for s in shape))


class LazyColumn:
    """One column of a dataset read row by row (no list of every row in memory)."""

    def __init__(self, ds: Any, column: str) -> None:
        self.ds, self.column = ds.select_columns([column]), column

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[int(i)][self.column]


class EncodedLatents:
    """The encoded counterpart of :class:`~hf_arb.train.cache.latent_dataset.CachedLatentDataset`: same keys
    (``(row, bucket, epoch)``, variant ``epoch % variants``), same items, same collate.

    Args:
        data: the opened dataset.
        captions: the caption of every source row (a string or a list: the epoch's pick, as the image dataset's).
        seed: the run's seed (caption choice).
    """

    def __init__(self, data: EncodedData, captions: Sequence[Any], seed: int = 0) -> None:
        self.table = data.latents
        self.captions, self.seed = captions, int(seed)
        self.variants = int(data.fingerprint["variants"])
        self.num_buckets = len(data.fingerprint["buckets"]["resolutions"])
        cols = data.latents.select_columns(["row", "bucket", "variant"]).with_format("numpy")[:]
        keys = entry_keys(cols["row"], cols["bucket"], cols["variant"], self.num_buckets, self.variants)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def __len__(self) -> int:
        return len(self.captions)

    def positions(self, rows: np.ndarray, buckets: np.ndarray, variants: np.ndarray) -> np.ndarray:
        """Table positions of (row, bucket, variant) entries, -1 where absent (vectorised)."""
        return find_entries(self.keys, self.order, entry_keys(rows, buckets, variants, self.num_buckets,
                                                              self.variants))

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        row, bucket, epoch = (int(x) for x in key)
        at = int(self.positions(np.array([row]), np.array([bucket]), np.array([epoch % self.variants]))[0])
        if at < 0:
            raise KeyError(f"Row {row} has no encoded entry at bucket {bucket}, variant {epoch % self.variants}: the "
                           "encoded dataset was made for another plan; encode it again with this run's flags.")
        caption = choose_caption(self.captions[row], seed=self.seed, epoch=epoch, row=row)
        return entry_item(self.table[at], caption)

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        from hf_arb.train.cache.latent_dataset import CachedLatentDataset

        return CachedLatentDataset.collate(items)


def entry_item(rec: dict[str, Any], caption: str) -> dict[str, Any]:
    """A ``latents`` table row (a dict of its columns) as the latent cache's item: the posterior as float32, the fit
    metadata, ``caption`` (the epoch's pick), ``row``, ``source_row`` and ``bucket`` (what
    :class:`EncodedLatents` and the encoded stream both give)."""
    import torch

    stats = decode(rec["latent_stats"], rec["latent_shape"], np.float16)
    return {"latent_stats": torch.from_numpy(np.array(stats, dtype=np.float32)),
            "original_size": rec["original_size"], "crop_top_left": rec["crop_top_left"],
            "target_size": rec["target_size"], "caption": caption, "row": int(rec["row"]),
            "source_row": int(rec["source_row"]), "bucket": int(rec["bucket"])}


class EncodedPrompts:
    """Captions → ``(hidden (B, S, D), pooled (B, P) or None)`` from the ``prompts`` table, in the run's dtype on
    its device: what :class:`~hf_arb.train.cache.caches.TextEncoder` returns with ``--cache_text_embeddings``
    (no text encoder runs). Holds ``{caption: position}`` (the distinct captions), reads embeddings on demand."""

    def __init__(self, prompts: Any, device: Any, dtype: Any) -> None:
        self.table, self.device, self.dtype = prompts, device, dtype
        self.at = {c: i for i, c in enumerate(prompts["caption"])}

    def __call__(self, captions: list[str]) -> tuple[Any, Any]:
        import torch

        missing = [c for c in captions if c not in self.at]
        if missing:
            raise KeyError(f"Caption {missing[0]!r} is not in the encoded dataset's prompts: encode it again with this "
                           "run's data and --caption_column.")
        recs = [self.table[self.at[c]] for c in captions]
        hidden = torch.stack([torch.from_numpy(decode(r["prompt_embeds"], r["prompt_shape"], np.float32).copy())
                              .to(self.dtype) for r in recs]).to(self.device)
        if recs[0]["pooled_prompt_embeds"] is None:
            return hidden, None
        pooled = torch.stack([torch.from_numpy(decode(r["pooled_prompt_embeds"], r["pooled_shape"], np.float32).copy())
                              .to(self.dtype) for r in recs]).to(self.device)
        return hidden, pooled


__all__ = ["EncodedData", "EncodedLatents", "EncodedPrompts", "LazyColumn", "decode", "entry_item", "open_encoded",
           "resolve"]
