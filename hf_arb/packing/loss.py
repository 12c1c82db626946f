"""The flow-matching loss of SD3 and Flux on a pack: several images at their own size in one sequence.

For each image ``i`` of a pack (latent ``x_i``, noise ``n_i``, its own shifted sigma ``s_i``, e.g.
:attr:`~hf_arb.packing.layout.PackMeta.sigmas` from :func:`~hf_arb.packing.layout.pack_meta` with a per-image resolution
shift) the model sees ``(1 - s_i) x_i + s_i n_i`` at timestep ``s_i`` and is trained towards ``n_i - x_i``
(``precondition_outputs``: towards ``x_i`` with the prediction mapped back as ``pred * (-s_i) + noisy``), weighted
by diffusers' ``compute_loss_weighting_for_sd3`` of ``s_i`` — diffusers' SD3/Flux training scripts, per image. The
forward is :func:`~hf_arb.packing.model.packed_sd3_forward` / :func:`~hf_arb.packing.model.packed_flux_forward`; the
loss is computed on the packed sequence with the padding masked:

* ``reduction="image"`` (default): the mean over the pack's images of each image's mean squared error — equal to
  the mean of the per-image (unpacked) losses, whatever the images' sizes (tested on tiny SD3 and Flux);
* ``reduction="token"``: the mean over all real tokens (big images weigh more, NaViT's choice).

:class:`PackedFlowModel` wraps a transformer in an ``nn.Module`` whose ``forward`` is this loss, so that
``accelerator.prepare`` (DDP, FSDP) wraps the packed computation: the packed forward calls the transformer's
submodules, not its ``forward``, and DDP synchronises gradients only for work done inside its own ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .layout import PackMeta
from .model import (
    Backend,
    enable_packed_attention,
    pack_tokens,
    packed_flux_forward,
    packed_sd3_forward,
    patchify,
)

__all__ = ["PACKED_ARCHITECTURES", "PackedArchitecture", "PackedFlowModel", "PackedLoss", "denoiser", "flow_family",
           "flux_pack_latent", "flux_unpack_latent", "packed_architecture", "packed_flow_loss"]

Reduction = Literal["image", "token"]


def flux_pack_latent(latent: torch.Tensor) -> torch.Tensor:
    """A ``(C, H, W)`` latent as Flux's ``(H/2 * W/2, 4C)`` tokens (:func:`hf_arb.families.flux.pack_latents`, the
    order of ``FluxPipeline``'s latent packing)."""
    from hf_arb.families.flux import pack_latents

    return pack_latents(latent[None])[0]


