"""Reuse: a shared low-rank latent between producer and consumer features, fitted in closed form.

For one layer and one stream (content keys or values), rows are flattened batch x heads x tokens:
A (N, d) producer, B (N, d) consumer, X = [A B] (N, 2d). A truncated SVD of the centred X gives
the shared latent Z = (X - mu) V_r (N, r) with decoders X ~ mu + Z V_r^T. The producer cannot see B
online, so its encoder is a ridge regression from A alone: W_enc = argmin |(A - mu_A) W - Z|^2 + lam |W|^2.
Everything is computed from the (2d x 2d) Gram matrix, accumulated in float64 over streamed chunks.

Online: Z = (A - mu_A) W_enc  (producer) ;  B_hat = mu_B + Z W_dec_B  (consumer).
A hidden-state codec may also carry a token table (scd.fitting.gram.TokenStats): a row per token id of the
calibration's most frequent tokens, added to what the code decodes. The consumer has the token ids (they are
in the payload), so the part of its K and V that is a function of the token alone costs no payload; a linear
map of the producer's features cannot express such a lookup. With a token table it may carry a bigram table
as well: a row per (previous token, token) key of the calibration's most frequent pairs (bigram_keys), added
on top of the token's row.
The latent's columns come in order of singular value, so a code's leading columns are a code of lower rank
(nested ranks: one artifact serves several payload sizes, see PairArtifacts.levels).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def bigram_keys(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(..., T) token ids of sequences (left-padded where `mask` is 0) -> each token's (previous token, token)
    key, (previous + 1) << 32 | token, with previous + 1 = 0 at a sequence's first real token; key & TOKEN is
    the token. Padded positions get keys too; their rows are masked out wherever they are used."""
    ids = ids.long()
    prev = torch.nn.functional.pad(ids + 1, (1, 0))[..., :-1]
    if mask is not None:
        prev = prev * torch.nn.functional.pad(mask.long(), (1, 0))[..., :-1]
    return (prev << 32) | ids


TOKEN = (1 << 32) - 1       # a bigram key's token bits


