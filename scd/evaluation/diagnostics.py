"""Where the error lives: per-layer drift of the consumer's x_norm on tokens decoded after a rebuilt cache.

The continuation is run twice, once on the oracle cache and once on a rebuilt one, with a hook on every
input_layernorm. The relative error ||x_method - x_oracle|| / ||x_oracle|| per layer shows how Reuse error
accumulates with depth and how a Patch layer resets it (the paper's layer-wise error figure).
"""
from __future__ import annotations

import torch

from scd.online import cache

KV = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def _xnorms(model, kv: list[KV], mask: torch.Tensor, cont: torch.Tensor) -> list[torch.Tensor]:
    got: list[torch.Tensor] = []
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, i, o: got.append(o))
             for layer in model.model.layers]
    try:
        cache.extend(model, cache.assemble(model, kv), mask, cont)
    finally:
        for h in hooks:
            h.remove()
    return got


def xnorm_errors(model, kv: list[KV], oracle_kv: list[KV], mask: torch.Tensor, cont: torch.Tensor) -> list[float]:
    """Relative x_norm error per layer on the continuation tokens (B, S); one float per layer."""
    ref = _xnorms(model, oracle_kv, mask, cont)
    got = _xnorms(model, kv, mask, cont)
    return [((g - r).norm() / r.norm().clamp(min=1e-12)).item() for g, r in zip(got, ref)]
