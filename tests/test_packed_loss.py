"""The packed flow-matching loss (hf_arb.packing.loss) equals the mean of the per-image, unpacked losses that
diffusers' SD3/Flux training scripts compute, for the tiny SD3 and Flux transformers, every weighting scheme,
with and without preconditioned outputs; and its gradients equal the per-image losses' gradients."""

from __future__ import annotations

import pytest
import torch
from diffusers.training_utils import compute_loss_weighting_for_sd3

from hf_arb.packing.loss import (
    PackedFlowModel,
    flow_family,
    flux_pack_latent,
    flux_unpack_latent,
    packed_flow_loss,
)
from hf_arb.packing.model import enable_packed_attention

LATENTS = [(8, 12), (12, 6), (10, 10)]  # (H, W) of 16-channel latents: SD3 grids 4x6, 6x3, 5x5 (Flux the same)
TEXT = (5, 7, 4)
SIGMAS = [0.15, 0.6, 0.93]


@pytest.fixture(scope="module")
def x():
    g = torch.Generator().manual_seed(3)
    return {
        "latents": [torch.randn(16, h, w, generator=g) for h, w in LATENTS],
        "noise": [torch.randn(16, h, w, generator=g) for h, w in LATENTS],
        "text": [torch.randn(n, 64, generator=g) for n in TEXT],
        "pooled": torch.randn(3, 64, generator=g),
        "sigmas": torch.tensor(SIGMAS),
        "guidance": torch.tensor([3.5, 1.0, 4.0]),
    }


@pytest.fixture(scope="module")
def sd3():
    from hf_arb.testing.tiny_flow import tiny_sd3_pipeline

    return enable_packed_attention(tiny_sd3_pipeline().transformer.eval())


@pytest.fixture(scope="module")
def flux():
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline

    return enable_packed_attention(tiny_flux_pipeline().transformer.eval())


def _per_image_losses(model, x, scheme, precondition):
    """diffusers' SD3/Flux training loss, one image at a time through the model's own forward."""
    family, out = flow_family(model), []
    for i, (lat, n, e) in enumerate(zip(x["latents"], x["noise"], x["text"])):
        s = x["sigmas"][i]
        noisy = (1 - s) * lat + s * n
        if family == "sd3":
            pred = model(hidden_states=noisy[None], encoder_hidden_states=e[None],
                         pooled_projections=x["pooled"][i:i + 1],
                         timestep=(1000 * s)[None]).sample[0]
        else:
            h, w = lat.shape[1] // 2, lat.shape[2] // 2
            ids = torch.zeros(h, w, 3)
            ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
            tokens = model(hidden_states=flux_pack_latent(noisy)[None], encoder_hidden_states=e[None],
                           pooled_projections=x["pooled"][i:i + 1, :32], timestep=s[None],
                           img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(e.shape[0], 3),
                           guidance=x["guidance"][i:i + 1]).sample[0]
            pred = flux_unpack_latent(tokens, (h, w))
        if precondition:
            pred, target = pred * (-s) + noisy, lat
        else:
            target = n - lat
        weight = compute_loss_weighting_for_sd3(scheme, s[None])[0]
        out.append(torch.mean(weight * (pred - target) ** 2))
    return torch.stack(out)


def _packed(model, x, **kw):
    flux = flow_family(model) == "flux"
    return packed_flow_loss(model, x["latents"], x["noise"], x["text"], x["pooled"][:, :32] if flux else x["pooled"],
                            x["sigmas"], guidance=x["guidance"] if flux else None, **kw)


@pytest.mark.parametrize(("family", "scheme", "precondition"), [
    ("sd3", "none", False), ("sd3", "cosmap", True), ("flux", "sigma_sqrt", False), ("flux", "logit_normal", True)])
def test_packed_loss_equals_the_mean_of_per_image_losses(request, x, family, scheme, precondition):
    model = request.getfixturevalue(family)
    with torch.no_grad():
        ref = _per_image_losses(model, x, scheme, precondition)
        out = _packed(model, x, max_tokens=80, max_text_tokens=20, weighting_scheme=scheme,
                      precondition_outputs=precondition)
    assert out.meta.padding_fraction == pytest.approx(1 - 67 / 80)  # padding present, and masked
    torch.testing.assert_close(out.per_image, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.mean(), rtol=1e-5, atol=1e-6)


def test_token_reduction_weighs_images_by_their_tokens(sd3, x):
    with torch.no_grad():
        ref = _per_image_losses(sd3, x, "none", False)
        out = _packed(sd3, x, max_tokens=96, reduction="token")
    tokens = torch.tensor([24.0, 18.0, 25.0])
    torch.testing.assert_close(out.loss, (ref * tokens).sum() / tokens.sum(), rtol=1e-5, atol=1e-6)
    assert not torch.isclose(out.loss, ref.mean())


