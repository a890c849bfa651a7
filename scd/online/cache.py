"""Assembling rebuilt K/V into a transformers Cache and decoding from it.

A prefix cache holds T positions (left-padded batch allowed). Everything after the prefix (a question,
teacher-forced continuation tokens, generated tokens) is fed through the model on top of that cache, with
the attention mask and position ids continuing the prefix's.
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from scd.online import activated

KV = tuple[torch.Tensor, torch.Tensor]


def id_row(token_ids: list[int], device="cpu") -> torch.Tensor:
    """A request's token ids as the (1, n) int64 row a forward pass reads. Through numpy: torch.tensor reads a
    long Python list about four times slower (0.25 against 0.06 ms at 3.5k tokens)."""
    return torch.from_numpy(np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))).view(1, len(token_ids)).to(device)


@functools.lru_cache(maxsize=None)
def _cache_name(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_arg(module, cache) -> dict:
    """The keyword that hands a Cache to this model or decoder layer: transformers 5.24 renamed it from
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); earlier 5.x only know the old one."""
    return {_cache_name(type(module)): cache}


def cache_of(out):
    """The Cache a forward pass returned, under either name of its output field (see `cache_arg`)."""
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def assemble(model, kv: list[KV]) -> DynamicCache:
    """A fresh DynamicCache holding the given per-layer (K post-RoPE, V), each (B, n_kv, T, d_h). A plain
    dynamic layer takes the tensors as they are (its first update would copy them, by concatenation, into
    a cache that the next forward copies again: a long prefix's whole cache, twice); the
    tensors are not written to (every later update concatenates into new ones)."""
    cache = DynamicCache(config=model.config)
    for l, (k, v) in enumerate(kv):
        layer = cache.layers[l] if l < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:                                           # sliding-window and other layers keep their own update
            cache.update(k, v, l)
    return cache


def forward_on_cache(model, cache, prefix_mask: torch.Tensor, ids: torch.Tensor, ids_mask: torch.Tensor | None = None,
                     last_only: bool = False, logits: bool = True):
    """Run ids (B, S) on top of the cache (mutated in place). Returns (logits (B, S, V), full mask (B, T+S));
    last_only: the last position's logits alone, (B, 1, V) (the head over every position of a long run is a
    large share of its compute on a large vocabulary); logits=False: none (None), the decoder's layers alone
    fill the cache (even one position's head reads the whole embedding matrix). Differentiable (calibration
    fine-tunes through it); serving code calls `extend`, its no-grad form."""
    if ids_mask is None:
        ids_mask = torch.ones_like(ids)
    full = torch.cat([prefix_mask, ids_mask], dim=1)
    start = prefix_mask.long().sum(-1, keepdim=True)                                 # (B, 1) next position
    pos = start + (ids_mask.long().cumsum(-1) - 1).clamp(min=0)
    if not logits:
        body = model.get_decoder()
        body(input_ids=ids, attention_mask=full, position_ids=pos, use_cache=True, **cache_arg(body, cache))
        return None, full
    out = model(input_ids=ids, attention_mask=full, position_ids=pos, use_cache=True, **cache_arg(model, cache),
                **({"logits_to_keep": 1} if last_only else {}))
    return out.logits, full


@torch.no_grad()
def extend(model, cache, prefix_mask: torch.Tensor, ids: torch.Tensor, ids_mask: torch.Tensor | None = None,
           last_only: bool = False, logits: bool = True):
    """forward_on_cache without gradients, for serving and evaluation. An activated LoRA (scd.online.activated)
    runs the ids before its invocation on its base weights and the rest on the adapted ones (with last_only,
    each part's last logits)."""
    at = activated.switch(model, ids)
    if at == 0:
        return forward_on_cache(model, cache, prefix_mask, ids, ids_mask, last_only, logits)
    base = activated.of(model).base
    if at == ids.shape[1]:
        return forward_on_cache(base, cache, prefix_mask, ids, ids_mask, last_only, logits)
    ids_mask = torch.ones_like(ids) if ids_mask is None else ids_mask
    head, mask = forward_on_cache(base, cache, prefix_mask, ids[:, :at], ids_mask[:, :at], last_only, logits)
    tail, mask = forward_on_cache(model, cache, mask, ids[:, at:], ids_mask[:, at:], last_only, logits)
    return (torch.cat([head, tail], 1) if logits else None), mask
