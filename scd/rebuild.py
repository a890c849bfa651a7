"""The online path: producer-side encoding of a prefix into codes, consumer-side cache rebuild.

Codes for one request (batch B, prefix length T), per layer by the artifact's plan:
  exact: nothing (the consumer regenerates layer 0 from token ids)
  reuse: z_k (B, n_kv, T, r_k), z_v (B, n_kv, T, r_v)
  patch: z_h (B, T, r_h)
plus token ids and the left-padding mask, both (B, T).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scd.artifacts import PairArtifacts
from scd.patch import regenerate_kv
from scd.rope import apply_rope, cos_sin, positions_from_mask
from scd.trace import Trace

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Codes:
    token_ids: torch.Tensor                             # (B, T) int
    mask: torch.Tensor                                  # (B, T) 0/1
    plan: list[str]
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


@torch.no_grad()
def encode(art: PairArtifacts, trace: Trace, token_ids: torch.Tensor) -> Codes:
    """Producer side: codes for every non-exact layer from the producer's own trace."""
    codes = Codes(token_ids, trace.mask, list(art.plan))
    for l, kind in enumerate(art.plan):
        if kind == "reuse":
            codes.layers[l] = {"z_k": art.reuse_k[l].encode(trace.content[l]), "z_v": art.reuse_v[l].encode(trace.values[l])}
        elif kind == "patch":
            codes.layers[l] = {"z_h": art.patch_enc[l].encode(trace.xnorm[l])}
    return codes


@torch.no_grad()
def exact_layer0(model, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> KV:
    """Layer 0's K/V depend only on the tokens: embed -> input_layernorm -> k/v proj (+RoPE). Exact, free."""
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(token_ids))
    return regenerate_kv(layer, x, cos, sin, head_dim)


@torch.no_grad()
def rebuild(model, art: PairArtifacts, codes: Codes) -> tuple[list[KV], dict[str, float]]:
    """Consumer side: per-layer (K post-RoPE, V) in the consumer's own feature space, plus phase times (ms)."""
    import time
    t0 = time.perf_counter()
    dtype = next(model.parameters()).dtype
    positions = positions_from_mask(codes.mask)
    cos, sin = cos_sin(model, positions, dtype)
    d_h = art.spec.head_dim
    kv: list[KV] = []
    patch_s = 0.0
    for l, kind in enumerate(codes.plan):
        c = codes.layers.get(l, {})
        if kind == "exact":
            kv.append(exact_layer0(model, codes.token_ids, cos, sin, d_h))
        elif kind == "reuse":
            k = art.reuse_k[l].decode(c["z_k"].to(dtype))
            kv.append((apply_rope(k, cos, sin), art.reuse_v[l].decode(c["z_v"].to(dtype))))
        else:
            tp = time.perf_counter()
            x = art.aligners[l](c["z_h"].to(dtype), positions)
            kv.append(regenerate_kv(model.model.layers[l], x, cos, sin, d_h))
            patch_s += time.perf_counter() - tp
    total = time.perf_counter() - t0
    return kv, {"rebuild_ms": (total - patch_s) * 1e3, "patch_ms": patch_s * 1e3}
