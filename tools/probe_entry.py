"""What a recompute block can reach on a specialist adapted on every layer: a probe, not a serving path.

    python -m tools.probe_entry --config configs/smollm2.yaml --pair smollm2:code --entries 8,12,16,20

For each entry layer e the consumer runs its own layers e..L-1 over the prefix (a cost of (L - e) / L of a
prefill) from a residual stream entering e, and takes layers 1..e-1 from the producer. Four ways, each
scored by held-out KL against raw KV reuse's:

  e<e>        the producer's residual as it is, the producer's K and V below: DroidSpeak's entry
  e<e>+align  the residual through a linear map fitted to the consumer's residual at e (a Patch-style
              aligned entry; closed form, ridge, as a correction to the producer's residual)
  e<e>+below  the producer's residual, and below e the consumer's K and V predicted from the producer's
              x_norm by a full-rank linear map per layer (the best a per-token hidden-state code can send)
  e<e>+both   both
  e<e>+trained  (with --train-samples) +both, its entry map then trained end to end: the consumer's
              next-token KL on teacher-forced continuations, back through its own layers e..L-1 over the
              prefix into the map (the closed form fits the residual; this fits what the consumer predicts)

plus `below` alone (no block: every layer 1..L-1 predicted). Layer 0 is always exact. No rounding on the
wire: the figures are what the maps can do, not a payload. The maps are fitted on --prefixes calibration
prefixes.

With --below-artifact REF (a published artifact of the pair, e.g. smollm2:qa@latest): below e the consumer
takes that artifact's rebuilt cache from its codes as sent (rounded as on the wire), instead of the full-rank
translation; `+below`, `+both` and `+trained` then measure a block over the codes a payload carries.

With --stops S,...: also a block that ends below the top, e<e>-<s>+both for each stop s > e: the consumer runs
its layers e..s-1 only (a cost of (s - e) / L), and takes `below`'s K and V above s too (a block where the
error lives, the codes elsewhere).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting.gram import JointGram
from scd.fitting.blocks import codes_kv, train_entry
from scd.online.recompute import run_layers
from scd.online.reuse import LinearCodec
from scd.online.rope import apply_rope, cos_sin
from scd.online.trace import capture
from tools.pairs import config_pair


def kv_rows(trace, layer: int) -> torch.Tensor:
    """(T, 2 n_kv d): a one-sequence trace's K before RoPE and V of one layer, side by side."""
    rows = lambda t: t[0].transpose(0, 1).flatten(1).float()       # noqa: E731  (1, n_kv, T, d) -> (T, n_kv d)
    return torch.cat([rows(trace.content[layer]), rows(trace.values[layer])], 1)


class CodesBelow:
    """`below` from a published artifact: its rebuilt cache from its codes as sent (scd.fitting.blocks.codes_kv;
    its own block, if it has one, is cut away by the entry above it)."""

    def __init__(self, art):
        self.art = art

    def kv(self, consumer, ids, tr) -> list:
        return codes_kv(consumer, self.art, ids, tr)


