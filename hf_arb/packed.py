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

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from .pack_layout import PackMeta, pack_meta

__all__ = ["Backend", "DocumentSegments", "PackedFluxAttnProcessor", "PackedJointAttnProcessor", "PackedOutput",
           "document_mask", "enable_packed_attention", "flux_image_ids", "pack_tokens", "packed_flux_forward",
           "packed_sd3_forward", "patchify", "unpack_tokens", "unpatchify"]

Backend = Literal["auto", "sdpa", "flex", "varlen"]


# ------------------------------------------------------------------------------------------------- masks
def document_mask(document_id: torch.Tensor, backend: Backend = "auto") -> Any:
    """The block-diagonal self-attention mask of a packed sequence: ``q`` sees ``k`` iff their documents match.

    Padding (``-1``) attends only to padding, so no row is empty and real tokens never see it.

    Args:
        document_id: int tensor ``(S,)``.
        backend: ``"auto"`` → ``"flex"`` on CUDA, ``"varlen"`` elsewhere; ``"sdpa"`` → bool ``(1, 1, S, S)``;
            ``"flex"`` → a FlexAttention ``BlockMask`` (no backward on CPU in torch 2.x); ``"varlen"`` →
            :class:`DocumentSegments` (one attention call per image).
    """
    doc = document_id.to(torch.int32)
    if backend == "auto":
        backend = "flex" if doc.is_cuda else "varlen"
    if backend == "sdpa":
        return (doc[:, None] == doc[None, :])[None, None]
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return doc[q] == doc[kv]

        s = doc.numel()
        return create_block_mask(same_document, B=None, H=None, Q_LEN=s, KV_LEN=s, device=doc.device)
    if backend == "varlen":
        order = torch.argsort(doc, stable=True)
        counts = torch.bincount(doc[doc >= 0].long()).tolist()
        n_pad = int((doc < 0).sum())
        return DocumentSegments(list(torch.split(order[n_pad:], counts)))
    raise ValueError(f"`backend` must be 'sdpa', 'flex' or 'varlen', got {backend!r}.")


@dataclass
class DocumentSegments:
    """The ``"varlen"`` mask: each document's token positions in the joint sequence (one int64 tensor each).

    Attention runs once per document (``sum n_i²`` work, no ``S × S`` mask; padding outputs are 0): exact on any
    device and the fastest choice on CPU, where FlexAttention has no backward. ``flash_attn_varlen_func`` is the
    fused GPU kernel for the same layout.
    """

    index: list[torch.Tensor]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """Attention over ``(B, H, S, D)`` with no mask, a bool/float mask (SDPA) or a ``BlockMask`` (flex)."""
    if isinstance(mask, DocumentSegments):
        parts = [F.scaled_dot_product_attention(q[:, :, i], k[:, :, i], v[:, :, i]) for i in mask.index]
        out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
        return out.index_copy(2, torch.cat(mask.index), torch.cat(parts, 2)) if parts else out
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:  # fused kernel; on CPU the eager (unfused) implementation is exact but slow
        return _compiled_flex()(q, k, v, block_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": intended on CPU (tests, small runs)
        return flex_attention(q, k, v, block_mask=mask)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# ------------------------------------------------------------------------------------------------- processors
class PackedJointAttnProcessor:
    """SD3's joint attention (``JointAttnProcessor2_0``'s computation) with an optional packed ``attention_mask``.

    Joint sequence order is ``[image tokens, text tokens]``, as in diffusers' SD3; the mask covers that order.
    """

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        b, n = hidden_states.shape[:2]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if encoder_hidden_states is not None:
            cq = heads(attn.add_q_proj(encoder_hidden_states))
            ck = heads(attn.add_k_proj(encoder_hidden_states))
            cv = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            q, k, v = torch.cat([q, cq], 2), torch.cat([k, ck], 2), torch.cat([v, cv], 2)
        out = _attend(q, k, v, attention_mask).transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[-1]).to(q.dtype)
        if encoder_hidden_states is not None:
            out, ctx = out[:, :n], out[:, n:]
            if not attn.context_pre_only:
                ctx = attn.to_add_out(ctx)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, ctx) if encoder_hidden_states is not None else out


class PackedFluxAttnProcessor:
    """Flux's attention (``FluxAttnProcessor``'s computation) with an optional packed ``attention_mask``.

    Joint sequence order is ``[text tokens, image tokens]``; RoPE (``image_rotary_emb``) is per token.
    """

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: Any = None, image_rotary_emb: Any = None) -> Any:
        from diffusers.models.embeddings import apply_rotary_emb

        if getattr(attn, "fused_projections", False):
            raise ValueError("Packed Flux attention needs unfused projections; call `unfuse_qkv_projections()`.")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))  # (B, S, H, D)

        q = attn.norm_q(heads(attn.to_q(hidden_states)))
        k = attn.norm_k(heads(attn.to_k(hidden_states)))
        v = heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            cq = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            ck = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            cv = heads(attn.add_v_proj(encoder_hidden_states))
            q, k, v = torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is not None:
            t = encoder_hidden_states.shape[1]
            ctx, out = out[:, :t], out[:, t:]
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            return out, attn.to_add_out(ctx.contiguous())
        return out


