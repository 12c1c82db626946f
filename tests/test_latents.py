"""Latent cache (hf_arb.train.cache.latents): keys, atomic float16 storage, per-rank shares, reuse and invalidation."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_arb.train.cache import latents as lat
from hf_arb.train.cache.latent_dataset import CachedLatentDataset


def _png(color: tuple[int, int, int], size: tuple[int, int] = (24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture()
def image_ds() -> datasets.Dataset:
    rows = {"image": [{"bytes": _png((i * 40, 10, 200 - i * 30)), "path": None} for i in range(6)],
            "text": [f"caption {i}" for i in range(6)]}
    return datasets.Dataset.from_dict(rows, features=datasets.Features({"image": datasets.Image(),
                                                                         "text": datasets.Value("string")}))


class Recorder:
    """Fake data pipeline + VAE: stats encode (row, bucket, variant) so reads can be checked."""

    def __init__(self) -> None:
        self.encoded: list[tuple[int, int, int]] = []

    def load_batch(self, keys: list[tuple[int, int, int]]) -> dict:
        self.encoded.extend(keys)
        n = len(keys)
        px = torch.tensor([[r, b, v] for r, b, v in keys], dtype=torch.float32)  # stands in for pixels
        return {"pixel_values": px, "original_sizes": torch.tensor([[16, 24]] * n),
                "crop_top_lefts": torch.tensor([[0, v] for _, _, v in keys]),
                "target_sizes": torch.tensor([[16, 16]] * n)}

    @staticmethod
    def encode(px: torch.Tensor) -> torch.Tensor:
        b = px.shape[0]
        out = torch.zeros(b, 2, 4, 2, 2)
        out[:, 0] = px[:, 0, None, None, None] + 0.25 * px[:, 2, None, None, None]  # mean encodes row, variant
        out[:, 1] = 0.5  # std
        return out


def test_store_roundtrip_float16_memmap_and_atomic(tmp_path: Path):
    cache = lat.LatentCache(tmp_path)
    stats = np.random.default_rng(0).normal(size=(2, 4, 6, 10)).astype(np.float32)  # (2, C, h, w) non-square
    key = "ab" * 16
    assert not cache.has(key)
    cache.write(key, stats, {"original_size": [48, 80]})
    got, meta = cache.read(key)
    assert isinstance(got, np.memmap) and got.dtype == np.float16 and got.shape == (2, 4, 6, 10)
    np.testing.assert_allclose(got, stats, rtol=1e-3, atol=1e-3)
    assert meta == {"original_size": [48, 80]}
    assert not list(tmp_path.rglob("*.tmp")), "temporary files left behind"
    assert len(cache) == 1
    with pytest.raises(ValueError, match=r"shape \(2, C, h, w\)"):
        cache.write(key, stats[0], {})
    with pytest.raises(ValueError, match="overflow float16"):
        cache.write("cd" * 16, stats * 1e6, {})
    assert not cache.has("cd" * 16)
    with pytest.raises(KeyError, match="Rebuild the cache"):
        cache.read("ef" * 16)


def test_keys_cover_content_plan_and_vae():
    base = lat.entry_key("c1", (64, 48, 0, 3, False), "vae1")
    assert base == lat.entry_key("c1", (64, 48, 0, 3, False), "vae1")
    others = {lat.entry_key("c2", (64, 48, 0, 3, False), "vae1"), lat.entry_key("c1", (48, 64, 0, 3, False), "vae1"),
              lat.entry_key("c1", (64, 48, 1, 3, False), "vae1"), lat.entry_key("c1", (64, 48, 0, 3, True), "vae1"),
              lat.entry_key("c1", (64, 48, 0, 3, False), "vae2")}
    assert base not in others and len(others) == 5


def test_content_hashes_without_decoding_and_edit_changes_hash(image_ds):
    hashes = lat.content_hashes(image_ds, "image")
    assert len(set(hashes)) == 6
    assert lat.content_hashes(image_ds, "image", [4, 1]) == [hashes[4], hashes[1]]
    edited = image_ds.map(lambda r, i: {"image": {"bytes": _png((1, 2, 3)), "path": None} if i == 2 else r["image"]},
                          with_indices=True, features=image_ds.features)
    new = lat.content_hashes(edited, "image")
    assert [a == b for a, b in zip(hashes, new)] == [True, True, False, True, True, True]
    with pytest.raises(ValueError, match="not in the dataset"):
        lat.content_hashes(image_ds, "picture")


def test_vae_fingerprint_tracks_weights():
    from hf_arb.testing.tiny import _vae

    a, b = _vae(1), _vae(1)
    assert lat.vae_fingerprint(a) == lat.vae_fingerprint(b)
    with torch.no_grad():
        next(b.parameters()).add_(1e-3)
    assert lat.vae_fingerprint(a) != lat.vae_fingerprint(b)


def _index(hashes, pairs, variants=1, vae="v"):
    return lat.build_index(pairs, hashes, lambda row, b, v: (b, v), variants=variants, vae_id=vae)


def test_fill_encodes_once_and_reuses(tmp_path: Path):
    cache, rec = lat.LatentCache(tmp_path), Recorder()
    hashes = [f"h{i}" for i in range(5)]
    pairs = [(i, i % 2) for i in range(5)]
    idx = lat.fill_cache(cache, _index(hashes, pairs), rank=0, world=1, load_batch=rec.load_batch,
                         encode=rec.encode, batch_size=2)
    assert (idx.encoded, idx.reused) == (5, 0) and sorted(rec.encoded) == [(i, i % 2, 0) for i in range(5)]
    # batched by bucket: every load_batch call holds one bucket
    rec2 = Recorder()
    again = lat.fill_cache(cache, _index(hashes, pairs), rank=0, world=1, load_batch=rec2.load_batch,
                           encode=rec2.encode, batch_size=2)
    assert (again.encoded, again.reused) == (0, 5) and rec2.encoded == []
    # an edited image (new content hash) and a changed bucket re-encode only those rows
    hashes[3] = "h3-edited"
    pairs[0] = (0, 7)
    rec3 = Recorder()
    third = lat.fill_cache(cache, _index(hashes, pairs), rank=0, world=1, load_batch=rec3.load_batch,
                           encode=rec3.encode, batch_size=2)
    assert sorted(rec3.encoded) == [(0, 7, 0), (3, 1, 0)] and third.reused == 3


def test_batches_hold_one_bucket(tmp_path: Path):
    cache, calls = lat.LatentCache(tmp_path), []
    rec = Recorder()

    def load(keys):
        calls.append({b for _, b, _ in keys})
        return rec.load_batch(keys)

    lat.fill_cache(cache, _index([f"h{i}" for i in range(9)], [(i, i % 3) for i in range(9)]), rank=0, world=1,
                   load_batch=load, encode=rec.encode, batch_size=2)
    assert all(len(c) == 1 for c in calls) and len(calls) == 6  # 3 buckets x ceil(3 / 2)


def test_rank_shares_are_disjoint_and_cover_everything(tmp_path: Path):
    hashes = [f"h{i}" for i in range(7)]
    pairs = [(i, 0) for i in range(7)]
    seen = []
    for rank in range(3):
        rec = Recorder()
        lat.fill_cache(lat.LatentCache(tmp_path / f"r{rank}"), _index(hashes, pairs, variants=2), rank=rank, world=3,
                       load_batch=rec.load_batch, encode=rec.encode, batch_size=4)
        seen.append(set(rec.encoded))
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert set().union(*seen) == {(i, 0, v) for i in range(7) for v in range(2)}
    assert np.array_equal(lat.plan_share(7, 1, 3), [1, 4])
    with pytest.raises(ValueError, match="rank must be in"):
        lat.plan_share(7, 3, 3)


def test_identical_content_is_encoded_once(tmp_path: Path):
    rec = Recorder()
    idx = lat.fill_cache(lat.LatentCache(tmp_path), _index(["same", "same", "other"], [(0, 0), (1, 0), (2, 0)]),
                         rank=0, world=1, load_batch=rec.load_batch, encode=rec.encode, batch_size=8)
    assert idx.encoded == 2 and idx.key(0, 0, 0) == idx.key(1, 0, 0)


def test_cached_dataset_reads_variant_of_the_epoch(tmp_path: Path):
    cache, rec = lat.LatentCache(tmp_path), Recorder()
    idx = lat.fill_cache(cache, _index(["a", "b", "c"], [(0, 0), (1, 0), (2, 1)], variants=3), rank=0, world=1,
                         load_batch=rec.load_batch, encode=rec.encode, batch_size=4)
    data = CachedLatentDataset(cache, idx, ["x", ["y1", "y2"], None], seed=0)
    for epoch in range(5):
        item = data[(1, 0, epoch)]
        v = lat.variant_for_epoch(epoch, 3)
        assert item["latent_stats"].dtype == torch.float32 and item["latent_stats"].shape == (2, 4, 2, 2)
        assert float(item["latent_stats"][0, 0, 0, 0]) == pytest.approx(1 + 0.25 * v)
        assert item["crop_top_left"] == [0, v]
        assert item["caption"] in ("y1", "y2")
    batch = data.collate([data[(0, 0, 1)], data[(1, 0, 1)]])
    assert batch["latent_stats"].shape == (2, 2, 4, 2, 2) and batch["original_sizes"].tolist() == [[16, 24]] * 2
    assert batch["captions"][0] == "x" and batch["rows"].tolist() == [0, 1]
    assert data[(2, 1, 0)]["caption"] == ""
    with pytest.raises(KeyError, match="was not cached for bucket 5"):
        data[(0, 5, 0)]


def test_caption_choice_matches_image_dataset(tmp_path: Path):
    """A list of captions gives the same pick per (row, epoch) as BucketedImageDataset."""
    from hf_arb.rng import ROW_CAPTION, row_rng

    cache, rec = lat.LatentCache(tmp_path), Recorder()
    idx = lat.fill_cache(cache, _index(["a"], [(0, 0)]), rank=0, world=1, load_batch=rec.load_batch,
                         encode=rec.encode, batch_size=1)
    caps = ["c0", "c1", "c2", "c3"]
    data = CachedLatentDataset(cache, idx, [caps], seed=3)
    for epoch in range(6):
        assert data[(0, 0, epoch)]["caption"] == caps[int(row_rng(3, epoch, 0, ROW_CAPTION).integers(4))]


def test_cache_phases_show_progress_on_the_main_process_only(tmp_path: Path, image_ds, capsys):
    """Hashing, checking and encoding show a tqdm bar (count and rate) once each when asked; never otherwise."""
    hashes = lat.content_hashes(image_ds, "image", show_progress=True)
    cache, pairs = lat.LatentCache(tmp_path), [(i, i % 2) for i in range(5)]
    lat.fill_cache(cache, _index(hashes, pairs), rank=0, world=1, load_batch=Recorder().load_batch,
                   encode=Recorder().encode, batch_size=2, show_progress=True)
    lat.fill_cache(cache, _index(hashes, pairs), rank=0, world=1, load_batch=Recorder().load_batch,
                   encode=Recorder().encode, batch_size=2, show_progress=True)  # all reused: a check, no encode
    err = capsys.readouterr().err
    finals = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if line]  # a bar's last state
    assert [line.split(":")[0] for line in finals] == ["Hashing images", "Checking latent cache", "Encoding latents",
                                                       "Checking latent cache"]
    assert f"{len(image_ds)}/{len(image_ds)}" in finals[0] and "img/s" in finals[0]
    assert "5/5" in finals[2] and "img/s" in finals[2]
    lat.content_hashes(image_ds, "image")  # other ranks (the default): silent
    lat.fill_cache(lat.LatentCache(tmp_path / "b"), _index(hashes, pairs), rank=1, world=2,
                   load_batch=Recorder().load_batch, encode=Recorder().encode, batch_size=2)
    assert capsys.readouterr().err == ""
