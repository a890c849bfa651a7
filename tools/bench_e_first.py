"""E-first pipelining measured at the serving engines over an emulated link, side by side in one run.

    python -m tools.bench_e_first [--config configs/smollm2.yaml] [--specialist code_few] [--tokens 2048]
                                  [--gbps 1,10,25,100] [--repeats 3] [--json out.json]

The pair's exact plan in bf16, entering at its first adapted layer (scd.fitting.structure): the producer's
K and V below it, its residual there, the consumer's own layers above. The producer's and the specialist's
engines (engines/producer.py, engines/specialist.py, the code a replica runs) in one process; the link is
emulated by sleeping each part's transfer time (links.transfer_ms) where a replica would wait for it:
- whole: the payload's time, then the rebuild and the first token (`complete`, one token);
- E-first: the entry part's time, then the engine starts its block while the rest's receive sleeps the rest's
  time (engines.specialist.Arriving), then decodes and rebuilds the rest and waits for the block.
Both are timed from the first byte to the first token, in turn, `--repeats` times after a warm-up (medians);
the model beside them is links.ready_ms from the phases of the whole payload's runs (its cache's decode,
rebuild and block; then the suffix and the first token, the same for both). The producer's prefill and
encode are not counted (its cache holds the codes, as for every request on a prefix after the first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from actors.messages import GenParams, pair_id
from engines.producer import ProducerEngine
from engines.specialist import Arriving, SpecialistEngine
from cli.evaluate import positives
from cluster.config import load_config
from scd.data import demo_data, samples
from scd.fitting import exact, structure
from scd.online import codec, links
from scd.online.models import ModelSpec, load


def first_token_ms(engine: SpecialistEngine, prefix: list[int], payload, wait_s: float) -> tuple[float, dict]:
    """(ms from the first byte to the first token, the answer's timings): `wait_s` of link before the engine
    gets `payload` (the whole payload, or an Arriving whose rest waits its own time)."""
    t0 = time.perf_counter()
    time.sleep(wait_s)
    _, info, _ = engine.complete(prefix, [prefix[-1]], payload, None, GenParams(max_tokens=1))
    if info.mode != "scd":
        raise SystemExit(f"the engine fell back ({info.reason}): the payload does not fit the artifact")
    return (time.perf_counter() - t0) * 1e3, info.timings


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--specialist", default="code_few")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--gbps", default="1,10,25,100")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    gbps = positives(args.gbps, "--gbps", float)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be positive, got {args.repeats}")
    cfg = load_config(args.config)
    try:
        spec_cfg = cfg.specialist(args.specialist)
    except (KeyError, ValueError):
        raise SystemExit(f"{args.config} has no specialist {args.specialist!r}") from None
    producer_model, tok, _ = load(cfg.producer.path)
    model, _, _ = load(spec_cfg.path, base=spec_cfg.base)
    found = structure.find(producer_model, model, spec_cfg.path)
    if not found.has_entry:
        raise SystemExit(f"{args.specialist}: {found.describe()}: no block to start early")
    pair = pair_id(cfg.producer.name, args.specialist)
    spec = ModelSpec.from_config(producer_model.config)
    art = exact.artifact(pair, spec, found.first_adapted, "bf16")
    text = "\n\n".join(demo_data.prose_texts("heldout"))
    prefix = samples.lm_samples(tok, [text], 1, args.tokens, 1, seed=5)[0].prefix.tolist()
    cache = 1 << 30
    parts = ProducerEngine(producer_model, tok, {pair: (art, "v1")}, cache).encode(prefix, [pair]).per_pair[pair].payload
    whole = ProducerEngine(producer_model, tok, {pair: (art, "v1")}, cache, e_first=False).encode(
        prefix, [pair]).per_pair[pair].payload
    engine = SpecialistEngine(args.specialist, model, tok, art, "v1")
    print(f"{pair}: {found.describe()}; {len(prefix)} tokens, payload {len(whole) / 1e6:.2f} MB whole, "
          f"entry part {len(parts.entry) / 1e6:.2f} MB + rest {len(parts.rest) / 1e6:.2f} MB")
    rows = []
    with torch.no_grad():
        for g in gbps:
            wait = lambda n: links.transfer_ms(n, g) / 1e3                       # noqa: E731
            runs = {"whole": [], "e_first": []}
            parts_ms = {"cache": [], "block": [], "after": []}
            for i in range(args.repeats + 1):                                     # the first round warms up
                w, tw = first_token_ms(engine, prefix, whole, wait(len(whole)))
                rest = lambda: (time.sleep(wait(len(parts.rest))), (parts.rest, None, 0.0))[1]   # noqa: E731
                e, te = first_token_ms(engine, prefix, Arriving(parts.entry, rest), wait(len(parts.entry)))
                if i:
                    runs["whole"].append(w)
                    runs["e_first"].append(e)
                    cache = sum(tw.get(k, 0.0) for k in ("decode", "rebuild", "patch", "recompute"))
                    parts_ms["cache"].append(cache)                     # the whole payload's, in order
                    parts_ms["block"].append(tw["recompute"])
                    parts_ms["after"].append(tw["first_token"] - cache)  # the suffix and the first token
            med = {k: statistics.median(v) for k, v in {**runs, **parts_ms}.items()}
            row = {"gbps": g, "whole_ms": med["whole"], "e_first_ms": med["e_first"],
                   "speedup": med["whole"] / med["e_first"],
                   "modeled_whole_ms": links.ready_ms(len(whole), med["cache"], g) + med["after"],
                   "modeled_e_first_ms": links.ready_ms(len(parts), med["cache"], g, len(parts.entry), med["block"])
                   + med["after"], "cache_ms": med["cache"], "block_ms": med["block"], "after_ms": med["after"]}
            rows.append(row)
            print(f"{g:>7g} Gbps  whole {row['whole_ms']:8.1f} ms  E-first {row['e_first_ms']:8.1f} ms  "
                  f"({row['speedup']:.2f}x)   modeled {row['modeled_whole_ms']:8.1f} / {row['modeled_e_first_ms']:8.1f}")
    out = {"pair": pair, "tokens": len(prefix), "entry": found.first_adapted, "payload_bytes": len(whole),
           "entry_bytes": len(parts.entry), "rest_bytes": len(parts.rest), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