def test_packed_loss_gradients_equal_the_per_image_mean(sd3, x):
    sd3.zero_grad()
    _per_image_losses(sd3, x, "cosmap", False).mean().backward()
    ref = {n: p.grad.clone() for n, p in sd3.named_parameters() if p.grad is not None}
    sd3.zero_grad()
    model = PackedFlowModel(sd3, backend="sdpa")
    loss, per_image = model(x["latents"], x["noise"], x["text"], x["pooled"], x["sigmas"], max_tokens=72,
                            weighting_scheme="cosmap")
    loss.backward()
    assert per_image.shape == (3,) and model.last_meta.num_images == 3 and len(ref) > 20
    for n, p in sd3.named_parameters():
        if n in ref:
            err, scale = float((p.grad - ref[n]).abs().max()), float(ref[n].abs().max())
            assert err <= 1e-6 + 1e-5 * scale, f"{n}: gradient differs by {err:.3g}"
    sd3.zero_grad()


def test_flux_latent_packing_is_the_pipelines():
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    packed, _ = pipe.prepare_latents(1, 16, 48, 80, torch.float32, torch.device("cpu"),
                                     torch.Generator().manual_seed(0))
    raw = torch.randn(1, 16, 6, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(flux_pack_latent(raw[0]), packed[0])
    assert torch.equal(flux_unpack_latent(packed[0], (3, 5)), raw[0])


def test_errors_name_the_fix(sd3, x):
    with pytest.raises(TypeError, match="max_pixels_per_batch"):
        flow_family(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="one sigma per image"):
        packed_flow_loss(sd3, x["latents"], x["noise"], x["text"], x["pooled"], [0.5])
    with pytest.raises(ValueError, match="reduction"):
        packed_flow_loss(sd3, x["latents"], x["noise"], x["text"], x["pooled"], x["sigmas"], reduction="sum")
    with pytest.raises(ValueError, match=">= 1 image"):
        packed_flow_loss(sd3, [], [], [], x["pooled"][:0], [])


# ------------------------------------------------------------------------------ the training step (--packing)
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_one_image_pack_trains_exactly_like_a_one_image_batch(family):
    """packed_flow_step draws posterior sample, noise, u and prompt dropout in flow_loss's order and shifts by the
    image's own token count, so a pack of one image (with padding) has the loss of the bucketed batch of it."""
    from hf_arb.families import get_family
    from hf_arb.families.flow import flow_loss
    from hf_arb.packing.family import packed_flow_step
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline, tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline() if family == "sd3" else tiny_flux_pipeline()
    fam = get_family(family)
    opts = fam.options(pipe.scheduler.config, pipe.transformer, max_sequence_length=16)
    assert opts.by_resolution == (family == "flux")  # Flux shifts per resolution, SD3 statically (both paths)
    tokenizers = [pipe.tokenizer, pipe.tokenizer_2] + ([pipe.tokenizer_3] if family == "sd3" else [])
    encoders = [pipe.text_encoder, pipe.text_encoder_2] + ([pipe.text_encoder_3] if family == "sd3" else [])

    def encode(captions):
        return fam.encode_prompts(tokenizers, encoders, captions, torch.device("cpu"), 16)

    pixels = torch.rand(3, 48, 80, generator=torch.Generator().manual_seed(0)) * 2 - 1
    captions = ["a wide photo"]
    model = PackedFlowModel(pipe.transformer)
    with torch.no_grad():
        packed = packed_flow_step(fam, opts, model, {"pixel_values": [pixels], "grids": torch.tensor([[3, 5]]),
                                                     "captions": captions}, pipe.vae, encode,
                                  torch.Generator().manual_seed(7), torch.float32, max_tokens=20,
                                  proportion_empty_prompts=0.5)
        ref = flow_loss(fam, opts, pipe.transformer, {"pixel_values": pixels[None], "captions": captions}, pipe.vae,
                        encode, torch.Generator().manual_seed(7), torch.float32, proportion_empty_prompts=0.5)
    assert model.last_meta.padding_fraction == pytest.approx(1 - 15 / 20)
    torch.testing.assert_close(packed, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ packing asks the adapter
def test_packing_asks_the_adapter_and_the_transformer_not_a_family_name():
    """packing/ never compares a family's name: the packed forward is chosen by the transformer's class
    (PACKED_ARCHITECTURES), which covers every family whose adapter says --packing applies, and the guidance input
    comes from the adapter (Family.guidance)."""
    import re
    from pathlib import Path

    import hf_arb.packing
    from hf_arb.families import family_names, get_family
    from hf_arb.packing.loss import PACKED_ARCHITECTURES

    names = "|".join(re.escape(n) for n in family_names())
    branch = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    hits = [f"{p.name}:{i}" for p in Path(hf_arb.packing.__file__).parent.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert not hits, hits
    packable = [get_family(n) for n in family_names() if get_family(n).supports_packing]
    assert {f.name for f in packable} >= {"sd3", "flux"}
    assert {f.transformer_class_name for f in packable} <= {a.transformer_class for a in PACKED_ARCHITECTURES}
    options = get_family("flux").options({}, type("T", (), {"config": {"guidance_embeds": True}})(), guidance_scale=2.5)
    assert get_family("flux").guidance(options, 3, "cpu").tolist() == [2.5] * 3
    assert get_family("sd3").guidance(options.__class__(**{**vars(options), "guidance_embeds": False}), 3,
                                      "cpu") is None
