"""The serving library's plain types, with no torch: what a request asks (GenParams), what a token's answer
carries (TokenLogprobs), and the refusal of an adapter a LoRA group cannot hold (AdapterError).

The router and the Serve replicas that only forward requests import these (and unpickle them when they cross
Ray) without loading torch or transformers; the engines' processes use the same classes through decode.py
and lora_group.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_tokens: int = 0                     # eos is masked out until this many tokens were generated
    ignore_eos: bool = False                # eos is always masked out: only max_tokens or a stop string ends it
    logprobs: int | None = None             # report each token's logprob and this many top alternatives


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model's own next-token distribution (its logits before
    temperature, top-p or the eos mask), and the `top` most likely tokens with theirs, most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class AdapterError(ValueError):
    """An adapter a group cannot hold; the message is one line naming the adapter and why."""