def enable_packed_attention(model: Any) -> Any:
    """Install the packed processor on every attention layer of an SD3 or Flux transformer (public
    ``set_attn_processor``); unpacked calls (no mask) compute what the stock processors do. Returns ``model``."""
    name = type(model).__name__
    if name.startswith("SD3"):
        model.set_attn_processor(PackedJointAttnProcessor())
    elif name.startswith("Flux"):
        model.set_attn_processor(PackedFluxAttnProcessor())
    else:
        raise ValueError(f"Packed attention supports SD3Transformer2DModel and FluxTransformer2DModel, got {name}.")
    return model


def _check_processors(model: Any, cls: type) -> None:
    bad = [k for k, p in model.attn_processors.items() if not isinstance(p, cls)]
    if bad:
        raise ValueError(f"{len(bad)} attention layer(s) (e.g. {bad[0]}) do not use {cls.__name__}; call "
                         "`hf_arb.packed.enable_packed_attention(model)` (after loading LoRA adapters is fine).")


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
            attention call per image) or ``"auto"`` (flex on CUDA, varlen elsewhere); see :func:`document_mask`.

    Returns:
        :class:`PackedOutput` with ``sample`` ``(1, L, p * p * C)``; :func:`unpack_tokens` + :func:`unpatchify`
        give each image's ``(C, H_i, W_i)`` prediction, or compare with :func:`patchify` targets and
        ``meta.loss_mask`` on the packed sequence.
    """
    _check_processors(model, PackedJointAttnProcessor)
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
    joint_mask, image_mask = document_mask(torch.cat([doc, tdoc]), backend), None
    for block in model.transformer_blocks:
        dual = block.attn2 is not None
        mod = _modulation(block.norm1, temb, idx, 9 if dual else 6)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mod[:6]
        normed = block.norm1.norm(hs)
        norm_hs = normed * (1 + scale) + shift
        if block.context_pre_only:  # AdaLayerNormContinuous: (scale, shift)
            c_scale, c_shift = _modulation(block.norm1_context, temb, tidx, 2)
            norm_ctx = block.norm1_context.norm(ctx) * (1 + c_scale) + c_shift
        else:
            c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(
                block.norm1_context, temb, tidx, 6)
            norm_ctx = block.norm1_context.norm(ctx) * (1 + c_scale) + c_shift
        attn_out, ctx_out = block.attn(hidden_states=norm_hs, encoder_hidden_states=norm_ctx,
                                       attention_mask=joint_mask)
        hs = hs + gate * attn_out
        if dual:
            if image_mask is None:
                image_mask = document_mask(doc, backend)
            shift2, scale2, gate2 = mod[6:]
            hs = hs + gate2 * block.attn2(hidden_states=normed * (1 + scale2) + shift2, attention_mask=image_mask)
        hs = hs + gate_mlp * block.ff(block.norm2(hs) * (1 + scale_mlp) + shift_mlp)
        if not block.context_pre_only:
            ctx = ctx + c_gate * ctx_out
            ctx = ctx + c_gate_mlp * block.ff_context(block.norm2_context(ctx) * (1 + c_scale_mlp) + c_shift_mlp)
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
    _check_processors(model, PackedFluxAttnProcessor)
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
    mask = document_mask(torch.cat([tdoc, doc]), backend)
    for block in model.transformer_blocks:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = _modulation(block.norm1, temb, idx, 6)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulation(block.norm1_context, temb,
                                                                                     tidx, 6)
        attn_out, ctx_out = block.attn(hidden_states=block.norm1.norm(hs) * (1 + scale) + shift,
                                       encoder_hidden_states=block.norm1_context.norm(ctx) * (1 + c_scale) + c_shift,
                                       image_rotary_emb=rope, attention_mask=mask)
        hs = hs + gate * attn_out
        hs = hs + gate_mlp * block.ff(block.norm2(hs) * (1 + scale_mlp) + shift_mlp)
        ctx = ctx + c_gate * ctx_out
        ctx = ctx + c_gate_mlp * block.ff_context(block.norm2_context(ctx) * (1 + c_scale_mlp) + c_shift_mlp)
    n_txt = ctx.shape[1]
    x, all_idx = torch.cat([ctx, hs], 1), torch.cat([tidx, idx])
    for block in model.single_transformer_blocks:
        shift, scale, gate = _modulation(block.norm, temb, all_idx, 3)
        normed = block.norm.norm(x) * (1 + scale) + shift
        attn_out = block.attn(hidden_states=normed, image_rotary_emb=rope, attention_mask=mask)
        x = x + gate * block.proj_out(torch.cat([attn_out, block.act_mlp(block.proj_mlp(normed))], 2))
    scale, shift = _modulation(model.norm_out, temb, idx, 2)
    out = model.proj_out(model.norm_out.norm(x[:, n_txt:]) * (1 + scale) + shift)
    return PackedOutput(out, meta)
