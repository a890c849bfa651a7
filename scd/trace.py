"""Trace capture: one forward pass over a prefix, recording what SCD needs per layer.

For each layer l of a model run on tokens (B, T) with a left-padding mask:
  keys[l]    (B, n_kv, T, d_h)  post-RoPE, exactly what the model's KV cache holds
  content[l] (B, n_kv, T, d_h)  keys with RoPE removed (Reuse fits and encodes these)
  values[l]  (B, n_kv, T, d_h)
  xnorm[l]   (B, T, H)          input_layernorm output (Patch encodes these)
Calibration writes paired traces to disk in chunks of valid (unpadded) rows, so a large calibration set is
streamed, never held in memory at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scd.rope import cos_sin, positions_from_mask, remove_rope


@dataclass
class Trace:
    keys: list[torch.Tensor]
    content: list[torch.Tensor]
    values: list[torch.Tensor]
    xnorm: list[torch.Tensor]
    mask: torch.Tensor          # (B, T) 1 = real token
    positions: torch.Tensor     # (B, T)
    logits: torch.Tensor        # (B, T, V)
    hidden: list[torch.Tensor] | None = None   # residual stream entering each layer, (B, T, H), if asked


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, mask: torch.Tensor | None = None, want_xnorm: bool = True,
            want_hidden: bool = False) -> Trace:
    """Run the model once over the prefix and record K/V/x_norm for every layer."""
    if mask is None:
        mask = torch.ones_like(input_ids)
    positions = positions_from_mask(mask)
    xnorm: list[torch.Tensor] = []
    hooks = []
    if want_xnorm:
        for layer in model.model.layers:
            hooks.append(layer.input_layernorm.register_forward_hook(lambda m, i, o: xnorm.append(o.detach())))
    try:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    output_hidden_states=want_hidden)
    finally:
        for h in hooks:
            h.remove()
    cos, sin = cos_sin(model, positions)
    keys = [layer.keys for layer in out.past_key_values.layers]
    values = [layer.values for layer in out.past_key_values.layers]
    content = [remove_rope(k, cos, sin) for k in keys]
    hidden = list(out.hidden_states[:-1]) if want_hidden else None
    return Trace(keys, content, values, xnorm, mask, positions, out.logits, hidden)


def valid_rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) KV or (B, T, d) hidden -> rows of real tokens: (N, H, d) or (N, d)."""
    keep = mask.bool()
    if t.dim() == 4:
        return t.transpose(1, 2)[keep]
    return t[keep]


class TraceWriter:
    """Writes paired (producer, consumer) traces as numbered safetensors chunks of valid rows."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = len(list(self.dir.glob("chunk_*.safetensors")))

    def write(self, a: Trace, b: Trace) -> Path:
        m = a.mask
        tensors = {}
        for l in range(len(a.keys)):
            for side, tr in (("a", a), ("b", b)):
                tensors[f"k{side}.{l}"] = valid_rows(tr.content[l], m).float().contiguous()
                tensors[f"v{side}.{l}"] = valid_rows(tr.values[l], m).float().contiguous()
                if tr.xnorm:
                    tensors[f"x{side}.{l}"] = valid_rows(tr.xnorm[l], m).float().contiguous()
        path = self.dir / f"chunk_{self.n:05d}.safetensors"
        save_file(tensors, str(path))
        self.n += 1
        return path


def read_chunks(directory: str | Path):
    """Yield each chunk's dict of tensors in order."""
    for path in sorted(Path(directory).glob("chunk_*.safetensors")):
        yield load_file(str(path))
