"""Patch: at a few transition layers, rebuild the consumer's own x_norm and regenerate K/V from it.

Producer: Z_H = (x_norm_A - mu) W_enc_H, a low-rank code of its layer input (same joint-SVD + ridge fit
as Reuse, on hidden states). Consumer: an aligner g(Z_H, ...) ~ x_norm_B, then K = RoPE(k_proj(x)),
V = v_proj(x) with the consumer's own projections. The aligner is a linear map initialised from the
joint-SVD decoder plus a zero-initialised MLP residual, so training starts at the linear solution; it
is fitted on calibration rows (scd.fitting.aligners), by default on the error of the K/V it regenerates.
Online, FusedPatches runs every patch layer's aligner composed with its layer's projections, all at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scd.online.rope import apply_rope


def window_index(positions: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For calibration rows (N,) of whole sequences: the row index of each window slot (N, context) and
    whether the slot is inside its sequence (N, context, 1)."""
    n = torch.arange(positions.shape[0])
    idx = torch.stack([(n - k).clamp(min=0) for k in range(context)], dim=1)
    inside = torch.stack([positions >= k for k in range(context)], dim=1)
    return idx, inside.unsqueeze(-1)


class Aligner(nn.Module):
    """x_norm_t = W f_t + b + U gelu(A f_t + sum_k C_k (S f)_{t-k}),  f = [z, P x0].

    Codes (..., T, r_h) with the left-padding mask (..., T) -> the consumer's x_norm (..., T, H).
    context = 1 without token features is the per-token aligner of the SCD paper. A consumer whose
    fine-tuning grew new token-mixing circuits (e.g. induction heads) carries features of earlier tokens
    in its layer input that a per-token map of the producer's own features cannot recover. Two inputs the
    consumer already holds supply them at no extra payload: a causal window over the last `context`
    positions (the C_k: a causal convolution over a learned squeeze S of the features to `window_dim`
    per position), and (token_dim > 0) a learned projection P of the consumer's own layer-0 input
    x0 = input_layernorm(embed(ids)), which is a function of the token ids alone: token identities.
    W starts at the joint-SVD decoder and U at zero, so training starts at the linear solution.
    """

    def __init__(self, r_h: int, hidden: int, width: int, context: int = 1, token_dim: int = 0,
                 window_dim: int = 8):
        super().__init__()
        self.context, self.token_dim = context, token_dim
        feat = r_h + token_dim
        self.token = nn.Linear(hidden, token_dim, bias=False) if token_dim else None
        self.linear = nn.Linear(feat, hidden)                                      # W, b
        self.inner = nn.Linear(feat, width)                                        # A
        self.squeeze = nn.Linear(feat, window_dim, bias=False) if context > 1 else None  # S
        self.window = nn.Conv1d(window_dim, width, context, bias=False) if context > 1 else None  # C
        self.out = nn.Linear(width, hidden)                                        # U
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def rows(self, z: torch.Tensor, x0: torch.Tensor | None) -> torch.Tensor:
        """Per-position features f = [z, P x0]."""
        if self.token is None:
            return z
        if x0 is None:
            raise ValueError("this aligner reads the consumer's layer-0 input x0 (token features); pass it")
        return torch.cat([z, self.token(x0.to(z.dtype))], dim=-1)

    def _out(self, f: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.linear(f) + self.out(F.gelu(h))

    def forward(self, z: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
        """z (B, T, r_h), mask (B, T) 1 = real token (left padding 0), x0 (B, T, H) -> x_norm (B, T, H)."""
        f = self.rows(z, x0)
        h = self.inner(f)
        if self.window is not None:                   # padding rows zeroed, then a causal convolution
            q = (self.squeeze(f) * mask.unsqueeze(-1).to(f.dtype)).transpose(1, 2)
            h = h + F.conv1d(F.pad(q, (self.context - 1, 0)), self.window.weight).transpose(1, 2)
        return self._out(f, h)

    def train_rows(self, z: torch.Tensor, x0: torch.Tensor | None, win: torch.Tensor, inside: torch.Tensor):
        """forward() on calibration rows, the window gathered: win/inside from window_index()."""
        f = self.rows(z[win], None if x0 is None else x0[win])                  # (n, context, feat)
        h = self.inner(f[:, 0])
        if self.window is not None:                   # slot k = t - k meets kernel tap context-1-k
            h = h + torch.einsum("nkd,wdk->nw", self.squeeze(f) * inside, self.window.weight.flip(-1))
        return self._out(f[:, 0], h)


class FusedPatches:
    """Inference form of an artifact's Patch layers: each aligner composed with its layer's k_proj/v_proj,
    and all layers run together.

    x_norm is affine in an aligner's last layers (W, U) and K/V are affine in x_norm, so
    [K; V] = (Wkv W) f + (Wkv U) gelu(h) + const: the maps on f = [z, P x0] (Wkv W, A, S) become one
    matmul, and P x0 a per-vocabulary table lookup. Stacked over the patch layers, what the consumer runs
    per request is: one table gather, three batched matmuls (features, causal window, output) and a gelu
    -> every patch layer's K (before RoPE) and V, with no x_norm in between. Exact up to float rounding;
    tested against the unfused path. The aligners must share their shapes (one artifact's do).
    """

    @torch.no_grad()
    def __init__(self, aligners: list[Aligner], layers: list, x0_table: torch.Tensor | None = None):
        parts = [_compose(g, layer) for g, layer in zip(aligners, layers)]
        shapes = {(tuple(q["sizes"]), q["w_f"].shape, q["tok"] is None) for q in parts}
        if len(shapes) != 1:
            raise ValueError(f"patch aligners of one artifact must share their shapes, got {shapes}")
        first, dtype = parts[0], layers[0].self_attn.k_proj.weight.dtype
        self.n, self.sizes, self.m_k, self.context = len(parts), first["sizes"], first["m_k"], aligners[0].context
        attns = [layer.self_attn for layer in layers]
        self.head_dim = attns[0].head_dim
        self.attns = attns if getattr(attns[0], "k_norm", None) is not None else None
        stack = lambda k: torch.stack([q[k] for q in parts]).to(dtype)  # noqa: E731
        self.w_f, self.bias, self.w_out = stack("w_f"), stack("b_f")[:, None], stack("w_out")  # (P, feat, n) (P, 1, n) (P, w, m)
        self.window = stack("window") if first["window"] is not None else None                # (P, wd * ctx, w)
        self.w_tok = self.token_table = None
        if first["tok"] is not None:
            w_tok = torch.cat([q["tok"] for q in parts])                                     # (P * td, H)
            if x0_table is not None:
                self.token_table = (x0_table.float() @ w_tok.T).to(dtype)                     # (vocab, P * td)
            else:
                self.w_tok = w_tok.to(dtype)

    def __call__(self, zs: list[torch.Tensor], mask: torch.Tensor, token_ids: torch.Tensor,
                 x0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """zs: each patch layer's codes (B, T, r_h); mask/token_ids (B, T); x0 (B, T, H) only without a token
        table. Returns K before RoPE and V of every patch layer, each (P, B, T, n_kv * d)."""
        b, t = token_ids.shape
        p = self.n
        f = torch.stack(zs).to(self.w_f.dtype).view(p, b * t, -1)
        if self.token_table is not None or self.w_tok is not None:
            if self.token_table is not None:
                tok = F.embedding(token_ids, self.token_table)
            elif x0 is None:
                raise ValueError("these aligners read the consumer's layer-0 input x0 (token features); pass it")
            else:
                tok = F.linear(x0, self.w_tok)
            f = torch.cat([f, tok.view(b * t, p, -1).transpose(0, 1)], dim=-1)      # (P, B*T, feat)
        u = torch.baddbmm(self.bias, f, self.w_f)                                    # (P, B*T, n)
        s, h, *q = u.split(self.sizes, dim=-1)
        if self.window is not None:        # padding rows zeroed, the last `context` rows side by side, one matmul
            wd = self.sizes[2]
            q = F.pad(q[0].view(p, b, t, wd) * mask.view(1, b, t, 1).to(u.dtype), (0, 0, self.context - 1, 0))
            h = h.baddbmm_(q.unfold(2, self.context, 1).reshape(p, b * t, -1), self.window)
        # in place: u's columns are this call's own, and baddbmm would first copy its input into a new output
        kv = s.baddbmm_(F.gelu(h), self.w_out)                                       # (P, B*T, m)
        k = kv[..., :self.m_k].view(p, b, t, -1)
        if self.attns is not None:                    # a per-head key norm is not affine: applied after the map
            k = torch.stack([key_norm(a, k[i], self.head_dim) for i, a in enumerate(self.attns)])
        return k, kv[..., self.m_k:].view(p, b, t, -1)


@torch.no_grad()
def _compose(g: Aligner, layer) -> dict:
    """One aligner and its layer's K/V projections as the float32 matrices FusedPatches stacks (see there)."""
    attn = layer.self_attn
    dev = attn.k_proj.weight.device
    f32 = lambda t: t.detach().to(dev, torch.float32)  # noqa: E731
    bias = lambda lin: f32(lin.bias) if lin.bias is not None else torch.zeros(lin.out_features, device=dev)  # noqa: E731
    w_kv = torch.cat([f32(attn.k_proj.weight), f32(attn.v_proj.weight)])            # (m, H)
    b_kv = torch.cat([bias(attn.k_proj), bias(attn.v_proj)])
    maps = [(w_kv @ f32(g.linear.weight), w_kv @ (f32(g.linear.bias) + f32(g.out.bias)) + b_kv),
            (f32(g.inner.weight), f32(g.inner.bias))]
    if g.squeeze is not None:
        maps.append((f32(g.squeeze.weight), torch.zeros(g.squeeze.out_features, device=dev)))
    window = None
    if g.window is not None:                           # conv taps (w, wd, ctx) as one (wd * ctx, w) matrix
        window = f32(g.window.weight).flatten(1).T.contiguous()
    return {"sizes": [w.shape[0] for w, _ in maps], "m_k": attn.k_proj.out_features,
            "w_f": torch.cat([w for w, _ in maps]).T.contiguous(), "b_f": torch.cat([b for _, b in maps]),
            "w_out": (w_kv @ f32(g.out.weight)).T.contiguous(), "window": window,
            "tok": f32(g.token.weight) if g.token is not None else None}


def regenerate_kv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """Consumer layer's own K (post-RoPE) and V from its input x_norm (B, T, H): each (B, n_kv, T, d_h).
    Differentiable in x (end-to-end fine-tuning goes through it)."""
    attn = layer.self_attn
    b, t, _ = x.shape
    k = key_norm(attn, attn.k_proj(x), head_dim).view(b, t, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    return apply_rope(k, cos, sin), v


def key_norm(attn, k: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The per-head norm some architectures apply to keys between k_proj and RoPE (qwen3's k_norm), on
    keys (..., n_kv * d_h); the identity for those without one (llama, mistral, qwen2)."""
    norm = getattr(attn, "k_norm", None)
    if norm is None:
        return k
    return norm(k.unflatten(-1, (-1, head_dim))).flatten(-2)
