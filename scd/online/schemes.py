"""The wire schemes of an exact plan's fields (scd.online.codec): each field in a format of its own.

  kivi4: keys in asymmetric int4 per channel over KIVI_GROUP tokens (KIVI), values in asymmetric int4 per
         group of values, fp16 scales and minima; the residual as it is
  klt:   the integer symbols of scd.online.klt's transform code as "sym16": 16-bit zigzag (0, -1, 1, -2, ...
         -> 0, 1, 2, 3, ...), the field's low bytes then its high bytes, no scales
"""
from __future__ import annotations

import math

import torch

from scd.online.klt import SYMBOL_MAX


def field_view(body: torch.Tensor, off: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [off, off + n) of the payload body as a flat tensor of `dtype`, without a copy when aligned."""
    raw = body[off:off + n]
    try:
        return raw.view(dtype)
    except RuntimeError:                      # storage offset not a multiple of the item size
        return raw.clone().view(dtype)


KIVI_GROUP = 32          # kivi4: tokens per key scale (per channel), values per value scale
# kivi4 is a scheme for an exact plan's fields, each in its own format: keys per channel, values per group,
# the residual as it is
KIVI_FIELDS = {"k": "kivi_k", "v": "asym4", "z_e": "bf16"}


# klt: an exact plan's K and V as transform-coded integer symbols (scd.online.klt): "sym16", each symbol
# zigzag-mapped to 16 bits (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...), the low bytes of the field, then its high
# bytes; nearly every symbol is small, so the high bytes are runs of zeros that zstd packs into almost nothing
KLT_FIELDS = {"k": "sym16", "v": "sym16", "z_e": "bf16"}
_SCHEMES = {"kivi4": KIVI_FIELDS, "klt": KLT_FIELDS}


def field_dtype(name: str, dtype: str) -> str:
    """The precision of code field `name` in a payload of `dtype` (kivi4 and klt name one per field; a residual
    stream beside int4 or mixed codes travels in bf16: a few large channels leave int4 steps too coarse for it)."""
    if name == "z_e" and dtype in ("int4", "mixed"):
        return "bf16"
    if dtype not in _SCHEMES:
        return dtype
    if name not in _SCHEMES[dtype]:
        raise ValueError(f"{dtype} carries an exact plan's K, V and residual only, not {name!r}")
    return _SCHEMES[dtype][name]


def _asym4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 over groups of `group` values of the last dim: (fp16 scales, fp16 minima (..., r // group),
    values packed two to a byte (..., r // 2), low nibble first)."""
    g = x.reshape(*x.shape[:-1], -1, group)
    lo = g.amin(-1).half()
    scale = ((g.amax(-1) - lo.float()) / 15).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(*x.shape)
    return scale, lo, q[..., 0::2] | (q[..., 1::2] << 4)


def _group(r: int) -> int:
    return KIVI_GROUP if r % KIVI_GROUP == 0 else r


def _asym4_shape(shape: tuple[int, ...], fd: str) -> tuple[tuple[int, ...], int]:
    """(the shape quantised by _asym4, its group) of a kivi_k or asym4 field of `shape`: keys (..., T, d) as
    (..., d, T') per channel over groups of KIVI_GROUP tokens (T' = T padded to whole groups); values along
    their last dim."""
    if fd == "asym4":
        return shape, _group(shape[-1])
    *lead, t, d = shape
    return (*lead, d, t + (-t) % KIVI_GROUP), KIVI_GROUP


def kivi_tensors(x: torch.Tensor, fd: str) -> tuple[torch.Tensor, ...]:
    """A kivi_k or asym4 field's wire tensors: _asym4 of the field as _asym4_shape lays it out (keys transposed
    to channels first, the last group of tokens padded by repeating the last token)."""
    shape, group = _asym4_shape(tuple(x.shape), fd)
    if fd == "kivi_k":
        pad = shape[-1] - x.shape[-2]
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], -2).transpose(-1, -2)
    return _asym4(x, group)


def kivi_bytes(shape: tuple[int, ...], fd: str) -> int:
    (*lead, r), group = _asym4_shape(shape, fd)
    return math.prod(lead) * (r // group * 4 + (r + 1) // 2)


def kivi_from(body: torch.Tensor, off: int, shape: tuple[int, ...], fd: str) -> torch.Tensor:
    """The float32 tensor of `shape` that a kivi_k or asym4 field at `off` stands for."""
    (*lead, r), group = _asym4_shape(shape, fd)
    n, groups = math.prod(lead), r // group
    scale = field_view(body, off, 2 * n * groups, torch.float16).view(*lead, groups)
    lo = field_view(body, off + 2 * n * groups, 2 * n * groups, torch.float16).view(*lead, groups)
    packed = field_view(body, off + 4 * n * groups, n * ((r + 1) // 2), torch.uint8).view(*lead, (r + 1) // 2)
    q = torch.stack([packed & 0xF, packed >> 4], -1).reshape(*lead, groups, group).float()
    x = (q * scale.float()[..., None] + lo.float()[..., None]).reshape(*lead, r)
    return x if fd == "asym4" else x.transpose(-1, -2)[..., :shape[-2], :]


def zigzag_planes(x: torch.Tensor) -> list[torch.Tensor]:
    """A sym16 field's wire bytes: its integer symbols zigzag-mapped, low bytes then high bytes."""
    y = x.detach().round().clamp(-SYMBOL_MAX, SYMBOL_MAX).to(torch.int32).reshape(-1)
    u = (y << 1) ^ (y >> 31)
    return [(u & 0xFF).to(torch.uint8), (u >> 8).to(torch.uint8)]


def sym16_from(body: torch.Tensor, off: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 integer symbols of shape `shape` that a sym16 field at `off` stands for."""
    n = math.prod(shape)
    u = field_view(body, off, n, torch.uint8).int() | (field_view(body, off + n, n, torch.uint8).int() << 8)
    return ((u >> 1) ^ -(u & 1)).float().reshape(shape)
