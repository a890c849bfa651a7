"""Trace capture: one forward pass over a prefix, recording what SCD needs per layer.

For each layer l of a model run on tokens (B, T) with a left-padding mask:
  keys[l]    (B, n_kv, T, d_h)  post-RoPE, exactly what the model's KV cache holds
  content[l] (B, n_kv, T, d_h)  keys with RoPE removed (Reuse fits and encodes these)
  values[l]  (B, n_kv, T, d_h)
  xnorm[l]   (B, T, H)          input_layernorm output (Patch encodes these)
Calibration writes paired traces to disk in chunks of valid (unpadded) rows (scd.fitting.traces).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from scd.online import activated
from scd.online.cache import cache_of
from scd.online.rope import cos_sin, positions_from_mask, remove_rope


@dataclass
class Trace:
    keys: list[torch.Tensor]
    content: list[torch.Tensor]
    values: list[torch.Tensor]
    xnorm: list[torch.Tensor]
    mask: torch.Tensor          # (B, T) 1 = real token
    positions: torch.Tensor     # (B, T)
    hidden: list[torch.Tensor] | None = None   # residual stream entering each layer, (B, T, H), if asked


def thread_hooks(modules: list, sink: Callable[[torch.Tensor], None]) -> list:
    """Forward hooks that pass each module's output to `sink`, for forwards the calling thread runs only: an
    engine runs several requests' forwards through one model at once, and theirs pass the same modules. Remove
    them when done."""
    me = threading.get_ident()

    def keep(mod, inputs, out):
        if threading.get_ident() == me:
            sink(out)
    return [m.register_forward_hook(keep) for m in modules]


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, mask: torch.Tensor | None = None, want_xnorm: bool = True,
            want_hidden: bool = False) -> Trace:
    """Run the model once over the prefix and record K/V/x_norm for every layer. `model` may be a PEFT model
    that cannot be merged (an activated LoRA, whose adapter switches on at its invocation tokens): it runs
    as itself, and its base model's layers and rotary tables are read."""
    if mask is None:
        mask = torch.ones_like(input_ids)
    at = activated.switch(model, input_ids)
    if at == input_ids.shape[1]:                 # an activated LoRA not invoked in the prompt: its base's trace
        return capture(activated.of(model).base, input_ids, mask, want_xnorm, want_hidden)
    if at > 0:                                   # invoked inside the prompt: base up to there, adapted after
        return _capture_switched(model, input_ids, mask, at, want_xnorm, want_hidden)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    positions = positions_from_mask(mask)
    xnorm: list[torch.Tensor] = []
    hooks = thread_hooks([layer.input_layernorm for layer in inner.model.layers],
                         lambda o: xnorm.append(o.detach())) if want_xnorm else []
    try:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    output_hidden_states=want_hidden, logits_to_keep=1)   # the cache is wanted, not the logits
    finally:
        for h in hooks:
            h.remove()
    cos, sin = cos_sin(inner, positions)
    cache = cache_of(out)
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    content = [remove_rope(k, cos, sin) for k in keys]
    hidden = list(out.hidden_states[:-1]) if want_hidden else None
    return Trace(keys, content, values, xnorm, mask, positions, hidden)


def _capture_switched(model, input_ids, mask, at: int, want_xnorm: bool, want_hidden: bool) -> Trace:
    """The K and V of a prompt that invokes an activated LoRA at `at`: the base's trace of the tokens before,
    then the adapted model's forward over the rest on that cache (K, V and content only)."""
    if want_xnorm or want_hidden:
        raise ValueError("an activated LoRA invoked inside the prefix has no single trace of x_norm or hidden "
                         "states; capture with want_xnorm=False, want_hidden=False")
    from scd.online.cache import assemble, forward_on_cache
    head = capture(activated.of(model).base, input_ids[:, :at], mask[:, :at], False, False)
    cache = assemble(model, list(zip(head.keys, head.values)))
    with torch.no_grad():
        forward_on_cache(model, cache, mask[:, :at], input_ids[:, at:], mask[:, at:])
    positions = positions_from_mask(mask)
    cos, sin = cos_sin(model, positions)
    keys = [layer.keys for layer in cache.layers]
    return Trace(keys, [remove_rope(k, cos, sin) for k in keys], [layer.values for layer in cache.layers], [], mask,
                 positions)
