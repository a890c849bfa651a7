"""Rotary position embedding and its inverse.

Reuse works on keys in content space (RoPE removed), so codes do not depend on where a token sits;
the consumer re-applies RoPE at the token's position. cos/sin come from the model's own rotary module,
so every RoPE variant the model supports (scaling, partial) is honoured.
"""
from __future__ import annotations

import torch


def cos_sin(model, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
    """(cos, sin), each (B, T, d_h), for integer positions (B, T)."""
    dummy = torch.empty(1, dtype=dtype, device=positions.device)
    return model.model.rotary_emb(dummy, positions)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k: (..., B, H, T, d_h); cos/sin: (B, T, d_h). k cos + rotate_half(k) sin, where rotate_half(k) =
    [-k2, k1] for the halves k1, k2 of the last dim, written as one product and
    two in-place half updates (three passes over k instead of five)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = k.shape[-1] // 2
    out = k * cos
    out[..., :h].addcmul_(k[..., h:], sin[..., :h], value=-1)
    out[..., h:].addcmul_(k[..., :h], sin[..., h:])
    return out


def remove_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of apply_rope: rotation by -theta (cos^2 + sin^2 = 1 per frequency pair)."""
    return apply_rope(k, cos, -sin)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Left-padded (B, T) 0/1 mask -> position ids; padding gets position 0 (its K/V is masked anyway)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
