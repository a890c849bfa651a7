"""Streaming joint Gram matrices of paired producer/consumer rows and the closed-form Reuse fit from them
(scd.online.reuse.LinearCodec is what it produces)."""
from __future__ import annotations

import torch

from scd.online.reuse import LinearCodec


class JointGram:
    """Streaming sufficient statistics of X = [A B]: sum of rows and X^T X, in float64."""

    def __init__(self, d_a: int, d_b: int):
        self.d_a, self.d_b = d_a, d_b
        self.n = 0
        self.s = torch.zeros(d_a + d_b, dtype=torch.float64)
        self.g = torch.zeros(d_a + d_b, d_a + d_b, dtype=torch.float64)

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: (..., d_a), b: (..., d_b) with the same leading shape (rows paired)."""
        x = torch.cat([a.reshape(-1, self.d_a), b.reshape(-1, self.d_b)], dim=1).double()
        self.n += x.shape[0]
        self.s += x.sum(0)
        self.g += x.T @ x

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.n": torch.tensor([self.n], dtype=torch.float64), f"{prefix}.s": self.s,
                f"{prefix}.g": self.g}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str, d_a: int) -> "JointGram":
        g = cls(d_a, t[f"{prefix}.s"].shape[0] - d_a)
        g.n, g.s, g.g = int(t[f"{prefix}.n"].item()), t[f"{prefix}.s"], t[f"{prefix}.g"]
        return g

    def spectrum(self) -> torch.Tensor:
        """Eigenvalues of the joint covariance, descending (for choosing ranks)."""
        return torch.linalg.eigvalsh(self.cov()).flip(0).clamp(min=0)

    def cov(self) -> torch.Tensor:
        """The covariance of the rows [A B] (population, float64)."""
        mu = self.s / self.n
        return self.g / self.n - torch.outer(mu, mu)

    def fit_regression(self, rank: int, ridge: float = 1e-4) -> LinearCodec:
        """Reduced-rank regression of B on A: the rank-`rank` linear map from A that predicts B best in least
        squares (ridge OLS B_hat = A W, then the top principal directions of B_hat). Encoder (d_a, r) and
        decoder (r, d_b) as a LinearCodec. Used for Reuse from hidden states, where A is the producer's
        x_norm and B the consumer's K and V of every head: unlike the joint SVD it spends its rank only on
        what A can predict, and it maps all heads at once."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        if not 1 <= rank <= self.d_b:
            raise ValueError(f"rank must be in [1, {self.d_b}], got {rank}")
        da = self.d_a
        mu, cov = self.s / self.n, self.cov()
        c_aa, c_ab = cov[:da, :da], cov[:da, da:]
        lam = ridge * c_aa.diagonal().mean().clamp(min=1e-12)
        w = torch.linalg.solve(c_aa + lam * torch.eye(da, dtype=cov.dtype), c_ab)        # (d_a, d_b)
        vals, vecs = torch.linalg.eigh(w.T @ c_aa @ w)                                  # covariance of B_hat
        v, var = vecs[:, -rank:].flip(1), vals[-rank:].flip(0)                          # (d_b, r), (r,)
        # whitened codes: each column has unit variance (the decoder scales it back), so a quantised row's one
        # scale suits all its columns instead of being set by the first, widest one
        sd = var.clamp(min=var.max() * 1e-12).sqrt()
        return LinearCodec(mu[:da].float(), (w @ v / sd).float(), mu[da:].float(), (sd[:, None] * v.T).contiguous().float())

    def fit(self, rank: int, ridge: float = 1e-4) -> LinearCodec:
        """Truncated joint SVD at `rank` + ridge encoder; `ridge` is relative to the mean variance of A."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        if not 1 <= rank <= self.d_a + self.d_b:
            raise ValueError(f"rank must be in [1, {self.d_a + self.d_b}], got {rank}")
        da = self.d_a
        mu, cov = self.s / self.n, self.cov()
        _, vecs = torch.linalg.eigh(cov)                    # ascending eigenvalues
        v = vecs[:, -rank:].flip(1)                         # (2d, r) top-r right singular vectors
        c_aa = cov[:da, :da]
        lam = ridge * c_aa.diagonal().mean().clamp(min=1e-12)
        # cov(A, Z) = cov(A, X) V_r ; W_enc = (C_AA + lam I)^-1 cov(A, Z)
        enc = torch.linalg.solve(c_aa + lam * torch.eye(da, dtype=cov.dtype), cov[:da, :] @ v)
        return LinearCodec(mu[:da].float(), enc.float(), mu[da:].float(), v[da:].T.contiguous().float())
