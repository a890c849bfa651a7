"""Fitting a Patch aligner (scd.online.patch.Aligner) on calibration rows, with early stopping."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from scd.online.patch import Aligner, window_index


@dataclass
class AlignerFit:
    aligner: Aligner
    train_loss: list[float]
    val_loss: list[float]
    best_epoch: int


@torch.no_grad()
def kv_proj(consumer, layer: int) -> torch.Tensor:
    """(H, 2 m): the consumer layer's k_proj and v_proj as one map, each scaled to unit spectral norm
    so K and V weigh alike in an aligner's loss (RoPE is a rotation, so K's error is RoPE-free)."""
    attn = consumer.model.layers[layer].self_attn
    ws = [attn.k_proj.weight.float().T, attn.v_proj.weight.float().T]
    return torch.cat([w / torch.linalg.matrix_norm(w, ord=2) for w in ws], dim=1).cpu()


@torch.enable_grad()
def train_aligner(z: torch.Tensor, x_b: torch.Tensor, init_dec: torch.Tensor, init_mu: torch.Tensor,
                  positions: torch.Tensor | None = None, context: int = 1, width: int = 256, epochs: int = 60,
                  lr: float = 2e-3, batch: int = 512, val_frac: float = 0.1, patience: int = 6,
                  seed: int = 0, x0: torch.Tensor | None = None, token_dim: int = 0,
                  target_proj: torch.Tensor | None = None, window_dim: int = 8) -> AlignerFit:
    """Fit g(z) ~ x_b with a held-out validation split and early stopping on its loss.

    z: (N, r_h) producer codes, rows of whole sequences in order; positions (N,) their positions;
    x_b: (N, H) consumer x_norm; init_dec (r_h, H) / init_mu (H,) seed the linear part (on the current
    position's code). x0 (N, H): the consumer's layer-0 input, read when token_dim > 0.
    target_proj (H, m): measure the error after this map, e.g. the layer's own [k_proj; v_proj] so the
    fit spends its capacity on what the cache holds; None = MSE on x_norm itself.
    Returns the weights of the best validation epoch.
    """
    if positions is None:
        positions = torch.zeros(z.shape[0], dtype=torch.long)
    if token_dim and x0 is None:
        raise ValueError("token_dim > 0 needs the consumer's layer-0 input rows x0")
    proj = target_proj if target_proj is not None else torch.eye(x_b.shape[1])
    target = x_b @ proj
    win, ok = window_index(positions, context)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(z.shape[0], generator=gen)
    n_val = max(1, int(val_frac * z.shape[0]))
    val, tr = perm[:n_val], perm[n_val:]
    scale = target.pow(2).mean().clamp(min=1e-12)     # report losses relative to the target's power
    with torch.random.fork_rng(devices=[]):         # the initial weights follow `seed`: a fit is reproducible
        torch.manual_seed(seed)
        g = Aligner(init_dec.shape[0], x_b.shape[1], width, context, token_dim, window_dim)
    with torch.no_grad():
        g.linear.weight.zero_()
        g.linear.weight[:, :init_dec.shape[0]].copy_(init_dec.T)
        g.linear.bias.copy_(init_mu)

    def loss_of(idx):
        pred = g.train_rows(z, x0 if token_dim else None, win[idx], ok[idx])
        return (pred @ proj - target[idx]).pow(2).mean() / scale

    opt = torch.optim.AdamW(g.parameters(), lr=lr, weight_decay=1e-4)
    best, best_state, best_epoch, bad = float("inf"), None, 0, 0
    train_hist, val_hist = [], []
    for epoch in range(epochs):
        g.train()
        order = tr[torch.randperm(len(tr), generator=gen)]
        tot = 0.0
        for idx in order.split(batch):
            loss = loss_of(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item() * len(idx)
        g.eval()
        with torch.no_grad():
            v = loss_of(val).item()
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


def first_sequences(rows: tuple[torch.Tensor, ...], n: int) -> tuple[torch.Tensor, ...]:
    """(x_a, x_b, positions, x0) rows of whole sequences in order -> those of the first n sequences (a sequence
    starts at position 0); all of them for n = 0."""
    starts = (rows[2] == 0).nonzero().flatten()
    if not n or n >= len(starts):
        return rows
    return tuple(r[:int(starts[n])] for r in rows)


def patch_aligner(path: Path, cfg, hidden_size: int, enc, consumer, layer: int,
                  rows: Callable[[int], tuple[torch.Tensor, ...]]) -> tuple[Aligner, dict, bool]:
    """The Patch aligner of one consumer layer under the calibration settings `cfg` (CalibConfig), loaded from
    its checkpoint `path` (safetensors + a JSON of its loss curves) or trained and saved there: trained on
    rows(n) = (x_a producer x_norm, x_b consumer x_norm, positions, x0 the consumer's layer-0 input), rows of
    whole sequences in order, at least the first n of them (all for n = 0; n = cfg.aligner_prefixes, and only
    the first n are used), with the linear part seeded by the
    Patch encoder `enc`. Returns (the aligner in eval mode, its loss curves, whether it was trained now)."""
    if path.is_file():
        g = Aligner(cfg.r_h, hidden_size, cfg.aligner_width, cfg.aligner_context, cfg.aligner_tokens,
                    cfg.aligner_window)
        g.load_state_dict(load_file(str(path)))
        return g.eval(), json.loads(path.with_suffix(".json").read_text()), False
    x_a, x_b, pos, x0 = first_sequences(rows(cfg.aligner_prefixes), cfg.aligner_prefixes)
    with torch.no_grad():
        z = enc.encode(x_a)
    fit = train_aligner(z, x_b, enc.dec, enc.mu_b, pos, cfg.aligner_context, width=cfg.aligner_width,
                        epochs=cfg.aligner_epochs, seed=cfg.seed + layer, x0=x0 if cfg.aligner_tokens else None,
                        token_dim=cfg.aligner_tokens,
                        target_proj=kv_proj(consumer, layer) if cfg.aligner_loss == "kv" else None,
                        window_dim=cfg.aligner_window)
    curve = {"train": fit.train_loss, "val": fit.val_loss, "best_epoch": fit.best_epoch}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in fit.aligner.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(curve))
    return fit.aligner.eval(), curve, True
