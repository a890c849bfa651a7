"""One code for a whole family: a producer's Reuse codes fitted against N consumers at once.

Each consumer's target rows (its K and V, or its K and V of every head for hidden-state codes) are stacked
side by side, B = [B_1 | ... | B_N], and fitted in closed form against the producer's rows A exactly as a
pair is (scd.fitting.gram: joint SVD for per-head codes, reduced-rank regression for hidden-state codes).
The encoder is then one for the whole family: a fan-out to N specialists encodes once and sends one
payload. The rows are every member's own calibration prefixes together (the encoder sees the producer on
all of them), but each member's decoder is refitted on its own prefixes only (`refit_decoder`, from a
Gram of [A | B_j] over them): a specialist is decoded for the text it serves and is scored on, as its pair
calibration decodes it, not for a mixture in which its own text is one share. That member Gram is also
its pair fit's, so one pass over the traces gives the family fit and every per-pair fit to compare it with.

Patch encoders are shared the same way: a layer's encoder is one joint SVD of the producer's x_norm with the
x_norm of every member that Patches it (over all the members' prefixes), and each such member trains its
own aligner on its own x_norm from that one code, on its own prefixes (`patch_rows`, `patch_encoders`,
`own_rows`).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from scd.fitting.traces import pad
from scd.fitting.gram import JointGram, TokenStats, backoff_table
from scd.fitting.traces import valid_rows
from scd.online.artifacts import code_groups
from scd.online.models import ModelSpec
from scd.online.reuse import LinearCodec, bigram_keys
from scd.online.trace import capture


def split(codec: LinearCodec, widths: list[int]) -> list[LinearCodec]:
    """A codec fitted on stacked targets [B_1 | ... | B_N] (decoder columns of widths `widths`) as one codec
    per member, all sharing its encoder (the same tensors)."""
    if sum(widths) != codec.dec.shape[1]:
        raise ValueError(f"member widths {widths} do not add up to the decoder's {codec.dec.shape[1]} columns")
    out, col = [], 0
    for w in widths:
        table = None if codec.table is None else codec.table[:, col:col + w].contiguous()
        bigram = None if codec.bigram is None else codec.bigram[:, col:col + w].contiguous()
        out.append(LinearCodec(codec.mu_a, codec.enc, codec.mu_b[col:col + w].contiguous(),
                               codec.dec[:, col:col + w].contiguous(), table, codec.table_ids, bigram,
                               codec.bigram_ids))
        col += w
    return out


def fit_codec(gram: JointGram, rank: int, ridge: float, regression: bool, tokens: TokenStats | None = None,
              shrink: float = 1.0, bigrams: TokenStats | None = None, bigram_shrink: float = 16.0) -> LinearCodec:
    """A pair's closed-form fit at `rank`: reduced-rank regression (hidden-state codes, with a token table
    when `tokens` are given, and a bigram table on top with `bigrams`; below full rank of B it is
    zero-padded to `rank`) or the joint SVD (per-head codes)."""
    if not regression:
        return gram.fit(rank, ridge)
    return gram.fit_regression(min(rank, gram.d_b), ridge, tokens, shrink, bigrams, bigram_shrink).padded(rank)


def refit_decoder(codec: LinearCodec, gram: JointGram, ridge: float, tokens: TokenStats | None = None,
                  shrink: float = 1.0, bigrams: TokenStats | None = None, bigram_shrink: float = 16.0) -> LinearCodec:
    """`codec`'s encoder with the decoder that rebuilds B best, in least squares, from its code on the rows
    of `gram` (a Gram of [A | B]): B ~ mu_b + (A - mu_a) E D with D = (E^T C_AA E + lam I)^-1 E^T C_AB and
    mu_b = mean(B) - (mean(A) - mu_a) E D. `ridge` is relative to the codes' mean variance; code columns
    that carry nothing (zero-padded) get zero decoder rows. With `tokens` (per-token sums of the same
    rows) the decoder gets a token table: D is fitted on the covariance with the token means taken out
    (JointGram.cov) and the table holds each token's mean residual (TokenStats.table); with `bigrams` too, a
    bigram table backs off to it (gram.backoff_table)."""
    if gram.d_a != codec.enc.shape[0] or gram.d_b != codec.dec.shape[1]:
        raise ValueError(f"a Gram of [{gram.d_a} | {gram.d_b}] columns cannot refit a decoder of a codec "
                         f"{tuple(codec.enc.shape)} -> {tuple(codec.dec.shape)}")
    if gram.n == 0:
        raise ValueError("no rows accumulated")
    da, e = gram.d_a, codec.enc.double()
    mu, cov = gram.s / gram.n, gram.cov(tokens, shrink)
    c_zz, c_zb = e.T @ cov[:da, :da] @ e, e.T @ cov[:da, da:]
    lam = ridge * c_zz.diagonal().mean().clamp(min=1e-12)
    dec = torch.linalg.solve(c_zz + lam * torch.eye(e.shape[1], dtype=e.dtype), c_zb)
    mu_b = mu[da:] - (mu[:da] - codec.mu_a.double()) @ e @ dec
    table = None if tokens is None else tokens.table(mu, e @ dec, shrink)
    bigram = None if bigrams is None else backoff_table(bigrams, tokens, table, mu, e @ dec, bigram_shrink)
    return LinearCodec(codec.mu_a, codec.enc, mu_b.float(), dec.float().contiguous(), table,
                       None if tokens is None else tokens.ids, bigram, None if bigrams is None else bigrams.ids)


def fit_family(gram: JointGram, n: int, rank: int, ridge: float, regression: bool,
               own: list[JointGram] | None = None, tokens: TokenStats | None = None,
               own_tokens: list[TokenStats] | None = None, shrink: float = 1.0,
               own_bigrams: list[TokenStats] | None = None, bigram_shrink: float = 16.0) -> list[LinearCodec]:
    """The family's shared-encoder codecs, one per member, from a Gram whose B holds n equal member blocks;
    with `own` (per member a Gram of [A | B_j] over its own rows), each member's decoder refitted on them.
    With `tokens` (the family rows' per-token sums) the shared code is fitted beside a token table, and
    with `own_tokens` each member's refitted decoder has its own table, from its own rows; with
    `own_bigrams` also its own bigram table on top."""
    if gram.d_b % n:
        raise ValueError(f"a family Gram of {gram.d_b} target columns cannot hold {n} equal member blocks")
    members = split(fit_codec(gram, rank, ridge, regression, tokens, shrink), [gram.d_b // n] * n)
    if own is None:
        return members
    if any(x is not None and len(x) != n for x in (own, own_tokens, own_bigrams)):
        raise ValueError(f"{len(own)} member Grams for a family of {n}")
    return [refit_decoder(m, g, ridge, None if own_tokens is None else own_tokens[j], shrink,
                          None if own_bigrams is None else own_bigrams[j], bigram_shrink)
            for j, (m, g) in enumerate(zip(members, own))]


# per stream ("x", or "k" and "v"), per layer (None: no code there); with token tables, "t": per hidden-state
# code the per-token sums of the same rows, and with bigram tables "p" (a member's own only): its per-pair sums
Grams = dict[str, list[JointGram | TokenStats | None]]


def member_batches(prefixes: list[list[torch.Tensor]], batch: int, pad_id: int | None, desc: str):
    """(member, ids, mask) for every batch of each member's own prefixes (`prefixes[j]`, member j's), a
    member at a time, so a batch holds one member's prefixes only."""
    for src, mine in enumerate(prefixes):
        for start in tqdm(range(0, len(mine), batch), desc=f"{desc} ({src + 1}/{len(prefixes)})"):
            yield (src, *pad(mine[start:start + batch], pad_id))


