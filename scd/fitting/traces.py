"""Paired traces on disk: a trace's valid (unpadded) rows, written in chunks so that a large calibration set
is streamed, never held in memory at once."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scd.online.trace import Trace


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


def pad(seqs: list[torch.Tensor], pad_id: int | None, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences as one (B, T) batch padded on the left (prefixes) or the right (continuations), with its mask.
    Padded positions are masked out everywhere, so their id does not matter: a tokenizer with neither a pad
    nor an eos token (pad_id None) pads with 0."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return ids, mask
