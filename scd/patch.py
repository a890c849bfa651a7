"""Patch: at a few transition layers, rebuild the consumer's own x_norm and regenerate K/V from it.

Producer: Z_H = (x_norm_A - mu) W_enc_H, a low-rank code of its layer input (same joint-SVD + ridge fit
as Reuse, on hidden states). Consumer: an MLP aligner g(Z_H) ~ x_norm_B, then K = RoPE(k_proj(x)),
V = v_proj(x) with the consumer's own projections. The aligner is a linear map initialised from the
joint-SVD decoder plus a zero-initialised MLP residual, so training starts at the linear solution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from scd.rope import apply_rope


def window(z: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
    """Each position's code followed by the codes of the `context - 1` positions before it, zeros where
    those would fall before the sequence start. z (..., T, r), positions (..., T) -> (..., T, context * r).
    Works on a batch (B, T, r) and on calibration rows (N, r) whose sequences are contiguous."""
    parts = [z]
    for k in range(1, context):
        shifted = torch.cat([torch.zeros_like(z[..., :k, :]), z[..., :-k, :]], dim=-2)
        parts.append(shifted * (positions >= k).unsqueeze(-1).to(z.dtype))
    return torch.cat(parts, dim=-1)


class Aligner(nn.Module):
    """g(window(z)) = W window(z) + b + MLP(window(z)); codes (..., T, r_h) + positions -> x_norm (..., T, H).

    context = 1 is the per-token aligner of the SCD paper. A consumer whose fine-tuning grew new
    token-mixing circuits (e.g. induction heads) carries features of the previous tokens in its layer input
    that a per-token map of the producer's own features cannot recover; a short causal window over the
    codes the consumer already holds (no extra payload) supplies them.
    """

    def __init__(self, r_h: int, hidden: int, width: int, context: int = 1):
        super().__init__()
        self.context = context
        self.linear = nn.Linear(r_h * context, hidden)
        self.mlp = nn.Sequential(nn.Linear(r_h * context, width), nn.GELU(), nn.Linear(width, hidden))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w = window(z, positions, self.context)
        return self.linear(w) + self.mlp(w)


@dataclass
class AlignerFit:
    aligner: Aligner
    train_loss: list[float]
    val_loss: list[float]
    best_epoch: int


@torch.enable_grad()
def train_aligner(z: torch.Tensor, x_b: torch.Tensor, init_dec: torch.Tensor, init_mu: torch.Tensor,
                  positions: torch.Tensor | None = None, context: int = 1, width: int = 256, epochs: int = 60,
                  lr: float = 2e-3, batch: int = 512, val_frac: float = 0.1, patience: int = 6,
                  seed: int = 0) -> AlignerFit:
    """Fit g(z) ~ x_b by MSE with a held-out validation split and early stopping on its loss.

    z: (N, r_h) producer codes, rows of whole sequences in order; positions (N,) their positions;
    x_b: (N, H) consumer x_norm; init_dec (r_h, H) / init_mu (H,) seed the linear part (on the current
    position's code). Returns the weights of the best validation epoch.
    """
    if positions is None:
        positions = torch.zeros(z.shape[0], dtype=torch.long)
    z = window(z, positions, context)                     # fixed features: window once, then sample rows
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(z.shape[0], generator=gen)
    n_val = max(1, int(val_frac * z.shape[0]))
    val, tr = perm[:n_val], perm[n_val:]
    scale = x_b.pow(2).mean().clamp(min=1e-12)          # report losses relative to the target's power
    g = Aligner(init_dec.shape[0], x_b.shape[1], width, context)
    with torch.no_grad():
        g.linear.weight.zero_()
        g.linear.weight[:, :init_dec.shape[0]].copy_(init_dec.T)
        g.linear.bias.copy_(init_mu)
    feats = lambda idx: (g.linear(z[idx]) + g.mlp(z[idx]))  # noqa: E731  (z is already windowed)
    opt = torch.optim.AdamW(g.parameters(), lr=lr, weight_decay=1e-4)
    best, best_state, best_epoch, bad = float("inf"), None, 0, 0
    train_hist, val_hist = [], []
    for epoch in range(epochs):
        g.train()
        order = tr[torch.randperm(len(tr), generator=gen)]
        tot = 0.0
        for idx in order.split(batch):
            loss = (feats(idx) - x_b[idx]).pow(2).mean() / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item() * len(idx)
        g.eval()
        with torch.no_grad():
            v = ((feats(val) - x_b[val]).pow(2).mean() / scale).item()
        train_hist.append(tot / len(tr))
        val_hist.append(v)
        if v < best - 1e-6:
            best, best_epoch, bad = v, epoch, 0
            best_state = {k: t.clone() for k, t in g.state_dict().items()}
        else:
            bad += 1
            if bad >= patience:
                break
    g.load_state_dict(best_state)
    return AlignerFit(g, train_hist, val_hist, best_epoch)


@torch.no_grad()
def regenerate_kv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """Consumer layer's own K (post-RoPE) and V from its input x_norm (B, T, H): each (B, n_kv, T, d_h)."""
    attn = layer.self_attn
    b, t, _ = x.shape
    k = attn.k_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    return apply_rope(k, cos, sin), v
