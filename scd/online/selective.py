"""Selective token recompute: a rebuilt cache repaired at the positions where it deviates most, across models
(CacheBlend, arXiv 2405.16444, which repairs a cache reused for another context).

The consumer runs every layer for a chosen set S of the prefix's positions. At each layer the positions of S
attend over the cache as it stands there: their own K, V (computed in this pass) at the positions of S, the
rebuilt K, V at the others. Their own K, V then replace the rebuilt ones at S. Selecting every position is
the consumer's own prefill; selecting the last k is a tail (`run_tail`). It costs |S| / T of a
prefill's projections and MLPs, and about the causal triangle of S in attention: the positions run in
chunks in column order, each over the columns up to its last, as a chunked prefill does.

Which positions (each a rule with its own cost, counted by `cost`):
- `attention`: the consumer's own last `window` positions first, through every layer over the rebuilt cache
  (a tail); the positions their queries attend to most, summed over layers and heads (SnapKV's observation
  window, read on the consumer's side). Those last positions are then selected again, so that they attend
  over the repaired cache: the window costs twice. A share of at most `window` positions selects the window
  alone: it runs once, as a tail, with nothing to score.
- `deviation`: CacheBlend's rule. The consumer's own first `layers` layers over every position (that share of
  a prefill), against the rebuilt K, V there; the positions that deviate most. Those first layers are then the
  consumer's own for every position (they were computed anyway; `repair` puts them in before S runs).
- `last`: the prefix's last positions, a tail (`run_tail`), as the baseline the others are measured
  against on the same windows.
- `structural`: no compute. The prefix's last positions, then its separators (newlines, punctuation), then
  the first tokens of capitalised words (names), then the latest others.
- `suffix`: the request's own tokens (the prompt after the shared prefix: a question), run through every layer
  over the rebuilt cache; the positions they attend to most, summed over layers and heads. The suffix then runs
  again over the repaired cache, as it does for every plan: its first pass is the rule's cost. It needs the
  request, so a cache repaired by it serves that request alone.
- `learned`: no compute to choose. A linear score of each position's features in the given cache (its V at a
  few layers, its distance from the prefix's end, whether it is the first), fitted at calibration to the
  attention the consumer's continuations pay each position over its own cache (scd.fitting.selector, over
  `reads_of`): the positions the next tokens will read, as well as the rebuilt cache tells.
"""
from __future__ import annotations

import re

import torch

from scd.online import fast_decode
from scd.online.cache import assemble, cache_arg, extend
from scd.online.recompute import run_layers
from scd.online.rope import apply_rope, cos_sin, positions_from_mask
from scd.online.trace import thread_hooks
from scd.settings import SELECT_WINDOW

KV = tuple[torch.Tensor, torch.Tensor]
RULES = ("attention", "deviation", "structural", "last", "learned", "suffix")
WINDOW = SELECT_WINDOW
CHUNK = 256                  # positions recomputed together (`recompute_tokens`)
READ_TOKENS = 32             # a continuation's tokens whose reads a learned selector fits (the evaluation's horizon)
NEAR = 8                     # a learned selector's distance buckets: log2 of the distance from the prefix's end,
                             # the last for 2^(NEAR-1) - 1 and farther
POSITION_FEATURES = NEAR + 3  # a learned selector's features besides V: those buckets, log2 distance, first, 1


def request_reader(art, suffix_ids: list[int] | None, device) -> torch.Tensor | None:
    """What a served plan's rebuild reads the request by: its tokens after the prefix, (1, S), for a plan by the
    suffix rule (`art.tail_rule`); None for any other (nothing to build)."""
    if art.tail_rule != "suffix":
        return None
    return torch.tensor([list(suffix_ids or [])], dtype=torch.long, device=device)


def count_for(mask: torch.Tensor, fraction: float) -> int:
    """How many positions a fraction of the prefix selects: of its shortest row's real (unpadded) ones."""
    valid = int(mask.long().sum(-1).min())
    return max(0, min(valid, round(fraction * valid)))


