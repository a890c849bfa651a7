"""One code for a whole family: a producer's Reuse codes fitted against N consumers at once.

Each consumer's target rows (its K and V, or its K and V of every head for hidden-state codes) are stacked
side by side, B = [B_1 | ... | B_N], and fitted in closed form against the producer's rows A exactly as a
pair is (scd.fitting.gram: joint SVD for per-head codes, reduced-rank regression for hidden-state codes).
The encoder is then one for the whole family: a fan-out to N specialists encodes once and sends one
payload. Each member keeps its own decoder, the columns of the stacked decoder that rebuild its B_j.
A member's pair fit is the same Gram restricted to [A | B_j] (JointGram.select), so one pass over the
traces gives the family fit and every per-pair fit to compare it with.
"""
from __future__ import annotations

from scd.fitting.gram import JointGram
from scd.online.reuse import LinearCodec


def split(codec: LinearCodec, widths: list[int]) -> list[LinearCodec]:
    """A codec fitted on stacked targets [B_1 | ... | B_N] (decoder columns of widths `widths`) as one codec
    per member, all sharing its encoder (the same tensors)."""
    if sum(widths) != codec.dec.shape[1]:
        raise ValueError(f"member widths {widths} do not add up to the decoder's {codec.dec.shape[1]} columns")
    out, col = [], 0
    for w in widths:
        out.append(LinearCodec(codec.mu_a, codec.enc, codec.mu_b[col:col + w].contiguous(),
                               codec.dec[:, col:col + w].contiguous()))
        col += w
    return out


def member_blocks(width: int, n: int) -> list[tuple[int, int]]:
    """Column ranges of each of n members' blocks of `width` in a family Gram's B."""
    return [(j * width, (j + 1) * width) for j in range(n)]


def fit_family(gram: JointGram, n: int, rank: int, ridge: float, regression: bool) -> list[LinearCodec]:
    """The family's shared-encoder codecs, one per member, from a Gram whose B holds n equal member blocks."""
    if gram.d_b % n:
        raise ValueError(f"a family Gram of {gram.d_b} target columns cannot hold {n} equal member blocks")
    codec = gram.fit_regression(rank, ridge) if regression else gram.fit(rank, ridge)
    return split(codec, [gram.d_b // n] * n)


def fit_pair(gram: JointGram, n: int, member: int, rank: int, ridge: float, regression: bool) -> LinearCodec:
    """Member `member`'s own pair codec from the family Gram (its block of B only)."""
    sub = gram.select([member_blocks(gram.d_b // n, n)[member]])
    return sub.fit_regression(rank, ridge) if regression else sub.fit(rank, ridge)
