"""Latent cache fault injection: damaged entries are detected on read, re-encoded, counted; never trained on."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_arb.train.cache import latents as lat
from hf_arb.train.cache.latent_dataset import CachedLatentDataset


class Pipe:
    """Fake data pipeline + VAE: the stats encode (row, bucket, variant), so a repaired entry is checkable."""

    def __init__(self) -> None:
        self.encoded: list[tuple[int, int, int]] = []

    def load_batch(self, keys: list[tuple[int, int, int]]) -> dict:
        self.encoded.extend(keys)
        n = len(keys)
        return {"pixel_values": torch.tensor([[r, b, v] for r, b, v in keys], dtype=torch.float32),
                "original_sizes": torch.tensor([[16, 24]] * n), "crop_top_lefts": torch.tensor([[0, 0]] * n),
                "target_sizes": torch.tensor([[16, 16]] * n)}

    @staticmethod
    def encode(px: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(px.shape[0], 2, 4, 2, 2)
        out[:, 0] = px[:, 0, None, None, None] + 0.25 * px[:, 1, None, None, None]
        out[:, 1] = 0.5
        return out


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


# damage name -> function(npy path, json path) that damages one entry
DAMAGE = {
    "truncated": lambda npy, js: npy.write_bytes(npy.read_bytes()[:-20]),
    "empty": lambda npy, js: npy.write_bytes(b""),
    "header_only": lambda npy, js: npy.write_bytes(npy.read_bytes()[:128]),
    "wrong_shape": lambda npy, js: npy.write_bytes(_npy(np.zeros((2, 4, 2, 3), np.float16))),
    "wrong_dtype": lambda npy, js: npy.write_bytes(_npy(np.zeros((2, 4, 2, 2), np.float32))),
    "nan_filled": lambda npy, js: npy.write_bytes(_npy(np.full((2, 4, 2, 2), np.nan, np.float16))),
    "bit_flip": lambda npy, js: npy.write_bytes(npy.read_bytes()[:-1] + b"\x7f"),
    "json_deleted": lambda npy, js: js.unlink(),
    "json_garbage": lambda npy, js: js.write_text("{not json"),
    "no_checksum": lambda npy, js: js.write_text(json.dumps({"original_size": [16, 24]})),  # older cache layout
}


def _built(tmp_path: Path) -> tuple[lat.LatentCache, lat.CacheIndex]:
    cache = lat.LatentCache(tmp_path)
    index = lat.build_index([(i, i % 2) for i in range(4)], [f"h{i}" for i in range(4)], lambda r, b, v: (b, v),
                            variants=1, vae_id="v")
    lat.fill_cache(cache, index, rank=0, world=1, load_batch=Pipe().load_batch, encode=Pipe.encode, batch_size=2)
    return cache, index


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_reencoded_at_build_and_never_read(damage: str, tmp_path: Path) -> None:
    cache, index = _built(tmp_path)
    key = index.key(2, 0, 0)
    before = np.array(cache.read(key)[0])
    npy, js = cache._paths(key)
    DAMAGE[damage](npy, js)
    with pytest.raises(lat.LatentCacheError, match=str(key)) as err:  # the message names the file
        cache.read(key)
    assert str(err.value).startswith(
        f"Latent cache entry {npy if damage not in ('json_deleted', 'json_garbage', 'no_checksum') else js}"
    )
    assert cache.check(key) is not None and cache.check(index.key(1, 1, 0)) is None
    pipe = Pipe()
    again = lat.fill_cache(cache, lat.build_index([(i, i % 2) for i in range(4)], [f"h{i}" for i in range(4)],
                                                  lambda r, b, v: (b, v), variants=1, vae_id="v"),
                           rank=0, world=1, load_batch=pipe.load_batch, encode=Pipe.encode, batch_size=2)
    assert (again.encoded, again.repaired, again.reused) == (1, 1, 3)  # rows in = reused + re-encoded
    assert pipe.encoded == [(2, 0, 0)]
    np.testing.assert_array_equal(cache.read(key)[0], before)


@pytest.mark.parametrize("damage", ["truncated", "nan_filled", "wrong_shape"])
def test_entry_damaged_while_training_is_repaired_by_the_dataset(damage: str, tmp_path: Path) -> None:
    cache, index = _built(tmp_path)
    key = index.key(3, 1, 0)
    good = CachedLatentDataset(cache, index, ["a"] * 4)[(3, 1, 0)]["latent_stats"]
    DAMAGE[damage](*cache._paths(key))
    with pytest.raises(lat.LatentCacheError):
        CachedLatentDataset(cache, index, ["a"] * 4)[(3, 1, 0)]  # no repair callback: refuses, clearly
    pipe = Pipe()

    def repair(row: int, bucket: int, epoch: int) -> None:
        batch = pipe.load_batch([(row, bucket, epoch)])
        cache.write(index.key(row, bucket, epoch), Pipe.encode(batch["pixel_values"])[0].numpy(),
                    {"original_size": [16, 24], "crop_top_left": [0, 0], "target_size": [16, 16]})

    data = CachedLatentDataset(cache, index, ["a"] * 4, repair=repair)
    item = data[(3, 1, 0)]
    assert torch.equal(item["latent_stats"], good) and torch.isfinite(item["latent_stats"]).all()
    assert pipe.encoded == [(3, 1, 0)] and index.repaired == 1


def test_non_finite_latents_are_refused_at_write(tmp_path: Path) -> None:
    cache = lat.LatentCache(tmp_path)
    stats = np.zeros((2, 4, 2, 2), np.float32)
    stats[0, 1, 1, 1] = np.nan
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\).*not cached"):
        cache.write("ab" * 16, stats, {})
    stats[0, 1, 1, 1] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        cache.write("ab" * 16, stats, {})
    assert not cache.has("ab" * 16) and len(cache) == 0
    with pytest.raises(ValueError, match="reserved"):
        cache.write("ab" * 16, np.zeros((2, 4, 2, 2)), {"_entry": 1})


def test_nan_entry_with_a_matching_checksum_is_still_refused(tmp_path: Path) -> None:
    """Defence in depth: an internally consistent entry (checksum matches) full of NaN is never trained on."""
    cache, index = _built(tmp_path)
    key = index.key(0, 0, 0)
    npy, js = cache._paths(key)
    nan = np.full((2, 4, 2, 2), np.nan, np.float16)
    npy.write_bytes(_npy(nan))
    meta = json.loads(js.read_text())
    meta["_entry"]["crc32"] = lat._crc32(nan)
    js.write_text(json.dumps(meta))
    assert cache.check(key) == "non-finite values"
