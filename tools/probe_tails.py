"""How the consumer's own last tokens (tails) pay at other prefix lengths than the calibration's: a probe.

    python -m tools.probe_tails --config configs/smollm2.yaml --artifact smollm2:code --tokens 512,2048

A tail of k tokens costs about k / T of a prefill, so at a longer serving length the same tail is cheaper;
what it buys depends on how much of what a continuation reads lies in the last k tokens. For each prefix
length T this measures, on the same held-out windows, the teacher-forced KL of the next 32 tokens for:

  raw_kv            the producer's K and V as they are (no consumer compute)
  droidspeak@<e>    DroidSpeak entering at e (the consumer's layers e..L-1 from the producer's residual)
  codes, codes+tail<k>  the artifact's codes alone (its recompute block, if it has one, decoded from its
                    codes instead), and with the consumer running the prefix's last k tokens itself

(--heads: each again with the consumer's own K and V for the prefix's first h tokens, an attention sink's),
and prints each plan's compute (counted: layers, plus k / T; and timed over the consumer's own prefill, side by
side on one prefix of that length), its KL over raw KV's, and over DroidSpeak's at the same counted compute
(linear between DroidSpeak's entries, raw KV at 0: scd.fitting.points.droidspeak_at).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator
from scd.fitting import points
from scd.online.artifacts import PairArtifacts
from scd.online.trace import capture


def codes_alone(art: PairArtifacts) -> PairArtifacts:
    """`art` without its recompute blocks: the layers of a block decoded from their hidden-state codes (a
    published block plan keeps the codes of every layer), without a tail."""
    plan = ["hidden" if k in ("entry", "recompute") else k for k in art.plan]
    if plan != art.plan:
        missing = [l for l, k in enumerate(plan) if k == "hidden" and art.hidden_source(l)[0] not in art.reuse_x]
        if missing:
            raise SystemExit(f"{art.pair}: layers {missing} of its block have no code to decode them from")
    return art.with_plan(plan, {}).with_tail(0)


class WithHead(methods.Method):
    """Another method's cache with its first `head` positions the consumer's own (exact: the consumer's prefill
    of the prefix's first tokens, which attend to nothing after them), named <method>+head<h>."""

    def __init__(self, inner: methods.Method, head: int):
        self.inner, self.head, self.name = inner, head, f"{inner.name}+head{head}"

    @torch.no_grad()
    def build(self, consumer, ids, mask, tr):
        built = self.inner.build(consumer, ids, mask, tr)
        t0 = time.perf_counter()
        own = capture(consumer, ids[:, :self.head], mask[:, :self.head], want_xnorm=False)
        kv = [(torch.cat([ok, k[..., self.head:, :]], -2), torch.cat([ov, v[..., self.head:, :]], -2))
              for (k, v), ok, ov in zip(built.kv, own.keys, own.values)]
        ms = built.consumer_ms + (time.perf_counter() - t0) * 1e3
        return methods.Built(kv, built.payload_bytes, ms, built.phases, built.entry_bytes)


def curve_rows(ev: Evaluator, held: list, art: PairArtifacts, tails: list[int], entries: list[int],
               repeats: int = 0, heads: tuple[int, ...] = ()) -> list[dict]:
    """One row per method on `held` (samples of one length): {"method", "consumer_ratio" (counted), "kl",
    "over_raw", "over_droidspeak" (SCD plans: over DroidSpeak's KL at the same compute)}; with `repeats`,
    "timed" too: the method's consumer compute over the consumer's prefill, timed side by side on one prefix
    of that length (Evaluator.cost, medians of `repeats` rounds). `heads`: each SCD plan again with the
    consumer's own K and V for the prefix's first h tokens (WithHead; counted h / T more)."""
    n, t = art.spec.num_layers, held[0].prefix.shape[-1]
    codes = codes_alone(art)
    scd = [methods.SCDMethod(codes.with_tail(k), points.point_name(n, k, n)) for k in tails]
    ms = [methods.RawKV()] + [methods.DroidSpeak.entering(e, n) for e in entries] + scd + [
        WithHead(m, h) for h in heads for m in scd]
    kl = {m.name: 0.0 for m in ms}
    for s in tqdm(held, desc=f"tails at {t} tokens"):
        ref = ev.reference(s)
        for m in ms:
            kl[m.name] += ev.kl(s, m, ref) / len(held)
    raw = kl["raw_kv"]
    def counted(name: str) -> float:
        entry, tail, rule, stop = points.parse_point(name, n) or (n, 0, "last", n)
        return points.consumer_ratio(entry, tail, n, t, rule, stop)
    cost = {m.name: counted(getattr(m, "inner", m).name) + getattr(m, "head", 0) / t for m in ms}
    ds = [(0.0, raw)] + [(cost[f"droidspeak@{e}"], kl[f"droidspeak@{e}"]) for e in entries]
    timed = ev.cost(held, ms, t, repeats) if repeats else {}
    rows = []
    for name, v in kl.items():
        at = points.droidspeak_at(cost[name], ds) if name.startswith("codes") else None
        rows.append({"method": name, "tokens": t, "consumer_ratio": cost[name], "kl": v, "over_raw": v / raw,
                     "over_droidspeak": None if not at else v / at,
                     **({"timed": timed[name]["ratio"]} if name in timed else {})})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="tools.probe_tails", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--artifact", required=True, help="PRODUCER:CONSUMER[@VERSION] in the config's store")
    p.add_argument("--tokens", default="512,2048", help="prefix lengths, comma-separated")
    p.add_argument("--samples", type=int, default=12, help="held-out windows per length")
    p.add_argument("--tails", default="0,32,64,128,256", help="tail lengths (0: the codes alone)")
    p.add_argument("--entries", default="24,19,14", help="DroidSpeak's entry layers")
    p.add_argument("--heads", default="", help="also each plan with the consumer's own first h tokens, for each h "
                                               "listed (comma-separated; default none)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the side-by-side timing (0: no timing)")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    try:
        lengths, tails, entries, heads = ([int(x) for x in v.split(",") if x]
                                          for v in (args.tokens, args.tails, args.entries, args.heads))
    except ValueError as e:
        raise SystemExit(f"--tokens, --tails, --entries and --heads take comma-separated integers: {e}") from None
    if args.samples < 1 or args.repeats < 0 or not lengths or min(lengths) < 2 or min(tails, default=0) < 0 \
            or min(heads, default=1) < 1:
        raise SystemExit("--samples must be >= 1, --repeats >= 0, --tokens >= 2, --tails >= 0 and --heads >= 1")

    from artifacts_store import ArtifactStore, ArtifactStoreError, Fingerprints
    from tools.pairs import config_pair
    cfg, name, producer, consumer, tok, spec = config_pair(args.config, args.artifact.split("@")[0])
    if any(not 0 < e < spec.num_layers for e in entries):
        raise SystemExit(f"--entries must lie in 1..{spec.num_layers - 1}")
    try:                                                # (load_config resolved the store's path already)
        art, manifest = ArtifactStore(cfg.artifacts.uri).load(
            args.artifact, expect=Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok))
    except ArtifactStoreError as e:
        raise SystemExit(f"--artifact {args.artifact}: {e}") from None
    c = cfg.calibration_for(name)
    ev = Evaluator(producer, consumer, tok)
    rows = []
    for t in lengths:
        held = samples.pair_data(name, tok, 1, 1, args.samples, t, text_file=c.text_file)[2]
        rows += curve_rows(ev, held, art, tails, entries, args.repeats, tuple(heads))
        print(f"\n{args.artifact} ({manifest.version}) at {t} tokens, {args.samples} held-out windows:")
        print(f"  {'method':22s} {'compute':>8s} {'timed':>7s} {'KL':>8s} {'/ raw KV':>9s} {'/ DroidSpeak':>13s}")
        for r in rows:
            if r["tokens"] == t:
                ds = f"{r['over_droidspeak']:.3f}" if r["over_droidspeak"] else "-"
                tm = f"{r['timed']:.3f}" if "timed" in r else "-"
                print(f"  {r['method']:22s} {r['consumer_ratio']:8.3f} {tm:>7s} {r['kl']:8.4f} {r['over_raw']:9.3f} "
                      f"{ds:>13s}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(0 if main() else 1)
