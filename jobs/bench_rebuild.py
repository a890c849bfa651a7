"""`scd bench`: consumer-side cost of SCD vs the consumer's own prefill, measured side by side.

For a prefix of --tokens tokens, alternates (prefill, decode+rebuild) --repeats times in one process and
reports medians and their ratio. The codes come from the pair's calibrated artifact (the one `scd eval`
keeps under --work-dir; calibrated on the spot if missing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from jobs import demo_data
from jobs.evaluate import add_pair_args, calibrated, parse, resolve_pair
from scd.online import codec
from scd.online.models import load_pair
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture


@torch.no_grad()
def bench(producer, consumer, art, ids: torch.Tensor, repeats: int, dtype: str | None = None) -> dict:
    mask = torch.ones_like(ids)
    dims = codec.artifact_dims(art)
    payload = codec.encode(encode(art, capture(producer, ids, mask), ids), art.pair, "bench", dims, dtype or art.code_dtype)
    prefill, consumer_side, phases = [], [], []
    for _ in range(repeats + 1):                       # first round warms up both paths
        t0 = time.perf_counter()
        consumer(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)   # the prefix's cache
        t1 = time.perf_counter()
        codes = codec.decode(payload, art.pair, "bench", art.plan, dims)
        t2 = time.perf_counter()
        _, ph = rebuild(consumer, art, codes)
        t3 = time.perf_counter()
        prefill.append((t1 - t0) * 1e3)
        consumer_side.append((t3 - t1) * 1e3)
        phases.append({"decode_ms": (t2 - t1) * 1e3, **ph})
    prefill, consumer_side, phases = prefill[1:], consumer_side[1:], phases[1:]
    med = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    pf, cs = statistics.median(prefill), statistics.median(consumer_side)
    return {"tokens": ids.shape[1], "repeats": repeats, "prefill_ms": pf, "consumer_ms": cs, "ratio": cs / pf,
            "payload_bytes": len(payload), "plan": art.plan, **med}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"--tokens takes integers separated by commas, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise SystemExit(f"--tokens must be positive, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="scd bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p)
    p.add_argument("--tokens", default="1024", help="prefix length(s), e.g. 1024,2048,4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", choices=codec.DTYPES, help="code precision (default: the artifact's)")
    p.add_argument("--work-dir", default="runs/eval")
    p.add_argument("--json", action="store_true")
    args = parse(p, argv)
    args.tokens = _sizes(args.tokens)
    pa, pb, na, nb = resolve_pair(args)
    producer, consumer, tok, spec = load_pair(pa, pb, consumer_base=getattr(args, "consumer_base", None))
    pair = f"{na}:{nb}"
    art = calibrated(args, producer, consumer, spec, tok, pair)
    text = "\n\n".join(demo_data.prose_texts("heldout"))
    all_ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(all_ids) < max(args.tokens):
        raise SystemExit(f"only {len(all_ids)} tokens of text available, asked for {max(args.tokens)}")
    out = []
    for n in args.tokens:
        r = bench(producer, consumer, art, torch.tensor(all_ids[:n])[None], args.repeats, args.dtype)
        out.append(r)
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{pair} at {r['tokens']} tokens, median of {r['repeats']} interleaved runs, plan {r['plan']}:\n"
                  f"  consumer prefill            {r['prefill_ms']:8.2f} ms\n"
                  f"  SCD decode+rebuild+patch    {r['consumer_ms']:8.2f} ms  (codec {r['decode_ms']:.2f}, "
                  f"rebuild {r['rebuild_ms']:.2f}, patch {r['patch_ms']:.2f})\n"
                  f"  ratio                       {r['ratio']:8.3f}\n"
                  f"  payload                     {r['payload_bytes'] / 1024:8.1f} KB", flush=True)
    return out


if __name__ == "__main__":
    main()