def rows_of(table_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's index in `table_ids` (sorted, distinct), or len(table_ids) for a token not in it."""
    if len(table_ids) == 0:
        return torch.zeros_like(tokens)
    at = torch.searchsorted(table_ids, tokens).clamp(max=len(table_ids) - 1)
    return torch.where(table_ids[at] == tokens, at, len(table_ids))


@dataclass
class LinearCodec:
    """Producer encoder and consumer decoder for one layer/stream. Shapes: enc (d_a, r), dec (r, d_b); with a
    token table, table (K, d_b) is added to the decoded rows of the tokens in table_ids (K,), sorted."""
    mu_a: torch.Tensor
    enc: torch.Tensor
    mu_b: torch.Tensor
    dec: torch.Tensor
    table: torch.Tensor | None = None
    table_ids: torch.Tensor | None = None
    bigram: torch.Tensor | None = None          # (K2, d_b) on top of the token's table row
    bigram_ids: torch.Tensor | None = None      # (K2,) sorted bigram_keys

    def __post_init__(self):
        if (self.table is None) != (self.table_ids is None):
            raise ValueError("a token table needs both its rows and their token ids")
        if (self.bigram is None) != (self.bigram_ids is None) or (self.bigram is not None and self.table is None):
            raise ValueError("a bigram table needs its rows, their keys and a token table")
        if self.bigram is not None and (self.bigram.shape != (len(self.bigram_ids), self.dec.shape[1])
                                        or not bool((self.bigram_ids[1:] > self.bigram_ids[:-1]).all())):
            raise ValueError(f"bigram table {tuple(self.bigram.shape)} must have one row of width {self.dec.shape[1]} "
                             f"per key, and its {len(self.bigram_ids)} keys must be sorted and distinct")
        if self.table is not None and (self.table.shape != (len(self.table_ids), self.dec.shape[1])
                                       or not bool((self.table_ids[1:] > self.table_ids[:-1]).all())):
            raise ValueError(f"token table {tuple(self.table.shape)} must have one row of width {self.dec.shape[1]} "
                             f"per token id, and its {len(self.table_ids)} ids must be sorted and distinct")

    @property
    def rank(self) -> int:
        return self.enc.shape[1]

    def encode(self, a: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """(..., d_a) -> (..., r), or the code's first `rank` columns. Codes are nested: the columns are
        ordered (by singular value, then whitened), so the first r' of a rank-r fit are the rank-r' fit, and
        decoding them with the decoder's first r' rows is that fit's reconstruction."""
        return (a - self.mu_a) @ (self.enc if rank is None else self.enc[:, :rank])

    def decode(self, z: torch.Tensor, token_ids: torch.Tensor | None = None,
               keys: torch.Tensor | None = None) -> torch.Tensor:
        """(..., r) -> (..., d_b); a codec with a token table needs the rows' token ids (...), one with a
        bigram table their bigram_keys (...) too."""
        return z @ self.dec[:z.shape[-1]] + self.bias(token_ids, keys)

    def bias(self, token_ids: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
        """What the decoder adds to the code's map: mu_b, plus each token's table row with a table
        ((..., d_b) then; tokens not in the table get mu_b alone), plus each key's bigram row with those."""
        if self.table is None:
            return self.mu_b
        if token_ids is None:
            raise ValueError("this codec has a token table: decoding needs the token ids")
        if self.bigram is not None and keys is None:
            raise ValueError("this codec has a bigram table: decoding needs the tokens' bigram keys")
        return self.biases()[self.bias_rows(token_ids, keys)]

    def bias_rows(self, token_ids: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Each position's row of biases(): its bigram's row where the codec has one for its key, else its
        token's (one gather per layer, not a gather of each and an add)."""
        rows = self.table_rows(token_ids)
        if self.bigram is None:
            return rows
        pair = rows_of(self.bigram_ids.to(keys.device), keys)
        return torch.where(pair < len(self.bigram_ids), pair + len(self.table_ids) + 1, rows)

    def table_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Each token's row of biases(): its table row, or the last row (mu_b alone) if it has none."""
        return rows_of(self.table_ids.to(token_ids.device), token_ids)

    def biases(self) -> torch.Tensor:
        """(K + 1 [+ K2], d_b): mu_b plus each table row, then mu_b alone, then (with a bigram table) each
        bigram's token row plus its bigram row. Index it with bias_rows()."""
        tokens = torch.cat([self.table + self.mu_b, self.mu_b[None]])
        if self.bigram is None:
            return tokens
        return torch.cat([tokens, tokens[self.table_rows(self.bigram_ids & TOKEN)] + self.bigram])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LinearCodec":
        """The same codec with fn applied to each of its float tensors (table ids are kept as they are)."""
        return LinearCodec(fn(self.mu_a), fn(self.enc), fn(self.mu_b), fn(self.dec),
                           None if self.table is None else fn(self.table), self.table_ids,
                           None if self.bigram is None else fn(self.bigram), self.bigram_ids)

    def padded(self, rank: int) -> "LinearCodec":
        """The same map with zero code columns appended up to `rank` (a shorter group's code at the rank of
        the others: its extra columns carry nothing)."""
        extra = rank - self.rank
        if extra <= 0:
            return self
        return LinearCodec(self.mu_a, torch.nn.functional.pad(self.enc, (0, extra)), self.mu_b,
                           torch.nn.functional.pad(self.dec, (0, 0, 0, extra)), self.table, self.table_ids,
                           self.bigram, self.bigram_ids)

    def to(self, device) -> "LinearCodec":
        out = self.map(lambda t: t.to(device))
        if out.table_ids is not None:
            out.table_ids = out.table_ids.to(device)
        if out.bigram_ids is not None:
            out.bigram_ids = out.bigram_ids.to(device)
        return out

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": v.contiguous() for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> "LinearCodec":
        return cls(*(t.get(f"{prefix}.{k}") for k in ("mu_a", "enc", "mu_b", "dec", "table", "table_ids", "bigram",
                                                       "bigram_ids")))
