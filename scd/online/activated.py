"""Activated LoRA (aLoRA): an adapter that switches on at its invocation tokens.

PEFT's aLoRA (`alora_invocation_tokens` in the adapter's config) adapts only the tokens from the start of the
last occurrence of its invocation sequence in the input. Everything before it runs on the base weights, so
the cache of a prefix without the invocation is the base model's own: the producer's, exactly.

A loaded aLoRA (scd.online.models.load) is the adapter merged into its base, for the tokens it adapts, with an
`Activation` attached: the base weights, for the tokens before the invocation, and the invocation's ids. The
two places where prompt tokens meet the model route through here:
  - `trace.capture` of a prompt: the base's forward up to the invocation, the adapted one from it on;
  - `cache.extend` (a suffix, a question, a teacher-forced continuation): the same split.
Generated tokens always follow the prompt's end, so decode steps run the adapted weights: for a chat request,
whose prompt ends with the assistant header that invokes the adapter, this is PEFT's behaviour. A prompt with
no invocation at all is run on the base weights, and what it generates still on the adapter's (PEFT would
keep the adapter off).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Activation:
    base: torch.nn.Module                   # the weights before the invocation
    invocation: tuple[int, ...]


def of(model) -> Activation | None:
    """The model's Activation, if it is an activated LoRA."""
    return getattr(model, "scd_activation", None)


def switch(model, ids: torch.Tensor) -> int:
    """Where the adapter switches on in `ids` (B, S): the start of the invocation's last occurrence, the same
    in every row; S when no row holds it (all base), 0 for a model that is no aLoRA (all adapted)."""
    act = of(model)
    if act is None:
        return 0
    return invocation_start(ids, act.invocation)


def invocation_start(ids: torch.Tensor, invocation: tuple[int, ...]) -> int:
    """The start of the invocation's last occurrence in `ids` (B, S), the same in every row; S when no row
    holds it."""
    inv = torch.tensor(invocation, device=ids.device)
    n, s = len(inv), ids.shape[1]
    if s < n:
        return s
    hits = (ids.unfold(1, n, 1) == inv).all(-1)                 # (B, S - n + 1): an invocation starts here
    last = torch.where(hits.any(-1), s - n - hits.flip(-1).int().argmax(-1), s)
    found = set(last.tolist())
    if len(found) > 1:
        raise ValueError("rows of one batch switch the activated LoRA on at different places; run them apart")
    return found.pop()


def to(model, device):
    """model.to(device), its base weights too when it is an activated LoRA."""
    if of(model) is not None:
        of(model).base.to(device)
    return model.to(device)
