"""One code for a whole family: a producer's Reuse codes fitted against N consumers at once.

Each consumer's target rows (its K and V, or its K and V of every head for hidden-state codes) are stacked
side by side, B = [B_1 | ... | B_N], and fitted in closed form against the producer's rows A exactly as a
pair is (scd.fitting.gram: joint SVD for per-head codes, reduced-rank regression for hidden-state codes).
The encoder is then one for the whole family: a fan-out to N specialists encodes once and sends one
payload. Each member keeps its own decoder, the columns of the stacked decoder that rebuild its B_j.
A member's pair fit is the same Gram restricted to [A | B_j] (JointGram.select), so one pass over the
traces gives the family fit and every per-pair fit to compare it with.

Patch encoders are shared the same way: a layer's encoder is one joint SVD of the producer's x_norm with the
x_norm of every member that Patches it, and each such member trains its own aligner on its own x_norm from
that one code (`patch_rows`, `patch_encoders`).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from scd.fitting.calibrate import pad
from scd.fitting.gram import JointGram
from scd.fitting.traces import valid_rows
from scd.online.reuse import LinearCodec
from scd.online.trace import capture


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
    codec = gram.fit_regression(min(rank, gram.d_b), ridge).padded(rank) if regression else gram.fit(rank, ridge)
    return split(codec, [gram.d_b // n] * n)


def fit_pair(gram: JointGram, n: int, member: int, rank: int, ridge: float, regression: bool) -> LinearCodec:
    """Member `member`'s own pair codec from the family Gram (its block of B only)."""
    sub = gram.select([member_blocks(gram.d_b // n, n)[member]])
    return sub.fit_regression(min(rank, sub.d_b), ridge).padded(rank) if regression else sub.fit(rank, ridge)


def patch_rows(producer, consumers: list, prefixes: list[torch.Tensor], layers: list[int], batch: int,
               pad_id: int | None) -> dict[str, torch.Tensor]:
    """The rows a family's Patch layers are fitted on, from one pass over the prefixes: "pos" (N,) the
    positions, per Patch layer l "xa.l" (N, H) the producer's x_norm and "xb<j>.l" member j's, and "xb<j>.0"
    each member's layer-0 input (its aligners' token features). Rows of whole sequences, in order."""
    out: dict[str, list[torch.Tensor]] = defaultdict(list)
    for start in tqdm(range(0, len(prefixes), batch), desc="family Patch rows"):
        ids, mask = pad(prefixes[start:start + batch], pad_id)
        a = capture(producer, ids, mask)
        out["pos"].append(valid_rows(a.positions, a.mask))
        for l in layers:
            out[f"xa.{l}"].append(valid_rows(a.xnorm[l], a.mask).float())
        for j, consumer in enumerate(consumers):
            b = capture(consumer, ids, mask)
            for l in (0, *layers):
                out[f"xb{j}.{l}"].append(valid_rows(b.xnorm[l], b.mask).float())
    return {k: torch.cat(v).contiguous() for k, v in out.items()}


def patch_encoders(rows: dict[str, torch.Tensor], plans: list[list[int]], rank: int,
                   ridge: float) -> list[dict[int, LinearCodec]]:
    """Per member, the Patch encoders of the layers its plan Patches (rows from `patch_rows`): per layer one
    joint SVD of [x_A | x_B of each member that Patches it] at `rank`, one encoder for the family (the
    producer subspace shared with the members that read it, so a layer only one member Patches gets that
    member's own pair encoder), each member's decoder its own columns."""
    out: list[dict[int, LinearCodec]] = [{} for _ in plans]
    for l in sorted({l for p in plans for l in p}):
        users = [j for j, p in enumerate(plans) if l in p]
        x_a = rows[f"xa.{l}"]
        gram = JointGram(x_a.shape[1], len(users) * x_a.shape[1])
        gram.update(x_a, torch.cat([rows[f"xb{j}.{l}"] for j in users], 1))
        for j, c in zip(users, fit_family(gram, len(users), rank, ridge, regression=False)):
            out[j][l] = c
    return out
