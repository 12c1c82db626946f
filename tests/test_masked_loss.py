"""Issue 36, item 3: the masked loss (``--masked_loss``, ``--alpha_mask``, ``--mask_column``, ``--mask_dir``,
``--unmasked_weight``).

Pure functions first: the weighting leaves the loss unchanged with an all-ones mask (UNet, flow, Flux.2's patchified
and packed losses) and makes it blind to everything outside a binary mask; the mask lands on the latent cells its
pixels become after a real crop, resize and flip; the three sources give the same mask; a missing or wrong-size mask
is one counted line per row. Then two tiny SD runs: a masked run from the latent cache equals the same masked run
encoding on the fly (the masks are recomputed with each cached variant's crop), and the flags' mistakes are refused
in one line before any model loads. Every image is a real PNG with an alpha channel, built with PIL here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_arb import BucketSet, add_bucket_columns
from hf_arb.checks import UsageError
from hf_arb.families.flow import flow_matching_loss
from hf_arb.families.loss_mask import apply_loss_mask
from hf_arb.images.masks import MaskedImageDataset, MaskSpec, find_mask_file, latent_weights, mask_files
from hf_arb.train.sources.masks.data import CachedLatentsWithMasks, rows_with_masks

BUCKETS = BucketSet([(64, 32), (32, 64), (48, 48)])
#: (width, height) of the test images: each covers its bucket with a real resize and crop
SIZES = [(128, 96), (128, 96), (96, 160), (80, 80)]


# ------------------------------------------------------------------------------------------- data
def _alpha(w: int, h: int, i: int) -> np.ndarray:
    """A binary alpha on 2-pixel-aligned rectangles (so a 2x box downscale keeps it exactly 0 / 255)."""
    a = np.zeros((h, w), np.uint8)
    a[10 + 2 * i: h // 2 + 2 * i, 6: w // 2 + 4] = 255
    a[h - 20:, w - 30: w - 6] = 255
    return a


def _photo(w: int, h: int, i: int) -> np.ndarray:
    from _photos import photo

    return np.asarray(photo("coffee.png", (w + 7 * i, h + 5 * i)).convert("RGB"))[:h, :w]


def write_masked_folder(root: Path) -> dict[str, Path]:
    """An imagefolder of RGBA PNGs (captions in metadata.jsonl), a folder of their alpha as greyscale mask PNGs
    with the same names, and the image / mask pairs' paths."""
    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True)
    masks.mkdir()
    lines = []
    for i, (w, h) in enumerate(SIZES):
        rgba = np.dstack([_photo(w, h, i), _alpha(w, h, i)])
        Image.fromarray(rgba, "RGBA").save(images / f"{i:02d}.png")
        Image.fromarray(_alpha(w, h, i), "L").save(masks / f"{i:02d}.png")
        lines.append(json.dumps({"file_name": f"{i:02d}.png", "text": f"photo {i}"}))
    (images / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return {"images": images, "masks": masks}


def annotated(folder: Path, with_mask_column: Path | None = None) -> datasets.Dataset:
    ds = datasets.load_dataset("imagefolder", data_files={"train": str(folder / "**")}, split="train")
    if with_mask_column is not None:
        files = [str(with_mask_column / f"{i:02d}.png") for i in range(len(ds))]
        ds = ds.add_column("mask", files).cast_column("mask", datasets.Image())
    return add_bucket_columns(ds, BUCKETS, show_summary=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    paths = write_masked_folder(tmp_path_factory.mktemp("masked"))
    return {**paths, "ds": annotated(paths["images"], with_mask_column=paths["masks"])}


def masked(ds: datasets.Dataset, spec: MaskSpec, **kw: object) -> MaskedImageDataset:
    return MaskedImageDataset(ds, BUCKETS, masks=spec, seed=3, random_flip=True, **kw)


# ------------------------------------------------------------------------------------------- the loss
def test_an_all_ones_mask_is_the_plain_loss_and_zeros_cut_the_error() -> None:
    g = torch.Generator().manual_seed(0)
    pred, latents, noise = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    noisy, sigmas = torch.randn(2, 4, 6, 8, generator=g), torch.tensor([0.3, 0.8])
    plain = flow_matching_loss(pred, latents, noise, noisy, sigmas, "logit_normal", False)
    ones = flow_matching_loss(pred, latents, noise, noisy, sigmas, "logit_normal", False, mask=torch.ones(2, 1, 6, 8))
    assert torch.equal(plain, ones)
    error = torch.rand(2, 4, 6, 8, generator=g)
    assert apply_loss_mask(error, None) is error
    with pytest.raises(ValueError, match=r"does not fit the loss \(2, 4, 6, 8\)"):
        apply_loss_mask(error, torch.ones(2, 1, 3, 4))


def test_nothing_outside_the_mask_moves_the_loss_or_its_gradient() -> None:
    """With --unmasked_weight 0, the target changed at every element outside a binary mask (the pixels the mask
    leaves out) gives the same loss and the same gradient, to the bit."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(2, 1, 6, 8, generator=g) > 0.5).float()
    latents, noise, noisy = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    pred = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    sig = torch.tensor([0.3, 0.8])

    def loss_and_grad(lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred.grad = None
        loss = flow_matching_loss(pred, lat, noise, noisy, sig, "none", False, mask=mask)
        loss.backward()
        return loss.detach(), pred.grad.clone()

    other = torch.where(mask.bool(), latents, latents + 5 * torch.randn(latents.shape, generator=g))
    (l1, g1), (l2, g2) = loss_and_grad(latents), loss_and_grad(other)
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and float(l1) > 0
    assert not torch.equal(loss_and_grad(latents + 5 * mask)[0], l1)  # the same change inside would move it


def _unet_loss(batch: dict, snr_gamma: float | None) -> torch.Tensor:
    from diffusers import DDPMScheduler

    from hf_arb.families.unet_loss import unet_loss

    args = argparse.Namespace(noise_offset=0, timestep_bias_strategy="none", input_perturbation=0,
                              proportion_empty_prompts=0, dream_training=False, snr_gamma=snr_gamma)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    torch.nn.init.constant_(conv.weight, 0.01)
    torch.nn.init.constant_(conv.bias, 0.1)
    vae = argparse.Namespace(config={"scaling_factor": 0.18215})
    return unet_loss(args, DDPMScheduler(num_train_timesteps=1000), vae, batch, lambda c: (torch.zeros(len(c), 3, 8),
                                                                                          None),
                     torch.Generator().manual_seed(5), torch.float32, lambda x, *_: conv(x))


@pytest.mark.parametrize("snr_gamma", [None, 5.0])
def test_the_unet_loss_with_an_all_ones_mask_is_the_plain_loss(snr_gamma: float | None) -> None:
    stats = torch.randn(2, 2, 4, 6, 8, generator=torch.Generator().manual_seed(2)).abs()
    batch = {"latent_stats": stats, "captions": ["a", "b"], "original_sizes": torch.tensor([[48, 64]] * 2),
             "crop_top_lefts": torch.zeros(2, 2, dtype=torch.long), "target_sizes": torch.tensor([[48, 64]] * 2)}
    plain = _unet_loss(batch, snr_gamma)
    ones = _unet_loss({**batch, "loss_mask": torch.ones(2, 1, 6, 8)}, snr_gamma)
    torch.testing.assert_close(ones, plain, rtol=1e-7, atol=0)
    half = _unet_loss({**batch, "loss_mask": torch.cat([torch.ones(2, 1, 3, 8), torch.zeros(2, 1, 3, 8)], 2)},
                      snr_gamma)
    assert 0 < float(half.detach()) < float(plain.detach())


def test_flux2_weights_each_element_of_its_patchified_latents_by_its_own_cell() -> None:
    """Flux.2's loss sees 2x2-patchified latents: the mask is patchified the same way, so the masked loss equals the
    masked loss computed on the unpatchified latents."""
    from hf_arb.families.flux2 import patchify

    g = torch.Generator().manual_seed(4)
    error = torch.rand(2, 3, 6, 8, generator=g)
    mask = torch.rand(2, 1, 6, 8, generator=g)
    flat = apply_loss_mask(error, mask)
    patched = apply_loss_mask(patchify(error), patchify(mask.expand(-1, 3, -1, -1).contiguous()))
    torch.testing.assert_close(patched, patchify(flat), rtol=0, atol=0)


@pytest.fixture(scope="module")
def flux_pipe():
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline

    return tiny_flux_pipeline()


def test_packed_masked_loss_is_the_mean_of_the_per_image_masked_losses(flux_pipe) -> None:
    """--packing: each image's mask is tokenised as its latent is; the packed loss equals the per-image masked losses
    computed through the transformer's own (unpacked) forward, and an all-ones mask is the unmasked packed loss."""
    from hf_arb.packing.loss import flux_pack_latent, flux_unpack_latent, packed_flow_loss
    from hf_arb.packing.model import enable_packed_attention

    model = enable_packed_attention(flux_pipe.transformer.eval())
    g = torch.Generator().manual_seed(6)
    shapes = [(8, 12), (6, 10)]
    lat = [torch.randn(16, h, w, generator=g) for h, w in shapes]
    noise = [torch.randn(16, h, w, generator=g) for h, w in shapes]
    text = [torch.randn(5, 64, generator=g) for _ in shapes]
    pooled, sig, guide = torch.randn(2, 32, generator=g), torch.tensor([0.2, 0.7]), torch.tensor([3.5, 1.0])
    masks = [(torch.rand(1, h, w, generator=g) > 0.4).float() for h, w in shapes]
    ref = []
    with torch.no_grad():
        for i, (x, n, m) in enumerate(zip(lat, noise, masks)):
            s, (h, w) = sig[i], (x.shape[1] // 2, x.shape[2] // 2)
            ids = torch.zeros(h, w, 3)
            ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
            tokens = model(hidden_states=flux_pack_latent((1 - s) * x + s * n)[None],
                           encoder_hidden_states=text[i][None], pooled_projections=pooled[i:i + 1],
                           timestep=s[None], img_ids=ids.reshape(-1, 3),
                           txt_ids=torch.zeros(5, 3), guidance=guide[i:i + 1]).sample[0]
            ref.append(torch.mean(m * (flux_unpack_latent(tokens, (h, w)) - (n - x)) ** 2))
        kw = dict(guidance=guide, max_tokens=64, max_text_tokens=12)
        out = packed_flow_loss(model, lat, noise, text, pooled, sig, masks=masks, **kw)
        plain = packed_flow_loss(model, lat, noise, text, pooled, sig, **kw)
        ones = packed_flow_loss(model, lat, noise, text, pooled, sig, masks=[torch.ones_like(m) for m in masks], **kw)
    torch.testing.assert_close(out.per_image, torch.stack(ref), rtol=1e-5, atol=1e-6)
    assert torch.equal(ones.loss, plain.loss) and float(out.loss) < float(plain.loss)


# ------------------------------------------------------------------------------------------- the masks
def test_latent_weights_are_area_means_floored_at_the_unmasked_weight() -> None:
    m = np.zeros((16, 24), np.float32)
    m[:8, :4] = 1  # half of cell (0, 0)
    m[8:, 8:16] = 0.5
    w = latent_weights(m, 8)
    np.testing.assert_array_equal(w, [[0.5, 0, 0], [0, 0.5, 0]])
    np.testing.assert_array_equal(latent_weights(m, 8, 0.25), [[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])
    assert latent_weights(np.ones((16, 24), np.float32), 8).dtype == np.float32
    np.testing.assert_array_equal(latent_weights(np.ones((16, 24), np.float32), 8), np.ones((2, 3)))


def _expected_cells(alpha: np.ndarray, plan, factor: int = 8) -> np.ndarray:
    """The latent cells a source mask should give, by hand: an exact 2x area downscale (every test image is scaled
    by 1/2), the plan's crop, its flip, then factor x factor means."""
    (w, h), (sw, sh), (bw, bh) = plan.size, plan.scaled_size, plan.bucket
    assert (sw * 2, sh * 2) == (w, h), "the test images are scaled by exactly 1/2"
    small = alpha.astype(np.float64).reshape(sh, 2, sw, 2).mean((1, 3)) / 255
    y, x = plan.crop_top_left[0], plan.crop_left
    crop = small[y: y + bh, x: x + bw]
    crop = crop[:, ::-1] if plan.flipped else crop
    return crop.reshape(bh // factor, factor, bw // factor, factor).mean((1, 3))


def test_a_mask_lands_on_the_latent_cells_of_its_pixels_after_a_crop_resize_and_flip(data) -> None:
    ds = data["ds"]
    images = masked(ds, MaskSpec("alpha"))
    seen = set()
    for epoch in range(8):  # random crops and flips: find keys with a non-zero crop, flipped and not
        key = (0, 0, epoch)  # 128x96 -> scaled 64x48, cut to the 64x32 bucket at a random y
        plan = images.fit_row(*key)
        if plan.crop_top_left[0] % 8 == 0:
            continue
        sample = images[key]
        expected = _expected_cells(_alpha(128, 96, 0), plan)
        assert sample["loss_mask"].shape == (1, 4, 8)
        np.testing.assert_allclose(sample["loss_mask"][0].numpy(), expected, atol=1e-6)
        assert 0 < float(sample["loss_mask"].mean()) < 1
        seen.add(plan.flipped)
    assert seen == {True, False}


@pytest.mark.parametrize("source", ["column", "dir"])
def test_a_mask_column_or_folder_gives_the_alpha_channels_mask(data, source: str) -> None:
    ds = data["ds"]
    alpha = masked(ds, MaskSpec("alpha"))
    other = masked(ds, MaskSpec(source, column="mask", folder=str(data["masks"])))
    for key in [(0, 0, 1), (2, 1, 0), (3, 2, 5), (1, 2, 2)]:
        a, o = alpha[key], other[key]
        assert torch.equal(a["loss_mask"], o["loss_mask"]) and torch.equal(a["pixel_values"], o["pixel_values"])
    batch = other.collate([other[(0, 0, 0)], other[(1, 0, 0)]])
    assert batch["loss_mask"].shape == (2, 1, 4, 8) and batch["pixel_values"].shape == (2, 3, 32, 64)


def test_unmasked_weight_floors_every_cell(data) -> None:
    floor = masked(data["ds"], MaskSpec("alpha", unmasked_weight=0.3))[(0, 0, 0)]["loss_mask"]
    plain = masked(data["ds"], MaskSpec("alpha"))[(0, 0, 0)]["loss_mask"]
    torch.testing.assert_close(floor, plain.clamp(min=0.3), rtol=0, atol=0)


def test_mask_files_match_by_name_then_by_stem(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a.png", "b.png", "sub/c.webp", "d.png", "d.jpg", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    files = mask_files(tmp_path)
    assert find_mask_file("/data/a.png", files).endswith("a.png")
    assert find_mask_file("/data/b.jpg", files).endswith("b.png")  # a JPEG photo, its PNG mask
    assert find_mask_file("/data/c.png", files).endswith("sub/c.webp")
    assert find_mask_file("/data/d.png", files).endswith("d.png")  # the same name wins
    assert find_mask_file("/data/d.webp", files) is None  # two files of that stem: ambiguous, not guessed
    assert find_mask_file("/data/notes.png", files) is None and find_mask_file(None, files) is None


def test_a_missing_or_wrong_size_mask_is_one_counted_line_per_row(data, tmp_path: Path) -> None:
    ds = data["ds"]
    folder = tmp_path / "masks"
    folder.mkdir()
    for i in (0, 2, 3):  # row 1's mask is missing; row 3's has the wrong size
        im = Image.open(data["masks"] / f"{i:02d}.png")
        (im.resize((40, 40)) if i == 3 else im).save(folder / f"{i:02d}.png")
    spec = MaskSpec("dir", folder=str(folder))
    assert rows_with_masks(ds, "image", spec).tolist() == [True, False, True, True]  # no file opened
    log = tmp_path / "skipped_rows.jsonl"
    images = masked(ds, spec, bad_image_log=log)
    for _ in range(3):  # asked again and again: still one line per row
        assert int(images[(1, 0, 0)]["row"]) == 0  # the other row of its bucket trains instead
        assert int(images[(3, 2, 0)]["row"]) != 3
    lines = [json.loads(t) for t in log.read_text().splitlines()]
    assert sorted(r["row"] for r in lines) == [1, 3]
    reasons = {r["row"]: r["reason"] for r in lines}
    assert reasons[1].startswith("mask missing (no 01.png") and reasons[3].startswith("mask size 40x40")
    cells = datasets.Dataset.from_dict({"m": [None, "x"]})
    assert rows_with_masks(cells, "image", MaskSpec("column", column="m")).tolist() == [False, True]
    with pytest.raises(Exception, match="mask missing"):
        masked(ds, spec, on_bad_image="error")[(1, 0, 0)]


def test_a_pack_carries_each_images_mask_on_its_own_latent_grid(data) -> None:
    """--packing: every image of a pack at its own fitted size, its mask on that image's latent grid, in a list that
    packed_flow_step hands the packed loss (which tokenises it as the latent: tested above)."""
    from hf_arb import PackBatchSampler
    from hf_arb.train.sources.masks.data import MaskedPackedImageDataset

    ds = data["ds"]
    sampler = PackBatchSampler(ds, 64, num_replicas=1, rank=0, seed=0, log_report=False, max_image_tokens=48)
    images = MaskedPackedImageDataset(ds, sampler.sizes, masks=MaskSpec("alpha"), seed=0)
    plain = MaskedPackedImageDataset(ds, sampler.sizes, masks=MaskSpec("alpha"), seed=0)
    packs = list(sampler)
    assert packs and sum(len(p) for p in packs) >= 3
    for pack in packs:
        batch = images.collate([images[k] for k in pack])
        assert isinstance(batch["loss_mask"], list) and len(batch["loss_mask"]) == len(pack)
        for px, m in zip(batch["pixel_values"], batch["loss_mask"]):
            assert m.shape == (1, px.shape[1] // 8, px.shape[2] // 8) and 0 < float(m.mean()) < 1
        assert torch.equal(batch["loss_mask"][0], plain[pack[0]]["loss_mask"])


def test_a_packs_masks_reach_the_packed_step(data, flux_pipe) -> None:
    """packed_flow_step (what the script calls for a pack) hands the collated masks to the packed loss: all-ones
    masks give the unmasked loss, the real ones less."""
    from hf_arb import PackBatchSampler
    from hf_arb.families import get_family
    from hf_arb.packing.family import packed_flow_step
    from hf_arb.packing.loss import PackedFlowModel
    from hf_arb.train.sources.masks.data import MaskedPackedImageDataset

    ds, family = data["ds"], get_family("flux")
    model = PackedFlowModel(flux_pipe.transformer.eval(), backend="sdpa")
    options = family.options(flux_pipe.scheduler.config, flux_pipe.transformer)
    sampler = PackBatchSampler(ds, 64, num_replicas=1, rank=0, seed=0, log_report=False, max_image_tokens=48)
    images = MaskedPackedImageDataset(ds, sampler.sizes, masks=MaskSpec("alpha"), seed=0)
    pack = max(sampler, key=len)
    batch = images.collate([images[k] for k in pack])
    cfg = flux_pipe.transformer.config
    g = torch.Generator().manual_seed(0)
    text = (torch.randn(len(pack), 5, cfg.joint_attention_dim, generator=g),
            torch.randn(len(pack), cfg.pooled_projection_dim, generator=g))

    def loss(b: dict) -> float:
        with torch.no_grad():
            return float(packed_flow_step(family, options, model, b, flux_pipe.vae, lambda c: text,
                                          torch.Generator().manual_seed(1), torch.float32, 64))

    plain = {k: v for k, v in batch.items() if k != "loss_mask"}
    ones = {**batch, "loss_mask": [torch.ones_like(m) for m in batch["loss_mask"]]}
    assert loss(ones) == loss(plain) and 0 < loss(batch) < loss(plain)


class _Cached:
    """A stand-in for CachedLatentDataset: rows 0 and 1 cached at bucket 0, the index's two variants."""

    index = argparse.Namespace(variants=2)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, key):
        row, bucket, epoch = key
        if (row, bucket) not in {(0, 0), (1, 0)}:
            raise KeyError(row)
        return {"latent_stats": torch.zeros(2, 4, 4, 8), "row": row, "source_row": row, "bucket": bucket,
                "caption": "", "original_size": (96, 128), "crop_top_left": (0, 0), "target_size": (32, 64)}


def test_cached_latents_get_the_mask_of_the_cached_variants_crop_and_missing_masks_are_replaced(data, tmp_path):
    ds = data["ds"]
    images = masked(ds, MaskSpec("alpha"))
    cached = CachedLatentsWithMasks(_Cached(), images)
    for epoch in range(4):  # epoch e trains variant e % 2: the mask of that variant's crop and flip
        assert torch.equal(cached[(0, 0, epoch)]["loss_mask"], images[(0, 0, epoch % 2)]["loss_mask"])
    folder = tmp_path / "masks"
    folder.mkdir()
    Image.open(data["masks"] / "01.png").save(folder / "01.png")  # row 0 has none
    log = tmp_path / "skipped.jsonl"
    cached = CachedLatentsWithMasks(_Cached(), masked(ds, MaskSpec("dir", folder=str(folder)), bad_image_log=log))
    item = cached[(0, 0, 3)]
    assert item["row"] == 1 and item["loss_mask"].shape == (1, 4, 8)
    cached[(0, 0, 1)]
    assert [json.loads(t)["row"] for t in log.read_text().splitlines()] == [0]
    batch = cached.collate([item, cached[(1, 0, 0)]])
    assert batch["loss_mask"].shape == (2, 1, 4, 8) and batch["latent_stats"].shape == (2, 2, 4, 4, 8)
    empty = tmp_path / "none"
    empty.mkdir()  # no row of bucket 0 has a mask: the row trains with weight 0, recorded, not a crash
    log = tmp_path / "none.jsonl"
    cached = CachedLatentsWithMasks(_Cached(), masked(ds, MaskSpec("dir", folder=str(empty)), bad_image_log=log))
    item = cached[(1, 0, 0)]
    assert item["row"] == 1 and torch.equal(item["loss_mask"], torch.zeros(1, 4, 8))
    assert "trained with weight 0" in json.loads(log.read_text())["reason"]


def test_the_masked_source_counts_rows_without_a_mask_before_any_model_loads(data, tmp_path: Path) -> None:
    from hf_arb.train.sources import build_source, source_class
    from hf_arb.train.sources.masks import MaskedBucketedSource, MaskedPackedSource

    folder = tmp_path / "masks"
    folder.mkdir()
    Image.open(data["masks"] / "02.png").save(folder / "02.png")
    base = ["--train_data_dir", str(data["images"]), "--resolution", "64", "--bucket_step", "16",
            "--train_batch_size", "1", "--output_dir", str(tmp_path / "out")]
    source = build_source(_parse(*base, "--mask_dir", str(folder)), None)
    assert type(source) is MaskedBucketedSource and source.mask_counts == (1, 4)
    assert source_class(_parse(*base, "--alpha_mask")) is MaskedBucketedSource
    flux = ["--pretrained_model_name_or_path", "black-forest-labs/FLUX.1-dev"]
    assert source_class(_parse(*base, "--alpha_mask", "--packing", *flux)) is MaskedPackedSource
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="none of the 4 trainable rows has a mask"):
        build_source(_parse(*base, "--mask_dir", str(tmp_path / "empty")), None)


# ------------------------------------------------------------------------------------------- flags
def _parse(*extra: str):
    import train_text_to_image_arb as script

    model = [] if "--pretrained_model_name_or_path" in extra else ["--pretrained_model_name_or_path", "m"]
    data = [] if "--train_data_dir" in extra else ["--train_data_dir", "d"]
    return script.parse_args([*model, *data, "--full_finetune", "--learning_rate", "1e-5", *extra])


def test_the_flags_habits_and_their_one_line_refusals(tmp_path: Path) -> None:
    assert _parse("--alpha_mask").masked_loss  # sd-scripts: --alpha_mask alone masks
    assert _parse("--masked_loss", "--alpha_mask", "--unmasked_weight", "0.1").unmasked_weight == 0.1
    assert _parse("--mask_column", "mask").masked_loss and not _parse().masked_loss
    cases = [(["--masked_loss"], "--masked_loss needs masks: add --alpha_mask"),
             (["--alpha_mask", "--mask_column", "m"], "--alpha_mask and --mask_column are two mask sources"),
             (["--unmasked_weight", "0.2"], "--unmasked_weight 0.2 has no effect in this run"),
             (["--alpha_mask", "--unmasked_weight", "2"], r"--unmasked_weight 2: .* in \[0, 1\]"),
             (["--mask_dir", str(tmp_path / "nope")], "no such folder"),
             (["--alpha_mask", "--resolution", "128,256"], "not supported with --resolution 128,256"),
             (["--alpha_mask", "--streaming", "--stream_key_column", "id"], "not supported with --streaming")]
    for extra, message in cases:
        with pytest.raises(UsageError, match=message):
            _parse(*extra)
    (tmp_path / "images" / "masks").mkdir(parents=True)
    import train_text_to_image_arb as script

    with pytest.raises(UsageError, match="inside the image folder"):
        script.parse_args(["--pretrained_model_name_or_path", "m", "--train_data_dir", str(tmp_path / "images"),
                           "--mask_dir", str(tmp_path / "images" / "masks"), "--full_finetune"])


# ------------------------------------------------------------------------------------------- two tiny runs
@pytest.mark.slow
@pytest.mark.xdist_group("masked_loss")
def test_a_cached_masked_run_trains_what_the_on_the_fly_masked_run_trains(train_assets, data, tmp_path):
    """Tiny SD, one epoch (every row once) with masks from a folder where row 01's mask is missing: from the latent
    cache (masks recomputed with each cached crop) and encoding on the fly, the losses match within the cache's
    float16 rounding, the same rows train (01 replaced by 00, one counted line), and every batch was masked."""
    from test_train import COMMON, read_trace, run_script

    folder = tmp_path / "masks"
    folder.mkdir()
    for i in (0, 2, 3):
        Image.open(data["masks"] / f"{i:02d}.png").save(folder / f"{i:02d}.png")
    base = ["--pretrained_model_name_or_path", train_assets["sd"], "--train_data_dir", str(data["images"]), *COMMON,
            "--train_batch_size", "1", "--max_train_steps", "4", "--checkpointing_steps", "100", "--random_flip",
            "--mask_dir", str(folder), "--unmasked_weight", "0.05"]
    runs = {}
    for name, extra in (("fly", []), ("cached", ["--cache_latents"])):
        out = tmp_path / name
        runs[name] = run_script([*base, *extra, "--output_dir", str(out)])
        runs[name]["trace"] = read_trace(out, 0)
        runs[name]["skipped"] = [json.loads(t) for t in (out / "skipped_rows.jsonl").read_text().splitlines()]
    fly, cached = runs["fly"], runs["cached"]
    assert "masked loss: masks from the files of" in fly["log"] and "1 of 4 rows have no mask" in fly["log"]
    assert [t["rows"] for t in fly["trace"]] == [t["rows"] for t in cached["trace"]]
    assert sorted(r for t in fly["trace"] for r in t["rows"]) == [0, 0, 2, 3]  # row 1 trained as row 0
    np.testing.assert_allclose(cached["losses"], fly["losses"], rtol=2e-3)
    assert fly["mask_rows_replaced"] == cached["mask_rows_replaced"] == 1
    assert [(r["row"], r["replaced_by"]) for r in fly["skipped"]] == [(1, 0)] == [
        (r["row"], r["replaced_by"]) for r in cached["skipped"]]
    assert cached["latents_encoded"] == 4  # the cache holds image latents only, one entry per row


#: one family per loss code path: the UNet objective, the shared flow step (SD3, Flux.1, Z-Image, Kontext), Flux.2's
#: patchified latents, Qwen-Image's normalised ones (Qwen-Image-Edit's too)
LOSS_PATHS = ["sd", "flux", "flux2", "qwen"]


@pytest.mark.parametrize("family", LOSS_PATHS)
def test_every_familys_loss_is_unchanged_by_an_all_ones_mask_and_cut_by_a_partial_one(
        family, request: pytest.FixtureRequest) -> None:
    """Each family's own training_loss (the UNet objective, the flow step, Flux.2's patchified latents, Qwen-Image's
    normalised ones) on a real tiny model: the batch's all-ones ``loss_mask`` gives the plain loss, a mask that
    drops half the latent cells gives less."""
    import train_text_to_image_arb as script
    from hf_arb.families import get_family
    from hf_arb.train.cache.caches import TextEncoder

    assets = request.getfixturevalue({"sd": "train_assets", "flux": "flow_assets"}.get(family, "family_assets"))
    args = script.parse_args(["--pretrained_model_name_or_path", assets[family], "--train_data_dir", "d",
                              "--full_finetune", "--learning_rate", "1e-5", "--max_sequence_length", "16"]
                             if family != "sd" else ["--pretrained_model_name_or_path", assets[family],
                                                     "--train_data_dir", "d", "--full_finetune", "--learning_rate",
                                                     "1e-5"])
    models = get_family(args.family).load_models(args)
    pixels = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(7)) * 2 - 1
    batch = {"pixel_values": pixels, "captions": ["a photo", "a cat"],
             "original_sizes": torch.tensor([[48, 64]] * 2), "crop_top_lefts": torch.zeros(2, 2, dtype=torch.long),
             "target_sizes": torch.tensor([[48, 64]] * 2)}
    text = TextEncoder(models, torch.device("cpu"), torch.float32, cache=False)

    def loss(mask: torch.Tensor | None) -> float:
        b = batch if mask is None else {**batch, "loss_mask": mask}
        with torch.no_grad():
            return float(models.family.training_loss(args, models, models.unet, b, text,
                                                     torch.Generator().manual_seed(11), torch.float32))

    plain = loss(None)
    assert loss(torch.ones(2, 1, 6, 8)) == pytest.approx(plain, rel=1e-7, abs=0)
    half = torch.ones(2, 1, 6, 8)
    half[:, :, :, 4:] = 0
    assert 0 < loss(half) < plain