@torch.no_grad()
def recompute_tokens(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, sel: torch.Tensor,
                     attended: torch.Tensor | None = None, chunk: int = CHUNK) -> list[KV]:
    """`kv` (per layer (K post-RoPE, V), each (B, n_kv, T, d)) with the positions `sel` (B, s) (column
    indexes, sorted, each row's own and unpadded) replaced by the consumer's own K, V: every layer runs for
    the s positions only. They run in chunks of `chunk` in column order, as a chunked prefill does: a chunk
    attends over the columns up to its last one only (the earlier chunks' own K, V in place there), so the
    attention costs about the causal triangle of the selection, not s x T. With `attended` (B, T), the
    attention the s queries pay each column, summed over layers and heads, is added to it."""
    if sel.shape[1] == 0:
        return list(kv)
    out = [(k.clone(), v.clone()) for k, v in kv]
    positions = positions_from_mask(mask)
    for lo in range(0, sel.shape[1], chunk):
        _recompute_chunk(model, out, token_ids, mask, positions, sel[:, lo:lo + chunk], attended)
    return out


@torch.no_grad()
def run_tail(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> list[KV]:
    """The cache `kv` of a (B, T) prefix with its last `tokens` positions (at most T - 1: the first comes from
    `kv`) replaced by the consumer's own: it runs them through every layer, attending to `kv` before them,
    as it runs a request's suffix. A prefix the codes translate imperfectly at every layer (a specialist
    adapted on every layer) is then exact where a continuation looks most: the recent tokens' K and V carry
    only what attending to the translated ones passes on. Costs about tokens / T of a prefill."""
    t = token_ids.shape[1]
    s = t - min(tokens, t - 1)
    if s >= t:
        return kv
    if token_ids.shape[0] == 1 and bool(mask.all()) and (fast := fast_decode.step_for(model)) is not None:
        # one unpadded row (a served request): plain torch, without transformers' per-call machinery
        _, keys, values = fast.extend([k[..., :s, :] for k, _ in kv], [v[..., :s, :] for _, v in kv],
                                      token_ids[:, s:])
        return list(zip(keys, values))
    c = assemble(model, [(k[..., :s, :], v[..., :s, :]) for k, v in kv])
    extend(model, c, mask[:, :s], token_ids[:, s:], mask[:, s:], logits=False)
    return [(layer.keys, layer.values) for layer in c.layers]


def _recompute_chunk(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     sel: torch.Tensor, attended: torch.Tensor | None) -> None:
    """One chunk of `recompute_tokens`: every layer for the positions `sel` over `kv`'s columns up to the
    chunk's last, whose K, V then replace `kv`'s (in place) at `sel`."""
    b, s = sel.shape
    t = int(sel.max()) + 1                                                    # the columns this chunk sees
    dtype = kv[0][0].dtype
    pos = positions.gather(1, sel)                                            # (B, s) RoPE positions
    chosen = torch.zeros(b, t, dtype=torch.bool, device=sel.device).scatter_(1, sel, True)
    cols = torch.arange(t, device=sel.device)
    # query i (column sel_i) sees: a column j <= sel_i that is not chosen (kv's K, V there: rebuilt, or an
    # earlier chunk's own) and not padding, and a chosen column m with sel_m <= sel_i (its own K, V, appended
    # after the t old ones)
    see_old = (cols[None, None, :] <= sel[:, :, None]) & ~chosen[:, None, :] & mask[:, :t].bool()[:, None, :]
    see_new = sel[:, None, :] <= sel[:, :, None]
    allowed = torch.cat([see_old, see_new], -1)[:, None]                      # (B, 1, s, t + s)
    attn = torch.zeros(allowed.shape, dtype=dtype, device=sel.device).masked_fill(~allowed, torch.finfo(dtype).min)
    emb = cos_sin(model, pos, dtype)
    cache = assemble(model, [(k[..., :t, :], v[..., :t, :]) for k, v in kv])
    x = model.model.embed_tokens(token_ids.gather(1, sel)).to(dtype)
    queries: list[torch.Tensor] = []
    hooks = [] if attended is None else thread_hooks([layer.self_attn.q_proj for layer in model.model.layers],
                                                     queries.append)
    try:
        for l in range(len(kv)):
            layer = model.model.layers[l]
            x = layer(x, attention_mask=attn, position_ids=pos, use_cache=True, position_embeddings=emb,
                      **cache_arg(layer, cache))
            x = x[0] if isinstance(x, tuple) else x
    finally:
        for h in hooks:
            h.remove()
    if attended is not None:
        attention_received(model, queries, cache, emb, attn, sel, attended[:, :t])
    for l, (k, v) in enumerate(kv):
        idx = sel[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        k.scatter_(2, idx, cache.layers[l].keys[..., t:, :])
        v.scatter_(2, idx, cache.layers[l].values[..., t:, :])


def attention_received(model, queries: list[torch.Tensor], cache, emb, attn: torch.Tensor, sel: torch.Tensor,
                        attended: torch.Tensor) -> None:
    """Add to `attended` (B, T) the softmax attention of the s queries (each layer's q_proj output) over the
    cache they saw (T old columns and s of their own, `attn` their additive mask), summed over layers and
    heads; a chosen column's own K, V count at its column. With no chosen columns (`sel` (B, 0)) and
    `attended` (B, T + s), every column counts where it is (tools.probe_selective reads a continuation so)."""
    b, s = queries[0].shape[:2]
    t = attended.shape[1]
    cos, sin = emb
    for l, q in enumerate(queries):
        att = model.model.layers[l].self_attn
        q = q.view(b, s, -1, att.head_dim)
        if hasattr(att, "q_norm"):                                              # Qwen3's per-head norm
            q = att.q_norm(q)
        q = apply_rope(q.transpose(1, 2).float(), cos.float(), sin.float())
        k = cache.layers[l].keys.float()                                        # (B, n_kv, T + s, d)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        w = ((q @ k.transpose(-1, -2)) * att.head_dim ** -0.5 + attn.float()).softmax(-1).sum((1, 2))   # (B, T + s)
        attended += w[:, :t]
        attended.scatter_add_(1, sel, w[:, t:])


def attention(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, fraction: float,
              window: int = WINDOW) -> torch.Tensor:
    """The attention rule's selection (B, s): the last `window` real positions, run through every layer over
    `kv`, and the positions their queries attend to most (they themselves first)."""
    b, t = token_ids.shape
    w = min(window, int(mask.long().sum(-1).min()))
    tail = torch.arange(t - w, t, device=token_ids.device).expand(b, -1)
    score = torch.zeros(b, t, dtype=torch.float32, device=token_ids.device)
    recompute_tokens(model, kv, token_ids, mask, tail, attended=score)
    score.scatter_(1, tail, float("inf"))
    return top(score, mask, max(w, count_for(mask, fraction)))


@torch.no_grad()
def deviation(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, fraction: float,
              layers: int = 1) -> tuple[torch.Tensor, list[KV]]:
    """CacheBlend's selection: (sel (B, s), the consumer's own K, V of layers [0, layers) over every position).
    A position's deviation is the squared distance of its rebuilt K and V from the consumer's own over those
    layers, each layer's scaled by its own K and V's mean square."""
    positions = positions_from_mask(mask)
    dtype = kv[0][0].dtype
    own = run_layers(model, model.model.embed_tokens(token_ids).to(dtype), mask, positions, 0, layers)
    score = torch.zeros(token_ids.shape, dtype=torch.float32, device=token_ids.device)
    for (k, v), (ok, ov) in zip(kv, own):
        for got, ref in ((k, ok), (v, ov)):
            d = (got.float() - ref.float()).pow(2).sum((1, 3))                # (B, T)
            score += d / ref.float().pow(2).sum((1, 3)).mean(-1, keepdim=True).clamp(min=1e-12)
    return top(score, mask, count_for(mask, fraction)), own


SEPARATOR = re.compile(r"[\n.,:;?!()\[\]\"]")


def structural(token_ids: torch.Tensor, mask: torch.Tensor, tok, fraction: float, last: int = 16) -> torch.Tensor:
    """The positions a prefix's structure points at, no compute: its last `last`, its separators, the first
    tokens of capitalised words, then the latest others, up to `fraction` of the prefix."""
    b, t = token_ids.shape
    score = torch.zeros(b, t)
    for r in range(b):
        pieces = tok.convert_ids_to_tokens(token_ids[r].tolist())
        for c, piece in enumerate(pieces):
            text = tok.convert_tokens_to_string([piece])
            if SEPARATOR.search(text):
                score[r, c] = 2.0
            elif text[:1].isspace() and text.strip()[:1].isupper():
                score[r, c] = 1.0
    score += torch.arange(t, dtype=torch.float32) / t                         # later first among equals
    score[:, max(0, t - last):] = 3.0 + torch.arange(min(t, last), dtype=torch.float32) / t
    return top(score, mask, count_for(mask, fraction))


def selector_layers(num_layers: int, n: int = 5) -> list[int]:
    """The layers whose V a learned selector reads: `n` spread from the first to the last."""
    return sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})


