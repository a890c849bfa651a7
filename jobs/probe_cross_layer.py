"""What one code per token for all layers would reach: a probe, not a serving path.

    python -m jobs.probe_cross_layer --config ray_config.yaml --pair base:prose --prefixes 512 --ranks 128,256,896

Fits the reduced-rank regression from the producer's x_norm of every layer (1..L-1, side by side) to the
consumer's K and V of every layer (one target), so one rank-r code per token serves all layers (xKV's shared
cross-layer subspace, and a map that may read any producer layer for any consumer layer). Layer 0 is exact,
nothing is Patched or fine-tuned, codes are rounded to fp16. Prints each rank's held-out KL against raw KV
reuse's: at the full rank it is the best any linear Reuse from the producer's hidden states can do, which
tells whether a pair's gap is rank (payload) or the map itself.
"""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from cluster.config import load_config
from jobs import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting.calibrate import pad
from scd.fitting.gram import JointGram
from scd.online.models import ModelSpec, load
from scd.online.reuse import LinearCodec
from scd.online.rope import apply_rope, positions_from_mask
from scd.online.tables import consumer_tables
from scd.online.trace import Trace, capture


def producer_rows(trace: Trace, keep: torch.Tensor) -> torch.Tensor:
    """(N, (L-1) * hidden): every layer's x_norm but layer 0's, for the kept (unpadded) positions."""
    return torch.cat([x[keep].float() for x in trace.xnorm[1:]], 1)


def consumer_rows(trace: Trace, keep: torch.Tensor) -> torch.Tensor:
    """(N, (L-1) * 2 * n_kv * d): every layer's K (before RoPE) and V but layer 0's."""
    rows = lambda t: t.transpose(1, 2)[keep].float().flatten(1)      # noqa: E731  (B, n_kv, T, d) -> (N, n_kv*d)
    return torch.cat([torch.cat([rows(k), rows(v)], 1) for k, v in zip(trace.content[1:], trace.values[1:])], 1)


class CrossLayer(methods.Method):
    """Reuse from one cross-layer code per token (fp16 on the wire)."""

    def __init__(self, codec: LinearCodec, spec: ModelSpec):
        self.codec, self.spec, self.name = codec, spec, f"cross_layer_r{codec.enc.shape[1]}"

    def build(self, consumer, ids, mask, producer_trace):
        b, t = ids.shape
        s = self.spec
        z = self.codec.encode(producer_rows(producer_trace, mask.bool())).half().float()
        pred = self.codec.decode(z).view(b, t, s.num_layers - 1, 2, s.num_kv_heads, s.head_dim)    # 2: K, V
        tables = consumer_tables(consumer, s.head_dim)
        cos, sin = tables.rope(positions_from_mask(mask), torch.float32)
        k0, v0 = tables.layer0(ids)
        heads = lambda x: x.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)     # noqa: E731
        kv = [(apply_rope(heads(k0), cos, sin), heads(v0))]
        kv += [(apply_rope(pred[:, :, l, 0].transpose(1, 2), cos, sin), pred[:, :, l, 1].transpose(1, 2))
               for l in range(s.num_layers - 1)]
        return methods.Built(kv, b * t * z.shape[-1] * 2, 0.0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="jobs.probe_cross_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--pair", required=True, help="producer:specialist of the config")
    p.add_argument("--prefixes", type=int, default=512, help="calibration prefixes")
    p.add_argument("--samples", type=int, default=48, help="held-out samples")
    p.add_argument("--ranks", default="128,256,896", help="code ranks, comma-separated")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    name = args.pair.split(":", 1)[-1]
    try:
        s = cfg.specialist(name)
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    torch.manual_seed(cfg.calibration.seed)
    producer, tok, spec = load(cfg.producer.path)
    consumer, _, _ = load(s.path, base=s.base)
    width = (spec.num_layers - 1) * 2 * spec.num_kv_heads * spec.head_dim
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(not 1 <= r <= width for r in ranks):
        raise SystemExit(f"--ranks must be within 1..{width} (every layer's K and V)")
    calib, _, held = samples.pair_data(name, tok, args.prefixes, 1, args.samples, cfg.calibration.prefix_tokens)
    gram = JointGram((spec.num_layers - 1) * spec.hidden_size, width)
    for start in tqdm(range(0, len(calib), cfg.calibration.batch), desc="cross-layer Gram"):
        ids, mask = pad(calib[start:start + cfg.calibration.batch], tok.pad_token_id)
        keep = mask.bool()
        gram.update(producer_rows(capture(producer, ids, mask), keep),
                    consumer_rows(capture(consumer, ids, mask, want_xnorm=False), keep))
    ways = [methods.RawKV()] + [CrossLayer(gram.fit_regression(r, cfg.calibration.ridge), spec) for r in ranks]
    rows = Evaluator(producer, consumer, tok).run(held, ways, desc=f"held-out {args.pair}")
    raw = rows[0]["kl"]
    print(f"\n{args.pair}: one code per token for all layers, Reuse-only, fp16; {len(calib)} calibration prefixes, "
          f"{len(held)} held-out")
    for r in rows:
        print(f"  {r['method']:<18} payload {r['payload_ratio']:.3f}  KL {r['kl']:.4f} = {r['kl'] / raw:.3f} x raw KV  "
              f"greedy {r['greedy']:.3f}")
    return rows


if __name__ == "__main__":
    main()
