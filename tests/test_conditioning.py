"""SDXL time ids and the SD 1.x resolution embedding (hf_arb.families.conditioning), with tiny offline models."""

from __future__ import annotations

import pytest
import torch

from hf_arb.families.conditioning import (
    StableDiffusionResolutionPipeline,
    add_resolution_conditioning,
    has_resolution_conditioning,
    inference_time_ids,
    resolution_class_labels,
    resolution_embed_dim,
    sdxl_time_ids,
)
from hf_arb.testing.tiny import tiny_sd_pipeline, tiny_sdxl_pipeline


@pytest.fixture(scope="module")
def sdxl():
    return tiny_sdxl_pipeline()


@pytest.fixture(scope="module")
def sd():
    return tiny_sd_pipeline()


@pytest.mark.parametrize(
    "original, crop, target",
    [((48, 80), (0, 0), (48, 80)), ((1080, 1920), (12, 7), (768, 1344)), ((300, 200), (0, 5), (96, 64))],
)
def test_sdxl_time_ids_equal_pipeline(sdxl, original, crop, target):
    proj_dim = sdxl.text_encoder_2.config.projection_dim
    expected = sdxl._get_add_time_ids(original, crop, target, dtype=torch.float32, text_encoder_projection_dim=proj_dim)
    ours = sdxl_time_ids([original], [crop], [target])
    assert ours.shape == (1, 6)
    torch.testing.assert_close(ours, expected)


def test_sdxl_time_ids_per_sample_rows():
    o = torch.tensor([[100, 200], [300, 50]])
    c = torch.tensor([[1, 2], [3, 4]])
    t = torch.tensor([[64, 128], [96, 16]])
    ids = sdxl_time_ids(o, c, t)
    assert ids.tolist() == [[100, 200, 1, 2, 64, 128], [300, 50, 3, 4, 96, 16]]
    with pytest.raises(ValueError, match="same batch size"):
        sdxl_time_ids(o, c[:1], t)
    with pytest.raises(ValueError, match=r"shape \(B, 2\)"):
        sdxl_time_ids(torch.zeros(2, 3), c, t)


def test_inference_time_ids_defaults_match_sdxl_call_defaults(sdxl):
    # StableDiffusionXLPipeline.__call__ uses original_size = target_size = (height, width), crop (0, 0).
    ids = inference_time_ids(48, 80)
    assert ids.tolist() == [[48, 80, 0, 0, 48, 80]]


def test_resolution_labels_match_sdxl_add_time_proj(sdxl):
    # The SD 1.x embedding uses the same sinusoid as SDXL's add_time_proj.
    ids = sdxl_time_ids([(48, 80), (64, 32)], [(0, 3), (1, 0)], [(48, 80), (64, 32)])
    dim = sdxl.unet.config.addition_time_embed_dim
    expected = sdxl.unet.add_time_proj(ids.flatten()).reshape(2, -1)
    torch.testing.assert_close(resolution_class_labels(ids, dim), expected)


def test_zero_init_embedding_leaves_output_unchanged(sd):
    base = sd.unet
    cond = add_resolution_conditioning(base, embed_dim=16)
    assert has_resolution_conditioning(cond) and not has_resolution_conditioning(base)
    assert resolution_embed_dim(cond) == 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, 10, generator=g)  # non-square latents
    text = torch.randn(2, 77, base.config.cross_attention_dim, generator=g)
    t = torch.tensor([10, 500])
    labels = resolution_class_labels(sdxl_time_ids([(48, 80)] * 2, [(0, 0)] * 2, [(48, 80)] * 2), 16)
    with torch.no_grad():
        ref = base(x, t, text).sample
        out = cond(x, t, text, class_labels=labels).sample
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # Not a no-op once trained: a non-zero output layer changes the prediction.
    with torch.no_grad():
        cond.class_embedding.linear_2.weight.normal_(generator=g)
        changed = cond(x, t, text, class_labels=labels).sample
    assert not torch.allclose(changed, ref)


def test_add_resolution_conditioning_rejects_sdxl(sdxl):
    with pytest.raises(ValueError, match="SDXL UNets already take"):
        add_resolution_conditioning(sdxl.unet)


def test_resolution_pipeline_generates_non_square(sd, tmp_path):
    pipe = StableDiffusionResolutionPipeline(**sd.components)
    pipe.unet = add_resolution_conditioning(sd.unet, embed_dim=16)
    pipe.save_pretrained(tmp_path)
    loaded = StableDiffusionResolutionPipeline.from_pretrained(tmp_path)
    assert has_resolution_conditioning(loaded.unet)
    seen = []
    hook = loaded.unet.register_forward_hook(lambda m, a, kw, out: seen.append(kw.get("class_labels")),
                                             with_kwargs=True)
    out = loaded("a cat", height=48, width=80, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0))
    hook.remove()
    assert out.images.shape == (1, 48, 80, 3)
    assert seen and all(s is not None and s.shape[1] == 6 * 16 for s in seen)
    # The hook is removed after the call: the UNet alone is unchanged.
    assert not loaded.unet._forward_pre_hooks
