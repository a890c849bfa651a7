"""Reuse: a shared low-rank latent between producer and consumer features, fitted in closed form.

For one layer and one stream (content keys or values), rows are flattened batch x heads x tokens:
A (N, d) producer, B (N, d) consumer, X = [A B] (N, 2d). A truncated SVD of the centred X gives
the shared latent Z = (X - mu) V_r (N, r) with decoders X ~ mu + Z V_r^T. The producer cannot see B
online, so its encoder is a ridge regression from A alone: W_enc = argmin |(A - mu_A) W - Z|^2 + lam |W|^2.
Everything is computed from the (2d x 2d) Gram matrix, accumulated in float64 over streamed chunks.

Online: Z = (A - mu_A) W_enc  (producer) ;  B_hat = mu_B + Z W_dec_B  (consumer).
The latent's columns come in order of singular value, so a code's leading columns are a code of lower rank
(nested ranks: one artifact serves several payload sizes, see PairArtifacts.levels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearCodec:
    """Producer encoder and consumer decoder for one layer/stream. Shapes: enc (d_a, r), dec (r, d_b)."""
    mu_a: torch.Tensor
    enc: torch.Tensor
    mu_b: torch.Tensor
    dec: torch.Tensor

    @property
    def rank(self) -> int:
        return self.enc.shape[1]

    def encode(self, a: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """(..., d_a) -> (..., r), or the code's first `rank` columns. Codes are nested: the columns are
        ordered (by singular value, then whitened), so the first r' of a rank-r fit are the rank-r' fit, and
        decoding them with the decoder's first r' rows is that fit's reconstruction."""
        return (a - self.mu_a) @ (self.enc if rank is None else self.enc[:, :rank])

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(..., r) -> (..., d_b)"""
        return z @ self.dec + self.mu_b

    def padded(self, rank: int) -> "LinearCodec":
        """The same map with zero code columns appended up to `rank` (a shorter group's code at the rank of
        the others: its extra columns carry nothing)."""
        extra = rank - self.rank
        if extra <= 0:
            return self
        return LinearCodec(self.mu_a, torch.nn.functional.pad(self.enc, (0, extra)), self.mu_b,
                           torch.nn.functional.pad(self.dec, (0, 0, 0, extra)))

    def to(self, device) -> "LinearCodec":
        return LinearCodec(self.mu_a.to(device), self.enc.to(device), self.mu_b.to(device), self.dec.to(device))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": v.contiguous() for k, v in
                (("mu_a", self.mu_a), ("enc", self.enc), ("mu_b", self.mu_b), ("dec", self.dec))}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> "LinearCodec":
        return cls(t[f"{prefix}.mu_a"], t[f"{prefix}.enc"], t[f"{prefix}.mu_b"], t[f"{prefix}.dec"])
