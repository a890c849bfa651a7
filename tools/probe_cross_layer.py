"""What one code per token for all layers would reach: a probe, not a serving path.

    python -m tools.probe_cross_layer --config ray_config.yaml --pair base:prose --prefixes 512 --ranks 128,256,896
    python -m tools.probe_cross_layer --config configs/smollm2.yaml --pair smollm2:code --group 4 --ranks 96,192

Fits the reduced-rank regression from the producer's x_norm of every layer of a group (layers 1..L-1, in
groups of --group adjacent layers, default all of them) side by side to the consumer's K and V of every
layer of the group, so one rank-r code per token serves a whole group (xKV's shared cross-layer subspace,
and a map that may read any producer layer of the group for any consumer layer of it). Layer 0 is exact,
nothing is Patched or fine-tuned, codes are rounded to fp16. Prints each rank's held-out KL against raw KV
reuse's: with one group at the full rank it is the best any linear Reuse from the producer's hidden states
can do, which tells whether a pair's gap is rank (payload) or the map itself.

With --token-table k the decoders add a row per token (free on the wire: the consumer has the ids); with
--bigram-table k as well, a second method at each rank adds a row per (previous token, token) pair on top of
the token's row, fitted in the same pass (TokenStats.table with the token's row as its prior).
"""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting.traces import pad
from scd.fitting.gram import JointGram, TokenStats
from scd.online.artifacts import code_groups
from scd.online.models import ModelSpec
from scd.online.reuse import LinearCodec, bigram_keys
from scd.online.rope import apply_rope, positions_from_mask
from scd.online.tables import consumer_tables
from scd.online.trace import Trace, capture
from tools.pairs import config_pair


def producer_rows(trace: Trace, keep: torch.Tensor, layers: list[int], window: int = 1) -> torch.Tensor:
    """(N, window * len(layers) * hidden): the layers' x_norm side by side, for the kept (unpadded)
    positions, and with window > 1 the same of the window - 1 positions before each (zeros before the
    sequence's start)."""
    x = torch.cat([trace.xnorm[l].float() for l in layers], -1) * keep[..., None]        # (B, T, F), pads zero
    lagged = [torch.nn.functional.pad(x, (0, 0, w, 0))[:, :x.shape[1]] for w in range(window)]
    return torch.cat(lagged, -1)[keep]


