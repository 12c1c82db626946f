"""Packed forwards of diffusers' SD3 and Flux transformers: several images at their own size in one sequence.

A pack (:mod:`hf_arb.packing`) concatenates the latent tokens of ``m`` images, each at its own resolution, and the
text tokens of their ``m`` prompts. Three things make the packed forward equal the per-image forwards:

* **attention** is block-diagonal: a token attends only to the image and text tokens of its own image
  (``document_id``). :class:`PackedJointAttnProcessor` (SD3) and :class:`PackedFluxAttnProcessor` (Flux) are
  attention processors installed with the public ``model.set_attn_processor``; they take the mask as
  ``attention_mask``: a boolean tensor (``torch.nn.functional.scaled_dot_product_attention``) or a FlexAttention
  ``BlockMask`` built from ``document_id`` (``backend="flex"``: block-sparse, no ``L × L`` mask). Without a mask
  they compute exactly what the stock processors compute, so the model's own ``forward`` keeps working.
* **position embeddings** are per image: SD3's ``pos_embed`` (patch embedding + cropped sin-cos table) is called
  on each image's latent; Flux's RoPE ids are each token's ``(row, col)`` inside its own image.
* **timestep and text conditioning** are per image: adaLN modulations are computed once per image and gathered
  to its tokens.

diffusers' transformer blocks broadcast one modulation per batch row over the whole sequence, and expose no hook
for a per-token one, so :func:`packed_sd3_forward` and :func:`packed_flux_forward` run the models' public
submodules (``pos_embed``, ``time_text_embed``, ``context_embedder``, each block's ``norm1``/``attn``/``ff`` …,
``norm_out``, ``proj_out``) in the order of the models' ``forward``, with per-token modulation. Varlen flash
attention (``flash_attn_varlen_func`` with :attr:`~hf_arb.packing.PackMeta.cu_seqlens` and ``max_seqlen``) is the
GPU option for the same layout; it is not wired here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .attention import (
    Backend,
    DocumentSegments,
    PackedFluxAttnProcessor,
    PackedJointAttnProcessor,
    check_processors,
    document_mask,
    enable_packed_attention,
)
from .layout import PackMeta, pack_meta

__all__ = ["PackedOutput", "flux_image_ids", "pack_tokens", "packed_flux_forward", "packed_sd3_forward", "patchify",
           "unpack_tokens", "unpatchify"]
_REEXPORTED = (DocumentSegments, PackedFluxAttnProcessor, PackedJointAttnProcessor, enable_packed_attention)


# ------------------------------------------------------------------------------------------------- layout helpers
def patchify(latent: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(C, H, W)`` latent → ``(H/p * W/p, p * p * C)`` tokens in the order of SD3's ``proj_out`` output."""
    c, h, w = latent.shape
    p = patch_size
    return latent.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, grid: Sequence[int], patch_size: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``(h * w, p * p * C)`` tokens of grid ``(h, w)`` → ``(C, h * p, w * p)``."""
    h, w = int(grid[0]), int(grid[1])
    p = patch_size
    c = tokens.shape[-1] // (p * p)
    return tokens.reshape(h, w, p, p, c).permute(4, 0, 2, 1, 3).reshape(c, h * p, w * p)


def pack_tokens(parts: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Concatenate ``(n_i, C)`` token tensors and zero-pad to ``(1, length, C)``."""
    x = torch.cat(list(parts), 0)
    if x.shape[0] > length:
        raise ValueError(f"{x.shape[0]} tokens do not fit a pack of {length}.")
    return F.pad(x, (0, 0, 0, length - x.shape[0]))[None]


def unpack_tokens(packed: torch.Tensor, cu_seqlens: Any) -> list[torch.Tensor]:
    """Split ``(1, L, C)`` packed tokens back into the ``(n_i, C)`` tokens of each image."""
    cu = np.asarray(cu_seqlens).tolist()
    return [packed[0, a:b] for a, b in zip(cu[:-1], cu[1:])]


