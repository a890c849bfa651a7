"""Assembling rebuilt K/V into a transformers Cache and decoding from it.

A prefix cache holds T positions (left-padded batch allowed). Everything after the prefix (a question,
teacher-forced continuation tokens, generated tokens) is fed through the model on top of that cache, with
the attention mask and position ids continuing the prefix's.
"""
from __future__ import annotations

from typing import Iterator

import torch
from transformers import DynamicCache

KV = tuple[torch.Tensor, torch.Tensor]


def assemble(model, kv: list[KV]) -> DynamicCache:
    """A fresh DynamicCache holding the given per-layer (K post-RoPE, V), each (B, n_kv, T, d_h)."""
    cache = DynamicCache(config=model.config)
    for l, (k, v) in enumerate(kv):
        cache.update(k, v, l)
    return cache


def forward_on_cache(model, cache, prefix_mask: torch.Tensor, ids: torch.Tensor, ids_mask: torch.Tensor | None = None):
    """Run ids (B, S) on top of the cache (mutated in place). Returns (logits (B, S, V), full mask (B, T+S)).
    Differentiable (calibration fine-tunes through it); serving code calls `extend`, its no-grad form."""
    if ids_mask is None:
        ids_mask = torch.ones_like(ids)
    full = torch.cat([prefix_mask, ids_mask], dim=1)
    start = prefix_mask.long().sum(-1, keepdim=True)                                 # (B, 1) next position
    pos = start + (ids_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=full, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits, full


extend = torch.no_grad()(forward_on_cache)


@torch.no_grad()
def decode_steps(model, cache, prefix_mask: torch.Tensor, first_ids: torch.Tensor, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """The decode loop (serving engines and evaluation both use it). first_ids (B, S) are fed first (at least
    the suffix's last token); then yields each step's next token of every row (B,), at most max_new_tokens
    times. temperature 0 = greedy, otherwise nucleus sampling. Rows that hit eos keep yielding eos; the loop
    ends after the step where every row has. Nothing is computed past the last token taken: a caller that
    stops early (a stop string) wastes no forward pass."""
    logits, mask = extend(model, cache, prefix_mask, first_ids)
    done = torch.zeros(first_ids.shape[0], dtype=torch.bool, device=first_ids.device)
    for step in range(max_new_tokens):
        nxt = pick(logits[:, -1].float(), temperature, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        yield nxt
        if step + 1 == max_new_tokens or bool(done.all()):
            return
        logits, mask = extend(model, cache, mask, nxt[:, None])


def generate(model, cache, prefix_mask: torch.Tensor, first_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """decode_steps collected: new tokens (B, <= max_new_tokens); rows that hit eos are padded with eos."""
    out = list(decode_steps(model, cache, prefix_mask, first_ids, max_new_tokens, temperature, top_p, eos_id,
                            generator))
    return torch.stack(out, dim=1) if out else first_ids[:, :0]


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p                 # always keeps the top token
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)
