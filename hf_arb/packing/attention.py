"""Packed attention for diffusers' SD3 and Flux transformers: block-diagonal masks and attention processors.

:func:`document_mask` turns a packed sequence's ``document_id`` into the mask of one backend (``"sdpa"``: explicit
boolean mask; ``"flex"``: FlexAttention ``BlockMask``; ``"varlen"``: one attention call per image).
:class:`PackedJointAttnProcessor` (SD3) and :class:`PackedFluxAttnProcessor` (Flux) take it as ``attention_mask``
and are installed with the public ``set_attn_processor`` (:func:`enable_packed_attention`); without a mask they
compute what the stock processors compute. :mod:`hf_arb.packing.model` runs whole packs through the models.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["Backend", "DocumentSegments", "PackedFluxAttnProcessor", "PackedJointAttnProcessor", "document_mask",
           "enable_packed_attention"]

Backend = Literal["auto", "sdpa", "flex", "varlen"]


# ------------------------------------------------------------------------------------------------- masks
def document_mask(document_id: torch.Tensor, backend: Backend = "auto") -> Any:
    """The block-diagonal self-attention mask of a packed sequence: ``q`` sees ``k`` iff their documents match.

    Padding (``-1``) attends only to padding, so no row is empty and real tokens never see it.

    Args:
        document_id: int tensor ``(S,)``.
        backend: ``"auto"`` (= ``"varlen"``, the one backend with a backward everywhere that was tested);
            ``"sdpa"`` → bool ``(1, 1, S, S)``;
            ``"flex"`` → a FlexAttention ``BlockMask`` (no backward on CPU in torch 2.x); ``"varlen"`` →
            :class:`DocumentSegments` (one attention call per image).
    """
    doc = document_id.to(torch.int32)
    if backend == "auto":
        backend = "varlen"
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


def check_processors(model: Any, cls: type) -> None:
    bad = [k for k, p in model.attn_processors.items() if not isinstance(p, cls)]
    if bad:
        raise ValueError(f"{len(bad)} attention layer(s) (e.g. {bad[0]}) do not use {cls.__name__}; call "
                         "`hf_arb.packing.model.enable_packed_attention(model)` (after loading LoRA adapters is fine).")