@dataclass
class PackedOutput:
    """``sample``: ``(1, L, C)`` predicted tokens of the pack (padding slots included, see ``meta.loss_mask``)."""

    sample: torch.Tensor
    meta: PackMeta


# ------------------------------------------------------------------------------------------------- forwards
def _modulation(norm: Any, temb: torch.Tensor, idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``norm.linear(norm.silu(temb))`` once per image, split in ``n`` and gathered per token: ``(1, S, D)`` each."""
    emb = norm.linear(norm.silu(temb))
    return [c[idx][None] for c in emb.chunk(n, dim=1)]


def _checkpointing(model: Any) -> bool:
    """Whether to run blocks under activation checkpointing (``model.enable_gradient_checkpointing()``)."""
    return torch.is_grad_enabled() and bool(getattr(model, "is_gradient_checkpointing", False))


def _run(ckpt: bool, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, under ``torch.utils.checkpoint`` when ``ckpt``."""
    if ckpt:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _sd3_block(block: Any, hs: torch.Tensor, ctx: torch.Tensor, temb: torch.Tensor, idx: torch.Tensor,
               tidx: torch.Tensor, joint_mask: Any, image_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``JointTransformerBlock.forward`` with per-token modulation: returns ``(ctx, hs)``."""
    dual = block.attn2 is not None
    mod = _modulation(block.norm1, temb, idx, 9 if dual else 6)
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mod[:6]
    normed = block.norm1.norm(hs)
    if block.context_pre_only:  # AdaLayerNormContinuous: (scale, shift)
        c_scale, c_shift = _modulation(block.norm1_context, temb, tidx, 2)
    else:
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(block.norm1_context, temb,
                                                                                     tidx, 6)
    attn_out, ctx_out = block.attn(hidden_states=normed * (1 + scale) + shift,
                                   encoder_hidden_states=block.norm1_context.norm(ctx) * (1 + c_scale) + c_shift,
                                   attention_mask=joint_mask)
    hs = hs + gate * attn_out
    if dual:
        shift2, scale2, gate2 = mod[6:]
        hs = hs + gate2 * block.attn2(hidden_states=normed * (1 + scale2) + shift2, attention_mask=image_mask)
    hs = hs + gate_mlp * block.ff(block.norm2(hs) * (1 + scale_mlp) + shift_mlp)
    if not block.context_pre_only:
        ctx = ctx + c_gate * ctx_out
        ctx = ctx + c_gate_mlp * block.ff_context(block.norm2_context(ctx) * (1 + c_scale_mlp) + c_shift_mlp)
    return ctx, hs


def _flux_block(block: Any, hs: torch.Tensor, ctx: torch.Tensor, temb: torch.Tensor, idx: torch.Tensor,
                tidx: torch.Tensor, rope: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` with per-token modulation: returns ``(ctx, hs)``."""
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = _modulation(block.norm1, temb, idx, 6)
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(block.norm1_context, temb, tidx, 6)
    attn_out, ctx_out = block.attn(hidden_states=block.norm1.norm(hs) * (1 + scale) + shift,
                                   encoder_hidden_states=block.norm1_context.norm(ctx) * (1 + c_scale) + c_shift,
                                   image_rotary_emb=rope, attention_mask=mask)
    hs = hs + gate * attn_out
    hs = hs + gate_mlp * block.ff(block.norm2(hs) * (1 + scale_mlp) + shift_mlp)
    ctx = ctx + c_gate * ctx_out
    ctx = ctx + c_gate_mlp * block.ff_context(block.norm2_context(ctx) * (1 + c_scale_mlp) + c_shift_mlp)
    return ctx, hs


def _flux_single_block(block: Any, x: torch.Tensor, temb: torch.Tensor, idx: torch.Tensor, rope: Any,
                       mask: Any) -> torch.Tensor:
    """``FluxSingleTransformerBlock.forward`` on the joint ``[text, image]`` sequence, per-token modulation."""
    shift, scale, gate = _modulation(block.norm, temb, idx, 3)
    normed = block.norm.norm(x) * (1 + scale) + shift
    attn_out = block.attn(hidden_states=normed, image_rotary_emb=rope, attention_mask=mask)
    return x + gate * block.proj_out(torch.cat([attn_out, block.act_mlp(block.proj_mlp(normed))], 2))


def _text(encoder_hidden_states: Any, meta: PackMeta) -> torch.Tensor:
    parts = [e for e in encoder_hidden_states]
    return pack_tokens(parts, int(meta.text_document_id.size))


def _prepare(meta: PackMeta | None, grids: Any, max_tokens: int | None, text: Any, max_text_tokens: int | None,
             n_images: int) -> PackMeta:
    if meta is None:
        g = np.asarray(grids, dtype=np.int64).reshape(-1, 2)
        budget = int(max_tokens) if max_tokens is not None else int((g[:, 0] * g[:, 1]).sum())
        meta = pack_meta(g, budget, text_lens=[int(e.shape[0]) for e in text], max_text_tokens=max_text_tokens)
    if meta.num_images != n_images or n_images == 0:
        raise ValueError(f"The pack has {meta.num_images} images in its metadata and {n_images} inputs; "
                         "packs need >= 1 image and one input per image.")
    return meta


def packed_sd3_forward(model: Any, latents: Sequence[torch.Tensor], encoder_hidden_states: Sequence[torch.Tensor],
                       pooled_projections: torch.Tensor, timestep: torch.Tensor, *, max_tokens: int | None = None,
                       max_text_tokens: int | None = None, meta: PackMeta | None = None,
                       backend: Backend = "auto") -> PackedOutput:
    """One pack through an ``SD3Transformer2DModel`` (after :func:`enable_packed_attention`).

    Args:
        model: the transformer (``skip_layers``, ControlNet and IP-Adapter inputs are not supported packed).
        latents: ``m`` latents ``(C, H_i, W_i)``, each at its own size (sides divisible by the patch size).
        encoder_hidden_states: ``m`` text embeddings ``(T_i, joint_attention_dim)``.
        pooled_projections: ``(m, pooled_projection_dim)``; timestep: ``(m,)`` (the scheduler's scale, 0–1000).
        max_tokens, max_text_tokens: pack slots (default: no padding); meta: precomputed layout instead.
        backend: ``"sdpa"`` (explicit boolean mask), ``"flex"`` (FlexAttention block mask), ``"varlen"`` (one
            attention call per image) or ``"auto"`` (= varlen); see :func:`document_mask`.

    Returns:
        :class:`PackedOutput` with ``sample`` ``(1, L, p * p * C)``; :func:`unpack_tokens` + :func:`unpatchify`
        give each image's ``(C, H_i, W_i)`` prediction, or compare with :func:`patchify` targets and
        ``meta.loss_mask`` on the packed sequence.
    """
    check_processors(model, PackedJointAttnProcessor)
    p = model.config.patch_size
    meta = _prepare(meta, [(x.shape[-2] // p, x.shape[-1] // p) for x in latents], max_tokens,
                    encoder_hidden_states, max_text_tokens, len(latents))
    dev = latents[0].device
    length = int(meta.document_id.size)
    hs = pack_tokens([model.pos_embed(x[None])[0] for x in latents], length)  # per-image patch + position embed
    temb = model.time_text_embed(timestep, pooled_projections)  # (m, D)
    ctx = model.context_embedder(_text(encoder_hidden_states, meta))
    doc = torch.as_tensor(meta.document_id, device=dev)
    tdoc = torch.as_tensor(meta.text_document_id, device=dev)
    idx, tidx = doc.clamp(min=0).long(), tdoc.clamp(min=0).long()
    joint_mask, ckpt = document_mask(torch.cat([doc, tdoc]), backend), _checkpointing(model)
    image_mask = document_mask(doc, backend) if any(b.attn2 is not None for b in model.transformer_blocks) else None
    for block in model.transformer_blocks:
        ctx, hs = _run(ckpt, _sd3_block, block, hs, ctx, temb, idx, tidx, joint_mask, image_mask)
    scale, shift = _modulation(model.norm_out, temb, idx, 2)
    out = model.proj_out(model.norm_out.norm(hs) * (1 + scale) + shift)
    return PackedOutput(out, meta)


def flux_image_ids(meta: PackMeta, device: Any = None) -> torch.Tensor:
    """Flux RoPE ids ``(L, 3)`` of a pack's image tokens: ``(0, row, col)`` inside each token's own image."""
    ids = torch.zeros(meta.document_id.size, 3, device=device)
    ids[:, 1:] = torch.as_tensor(meta.positions, device=device, dtype=ids.dtype)
    return ids


def packed_flux_forward(model: Any, tokens: Sequence[torch.Tensor], grids: Any,
                        encoder_hidden_states: Sequence[torch.Tensor], pooled_projections: torch.Tensor,
                        timestep: torch.Tensor, guidance: torch.Tensor | None = None, *,
                        max_tokens: int | None = None, max_text_tokens: int | None = None,
                        meta: PackMeta | None = None, backend: Backend = "auto") -> PackedOutput:
    """One pack through a ``FluxTransformer2DModel`` (after :func:`enable_packed_attention`).

    Args:
        model: the transformer (ControlNet and IP-Adapter inputs are not supported packed).
        tokens: ``m`` packed latents ``(h_i * w_i, in_channels)`` (the pipeline's 2×2 packing, row-major).
        grids: ``(m, 2)`` token grids ``(h_i, w_i)`` of those latents.
        encoder_hidden_states: ``m`` text embeddings ``(T_i, joint_attention_dim)``.
        pooled_projections: ``(m, pooled_projection_dim)``; timestep: ``(m,)`` in ``[0, 1]`` (as the pipeline
            passes it); guidance: ``(m,)`` for guidance-distilled models.
        max_tokens, max_text_tokens, meta, backend: as in :func:`packed_sd3_forward`.

    Returns:
        :class:`PackedOutput` with ``sample`` ``(1, L, out_channels)``.
    """
    check_processors(model, PackedFluxAttnProcessor)
    meta = _prepare(meta, grids, max_tokens, encoder_hidden_states, max_text_tokens, len(tokens))
    dev = tokens[0].device
    hs = model.x_embedder(pack_tokens(tokens, int(meta.document_id.size)))
    t = timestep.to(hs.dtype) * 1000
    if guidance is None:
        temb = model.time_text_embed(t, pooled_projections)
    else:
        temb = model.time_text_embed(t, guidance.to(hs.dtype) * 1000, pooled_projections)
    ctx = model.context_embedder(_text(encoder_hidden_states, meta))
    doc = torch.as_tensor(meta.document_id, device=dev)
    tdoc = torch.as_tensor(meta.text_document_id, device=dev)
    idx, tidx = doc.clamp(min=0).long(), tdoc.clamp(min=0).long()
    ids = torch.cat([torch.zeros(tdoc.numel(), 3, device=dev), flux_image_ids(meta, dev)])
    rope = model.pos_embed(ids)
    mask, ckpt = document_mask(torch.cat([tdoc, doc]), backend), _checkpointing(model)
    for block in model.transformer_blocks:
        ctx, hs = _run(ckpt, _flux_block, block, hs, ctx, temb, idx, tidx, rope, mask)
    n_txt = ctx.shape[1]
    x, all_idx = torch.cat([ctx, hs], 1), torch.cat([tidx, idx])
    for block in model.single_transformer_blocks:
        x = _run(ckpt, _flux_single_block, block, x, temb, all_idx, rope, mask)
    scale, shift = _modulation(model.norm_out, temb, idx, 2)
    out = model.proj_out(model.norm_out.norm(x[:, n_txt:]) * (1 + scale) + shift)
    return PackedOutput(out, meta)
