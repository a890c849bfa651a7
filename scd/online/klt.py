"""Transform coding of a shared layer's K and V: an exact plan's compressed wire form ("klt").

A layer the consumer shares with its producer holds the producer's own K and V, so compressing it is
compressing one model's cache: no translation, only bits. This is textbook transform coding (a
Karhunen-Loeve transform), the design of image and audio codecs:
  - each token's keys before RoPE (every KV head side by side, n_kv x d values) and its values are rotated
    into their principal axes, fitted once on calibration prefixes (`codec`);
  - one uniform step per layer and stream, `step` x the root mean square of its coefficients, rounds them to
    integer symbols ("sym16" in scd.online.codec: 16 bits each, most of them small);
  - zstd entropy-codes the symbols, laid out axis by axis.
One step for every axis is the optimal bit allocation for squared error (reverse water-filling): an axis of
large variance gets many levels, an axis below the step sends zeros, which zstd packs into almost nothing.

The first token is an attention sink: most of every head's attention lands on it, so the step that suits the
other tokens leaves too large an error on it (sending it exactly lowers the whole prefix's KL). It attends to
itself only, so its K and V depend on that token alone: the consumer computes them itself, one token through
the shared layers (`sink_kv`), and its symbols travel as zeros.
"""
from __future__ import annotations

import torch

from scd.online.recompute import run_layers
from scd.online.reuse import LinearCodec

SYMBOL_MAX = 32767              # symbols are integers within +-SYMBOL_MAX (16 bits on the wire)


def rows(x: torch.Tensor) -> torch.Tensor:
    """(B, n_kv, T, d) -> (B, T, n_kv d): each token's heads side by side."""
    return x.transpose(1, 2).flatten(2)


def first_real(mask: torch.Tensor) -> torch.Tensor:
    """(B,) the index of each left-padded row's first real token: its attention sink."""
    return mask.long().argmax(1)


def without_sinks(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the real tokens of left-padded rows, each row's sink left out."""
    keep = mask.bool().clone()
    keep[torch.arange(len(keep), device=keep.device), first_real(mask)] = False
    return keep


def codec(mean: torch.Tensor, cov: torch.Tensor, step: float) -> LinearCodec:
    """The transform code of one stream of rows with this mean and covariance (scd.fitting.exact.klt_codecs):
    encode(x) = (x - mean) U / s, decode(y) = mean + y s U^T, with U the principal axes and s = step x the
    coefficients' root mean square. Rounding the code is left to the wire."""
    var, axes = torch.linalg.eigh(cov)
    axes = axes.flip(1)                                  # widest axis first
    s = step * float(var.clamp(min=0).mean().sqrt())
    s = s if s > 0 else 1.0                              # a stream that never varies: any step sends zeros
    return LinearCodec(mean.float(), (axes / s).float(), mean.float(), (axes * s).T.contiguous().float())


def encode(c: LinearCodec, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x (B, n_kv, T, d) -> integer symbols, as floats, in x's shape laid out axis by axis (each axis's symbols
    over the tokens side by side: zstd finds the runs of zeros of the narrow axes). The sinks' are zeros."""
    b, n_kv, t, d = x.shape
    y = torch.round(c.encode(rows(x).float())).clamp_(-SYMBOL_MAX, SYMBOL_MAX)   # the wire's range
    y[torch.arange(b, device=y.device), first_real(mask)] = 0
    return y.transpose(1, 2).reshape(b, n_kv, t, d)


def decode(c: LinearCodec, symbols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`encode`'s symbols (B, n_kv, T, d) -> the stream (B, n_kv, T, d) in `dtype` (its sinks still to be set)."""
    b, n_kv, t, d = symbols.shape
    y = symbols.reshape(b, n_kv * d, t).transpose(1, 2).to(dtype)
    return c.map(lambda m: m.to(dtype)).decode(y).view(b, t, n_kv, d).transpose(1, 2)


@torch.no_grad()
def sink_kv(model, token_ids: torch.Tensor, mask: torch.Tensor, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K post-RoPE, V), each (B, n_kv, 1, d), of each row's first real token at layers [0, stop): that token
    alone at position 0 through the model's own layers (the shared ones: the producer's, bit for bit)."""
    b = token_ids.shape[0]
    first = token_ids[torch.arange(b, device=token_ids.device), first_real(mask)][:, None]
    x = model.model.embed_tokens(first)
    ones = torch.ones_like(first)
    return run_layers(model, x, ones, torch.zeros_like(first), 0, stop)


def set_sinks(kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor) -> None:
    """Write each row's sink (B, n_kv, 1, d) into kv (B, n_kv, T, d) at its first real token, in place."""
    at = first_real(mask)
    for i in range(kv.shape[0]):
        kv[i, :, at[i]] = sink[i, :, 0].to(kv.dtype)
