"""Per-consumer lookups for the rebuild: what depends on a token id or a position alone is looked up,
not computed, and an artifact's Patch aligners are composed with their layers' K/V projections once.

The rebuild is a few dozen small tensor operations; on a small model each one costs more in dispatch
than in arithmetic, so every operation saved here is latency saved (see `scd bench`). Everything is
exact algebra on the model's own modules (every RoPE variant and projection bias is honoured) and is
tested against the direct computation. Tables assume frozen weights: serving never changes them.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from scd.online.patch import FusedPatches, key_norm
from scd.online.rope import cos_sin


def layer0_input(model, token_ids: torch.Tensor) -> torch.Tensor:
    """The consumer's layer-0 x_norm: input_layernorm(embed(ids)), (B, T, H). A function of the tokens alone."""
    return model.model.layers[0].input_layernorm(model.model.embed_tokens(token_ids))


class ConsumerTables:
    """RoPE cos/sin by position; per vocabulary entry the layer-0 input x0 and layer-0 K (before RoPE) and
    V, kept while vocab x (hidden + K/V width) stays under `max_vocab_elements` (a real vocabulary computes
    them on the fly instead); and the fused form of every Patch aligner used with this model."""

    def __init__(self, model, head_dim: int, max_vocab_elements: int = 1 << 24):
        self.model, self.head_dim = model, head_dim
        w = model.model.embed_tokens.weight
        self.made_for = (w.device, w.dtype)            # tables follow the model's device and dtype
        self._rope: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        vocab, hidden = w.shape
        attn = model.model.layers[0].self_attn
        self.vocab_kept = vocab * (hidden + attn.k_proj.out_features + attn.v_proj.out_features) <= max_vocab_elements
        self._vocab: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (B, T, d_h), as cos_sin(model, positions) gives them."""
        t = positions.shape[-1]
        need = int(positions.max()) + 1
        have = self._rope.get(dtype)
        if have is None or have[0].shape[0] < need:
            n = max(need, 2 * have[0].shape[0] if have else 1024)
            cos, sin = cos_sin(self.model, torch.arange(n, device=positions.device)[None], dtype)
            have = self._rope[dtype] = (cos[0], sin[0])
        if need == t and positions.shape[0] == 1:         # one unpadded row: positions 0..T-1, a slice
            return have[0][None, :t], have[1][None, :t]
        return have[0][positions], have[1][positions]

    @torch.no_grad()
    def _vocab_tables(self):
        if self._vocab is None:
            emb = self.model.model.embed_tokens.weight
            x0 = layer0_input(self.model, torch.arange(emb.shape[0], device=emb.device))
            attn = self.model.model.layers[0].self_attn
            self._vocab = (x0, key_norm(attn, attn.k_proj(x0), self.head_dim), attn.v_proj(x0))
        return self._vocab

    @torch.no_grad()
    def x0(self, token_ids: torch.Tensor) -> torch.Tensor:
        """layer0_input(model, ids), (B, T, H)."""
        return F.embedding(token_ids, self._vocab_tables()[0]) if self.vocab_kept else layer0_input(self.model, token_ids)

    @torch.no_grad()
    def layer0(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's K before RoPE and V, each (B, T, n_kv * d_h): exact, from the token ids alone."""
        if self.vocab_kept:
            _, k, v = self._vocab_tables()
            return F.embedding(token_ids, k), F.embedding(token_ids, v)   # a gather: faster than t[ids] on a CPU
        x0 = layer0_input(self.model, token_ids)
        attn = self.model.model.layers[0].self_attn
        return key_norm(attn, attn.k_proj(x0), self.head_dim), attn.v_proj(x0)

    def patches(self, art, layers: list[int]) -> FusedPatches:
        """The artifact's aligners of `layers` fused with this model's projections (made once per artifact
        and model: kept in the artifact's `derived`, checked to belong to these tables)."""
        key = ("patches", tuple(layers), id(self))
        hit = art.derived.get(key)
        if hit is None or hit[0]() is not self:
            table = self._vocab_tables()[0] if self.vocab_kept else None
            fused = FusedPatches([art.aligners[l] for l in layers], [self.model.model.layers[l] for l in layers], table)
            hit = art.derived[key] = (weakref.ref(self), fused)
        return hit[1]


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def consumer_tables(model, head_dim: int) -> ConsumerTables:
    """The model's ConsumerTables, made once per model object (again if the model moved device or dtype)."""
    w = model.model.embed_tokens.weight
    tables = _TABLES.get(model)
    if tables is None or tables.made_for != (w.device, w.dtype):
        tables = _TABLES[model] = ConsumerTables(model, head_dim)
    return tables
