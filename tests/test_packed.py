"""Packed forwards (hf_arb.packing.model) equal the per-image unpacked forwards of the tiny SD3 and Flux transformers,
image by image, for images of different aspect ratios and prompts of different lengths in one pack."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_arb.packing.model import (
    document_mask,
    enable_packed_attention,
    pack_tokens,
    packed_flux_forward,
    packed_sd3_forward,
    patchify,
    unpack_tokens,
    unpatchify,
)
from hf_arb.packing.plan import pack_meta

LATENTS = [(8, 12), (12, 6), (10, 10)]  # SD3 latent (H, W): token grids 4x6, 6x3, 5x5
GRIDS = [(4, 6), (6, 3), (5, 5)]  # Flux token grids (2x2-packed latents)
TEXT = (5, 7, 4)
ATOL = 2e-5


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    return {
        "latents": [torch.randn(16, h, w, generator=g) for h, w in LATENTS],
        "tokens": [torch.randn(h * w, 64, generator=g) for h, w in GRIDS],
        "text": [torch.randn(n, 64, generator=g) for n in TEXT],
        "pooled": torch.randn(3, 64, generator=g),
        "t": torch.tensor([0.1, 0.5, 0.9]),
        "guidance": torch.tensor([3.5, 2.0, 5.0]),
    }


@pytest.fixture(scope="module")
def sd3():
    from hf_arb.testing.tiny_flow import tiny_sd3_pipeline

    return tiny_sd3_pipeline().transformer.eval()


@pytest.fixture(scope="module")
def flux():
    from hf_arb.testing.tiny_flow import tiny_flux_pipeline

    return tiny_flux_pipeline().transformer.eval()


def _sd3_reference(model, x):
    with torch.no_grad():
        return [model(hidden_states=lat[None], encoder_hidden_states=e[None], pooled_projections=x["pooled"][i:i + 1],
                      timestep=1000 * x["t"][i:i + 1]).sample[0]
                for i, (lat, e) in enumerate(zip(x["latents"], x["text"]))]


def _flux_reference(model, x):
    out = []
    with torch.no_grad():
        for i, ((h, w), tok, e) in enumerate(zip(GRIDS, x["tokens"], x["text"])):
            ids = torch.zeros(h, w, 3)
            ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
            out.append(model(hidden_states=tok[None], encoder_hidden_states=e[None],
                             pooled_projections=x["pooled"][i:i + 1, :32], timestep=x["t"][i:i + 1],
                             img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(e.shape[0], 3),
                             guidance=x["guidance"][i:i + 1]).sample[0])
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
def test_packed_sd3_equals_unpacked_image_by_image(sd3, inputs, backend):
    ref = _sd3_reference(sd3, inputs)  # stock processors
    enable_packed_attention(sd3)
    with torch.no_grad():
        assert torch.allclose(_sd3_reference(sd3, inputs)[0], ref[0], atol=ATOL)  # unpacked calls unchanged
        out = packed_sd3_forward(sd3, inputs["latents"], inputs["text"], inputs["pooled"], 1000 * inputs["t"],
                                 max_tokens=96, max_text_tokens=20, backend=backend)
    assert out.sample.shape == (1, 96, 2 * 2 * 16) and out.meta.padding_fraction == pytest.approx(1 - 67 / 96)
    per = [unpatchify(tok, g, 2) for tok, g in zip(unpack_tokens(out.sample, out.meta.cu_seqlens), out.meta.grids)]
    for got, want in zip(per, ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_the_block_diagonal_mask_is_what_keeps_images_apart(sd3, inputs, monkeypatch):
    import hf_arb.packing.model as packed

    enable_packed_attention(sd3)
    ref = _sd3_reference(sd3, inputs)
    monkeypatch.setattr(packed, "document_mask", lambda doc, backend="auto": None)  # full attention
    with torch.no_grad():
        out = packed_sd3_forward(sd3, inputs["latents"], inputs["text"], inputs["pooled"], 1000 * inputs["t"])
    first = unpatchify(unpack_tokens(out.sample, out.meta.cu_seqlens)[0], out.meta.grids[0], 2)
    assert (first - ref[0]).abs().max() > 1e-3


def test_packed_sd35_dual_attention_and_qk_norm(inputs):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                  attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
                                  caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=64,
                                  dual_attention_layers=(0,), qk_norm="rms_norm").eval()
    ref = _sd3_reference(model, inputs)
    enable_packed_attention(model)
    with torch.no_grad():
        out = packed_sd3_forward(model, inputs["latents"], inputs["text"], inputs["pooled"], 1000 * inputs["t"])
    for tok, g, want in zip(unpack_tokens(out.sample, out.meta.cu_seqlens), out.meta.grids, ref):
        torch.testing.assert_close(unpatchify(tok, g, 2), want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("flex", marks=pytest.mark.slow), "varlen"])
def test_packed_flux_equals_unpacked_image_by_image(flux, inputs, backend):
    ref = _flux_reference(flux, inputs)
    enable_packed_attention(flux)
    with torch.no_grad():
        out = packed_flux_forward(flux, inputs["tokens"], GRIDS, inputs["text"], inputs["pooled"][:, :32],
                                  inputs["t"], inputs["guidance"], max_tokens=80, max_text_tokens=17,
                                  backend=backend)
    assert out.sample.shape == (1, 80, 64)
    for got, want in zip(unpack_tokens(out.sample, out.meta.cu_seqlens), ref):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def _close_grads(got, want, name):
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= 1e-5 + 1e-6 * scale, f"{name}: gradient differs by {err:.3g} (max |grad| {scale:.3g})"


@pytest.mark.parametrize(("backend", "checkpointing"), [("sdpa", False), ("varlen", True)])  # no CPU flex backward
def test_packed_loss_gradients_equal_the_per_image_sum(sd3, inputs, backend, checkpointing):
    enable_packed_attention(sd3)
    if checkpointing:
        sd3.enable_gradient_checkpointing()
    x = inputs
    target = [torch.randn_like(lat) for lat in x["latents"]]
    sd3.zero_grad()
    loss = sum(((sd3(hidden_states=lat[None], encoder_hidden_states=e[None], pooled_projections=x["pooled"][i:i + 1],
                     timestep=1000 * x["t"][i:i + 1]).sample[0] - y) ** 2).sum()
               for i, (lat, e, y) in enumerate(zip(x["latents"], x["text"], target)))
    loss.backward()
    ref = {n: p.grad.clone() for n, p in sd3.named_parameters() if p.grad is not None}
    sd3.zero_grad()
    out = packed_sd3_forward(sd3, x["latents"], x["text"], x["pooled"], 1000 * x["t"], max_tokens=80,
                             backend=backend)
    y = pack_tokens([patchify(t, 2) for t in target], 80)
    mask = torch.as_tensor(out.meta.loss_mask)[None, :, None]
    packed_loss = (((out.sample - y) ** 2) * mask).sum()
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-4)
    packed_loss.backward()
    for n, p in sd3.named_parameters():
        if n in ref:
            _close_grads(p.grad, ref[n], n)
    sd3.disable_gradient_checkpointing()


def test_packed_flux_gradients_equal_the_per_image_sum(flux, inputs):
    enable_packed_attention(flux)
    x = inputs
    flux.zero_grad()
    ref_out = []
    for i, ((h, w), tok, e) in enumerate(zip(GRIDS, x["tokens"], x["text"])):
        ids = torch.zeros(h, w, 3)
        ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
        ref_out.append(flux(hidden_states=tok[None], encoder_hidden_states=e[None],
                            pooled_projections=x["pooled"][i:i + 1, :32], timestep=x["t"][i:i + 1],
                            img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(e.shape[0], 3),
                            guidance=x["guidance"][i:i + 1]).sample[0])
    sum((o ** 2).sum() for o in ref_out).backward()
    ref = {n: p.grad.clone() for n, p in flux.named_parameters() if p.grad is not None}
    flux.zero_grad()
    out = packed_flux_forward(flux, x["tokens"], GRIDS, x["text"], x["pooled"][:, :32], x["t"], x["guidance"],
                              max_tokens=70)
    mask = torch.as_tensor(out.meta.loss_mask)[None, :, None]
    ((out.sample ** 2) * mask).sum().backward()
    assert len(ref) > 20
    for n, p in flux.named_parameters():
        if n in ref:
            _close_grads(p.grad, ref[n], n)


def test_masks_layout_helpers_and_errors(sd3):
    doc = torch.tensor([0, 0, 1, -1])
    m = document_mask(doc, "sdpa")[0, 0]
    assert m.tolist() == [[True, True, False, False], [True, True, False, False],
                          [False, False, True, False], [False, False, False, True]]
    lat = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)
    assert torch.equal(unpatchify(patchify(lat, 2), (2, 3), 2), lat)
    with pytest.raises(ValueError, match="enable_packed_attention"):
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                       in_channels=8, joint_attention_dim=8, pooled_projection_dim=8,
                                       axes_dims_rope=(4, 4, 8))
        packed_flux_forward(model, [torch.zeros(4, 8)], [(2, 2)], [torch.zeros(1, 8)], torch.zeros(1, 8),
                            torch.zeros(1))
    enable_packed_attention(sd3)
    with pytest.raises(ValueError, match=">= 1 image"):
        packed_sd3_forward(sd3, [], [], torch.zeros(0, 64), torch.zeros(0), meta=pack_meta(np.zeros((0, 2)), 4))