def accumulate(producer, consumers: list, spec: ModelSpec, prefixes: list[list[torch.Tensor]], hidden: bool,
               batch: int, pad_id: int | None, x_group: int = 1, token_table: int = 0,
               bigram_table: int = 0) -> tuple[Grams, list[Grams]]:
    """Family Gram matrices from one pass over every member's own prefixes (`prefixes[j]`, member j's):
    per hidden-state code (at each layer >= 1, or the first layer of each group of x_group layers),
    [x_A of its layers | (K_j, V_j of its layers)_j], or per layer, per-head codes [K_A | K_j...] and
    [V_A | V_j...] (every layer), over all the rows; and per member j the Gram of [A | B_j] over its own
    rows only (its decoders' fit, and its pair fit). With `token_table` (hidden-state codes), the same
    rows' per-token sums ("t") for the most frequent tokens of all the prefixes, and of a member's own; with
    `bigram_table` too, a member's per-pair sums ("p", bigram_keys) for the most frequent pairs of its own
    prefixes (the decoders are refitted per member, so the family's shared fit needs none).
    Returns (family Grams, each member's own)."""
    n, L = len(consumers), spec.num_layers
    m, d, hid = spec.num_kv_heads * spec.head_dim, spec.head_dim, spec.hidden_size
    groups = code_groups(spec.num_layers, x_group)

    def grams(members: int, mine: list[torch.Tensor], pairs: int) -> Grams:
        if hidden:
            out: Grams = {"x": [None] * L, **({"t": [None] * L} if token_table else {}),
                          **({"p": [None] * L} if pairs else {})}
            for g in groups:
                out["x"][g[0]] = JointGram(len(g) * hid, members * len(g) * 2 * m)
                if token_table:
                    out["t"][g[0]] = TokenStats.most_frequent(mine, token_table, len(g) * hid, members * len(g) * 2 * m)
                if pairs:
                    out["p"][g[0]] = TokenStats.most_frequent([bigram_keys(torch.as_tensor(p)) for p in mine], pairs,
                                                              len(g) * hid, len(g) * 2 * m)
            return out
        return {"k": [JointGram(d, members * d) for _ in range(L)], "v": [JointGram(d, members * d) for _ in range(L)]}

    fam = grams(n, [p for mine in prefixes for p in mine], 0)
    own = [grams(1, mine, bigram_table) for mine in prefixes]
    for src, ids, mask in member_batches(prefixes, batch, pad_id, "family traces"):
        keep = mask.bool()
        keys = bigram_keys(ids, mask)[keep] if bigram_table else None
        a = capture(producer, ids, mask, want_xnorm=hidden)
        bs = [capture(c, ids, mask, want_xnorm=False) for c in consumers]
        rows = lambda t: t.transpose(1, 2)[keep].float()        # noqa: E731  (B, n_kv, T, d) -> (N, n_kv, d)
        if hidden:
            for g in groups:
                x_a = torch.cat([a.xnorm[l][keep].float() for l in g], 1)
                targets = [torch.cat([torch.cat([rows(b.content[l]).flatten(1), rows(b.values[l]).flatten(1)], 1)
                                      for l in g], 1) for b in bs]
                fam["x"][g[0]].update(x_a, torch.cat(targets, 1))
                own[src]["x"][g[0]].update(x_a, targets[src])
                if token_table:
                    fam["t"][g[0]].update(ids[keep], x_a, torch.cat(targets, 1))
                    own[src]["t"][g[0]].update(ids[keep], x_a, targets[src])
                if bigram_table:
                    own[src]["p"][g[0]].update(keys, x_a, targets[src])
            continue
        for l in range(L):
            for s, t_a, t_b in (("k", a.content[l], [b.content[l] for b in bs]),
                                ("v", a.values[l], [b.values[l] for b in bs])):
                x_a, targets = rows(t_a), [rows(t) for t in t_b]
                fam[s][l].update(x_a, torch.cat(targets, -1))
                own[src][s][l].update(x_a, targets[src])
    return fam, own