def selector_features(kv: list[KV], mask: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """(B, T, F): each position's V at `layers` (every KV head's, each layer's scaled to unit norm); its
    distance d from the prefix's last position as log2(d + 1) (a power law of the distance, which carries to
    prefixes longer than those fitted on) and in NEAR log2 buckets (the shape near the end); whether it is the
    first real position (where attention sinks); and a constant 1."""
    b, t = mask.shape
    vs = [kv[l][1].float().transpose(1, 2).reshape(b, t, -1) for l in layers]
    vs = [v / v.norm(dim=-1, keepdim=True).clamp(min=1e-6) for v in vs]
    far = torch.log2(torch.arange(t - 1, -1, -1, device=mask.device, dtype=torch.float32) + 1)
    near = torch.nn.functional.one_hot(far.floor().long().clamp(max=NEAR - 1), NEAR).float()
    first = (torch.arange(t, device=mask.device)[None] == (mask.long() == 0).sum(-1, keepdim=True)).float()
    return torch.cat(vs + [near.expand(b, -1, -1), far[None, :, None].expand(b, -1, -1), first[..., None],
                           torch.ones(b, t, 1, device=mask.device)], -1)


@torch.no_grad()
def reads_of(model, kv: list[KV], mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T): the attention the queries of `tokens` (B, n) (tokens after the prefix, e.g. its continuation)
    pay each prefix position as `model` runs them over the prefix cache `kv`, summed over layers, heads and
    those tokens."""
    queries: list[torch.Tensor] = []
    hooks = thread_hooks([layer.self_attn.q_proj for layer in model.model.layers], queries.append)
    try:
        c = assemble(model, kv)
        extend(model, c, mask, tokens, logits=False)
    finally:
        for h in hooks:
            h.remove()
    b, t = mask.shape
    n = tokens.shape[-1]
    full = torch.cat([mask, torch.ones(b, n, dtype=mask.dtype, device=mask.device)], 1)
    pos = positions_from_mask(full)[:, t:]
    causal = torch.ones(n, t + n, dtype=torch.bool, device=mask.device).tril(t)   # the prefix, then up to itself
    allowed = causal[None, None] & full.bool()[:, None, None]
    attn = torch.zeros(allowed.shape, device=mask.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    read = torch.zeros(b, t + n, device=mask.device)        # every column; no selected ones of its own to add
    attention_received(model, queries, c, cos_sin(model, pos, torch.float32), attn,
                       torch.zeros(b, 0, dtype=torch.long, device=mask.device), read)
    return read[:, :t]


def selector_target(read: torch.Tensor, mask: torch.Tensor, error: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T): what a learned selector fits: the log of each position's share of the reads, scaled so that a
    uniform share is 1 (prefixes of any length on one scale), floored at 0.01 of it. Given `error` (B, T), the
    rebuilt cache's error at each position (rebuild_error), the log of that error relative to its mean over the
    real positions is added: the positions worth recomputing are those read much and rebuilt badly."""
    valid = mask.float().sum(-1, keepdim=True)
    share = read * mask / read.mul(mask).sum(-1, keepdim=True).clamp(min=1e-12) * valid
    target = torch.log(share + 0.01)
    if error is None:
        return target
    mean = error.mul(mask).sum(-1, keepdim=True) / valid.clamp(min=1)
    ratio = torch.where(mean > 0, error / mean.clamp(min=1e-12), torch.ones_like(error))   # no error: reads alone
    return target + torch.log(ratio.clamp(min=1e-6)) * mask


def rebuild_error(kv: list[KV], own: list[KV]) -> torch.Tensor:
    """(B, T): the relative squared error of a rebuilt cache `kv` against the consumer's own `own` at each
    position, summed over layers: per layer the squared distance of K and V over heads and channels, over the
    own K and V's squared norm there."""
    err = 0.0
    for (k, v), (ko, vo) in zip(kv, own):
        ko, vo = ko.float(), vo.float()
        diff = (k.float() - ko).pow(2).sum((1, 3)) + (v.float() - vo).pow(2).sum((1, 3))
        err = err + diff / (ko.pow(2).sum((1, 3)) + vo.pow(2).sum((1, 3))).clamp(min=1e-12)
    return err


def learned(kv: list[KV], mask: torch.Tensor, fraction: float,
            selector: tuple[torch.Tensor, list[int]]) -> torch.Tensor:
    """The learned rule's selection (B, s): the positions a fitted selector (weights, its layers:
    scd.fitting.selector) scores highest."""
    w, layers = selector
    score = selector_features(kv, mask, layers) @ w.to(mask.device)
    return top(score, mask, count_for(mask, fraction))


def top(score: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest-scoring unpadded columns of each row, in column order: (B, k)."""
    score = score.masked_fill(~mask.bool(), float("-inf"))
    return score.topk(k, dim=-1).indices.sort(-1).values


def cost(config, t: int, s: int, first_layers: int = 0, window: int = 0, columns: list[int] | None = None,
         chunk: int = CHUNK) -> float:
    """Multiply-adds of selective recompute over a prefix of t positions with s selected, as a share of the
    consumer's own prefill of it (`config`: its transformers config): s positions through every layer (their
    projections and MLP, and attention as `recompute_tokens` runs it: each chunk over the columns up to its
    last and its own), plus `first_layers` layers over all t (the deviation rule's), plus a first pass of
    `window` positions through every layer (the attention rule's: the prefix's last, one chunk over all t).
    `columns` (one row's s selected columns, sorted) places the chunks; without it each chunk counts all t
    columns, the most it can see."""
    h, f = config.hidden_size, config.intermediate_size
    n, n_kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // n
    linear = h * d * (2 * n + 2 * n_kv) + 3 * h * f                            # q, o, k, v; gate, up, down
    prefill_layer = t * linear + n * d * t * (t + 1)                            # QK^T and AV over the causal half
    ends = ([columns[min(i + chunk, s) - 1] + 1 for i in range(0, s, chunk)] if columns is not None
            else [t] * -(-s // chunk))
    seen = sum(min(chunk, s - i) * (ends[i // chunk] + min(chunk, s - i)) for i in range(0, s, chunk))
    seen += window * (t + window)
    selective = (s + window) * linear + 2 * n * d * seen
    return (first_layers * prefill_layer + config.num_hidden_layers * selective) / (config.num_hidden_layers * prefill_layer)


def last(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, k: int) -> tuple[list[KV], torch.Tensor]:
    """`kv` with its last k positions recomputed (a tail), and those columns (B, k)."""
    t = token_ids.shape[1]
    sel = torch.arange(t - k, t, device=token_ids.device).expand(token_ids.shape[0], -1)
    return (run_tail(model, kv, token_ids, mask, k) if k < t else recompute_tokens(model, kv, token_ids, mask, sel)), sel


@torch.no_grad()
def repair(model, kv: list[KV], token_ids: torch.Tensor, mask: torch.Tensor, rule: str, fraction: float,
           tok=None, layers: int = 1, selector: tuple[torch.Tensor, list[int]] | None = None,
           reader: torch.Tensor | None = None) -> tuple[list[KV], torch.Tensor]:
    """`kv` repaired by `rule` at `fraction` of the prefix's positions: (the cache, the columns recomputed
    (B, s)). The learned rule takes its `selector` (weights, layers: scd.fitting.selector's), the suffix rule
    the request's tokens after the prefix, `reader` (B, n)."""
    if rule == "suffix":
        if reader is None or reader.shape[-1] == 0:
            raise ValueError("the suffix rule needs the request's tokens after the prefix (reader)")
        sel = top(reads_of(model, kv, mask, reader), mask, count_for(mask, fraction))
    elif rule == "attention":
        w = min(WINDOW, int(mask.long().sum(-1).min()))
        if count_for(mask, fraction) <= w:      # the selection is the window alone: a tail of it, run once
            return last(model, kv, token_ids, mask, w)
        sel = attention(model, kv, token_ids, mask, fraction)
    elif rule == "deviation":
        sel, own = deviation(model, kv, token_ids, mask, fraction, layers)
        kv = own + list(kv[layers:])
    elif rule == "structural":
        sel = structural(token_ids, mask, tok, fraction)
    elif rule == "learned":
        if selector is None:
            raise ValueError("the learned rule needs a fitted selector (an artifact calibrated with one)")
        sel = learned(kv, mask, fraction, selector)
    elif rule == "last":
        return last(model, kv, token_ids, mask, count_for(mask, fraction))
    else:
        raise ValueError(f"selection rule {rule!r}: one of {RULES}")
    return recompute_tokens(model, kv, token_ids, mask, sel), sel
