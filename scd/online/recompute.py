"""Layers the consumer runs itself over the prefix: a recompute block, entered from a residual stream.

DroidSpeak's action and the exact plans' (scd.fitting.structure): given the residual stream entering layer s
(the producer's, exact when layers [0, s) are shared, or a coded one), the consumer runs its own layers
s..e-1 over the prefix and keeps the K and V they write. Its cost is those layers' share of a prefill.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from scd.online.cache import cache_arg
from scd.online.rope import cos_sin

KV = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def run_layers(model, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, start: int,
               stop: int) -> list[KV]:
    """The consumer's (K post-RoPE, V) of layers [start, stop), each (B, n_kv, T, d_h), from the residual
    stream `hidden` (B, T, H) entering layer `start`, over a left-padded prefix (mask, positions (B, T))."""
    return layers_kv(model, hidden, mask, positions, start, stop)


def layers_kv(model, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, start: int,
              stop: int) -> list[KV]:
    """run_layers, differentiable in `hidden` (an entry trained through the block, tools.probe_entry)."""
    t = hidden.shape[1]
    attn_mask = None                            # no padding: the attention's own causal path, as a prefill takes
    if not bool(mask.bool().all()):
        causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
        allowed = causal[None, None] & mask.bool()[:, None, None, :]          # (B, 1, T, T)
        attn_mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~allowed, torch.finfo(hidden.dtype).min)
    emb = cos_sin(model, positions, hidden.dtype)
    cache = DynamicCache(config=model.config)
    x = hidden
    for l in range(start, stop):
        layer = model.model.layers[l]
        x = layer(x, attention_mask=attn_mask, position_ids=positions, use_cache=True, position_embeddings=emb,
                  **cache_arg(layer, cache))
        x = x[0] if isinstance(x, tuple) else x
    return [(cache.layers[l].keys, cache.layers[l].values) for l in range(start, stop)]