def save_grams(fam: Grams, own: list[Grams], path: Path) -> None:
    """The family's Grams and each member's own (as "m<j>.<stream>.<layer>"), in one safetensors file."""
    t = {}
    for prefix, grams in (("", fam), *((f"m{j}.", g) for j, g in enumerate(own))):
        t.update({k: v for name, gs in grams.items() for l, g in enumerate(gs) if g is not None
                  for k, v in g.tensors(f"{prefix}{name}.{l}").items()})
    tmp = path.with_suffix(".tmp")
    save_file(t, str(tmp))
    tmp.replace(path)


def load_grams(path: Path, spec: ModelSpec, hidden: bool, members: int, x_group: int = 1) -> tuple[Grams, list[Grams]]:
    """What save_grams wrote: (the family's Grams, each of `members` members' own)."""
    t = load_file(str(path))

    def grams(prefix: str) -> Grams:
        if hidden:
            out: Grams = {"x": [None] * spec.num_layers}
            for g in code_groups(spec.num_layers, x_group):
                out["x"][g[0]] = JointGram.from_tensors(t, f"{prefix}x.{g[0]}", len(g) * spec.hidden_size)
                for name in "tp":
                    if f"{prefix}{name}.{g[0]}.ids" in t:
                        out.setdefault(name, [None] * spec.num_layers)[g[0]] = TokenStats.from_tensors(
                            t, f"{prefix}{name}.{g[0]}")
            return out
        return {s: [JointGram.from_tensors(t, f"{prefix}{s}.{l}", spec.head_dim) for l in range(spec.num_layers)]
                for s in "kv"}

    return grams(""), [grams(f"m{j}.") for j in range(members)]


def patch_rows(producer, consumers: list, prefixes: list[list[torch.Tensor]], layers: list[int], batch: int,
               pad_id: int | None) -> dict[str, torch.Tensor]:
    """The rows a family's Patch layers are fitted on, from one pass over every member's own prefixes
    (`prefixes[j]`, member j's): "pos" (N,) the positions, "src" (N,) the member whose prefix each row is
    from, per Patch layer l "xa.l" (N, H) the producer's x_norm and "xb<j>.l" member j's, and "xb<j>.0"
    each member's layer-0 input (its aligners' token features). Rows of whole sequences, in order."""
    out: dict[str, list[torch.Tensor]] = defaultdict(list)
    for src, ids, mask in member_batches(prefixes, batch, pad_id, "family Patch rows"):
        a = capture(producer, ids, mask)
        pos = valid_rows(a.positions, a.mask)
        out["pos"].append(pos)
        out["src"].append(torch.full_like(pos, src))
        for l in layers:
            out[f"xa.{l}"].append(valid_rows(a.xnorm[l], a.mask).float())
        for j, consumer in enumerate(consumers):
            b = capture(consumer, ids, mask)
            for l in (0, *layers):
                out[f"xb{j}.{l}"].append(valid_rows(b.xnorm[l], b.mask).float())
    return {k: torch.cat(v).contiguous() for k, v in out.items()}


def own_rows(rows: dict[str, torch.Tensor], member: int, layer: int) -> tuple[torch.Tensor, ...]:
    """Member `member`'s aligner rows at Patch layer `layer` (x_A, x_B, positions, x_B of layer 0), from its
    own prefixes only (whole sequences, so an aligner's context windows stay within one)."""
    keep = rows["src"] == member
    return (rows[f"xa.{layer}"][keep], rows[f"xb{member}.{layer}"][keep], rows["pos"][keep],
            rows[f"xb{member}.0"][keep])


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