def flux_unpack_latent(tokens: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`flux_pack_latent`: ``(h * w, 4C)`` tokens of token grid ``(h, w)`` → ``(C, 2h, 2w)``."""
    from hf_arb.families.flux import unpack_latents

    return unpack_latents(tokens[None], 2 * int(grid[0]), 2 * int(grid[1]))[0]


def _sd3_forward(transformer: Any, noisy: list[torch.Tensor], text: list[torch.Tensor], pooled: torch.Tensor,
                 sig: torch.Tensor, guidance: torch.Tensor | None, num_train_timesteps: int, dtype: torch.dtype,
                 **kw: Any) -> Any:
    """SD3's packed forward: latents as they are, timestep ``sigma × num_train_timesteps`` (as the pipeline)."""
    return packed_sd3_forward(transformer, [x.to(dtype) for x in noisy], text, pooled,
                              (sig * num_train_timesteps).to(dtype), **kw)


def _flux_forward(transformer: Any, noisy: list[torch.Tensor], text: list[torch.Tensor], pooled: torch.Tensor,
                  sig: torch.Tensor, guidance: torch.Tensor | None, num_train_timesteps: int, dtype: torch.dtype,
                  **kw: Any) -> Any:
    """Flux's packed forward: 2×2-packed latent tokens, timestep ``sigma``, guidance where the model takes it."""
    grids = [(x.shape[-2] // 2, x.shape[-1] // 2) for x in noisy]
    return packed_flux_forward(transformer, [flux_pack_latent(x).to(dtype) for x in noisy], grids, text, pooled,
                               sig.to(dtype), None if guidance is None else guidance.to(dtype), **kw)


@dataclass(frozen=True)
class PackedArchitecture:
    """How ``--packing`` runs one diffusers transformer class: the packed forward is written against the class's
    submodules (:mod:`hf_arb.packing.model`), so it is chosen by the transformer, not by a family's name (Flux.1
    Kontext has Flux.1's transformer; its adapter says whether packing applies: ``Family.supports_packing``).

    Attributes:
        name: the architecture (:func:`flow_family` reports it).
        transformer_class: the diffusers class name (a family's ``transformer_class_name``).
        tokens: ``(transformer, latent (C, H, W))`` → its ``(n, D)`` tokens, in the order of the forward's output.
        forward: ``(transformer, noisy latents, texts, pooled, sigmas, guidance, num_train_timesteps, dtype,
            **pack layout)`` → :class:`~hf_arb.packing.model.PackedOutput`.
    """

    name: str
    transformer_class: str
    tokens: Callable[[Any, torch.Tensor], torch.Tensor] = field(repr=False)
    forward: Callable[..., Any] = field(repr=False)


#: The transformers ``--packing`` has a packed forward for.
PACKED_ARCHITECTURES: tuple[PackedArchitecture, ...] = (
    PackedArchitecture("sd3", "SD3Transformer2DModel", lambda t, x: patchify(x, t.config.patch_size), _sd3_forward),
    PackedArchitecture("flux", "FluxTransformer2DModel", lambda _t, x: flux_pack_latent(x), _flux_forward),
)


def packed_architecture(transformer: Any) -> PackedArchitecture:
    """The :class:`PackedArchitecture` of ``transformer`` (an instance of one of its diffusers classes).

    Raises:
        TypeError: a model packing has no forward for (a UNet, or another transformer).
    """
    import diffusers

    for arch in PACKED_ARCHITECTURES:
        if isinstance(transformer, getattr(diffusers, arch.transformer_class)):
            return arch
    raise TypeError(f"Packing trains {' or '.join(a.transformer_class for a in PACKED_ARCHITECTURES)}, got "
                    f"{type(transformer).__name__}. UNet models (SD 1.x/2.x, SDXL) have no token sequence: use buckets "
                    "(and `--max_pixels_per_batch` for a per-bucket batch size).")


def flow_family(transformer: Any) -> str:
    """``"sd3"`` or ``"flux"`` for diffusers' ``SD3Transformer2DModel`` / ``FluxTransformer2DModel``: the name of
    its :func:`packed_architecture`."""
    return packed_architecture(transformer).name


@dataclass
class PackedLoss:
    """``loss``: the scalar to backpropagate; ``per_image``: each image's weighted MSE ``(m,)`` (float32);
    ``meta``: the pack's layout."""

    loss: torch.Tensor
    per_image: torch.Tensor
    meta: PackMeta


def denoiser(model: Any) -> Any:
    """The transformer inside a :class:`PackedFlowModel` (after ``accelerator.unwrap_model``), else ``model``."""
    return model.transformer if isinstance(model, PackedFlowModel) else model


def packed_flow_loss(transformer: Any, latents: Sequence[torch.Tensor], noise: Sequence[torch.Tensor],
                     prompt_embeds: Sequence[torch.Tensor], pooled_projections: torch.Tensor, sigmas: Any, *,
                     guidance: torch.Tensor | None = None, max_tokens: int | None = None,
                     max_text_tokens: int | None = None, meta: PackMeta | None = None,
                     weighting_scheme: str = "none", precondition_outputs: bool = False,
                     reduction: Reduction = "image", num_train_timesteps: int = 1000,
                     dtype: torch.dtype | None = None, backend: Backend = "auto",
                     masks: Sequence[torch.Tensor] | None = None) -> PackedLoss:
    """The flow-matching loss of one pack (see the module docstring).

    Args:
        transformer: an ``SD3Transformer2DModel`` or ``FluxTransformer2DModel`` after
            :func:`~hf_arb.packing.model.enable_packed_attention` (:class:`PackedFlowModel` calls it).
        latents, noise: ``m`` latents ``(C, H_i, W_i)`` (VAE-scaled, sides divisible by 2) and their noise.
        prompt_embeds: ``m`` text embeddings ``(T_i, joint_attention_dim)``.
        pooled_projections: ``(m, pooled_projection_dim)``.
        sigmas: each image's (shifted) sigma in ``(0, 1]``, ``(m,)``.
        guidance: Flux's guidance input per image ``(m,)`` (guidance-distilled models only).
        max_tokens, max_text_tokens, meta: the pack's slots or its precomputed layout (``meta.sigmas`` is not
            read: pass ``sigmas``).
        weighting_scheme: diffusers' ``--weighting_scheme`` (``"sigma_sqrt"``, ``"cosmap"``; others weigh 1).
        precondition_outputs: diffusers' ``--precondition_outputs`` (target ``x``, prediction ``pred·(-s) + noisy``).
        reduction: ``"image"`` or ``"token"``.
        num_train_timesteps: SD3's timestep scale (``timestep = sigma × num_train_timesteps``).
        dtype: the dtype of the model's inputs (noisy latents, text, timesteps; default: the latents'); targets and
            the loss stay in float32.
        backend: attention backend of the packed forward.
        masks: ``--masked_loss``: each image's loss weights on its latent grid, ``(1, H_i, W_i)``; tokenised as its
            latent is, so every element of the packed error gets its own cell's weight
            (:func:`hf_arb.families.loss_mask.apply_loss_mask`; the normalisation is unchanged).

    Raises:
        ValueError: inputs of different lengths, or an unknown ``reduction``.
    """
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    m = len(latents)
    if not (len(noise) == len(prompt_embeds) == m) or m == 0:
        raise ValueError(f"A pack needs >= 1 image and one noise and text per latent, got {m} latents, {len(noise)} "
                         f"noises, {len(prompt_embeds)} texts.")
    if reduction not in ("image", "token"):
        raise ValueError(f"`reduction` must be 'image' or 'token', got {reduction!r}.")
    arch = packed_architecture(transformer)
    dev = latents[0].device
    dtype = latents[0].dtype if dtype is None else dtype
    sig = torch.as_tensor(sigmas, dtype=torch.float32, device=dev).reshape(-1)
    if sig.numel() != m:
        raise ValueError(f"`sigmas` must hold one sigma per image ({m}), got {sig.numel()}.")
    noisy = [(1 - s) * x.float() + s * n.float() for s, x, n in zip(sig, latents, noise)]
    text = [e.to(dtype) for e in prompt_embeds]
    pooled = pooled_projections.to(dtype)
    out = arch.forward(transformer, noisy, text, pooled, sig, guidance, num_train_timesteps, dtype,
                       max_tokens=max_tokens, max_text_tokens=max_text_tokens, meta=meta, backend=backend)

    def to_tokens(x: torch.Tensor) -> torch.Tensor:
        return arch.tokens(transformer, x)
    meta = out.meta
    length = int(meta.document_id.size)
    doc = torch.as_tensor(meta.document_id, device=dev).long()
    idx, real = doc.clamp(min=0), (doc >= 0)
    pred = out.sample[0].float()  # (L, D)
    if precondition_outputs:
        pred = pred * (-sig[idx])[:, None] + pack_tokens([to_tokens(x) for x in noisy], length)[0]
        target = pack_tokens([to_tokens(x.float()) for x in latents], length)[0]
    else:
        target = pack_tokens([to_tokens(n.float() - x.float()) for x, n in zip(latents, noise)], length)[0]
    weight = compute_loss_weighting_for_sd3(weighting_scheme, sig).float()  # (m,)
    mask = None
    if masks is not None:  # each image's (1, H_i, W_i) weights, tokenised like its latent: (L, D)
        from hf_arb.families.loss_mask import apply_loss_mask

        mask = pack_tokens([to_tokens(w.float().expand(x.shape[0], -1, -1).contiguous())
                            for w, x in zip(masks, latents)], length)[0]
    error = (pred - target) ** 2 if mask is None else apply_loss_mask((pred - target) ** 2, mask)
    se = error.sum(-1) * weight[idx] * real  # (L,): padding masked
    per_sum = torch.zeros(m, device=dev, dtype=se.dtype).index_add(0, idx, se)
    elems = torch.as_tensor(meta.seq_lens, device=dev, dtype=se.dtype) * pred.shape[-1]
    per_image = per_sum / elems
    loss = per_image.mean() if reduction == "image" else per_sum.sum() / elems.sum()
    return PackedLoss(loss, per_image, meta)


class PackedFlowModel(torch.nn.Module):
    """An ``nn.Module`` around an SD3/Flux transformer whose ``forward`` is :func:`packed_flow_loss`.

    Prepare this wrapper with ``accelerator.prepare`` (not the bare transformer) so that DDP/FSDP see the packed
    computation as the module's forward; ``accelerator.unwrap_model(model).transformer`` is the transformer to
    save. ``forward`` takes :func:`packed_flow_loss`'s arguments after ``transformer`` and returns
    ``(loss, per_image)``; the last call's layout is :attr:`last_meta`.
    """

    def __init__(self, transformer: Any, backend: Backend = "auto") -> None:
        super().__init__()
        self.family = packed_architecture(transformer).name
        enable_packed_attention(transformer)
        self.transformer = transformer
        self.backend = backend
        self.last_meta: PackMeta | None = None

    def forward(self, latents: Sequence[torch.Tensor], noise: Sequence[torch.Tensor],
                prompt_embeds: Sequence[torch.Tensor], pooled_projections: torch.Tensor, sigmas: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs.setdefault("backend", self.backend)
        out = packed_flow_loss(self.transformer, latents, noise, prompt_embeds, pooled_projections, sigmas, **kwargs)
        self.last_meta = out.meta
        return out.loss, out.per_image
