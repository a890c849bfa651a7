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


def trace_rows(tr: Trace, side: str) -> dict[str, torch.Tensor]:
    """One side's valid rows, named for a chunk: k{side}.{l} (N, n_kv, d_h) de-RoPE'd, v{side}.{l}, x{side}.{l} (N, H)."""
    out = {f"pos{side}": valid_rows(tr.positions, tr.mask).contiguous()}
    for l in range(len(tr.keys)):
        out[f"k{side}.{l}"] = valid_rows(tr.content[l], tr.mask).float().contiguous()
        out[f"v{side}.{l}"] = valid_rows(tr.values[l], tr.mask).float().contiguous()
        if tr.xnorm:
            out[f"x{side}.{l}"] = valid_rows(tr.xnorm[l], tr.mask).float().contiguous()
    return out


def chunk_path(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"chunk_{index:05d}.safetensors"


def write_chunk(directory: str | Path, index: int, rows: dict[str, torch.Tensor]) -> Path:
    """Write atomically (temp file + rename) so a killed job never leaves a half chunk that looks done."""
    path = chunk_path(directory, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(rows, str(tmp))
    tmp.replace(path)
    return path


def read_chunks(directory: str | Path):
    """Yield each chunk's dict of tensors in order."""
    for path in sorted(Path(directory).glob("chunk_*.safetensors")):
        yield load_file(str(path))