class Entry(methods.Method):
    """The producer's K and V (or `below`'s predictions: full-rank maps per layer, or a CodesBelow) at layers
    1..e-1, the consumer's own from e (to `stop`, `below`'s again above it), entered from the producer's
    residual (through `align` when given)."""

    def __init__(self, entry: int, num_layers: int, align: LinearCodec | None,
                 below: "dict[int, LinearCodec] | CodesBelow | None", name: str | None = None,
                 stop: int | None = None):
        self.entry, self.num_layers, self.align, self.below = entry, num_layers, align, below
        self.stop = stop or num_layers                   # the block's layers: entry..stop-1
        self.name = name or ("below" if entry == num_layers else f"e{entry}") + (
            f"-{self.stop}" if self.stop < num_layers else "") + (
            "+both" if align and below and entry < num_layers else "+align" if align else
            "+below" if below and entry < num_layers else "")

    def build(self, consumer, ids, mask, tr):
        t0 = time.perf_counter()
        kv = self.below_kv(consumer, ids, tr)
        if self.entry < self.num_layers:
            h = tr.hidden[self.entry]
            if self.align is not None:
                h = h + self.align.decode(self.align.encode(h.float()))
            kv[self.entry:self.stop] = run_layers(consumer, h, mask, tr.positions, self.entry, self.stop)
        return methods.Built(kv, 0, (time.perf_counter() - t0) * 1e3)

    @torch.no_grad()
    def below_kv(self, consumer, ids, tr) -> list:
        """The producer's K and V of every layer, with `below`'s predictions at layers 1..e-1 (and from the
        block's stop up, for a block that ends below the top)."""
        if isinstance(self.below, CodesBelow):
            return list(self.below.kv(consumer, ids, tr))
        kv = list(zip(tr.keys, tr.values))
        _, n_kv, t, d = tr.keys[0].shape
        if self.below:
            cos, sin = cos_sin(consumer, tr.positions)
            for l in [*range(1, self.entry), *range(self.stop, self.num_layers)]:
                y = self.below[l].decode(self.below[l].encode(tr.xnorm[l][0].float()))
                k, v = (y[:, i * n_kv * d:(i + 1) * n_kv * d].view(t, n_kv, d).transpose(0, 1)[None] for i in (0, 1))
                kv[l] = (apply_rope(k, cos, sin), v)
        return kv


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="tools.probe_entry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--pair", required=True, help="producer:specialist of the config")
    p.add_argument("--entries", default="8,12,16,20", help="entry layers, comma-separated")
    p.add_argument("--prefixes", type=int, default=48, help="calibration prefixes the maps are fitted on")
    p.add_argument("--stops", default="", help="also blocks ending below the top: stop layers, comma-separated")
    p.add_argument("--samples", type=int, default=8, help="held-out samples")
    p.add_argument("--store", default=None, help="the store --below-artifact is in (default: the config's "
                                                 "artifacts.uri)")
    p.add_argument("--ridge", type=float, default=1e-2, help="the aligned entry's ridge, relative to the "
                                                             "residual's mean variance")
    p.add_argument("--train-samples", type=int, default=0, help="(prefix, continuation) training samples for "
                                                                 "the e<e>+trained rows (0: none)")
    p.add_argument("--train-epochs", type=int, default=3)
    p.add_argument("--train-lr", type=float, default=1e-4)
    p.add_argument("--below-artifact", default=None, metavar="REF",
                   help="below the entry, this published artifact's codes (e.g. smollm2:qa@latest) instead of "
                        "the full-rank translation")
    args = p.parse_args(argv)
    cfg, name, producer, consumer, tok, spec = config_pair(args.config, args.pair)
    if args.below_artifact:
        from artifacts_store import ArtifactStore, ArtifactStoreError
        try:
            store = str(Path(args.store).expanduser()) if args.store and "://" not in args.store else args.store
            codes_below = CodesBelow(ArtifactStore(store or cfg.artifacts.uri).load(args.below_artifact)[0])
        except (ArtifactStoreError, ValueError) as e:
            raise SystemExit(f"--below-artifact {args.below_artifact}: {e}") from None
    L, hsize = spec.num_layers, spec.hidden_size
    try:
        entries = sorted({int(e) for e in args.entries.split(",")})
        stops = sorted({int(s) for s in args.stops.split(",") if s})
    except ValueError:
        raise SystemExit(f"--entries and --stops must be layer numbers, comma-separated: {args.entries!r}, "
                         f"{args.stops!r}") from None
    if not all(1 <= e < L for e in entries + stops):
        raise SystemExit(f"--entries and --stops must be within 1..{L - 1}")
    calib, _, held = samples.pair_data(name, tok, args.prefixes, 0, args.samples, cfg.calibration.prefix_tokens)
    kv_width = 2 * spec.num_kv_heads * spec.head_dim
    entry_grams = {e: JointGram(hsize, hsize) for e in entries}
    below_grams = {l: JointGram(hsize, kv_width) for l in range(1, L)}
    for ids in tqdm(calib, desc="paired traces"):
        ids = torch.as_tensor(ids)[None]
        a = capture(producer, ids, want_hidden=True)
        b = capture(consumer, ids, want_xnorm=False, want_hidden=True)
        for e, g in entry_grams.items():
            g.update(a.hidden[e][0].float(), (b.hidden[e][0] - a.hidden[e][0]).float())
        for l, g in below_grams.items():
            g.update(a.xnorm[l][0].float(), kv_rows(b, l))
    align = {e: g.fit_regression(hsize, args.ridge) for e, g in entry_grams.items()}
    below = {l: g.fit_regression(kv_width, cfg.calibration.ridge) for l, g in below_grams.items()}
    if args.below_artifact:
        below = codes_below
    ways = [methods.RawKV(), Entry(L, L, None, below)] + [
        Entry(e, L, al, bl) for e in entries for al in (None, align[e]) for bl in (None, below)] + [
        Entry(e, L, align[e], below, stop=s) for e in entries for s in stops if s > e]
    if args.train_samples:
        train = samples.tune_samples(name, tok, args.train_samples, cfg.calibration.prefix_tokens)
        for e in entries:
            way = Entry(e, L, align[e], below)
            trained, curve = train_entry(producer, consumer, e, align[e],
                                         lambda ids, tr, way=way: way.below_kv(consumer, ids, tr), train,
                                         args.train_epochs, args.train_lr)
            print(f"entry {e}: training KL by epoch {', '.join(f'{v:.4f}' for v in curve)}")
            ways.append(Entry(e, L, trained, below, name=f"e{e}+trained"))
    rows = Evaluator(producer, consumer, tok).run(held, ways, desc=f"held-out {args.pair}")
    raw = rows[0]["kl"]
    print(f"\n{args.pair}: recompute blocks entered at {entries}; maps fitted on {len(calib)} calibration prefixes, "
          f"{len(held)} held-out")
    for r, w in zip(rows, ways):
        cost = (w.stop - w.entry) / L if isinstance(w, Entry) else 0.0
        f1 = f"  F1 {r['f1']:.3f}" if r["f1"] is not None else ""
        print(f"  {r['method']:<12} consumer {cost:.2f}  KL {r['kl']:.4f} = {r['kl'] / raw:.3f} x raw KV  "
              f"greedy {r['greedy']:.3f}{f1}")
    return rows


if __name__ == "__main__":
    main()
