"""Streaming joint Gram matrices of paired producer/consumer rows and the closed-form Reuse fit from them
(scd.online.reuse.LinearCodec is what it produces)."""
from __future__ import annotations

import torch

from scd.online.reuse import TOKEN, LinearCodec, rows_of


class JointGram:
    """Streaming sufficient statistics of X = [A B]: sum of rows and X^T X, in float64."""

    def __init__(self, d_a: int, d_b: int):
        self.d_a, self.d_b = d_a, d_b
        self.n = 0
        self.s = torch.zeros(d_a + d_b, dtype=torch.float64)
        self.g = torch.zeros(d_a + d_b, d_a + d_b, dtype=torch.float64)

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: (..., d_a), b: (..., d_b) with the same leading shape (rows paired; d_b may be 0: A's alone)."""
        a = a.reshape(-1, self.d_a)
        x = torch.cat([a, b.reshape(len(a), self.d_b)], dim=1).double()
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

    def cov(self, tokens: "TokenStats | None" = None, shrink: float = 1.0) -> torch.Tensor:
        """The covariance of the rows [A B] (population, float64). With `tokens` (the same rows' per-token
        sums), what is left of it once each token's mean, ridge-shrunk by `shrink` rows, is taken out:
        C - S^T diag(1 / (n + shrink)) S / N over the centred per-token sums S = [S_A S_B]. A least-squares fit
        on it is the fit of the model with a free row per token (fit_regression)."""
        mu = self.s / self.n
        cov = self.g / self.n - torch.outer(mu, mu)
        if tokens is None:
            return cov
        if (tokens.d_a, tokens.d_b) != (self.d_a, self.d_b):
            raise ValueError(f"token sums of widths {(tokens.d_a, tokens.d_b)} for a Gram of {(self.d_a, self.d_b)}")
        if shrink <= 0:
            raise ValueError(f"shrink must be > 0, got {shrink}")
        s = torch.cat(tokens.centred(mu[:self.d_a], mu[self.d_a:]), 1)                  # (K, d_a + d_b)
        return cov - (s.T / (tokens.n + shrink)) @ s / self.n

    def fit_regression(self, rank: int, ridge: float = 1e-4, tokens: "TokenStats | None" = None,
                       shrink: float = 1.0, bigrams: "TokenStats | None" = None,
                       bigram_shrink: float = 16.0) -> LinearCodec:
        """Reduced-rank regression of B on A: the rank-`rank` linear map from A that predicts B best in least
        squares (ridge OLS B_hat = A W, then the top principal directions of B_hat). Encoder (d_a, r) and
        decoder (r, d_b) as a LinearCodec. Used for Reuse from hidden states, where A is the producer's
        x_norm and B the consumer's K and V of every head: unlike the joint SVD it spends its rank only on
        what A can predict, and it maps all heads at once.

        With `tokens` (the same rows' per-token sums) the model is B = mu + A W + T[token]: a table row per
        token of `tokens`, ridge-shrunk towards 0 by `shrink` (in rows: a token seen n times keeps
        n / (n + shrink) of its mean residual). The table is free on the wire (the consumer has the token ids),
        so the code is fitted to what the table cannot say: W is the reduced-rank regression on the covariance
        with the token means taken out (cov(tokens, shrink)), and T = (S_B - S_A W) / (n + shrink) for the
        rank-r W (TokenStats.table).

        With `bigrams` too (sums per bigram_keys key), a bigram row per key on top: each key's mean residual after
        the code and its token's row, shrunk by `bigram_shrink` rows towards that row (TokenStats.table with the
        token's row as prior; a backoff). The code is not refitted for it."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        if not 1 <= rank <= self.d_b:
            raise ValueError(f"rank must be in [1, {self.d_b}], got {rank}")
        da = self.d_a
        mu, cov = self.s / self.n, self.cov(tokens, shrink)
        c_aa, c_ab = cov[:da, :da], cov[:da, da:]
        lam = ridge * c_aa.diagonal().mean().clamp(min=1e-12)
        w = torch.linalg.solve(c_aa + lam * torch.eye(da, dtype=cov.dtype), c_ab)        # (d_a, d_b)
        vals, vecs = torch.linalg.eigh(w.T @ c_aa @ w)                                  # covariance of B_hat
        v, var = vecs[:, -rank:].flip(1), vals[-rank:].flip(0)                          # (d_b, r), (r,)
        # whitened codes: each column has unit variance (the decoder scales it back), so a quantised row's one
        # scale suits all its columns instead of being set by the first, widest one
        sd = var.clamp(min=var.max() * 1e-12).sqrt()
        m = w @ v @ v.T                                                                  # the code's map
        table = None if tokens is None else tokens.table(mu, m, shrink)
        bigram = None if bigrams is None else backoff_table(bigrams, tokens, table, mu, m, bigram_shrink)
        return LinearCodec(mu[:da].float(), (w @ v / sd).float(), mu[da:].float(),
                           (sd[:, None] * v.T).contiguous().float(), table, None if tokens is None else tokens.ids,
                           bigram, None if bigrams is None else bigrams.ids)

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


class TokenStats:
    """Per-token sums of paired rows [A B] for the tokens of a table (`ids`; or the bigram_keys of a bigram
    table): counts, sums of A and of B, in float64. With a JointGram of the same rows they give the fit with a
    token table (JointGram.fit_regression)."""

    def __init__(self, ids: torch.Tensor, d_a: int, d_b: int):
        self.ids = torch.as_tensor(ids, dtype=torch.long).unique()      # sorted
        self.d_a, self.d_b = d_a, d_b
        k = len(self.ids)
        self.n = torch.zeros(k, dtype=torch.float64)
        self.sa = torch.zeros(k, d_a, dtype=torch.float64)
        self.sb = torch.zeros(k, d_b, dtype=torch.float64)

    @classmethod
    def most_frequent(cls, sequences, k: int, d_a: int, d_b: int) -> "TokenStats":
        """For the k tokens that occur most often in `sequences` (1-D token id tensors; ties: lower id first)."""
        ids = torch.cat([torch.as_tensor(s).flatten() for s in sequences]).long()
        uniq, counts = ids.unique(return_counts=True)
        order = sorted(range(len(uniq)), key=lambda i: (-int(counts[i]), int(uniq[i])))[:k]
        return cls(uniq[order], d_a, d_b)

    def update(self, tokens: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """tokens (N,) with their rows a (N, d_a), b (N, d_b); tokens outside the table are skipped."""
        at = rows_of(self.ids, tokens.reshape(-1).long())
        hit = at < len(self.ids)
        rows = at[hit]
        self.n.index_add_(0, rows, torch.ones(len(rows), dtype=torch.float64))
        self.sa.index_add_(0, rows, a.reshape(-1, self.d_a)[hit].double())
        self.sb.index_add_(0, rows, b.reshape(-1, self.d_b)[hit].double())

    def centred(self, mu_a: torch.Tensor, mu_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sums of (A - mu_a) and of (B - mu_b) per token: (K, d_a), (K, d_b)."""
        return self.sa - self.n[:, None] * mu_a, self.sb - self.n[:, None] * mu_b

    def table(self, mu: torch.Tensor, m: torch.Tensor, shrink: float, prior: torch.Tensor | None = None) -> torch.Tensor:
        """(K, d_b) float32: each token's mean residual of B - mu_B - (A - mu_A) m, shrunk by `shrink` rows
        (mu = [mu_A mu_B], the Gram's means; m (d_a, d_b) the linear map the table completes). With `prior`
        (K, d_b), what is already added for each token (a bigram's unigram row: backoff), the residual after
        it, so a rarely seen token keeps its prior."""
        s_a, s_b = self.centred(mu[:self.d_a], mu[self.d_a:])
        resid = s_b - s_a @ m.to(s_a.dtype)
        if prior is not None:
            resid = resid - self.n[:, None] * prior.to(resid.dtype)
        return (resid / (self.n + shrink)[:, None]).float()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.ids": self.ids, f"{prefix}.n": self.n, f"{prefix}.sa": self.sa, f"{prefix}.sb": self.sb}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> "TokenStats":
        sa, sb = t[f"{prefix}.sa"], t[f"{prefix}.sb"]
        out = cls(t[f"{prefix}.ids"], sa.shape[1], sb.shape[1])
        out.n, out.sa, out.sb = t[f"{prefix}.n"], sa, sb
        return out


def backoff_table(bigrams: TokenStats, tokens: TokenStats | None, table: torch.Tensor | None, mu: torch.Tensor,
                  m: torch.Tensor, shrink: float) -> torch.Tensor:
    """A bigram table (sums per bigram_keys key) on top of the token table `table` of `tokens`: each key's mean
    residual after the map m and its token's row, shrunk by `shrink` rows towards that row (a backoff)."""
    if tokens is None:
        raise ValueError("a bigram table backs off to a token table: give `tokens` too")
    prior = torch.cat([table, torch.zeros_like(table[:1])])[rows_of(tokens.ids, bigrams.ids & TOKEN)]
    return bigrams.table(mu, m, shrink, prior)