def consumer_rows(trace: Trace, keep: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """(N, len(layers) * 2 * n_kv * d): the layers' K (before RoPE) and V side by side."""
    rows = lambda t: t.transpose(1, 2)[keep].float().flatten(1)      # noqa: E731  (B, n_kv, T, d) -> (N, n_kv*d)
    return torch.cat([torch.cat([rows(trace.content[l]), rows(trace.values[l])], 1) for l in layers], 1)


class CrossLayer(methods.Method):
    """Reuse from one code per token per group of layers (fp16 on the wire)."""

    def __init__(self, codecs: list[tuple[list[int], LinearCodec]], spec: ModelSpec, window: int = 1):
        self.codecs, self.spec, self.window = codecs, spec, window
        self.name = f"cross_layer_r{codecs[0][1].enc.shape[1]}" + (f"x{len(codecs)}" if len(codecs) > 1 else "") \
            + (f"_w{window}" if window > 1 else "") + ("_bigram" if codecs[0][1].bigram is not None else "")

    def build(self, consumer, ids, mask, producer_trace):
        b, t = ids.shape
        s = self.spec
        tables = consumer_tables(consumer, s.head_dim)
        cos, sin = tables.rope(positions_from_mask(mask), torch.float32)
        k0, v0 = tables.layer0(ids)
        heads = lambda x: x.reshape(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)     # noqa: E731
        kv, nbytes = [(apply_rope(heads(k0), cos, sin), heads(v0))], 0
        keep = mask.bool()
        keys = bigram_keys(ids, mask)
        for layers, codec in self.codecs:
            z = codec.encode(producer_rows(producer_trace, keep, layers, self.window)).half().float()
            nbytes += z.numel() * 2
            pred = codec.decode(z, ids[keep], keys[keep]).view(b, t, len(layers), 2, -1)    # 2: K, V
            kv += [(apply_rope(heads(pred[:, :, i, 0]), cos, sin), heads(pred[:, :, i, 1])) for i in range(len(layers))]
        return methods.Built(kv, nbytes, 0.0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="tools.probe_cross_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--pair", required=True, help="producer:specialist of the config")
    p.add_argument("--prefixes", type=int, default=512, help="calibration prefixes")
    p.add_argument("--samples", type=int, default=48, help="held-out samples")
    p.add_argument("--ranks", default="128,256,896", help="code ranks (per group), comma-separated")
    p.add_argument("--group", type=int, default=0, help="adjacent layers per code (default 0: all layers, one code)")
    p.add_argument("--window", type=int, default=1, help=(
        "positions the map reads (default 1: each token's own; w: it and the w - 1 before it). At a full-rank "
        "code this is what a decoder reading the last w codes could reach"))
    p.add_argument("--token-table", type=int, default=0, help=(
        "k > 0: the decoders add a row per token of the calibration's k most frequent tokens (free on the "
        "wire; calibration.token_table)"))
    p.add_argument("--token-shrink", type=float, default=1.0, help="calibration.token_shrink of the table")
    p.add_argument("--bigram-table", type=int, default=0, help=(
        "k > 0 (with --token-table): also a row per (previous token, token) pair of the calibration's k most "
        "frequent, on top of the token's row (backoff); printed as a second method at each rank"))
    p.add_argument("--bigram-shrink", type=float, default=16.0, help="the bigram rows' shrink towards the token's row")
    args = p.parse_args(argv)
    cfg, name, producer, consumer, tok, spec = config_pair(args.config, args.pair)
    if args.group < 0:
        raise SystemExit(f"--group must be >= 0, got {args.group}")
    if args.token_table < 0 or args.token_shrink <= 0:
        raise SystemExit("--token-table must be >= 0 and --token-shrink > 0")
    if args.bigram_table < 0 or args.bigram_shrink <= 0 or (args.bigram_table and not args.token_table):
        raise SystemExit("--bigram-table must be >= 0 (and needs --token-table), --bigram-shrink > 0")
    if args.window < 1:
        raise SystemExit(f"--window must be >= 1, got {args.window}")
    layer_groups = code_groups(spec.num_layers, args.group)
    kv_width = 2 * spec.num_kv_heads * spec.head_dim
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(not 1 <= r <= len(layer_groups[0]) * kv_width for r in ranks):
        raise SystemExit(f"--ranks must be within 1..{len(layer_groups[0]) * kv_width} (a group's K and V; a "
                         "shorter last group is coded at most at its own width)")
    calib, _, held = samples.pair_data(name, tok, args.prefixes, 1, args.samples, cfg.calibration.prefix_tokens)
    grams = [JointGram(args.window * len(g) * spec.hidden_size, len(g) * kv_width) for g in layer_groups]
    tables = [TokenStats.most_frequent(calib, args.token_table, g.d_a, g.d_b) if args.token_table else None
              for g in grams]
    bigrams = [TokenStats.most_frequent([bigram_keys(torch.as_tensor(c)) for c in calib], args.bigram_table,
                                        g.d_a, g.d_b) if args.bigram_table else None for g in grams]
    for start in tqdm(range(0, len(calib), cfg.calibration.batch), desc="cross-layer Gram"):
        ids, mask = pad(calib[start:start + cfg.calibration.batch], tok.pad_token_id)
        keep = mask.bool()
        keys = bigram_keys(ids, mask)[keep]
        a, b = capture(producer, ids, mask), capture(consumer, ids, mask, want_xnorm=False)
        for g, gram, table, bigram in zip(layer_groups, grams, tables, bigrams):
            rows_a, rows_b = producer_rows(a, keep, g, args.window), consumer_rows(b, keep, g)
            gram.update(rows_a, rows_b)
            if table is not None:
                table.update(ids[keep], rows_a, rows_b)
            if bigram is not None:
                bigram.update(keys, rows_a, rows_b)
    ways = [methods.RawKV()]
    for r in ranks:
        for with_bigrams in (False, True)[:1 + bool(args.bigram_table)]:
            ways.append(CrossLayer([(g, gram.fit_regression(min(r, gram.d_b), cfg.calibration.ridge, table,
                                                            args.token_shrink, bigram if with_bigrams else None,
                                                            args.bigram_shrink))
                                    for g, gram, table, bigram in zip(layer_groups, grams, tables, bigrams)],
                                   spec, args.window))
    rows = Evaluator(producer, consumer, tok).run(held, ways, desc=f"held-out {args.pair}")
    raw = rows[0]["kl"]
    print(f"\n{args.pair}: one code per token per group of layers ({len(layer_groups)} groups of {len(layer_groups[0])}), "
          f"Reuse-only, fp16; {len(calib)} calibration prefixes, {len(held)} held-out")
    for r in rows:
        print(f"  {r['method']:<18} payload {r['payload_ratio']:.3f}  KL {r['kl']:.4f} = {r['kl'] / raw:.3f} x raw KV  "
              f"greedy {r['greedy']:.3f}")
    return rows


if __name__ == "__main__":
    main()
