"""Exact mode measured at the serving engines, side by side in one run: equality with the oracle, acceptance,
and the latency of exact answers against the oracle's and lossy SCD's.

    python -m tools.bench_exact [--config ray_config.yaml] [--specialists qa,prose,code] [--equality 70]
                                [--tokens 1024,3584] [--answers 16,64,256] [--prompts 3]

The producer's and the specialists' engines (engines/producer.py, engines/specialist.py: the same code a Serve
replica runs, with its batch decoder) in one process, the pairs' published artifacts from the config's store.
1. Equality: `--equality` held-out samples per specialist (prefixes of 160 tokens), 32 greedy tokens each,
   exact against the oracle (the specialist's own prefill), token for token; drafted and accepted counts, and
   for how many first tokens lossy SCD's greedy answer agrees with the oracle's (the acceptance that drafts
   unlimited by the prefill's time would reach).
2. Latency: for each prefix length in --tokens and answer length in --answers, `--prompts` prompts of that
   length (held-out samples of the specialist's domain; windows of the held-out prose where its texts or
   documents are shorter), each answered as the oracle, as lossy SCD and exactly,
   in turn, after one warm-up (the codes come from the producer's cache: its prefill is not counted). Medians.
   Modeled beside it from the measured parts: oracle = prefill + n steps, SCD = rebuild + n steps, exact =
   max(prefill, rebuild) + verify + (n - accepted - 1) steps, with the accepted counts measured.
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
from engines.specialist import SpecialistEngine
from artifacts_store import ArtifactStore
from cli.evaluate import positives
from cluster.config import load_config
from scd.data import demo_data, samples
from scd.online.models import load

REPO = Path(__file__).resolve().parents[1]


def answer(eng: SpecialistEngine, prefix: list[int], suffix: list[int], payload, reason, params: GenParams,
           exact: bool = False) -> tuple[object, float]:
    """(ServedInfo, wall ms from the request to its last token) of one answer through the engine."""
    t0 = time.perf_counter()
    _, info, _ = eng.complete(prefix, suffix, payload, reason, params, exact=exact)
    return info, (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "ray_config.yaml"))
    ap.add_argument("--specialists", default=None, help="default: every specialist of the config")
    ap.add_argument("--equality", type=int, default=70, help="greedy answers per specialist compared (0: none)")
    ap.add_argument("--tokens", default="1024,3584", help="prefix lengths of the latency runs")
    ap.add_argument("--answers", default="16,64,256", help="answer lengths of the latency runs")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per latency cell")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    names = args.specialists.split(",") if args.specialists else [s.name for s in cfg.specialists]
    tokens, answers = positives(args.tokens, "--tokens"), positives(args.answers, "--answers")
    store = ArtifactStore(cfg.artifacts.uri)
    producer_model, tok, _ = load(cfg.producer.path)
    pairs, engines = {}, {}
    for n in names:
        s = cfg.specialist(n)
        pair = pair_id(cfg.producer.name, n)
        try:
            art, manifest = store.load(f"{pair}@latest")
        except Exception as e:                                    # noqa: BLE001 - any missing artifact
            raise SystemExit(f"{pair} has no published artifact in {cfg.artifacts.uri} ({type(e).__name__}): "
                             "run `make demo` (or calibrate the pair) first") from None
        pairs[pair] = (art, manifest.version)
        model, stok, _ = load(s.path, base=s.base)
        # exact_cache_bytes=0: every exact answer drafts and prefills (a prefix asked again would otherwise be
        # answered from the specialist's own cache of it)
        engines[n] = SpecialistEngine(n, model, stok, art, manifest.version, exact_cache_bytes=0)
    producer = ProducerEngine(producer_model, tok, pairs, cache_bytes=1 << 30)
    text = "\n\n".join(demo_data.prose_texts("heldout"))
    out: dict = {"config": args.config, "equality": {}, "latency": []}
    with torch.no_grad():
        for n, eng in engines.items():
            if not args.equality:
                break
            pair = pair_id(cfg.producer.name, n)
            _, _, held = samples.pair_data(n, tok, 0, 0, args.equality, 160, seed=11)
            same, accepted, drafted, agree = 0, [], [], []
            for smp in held:
                prefix = smp.prefix.tolist()
                suffix = (smp.question if smp.question is not None else smp.cont[:1]).tolist()
                payload = producer.encode(prefix, [pair]).per_pair[pair].payload
                info, _ = answer(eng, prefix, suffix, payload, None, GenParams(max_tokens=32), exact=True)
                oracle, _ = answer(eng, prefix, suffix, None, "oracle", GenParams(max_tokens=32))
                lossy, _ = answer(eng, prefix, suffix, payload, None, GenParams(max_tokens=32))
                same += info.ids == oracle.ids
                agree.append(next((i for i, (x, y) in enumerate(zip(lossy.ids, oracle.ids)) if x != y),
                                  min(len(lossy.ids), len(oracle.ids))))
                if info.exact:
                    accepted.append(info.exact["accepted"])
                    drafted.append(info.exact["drafted"])
            out["equality"][n] = {"answers": len(held), "equal": same, "accepted": accepted, "drafted": drafted,
                                  "lossy_agrees_for": agree}
            print(f"{n}: {same} of {len(held)} greedy exact answers equal the oracle's token for token; accepted "
                  f"drafts median {statistics.median(accepted) if accepted else '-'} of drafted "
                  f"{statistics.median(drafted) if drafted else '-'}; lossy SCD's greedy answer agrees with the "
                  f"oracle's for its first {statistics.median(agree)} tokens (median; what unlimited drafts could reach)")
        for n, eng in engines.items():
            pair = pair_id(cfg.producer.name, n)
            for t in tokens:
                try:                     # the specialist's held-out domain: what its drafts are accepted on
                    _, _, prompts = samples.pair_data(n, tok, 0, 0, args.prompts, t, 1, seed=5)
                except ValueError:       # its texts hold no window this long
                    prompts = []
                if not prompts or min(len(p.prefix) for p in prompts) < 0.9 * t:     # (QA documents stay short)
                    prompts = samples.lm_samples(tok, [text], args.prompts, t, 1, seed=5)   # the held-out prose
                for a in answers:
                    params = GenParams(max_tokens=a, ignore_eos=True)
                    ms = {"oracle": [], "scd": [], "exact": []}
                    parts = {"prefill": [], "rebuild": [], "step": [], "verify": [], "accepted": [], "drafted": []}
                    for i, smp in enumerate(prompts):
                        prefix = smp.prefix.tolist()
                        suffix = (smp.question if smp.question is not None else smp.cont[:1]).tolist()
                        payload = producer.encode(prefix, [pair]).per_pair[pair].payload
                        runs = [("oracle", None, "oracle", False), ("scd", payload, None, False),
                                ("exact", payload, None, True)]
                        if i == 0:                                        # warm-up
                            for _, p, r, e in runs:
                                answer(eng, prefix, suffix, p, r, GenParams(max_tokens=2, ignore_eos=True), e)
                        for kind, p, r, e in runs:
                            info, wall = answer(eng, prefix, suffix, p, r, params, e)
                            ms[kind].append(wall)
                            tm = info.timings
                            if kind == "oracle":
                                parts["prefill"].append(tm["prefill"])
                            elif kind == "scd":
                                parts["rebuild"].append(tm.get("decode", 0) + tm["rebuild"] + tm.get("patch", 0)
                                                        + tm.get("recompute", 0))
                                parts["step"].append((tm["total"] - tm["first_token"]) / max(1, a - 1))
                            else:
                                parts["verify"].append(tm["verify"])
                                parts["accepted"].append(info.exact["accepted"])
                                parts["drafted"].append(info.exact["drafted"])
                    med = {k: statistics.median(v) for k, v in parts.items()}
                    model = {"oracle": med["prefill"] + a * med["step"], "scd": med["rebuild"] + a * med["step"],
                             "exact": max(med["prefill"], med["rebuild"]) + med["verify"]
                             + max(0.0, a - med["accepted"] - 1) * med["step"]}
                    row = {"specialist": n, "prefix_tokens": round(statistics.median(len(p.prefix) for p in prompts)),
                           "answer_tokens": a,
                           "measured_ms": {k: round(statistics.median(v), 1) for k, v in ms.items()},
                           "modeled_ms": {k: round(v, 1) for k, v in model.items()},
                           "parts_ms": {k: round(v, 2) for k, v in med.items() if k not in ("accepted", "drafted")},
                           "accepted": parts["accepted"], "drafted": parts["drafted"]}
                    out["latency"].append(row)
                    m, mo = row["measured_ms"], row["modeled_ms"]
                    print(f"{n} prefix {row['prefix_tokens']} answer {a}: oracle {m['oracle']:.0f} ms (model {mo['oracle']:.0f}), "
                          f"scd {m['scd']:.0f} ({mo['scd']:.0f}), exact {m['exact']:.0f} ({mo['exact']:.0f}); "
                          f"accepted {parts['accepted']} of drafted {parts['drafted']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
