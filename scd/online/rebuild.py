"""The online path: producer-side encoding of a prefix into codes, consumer-side cache rebuild.

Codes for one request (batch B, prefix length T), per layer by the artifact's plan:
  exact: nothing (the consumer regenerates layer 0 from token ids)
  reuse: z_k (B, n_kv, T, r_k), z_v (B, n_kv, T, r_v)
  hidden: z_x (B, T, r_x)   (from the producer's x_norm; decoded into K and V of every head; a code shared by
                             a group of layers travels at the group's first layer, art.x_codes)
  patch: z_h (B, T, r_h)
  shared: k (post-RoPE), v (B, n_kv, T, d_h): the producer's own, for a layer the consumer shares exactly
          (code_dtype "klt": the transform codes of its keys before RoPE and of its values, scd.online.klt)
  entry: z_e (B, T, e_groups, d_e): the producer's residual stream entering the layer, from which the consumer
         runs its own layers up to the next that is not "recompute" (scd.online.recompute)
  shared_entry: k, v and z_e (a family's payload: one member shares the layer, another enters there)
plus token ids and the left-padding mask, both (B, T).

An artifact with a tail has the consumer run the prefix's last tokens itself after the rebuild (k of them,
or k / tail_of of the prefix: PairArtifacts.tail_for), through every layer, over the cache rebuilt for the
tokens before them (selective.run_tail); with tail_rule "attention", k positions its last tokens attend to
most, with "learned" the k its selector (fitted at calibration) scores highest, with "suffix" the k the
request's own tokens after the prefix read most (rebuild's `reader`), over the cache rebuilt for every other
position (scd.online.selective).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from scd.online import activated, klt, selective
from scd.online.artifacts import PairArtifacts
from scd.online.patch import regenerate_kv
from scd.online.recompute import run_layers
from scd.online.rope import apply_rope, positions_from_mask
from scd.online.reuse import bigram_keys
from scd.online.tables import consumer_tables, layer0_input
from scd.online.trace import Trace

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class QuantCode:
    """A code as it arrives quantised (per-row fp16 scales; int8 values, or int4 ones packed two to a byte as
    uint8, low nibble first, offset by 8), dequantised where it is used: one layer at a time into a buffer
    that stays in cache, instead of the whole payload into fresh memory first (an up-front conversion of a
    long prefix's codes is a large share of its rebuild)."""
    scale: torch.Tensor                                 # (rows,) fp16
    q: torch.Tensor                                     # (rows, r) int8, or (rows, ceil(r / 2)) uint8 for int4
    shape: tuple[int, ...]                              # of the code it stands for; rows * r elements

    def to(self, device) -> "QuantCode":
        return QuantCode(self.scale.to(device), self.q.to(device), self.shape)

    def values(self) -> torch.Tensor:
        """The integer values (rows, r), signed."""
        r = self.shape[-1]
        if self.q.dtype == torch.int8:
            return self.q.view(-1, r)
        packed = self.q.view(-1, (r + 1) // 2)
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)[:, :r]
        return nibbles.to(torch.int8) - 8

    def dense(self, dtype=torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The code's values (rows * r,) reshaped to `shape`, written into `out` when given."""
        rows = self.values()
        out = torch.empty(rows.shape, dtype=dtype, device=rows.device) if out is None else out.view(rows.shape)
        return torch.mul(rows, self.scale.to(dtype)[:, None], out=out).view(self.shape)


@dataclass
class MixedCode:
    """A code whose leading columns arrived in one precision and the rest in another (code_dtype "mixed": the
    widest third in int8, the rest in int4), each part a QuantCode of its own columns."""
    parts: list[QuantCode]
    shape: tuple[int, ...]

    def to(self, device) -> "MixedCode":
        return MixedCode([p.to(device) for p in self.parts], self.shape)

    def dense(self, dtype=torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The code's values reshaped to `shape`, each part dequantised into its columns (of `out` when given)."""
        r = self.shape[-1]
        rows = self.parts[0].scale.shape[0]
        dev = self.parts[0].q.device
        out = torch.empty(rows, r, dtype=dtype, device=dev) if out is None else out.view(rows, r)
        col = 0
        for p in self.parts:
            w = p.shape[-1]
            torch.mul(p.values(), p.scale.to(dtype)[:, None], out=out[:, col:col + w])
            col += w
        return out.view(self.shape)


def dense(x: "torch.Tensor | QuantCode | MixedCode", dtype=torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """A code's values in `dtype`, whether it arrived as a float tensor or quantised (dequantised into `out`
    when given; a float tensor is only cast)."""
    return x.dense(dtype, out) if isinstance(x, (QuantCode, MixedCode)) else x.to(dtype)


@dataclass
class Codes:
    token_ids: torch.Tensor                             # (B, T) int
    mask: torch.Tensor                                  # (B, T) 0/1
    plan: list[str]
    layers: dict[int, dict[str, "torch.Tensor | QuantCode | MixedCode"]] = field(default_factory=dict)
    level: dict[str, int] | None = None                 # the Reuse ranks these codes were sent at (None: full)

    def to(self, device) -> "Codes":
        """These codes with every tensor on `device` (a no-op for those already there)."""
        return Codes(self.token_ids.to(device), self.mask.to(device), list(self.plan),
                     {l: {k: x.to(device) for k, x in fields.items()} for l, fields in self.layers.items()},
                     self.level)


def entry_groups(hidden_size: int, head_dim: int) -> tuple[int, int]:
    """(e_groups, d_e): how a residual stream's H values per token are cut into rows on the wire, one row per
    head_dim values where H allows it, else one row."""
    return (hidden_size // head_dim, head_dim) if hidden_size % head_dim == 0 else (1, hidden_size)


@torch.no_grad()
def encode(art: PairArtifacts, trace: Trace, token_ids: torch.Tensor, level: dict[str, int] | None = None) -> Codes:
    """Producer side: codes for every non-exact layer from the producer's own trace. `level`: Reuse ranks
    of one of art.levels (default: the full ranks); the Reuse codes are then that many leading columns."""
    if level is not None and level not in art.levels:
        raise ValueError(f"level {level} is not one this artifact serves: {art.levels}")
    rank = lambda name: (level or art.reuse_ranks)[name]  # noqa: E731
    plan = art.payload_plan                             # a family member's: every code its family sends
    codes = Codes(token_ids, trace.mask, list(plan), level=dict(level or art.reuse_ranks))
    for l, kind in enumerate(plan):
        if kind == "reuse":
            codes.layers[l] = {"z_k": art.reuse_k[l].encode(trace.content[l], rank("r_k")),
                               "z_v": art.reuse_v[l].encode(trace.values[l], rank("r_v"))}
        elif kind == "patch":
            codes.layers[l] = {"z_h": art.patch_enc[l].encode(trace.xnorm[l])}
        if kind in ("shared", "shared_entry"):
            codes.layers[l] = {"k": trace.keys[l], "v": trace.values[l]} if art.code_dtype != "klt" else \
                {"k": klt.encode(art.klt_k[l], trace.content[l], trace.mask),
                 "v": klt.encode(art.klt_v[l], trace.values[l], trace.mask)}
        if kind in ("entry", "shared_entry"):
            if trace.hidden is None:
                raise ValueError(f"{art.pair}: layer {l} is entered from the producer's residual stream; capture "
                                 f"the trace with want_hidden=True")
            b, t, h = trace.hidden[l].shape
            codes.layers.setdefault(l, {})["z_e"] = trace.hidden[l].reshape(b, t, *entry_groups(h, art.spec.head_dim))
    for l in (art.x_codes if art.x_codes is not None else [l for l, k in enumerate(plan) if k == "hidden"]):
        group = art.group(l)                            # x_norm of every layer of the group side by side
        x = trace.xnorm[l] if len(group) == 1 else torch.cat([trace.xnorm[j] for j in group], -1)
        codes.layers.setdefault(l, {})["z_x"] = art.reuse_x[l].encode(x, rank("r_x"))
    return codes


@torch.no_grad()
def exact_layer0(model, token_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> KV:
    """Layer 0's K/V depend only on the tokens: embed -> input_layernorm -> k/v proj (+RoPE). Exact, free.
    (The direct computation; rebuild() looks the same numbers up in ConsumerTables.)"""
    return regenerate_kv(model.model.layers[0], layer0_input(model, token_ids), cos, sin, head_dim)


@torch.no_grad()
def prepare(model, art: PairArtifacts) -> None:
    """Make everything rebuild() derives from the model and the artifact (lookup tables, stacked decoders,
    fused patches) now, so the first request does not pay for it."""
    param = next(model.parameters())
    dtype, one_token = param.dtype, torch.zeros(1, 1, dtype=torch.long, device=param.device)
    tables = consumer_tables(model, art.spec.head_dim)
    tables.rope(one_token, dtype)
    if tables.vocab_kept:
        tables.x0(one_token)
    reuse = [l for l, k in enumerate(art.plan) if k == "reuse"]
    if reuse:
        art.reuse_decoders(tuple(reuse), dtype)
    if any(k == "hidden" for k in art.plan):
        art.hidden_decoders(dtype)
    if art.patch_layers:
        tables.patches(art, art.patch_layers)


@torch.no_grad()
def rebuild(model, art: PairArtifacts, codes: Codes, own: Callable[[], dict[int, KV]] | None = None,
            reader: torch.Tensor | None = None) -> tuple[list[KV], dict[str, float]]:
    """Consumer side: per-layer (K post-RoPE, V) in the consumer's own feature space, plus phase times (ms).
    `own`: the blocks' layers run elsewhere (`run_blocks` from an E-first payload's entry part, running beside
    this): a call that returns them, made last; `codes` may then be the rest alone, and "recompute_ms" is the
    wait for them. `reader` (B, n): the request's tokens after the prefix, which an artifact with tail_rule
    "suffix" needs (a ValueError without them).

    Every kind of layer decodes K before RoPE and V in the (B, T, n_kv, d) layout its matmul writes, and the
    keys are rotated there; the cache holds (B, n_kv, T, d) views of that storage (no transposing copies).
    Hidden layers (most of a real family's plan) go code by code: the layers of a group (x_groups) decode
    from their one code by one matmul for their keys and one for their values (faster than layer by layer; a
    buffer stays a group's: one for every layer of a long prefix is fresh pages on every request, and slower).
    Per-head Reuse layers decode in one batched matmul each for K and V; all Patch layers run together. Reuse
    codes of a lower level (fewer columns than the artifact's ranks) decode with the decoders' leading rows."""
    t0 = time.perf_counter()
    dtype = next(model.parameters()).dtype
    b, t = codes.token_ids.shape
    n_kv, d_h = art.spec.num_kv_heads, art.spec.head_dim
    tables = consumer_tables(model, d_h)
    cos, sin = tables.rope(positions_from_mask(codes.mask), dtype)
    # the artifact's own plan: a family member reads the codes it uses of a payload laid out for the family
    by_kind = {kind: [l for l, k in enumerate(art.plan) if k == kind] for kind in ("exact", "reuse", "hidden", "patch")}
    kv: dict[int, KV] = {}
    heads = lambda x: x.view(*x.shape[:-2], t, n_kv, d_h).transpose(-3, -2)  # noqa: E731  (..., T, n_kv*d) -> (..., n_kv, T, d)
    if by_kind["exact"]:
        k0, v0 = tables.layer0(codes.token_ids)
        kv[0] = (apply_rope(heads(k0), cos, sin), heads(v0))
    if reuse := by_kind["reuse"]:
        dec_k, mu_k, dec_v, mu_v = art.reuse_decoders(tuple(reuse), dtype)
        r_k, r_v = (codes.layers[reuse[0]][name].shape[-1] for name in ("z_k", "z_v"))
        k = apply_rope(_decode_stacked(dec_k[:, :r_k], mu_k, [dense(codes.layers[l]["z_k"], dtype) for l in reuse]),
                       cos, sin)
        v = _decode_stacked(dec_v[:, :r_v], mu_v, [dense(codes.layers[l]["z_v"], dtype) for l in reuse])
        kv.update({l: (k[i], v[i]) for i, l in enumerate(reuse)})
    if hidden := by_kind["hidden"]:                     # one code per token -> K and V of every head
        kv.update(_hidden_kv(art, codes, hidden, dtype, cos, sin))
    kv.update(_shared_kv(model, art, codes, dtype, cos, sin))
    t_patch = time.perf_counter()
    if patch := by_kind["patch"]:                       # all Patch layers at once
        x0 = tables.x0(codes.token_ids) if art.aligner_tokens and not tables.vocab_kept else None
        k, v = tables.patches(art, patch)([dense(codes.layers[l]["z_h"]) for l in patch], codes.mask, codes.token_ids, x0)
        k = apply_rope(heads(k), cos, sin)                                      # (P, B, n_kv, T, d)
        kv.update({l: (k[i], heads(v[i])) for i, l in enumerate(patch)})
    t_run = time.perf_counter()
    kv.update(run_blocks(model, art, codes) if own is None else own())
    t_end = time.perf_counter()
    out = [kv[l] for l in range(len(art.plan))]
    if art.tail_tokens and art.tail_rule != "last":
        out, _ = selective.repair(model, out, codes.token_ids, codes.mask, art.tail_rule, art.tail_for(t) / t,
                                  selector=(art.selector, art.selector_layers), reader=reader)
    elif art.tail_tokens:
        out = selective.run_tail(model, out, codes.token_ids, codes.mask, art.tail_for(t))
    return out, {"rebuild_ms": (t_patch - t0) * 1e3, "patch_ms": (t_run - t_patch) * 1e3,
                 "recompute_ms": (t_end - t_run) * 1e3, "tail_ms": (time.perf_counter() - t_end) * 1e3}


def _hidden_kv(art: PairArtifacts, codes: Codes, hidden: list[int], dtype, cos: torch.Tensor, sin: torch.Tensor
               ) -> dict[int, KV]:
    """The K (post-RoPE) and V of the `hidden` layers: one code per token decodes to every head of every layer
    of its group, by one matmul for the group's keys and one for its values."""
    b, t = codes.token_ids.shape
    n_kv, d_h = art.spec.num_kv_heads, art.spec.head_dim
    kv: dict[int, KV] = {}
    keys = bigram_keys(codes.token_ids, codes.mask).reshape(-1) if art.hidden_bigrams(tuple(hidden)) else None
    # (B, T, G, n_kv, d) -> (G, B, n_kv, T, d) views; the keys rotated into one tensor, the values kept where
    # the matmul wrote them
    split = lambda y, g: y.view(b, t, g, n_kv, d_h).permute(2, 0, 3, 1, 4)  # noqa: E731
    for src, (layers, dec_k, mu_k, dec_v, mu_v) in art.hidden_decoders(dtype).items():
        z = dense(codes.layers[src]["z_x"], dtype)   # the layers of a group share their code: dequantised once,
        r = z.shape[-1]                              # decoded by one matmul for their keys, one for values
        z = z.reshape(b * t, r)
        # token (and bigram) tables: each position's bias row, gathered into the output the matmul adds to
        # (addmm would copy them there first)
        if mu_k.dim() == 2:
            rows = art.reuse_x[src].bias_rows(codes.token_ids.reshape(-1), keys)
            k = mu_k.index_select(0, rows).addmm_(z, dec_k[:r])
            v = mu_v.index_select(0, rows).addmm_(z, dec_v[:r])
        else:
            k, v = torch.addmm(mu_k, z, dec_k[:r]), torch.addmm(mu_v, z, dec_v[:r])
        k = apply_rope(split(k, len(layers)), cos, sin)
        v = split(v, len(layers))
        kv.update({l: (k[i], v[i]) for i, l in enumerate(layers)})
    return kv


def _shared_kv(model, art: PairArtifacts, codes: Codes, dtype, cos: torch.Tensor, sin: torch.Tensor
               ) -> dict[int, KV]:
    """The shared layers' K and V: the producer's own, as sent (dense, or transform codes whose attention sinks
    are computed here)."""
    kv: dict[int, KV] = {}
    shared = [l for l, k in enumerate(art.plan) if k == "shared"]
    for l in shared:
        if art.code_dtype == "klt":
            kv[l] = (apply_rope(klt.decode(art.klt_k[l], codes.layers[l]["k"], dtype), cos, sin),
                     klt.decode(art.klt_v[l], codes.layers[l]["v"], dtype))
        else:
            kv[l] = (dense(codes.layers[l]["k"], dtype), dense(codes.layers[l]["v"], dtype))
    if shared and art.code_dtype == "klt":
        base = activated.of(model).base if activated.of(model) is not None else model   # an aLoRA's: its base's
        for l, (k, v) in enumerate(klt.sink_kv(base, codes.token_ids, codes.mask, shared[-1] + 1)):
            if l in kv:
                klt.set_sinks(kv[l][0], k, codes.mask)
                klt.set_sinks(kv[l][1], v, codes.mask)
    return kv


@torch.no_grad()
def run_blocks(model, art: PairArtifacts, codes: Codes) -> dict[int, KV]:
    """The consumer's own layers of every block of `art`, run from the residual sent at its entry (through
    the entry's aligner, if it has one): what needs only the entry part of an E-first payload."""
    if not art.blocks:
        return {}
    dtype = next(model.parameters()).dtype
    b, t = codes.token_ids.shape
    positions = positions_from_mask(codes.mask)
    kv = {}
    for s, e in art.blocks:
        x = dense(codes.layers[s]["z_e"], dtype).reshape(b, t, -1)
        if (align := art.entry_align.get(s)) is not None:     # towards the consumer's own residual there
            x = x + align.decode(align.encode(x)).to(dtype)
        kv.update(zip(range(s, e), run_layers(model, x, codes.mask, positions, s, e)))
    return kv


def _decode_stacked(dec: torch.Tensor, mu: torch.Tensor, zs: list[torch.Tensor]) -> torch.Tensor:
    """Decode one code (B, n_kv, T, r) per layer as one batched matmul with stacked decoders: (L, B, n_kv, T, d)."""
    z = torch.stack(zs)                                               # (L, B, n_kv, T, r)
    return torch.baddbmm(mu, z.flatten(1, -2), dec).view(*z.shape[:-1], dec.shape[-1])
