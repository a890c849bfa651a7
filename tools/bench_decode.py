"""Tokens per second of the serving engines' decode loop at several batch sizes, side by side in one run.

    python -m tools.bench_decode [--batches 1,4,8,16] [--tokens 32] [--lengths 64,160,320,512] [--repeats 3]

The specialist (default: the demo family's qa) decodes `--tokens` tokens for each of B requests at once through
`scd.online.decode.Decoder` (continuous batching, one forward pass per step for every running row). Each request
starts from its own prefix cache, the prefix lengths cycling through --lengths (mixed lengths: the batch is
left-padded). The caches are rebuilt from codes when the pair has a published artifact in --store (encoded by
the producer, through the wire format on the device, rebuilt by the specialist); otherwise prefilled (a decode step does not
know the difference). Only the decode loop is timed; rounds of all batch sizes run in turn, medians reported.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cli.evaluate import positives
from scd.online import codec
from scd.online.cache import assemble, extend
from scd.online.decode import Decoder, GenParams, Row
from scd.online.models import load
from scd.online.rebuild import encode, rebuild
from scd.online.trace import capture

REPO = Path(__file__).resolve().parents[1]


def prefix_rows(producer, consumer, art, lengths: list[int], n: int, vocab: int, seed: int = 0) -> list[tuple]:
    """n (keys, values, first-token logits) for prefixes cycling through `lengths`, rebuilt from codes when
    `art` is given, else prefilled by the consumer."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(2, vocab, (1, lengths[i % len(lengths)]), generator=g).to(consumer.device)
        mask = torch.ones_like(ids)
        if art is not None:
            payload = codec.encode_wire(encode(art, capture(producer, ids), ids), art.pair, "bench",
                                        codec.artifact_dims(art), art.code_dtype)
            codes = codec.decode(payload, art.pair, "bench", art.payload_plan, codec.artifact_dims(art), art.x_codes)
            kv, _ = rebuild(consumer, art, codes)
        else:
            tr = capture(consumer, ids, mask, want_xnorm=False)
            kv = list(zip(tr.keys, tr.values))
        cache = assemble(consumer, kv)
        logits, _ = extend(consumer, cache, mask, ids[:, -1:])       # one suffix token: the first next-token logits
        rows.append(([l.keys for l in cache.layers], [l.values for l in cache.layers], logits[0, -1]))
    return rows


def decode_seconds(model, rows: list[tuple], batch: int, tokens: int) -> float:
    """Wall time of decoding `tokens` tokens for each of `batch` rows at once."""
    dec = Decoder(model, eos_id=None, max_batch=batch)
    for keys, values, logits in rows[:batch]:
        dec.waiting.append(Row(list(keys), list(values), logits, GenParams(max_tokens=tokens, ignore_eos=True),
                               lambda _t, _lp: True, lambda _f, _n: None))
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while dec.busy():
        dec.admit()
        dec.step()
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--producer", default=str(REPO / "demo_models" / "base"))
    ap.add_argument("--specialist", default=str(REPO / "demo_models" / "qa"))
    ap.add_argument("--pair", default="base:qa", help="the artifact in --store to rebuild with")
    ap.add_argument("--store", default=str(Path.home() / ".scd" / "artifacts"))
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--lengths", default="64,160,320,512", help="prefix lengths, cycled over the rows")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    batches, lengths = positives(args.batches, "--batches"), positives(args.lengths, "--lengths")
    if args.tokens < 1 or args.repeats < 1:
        raise SystemExit("--tokens and --repeats must be positive")
    producer, consumer = load(args.producer)[0].to(args.device), load(args.specialist)[0].to(args.device)
    art, source = None, "prefilled (no published artifact for the pair in --store)"
    try:
        from artifacts_store import ArtifactStore
        art, manifest = ArtifactStore(args.store).load(f"{args.pair}@latest")
        art = art.to(args.device)
        source = f"rebuilt from codes ({args.pair}@{manifest.version})"
    except Exception as e:                                      # noqa: BLE001 - any missing store or pair
        print(f"no artifact ({type(e).__name__}: {e}); caches are prefilled")
    with torch.no_grad():
        rows = prefix_rows(producer, consumer, art, lengths, max(batches), consumer.config.vocab_size)
        for b in batches:                                           # warm-up
            decode_seconds(consumer, rows, b, 2)
        times: dict[int, list[float]] = {b: [] for b in batches}
        for _ in range(args.repeats):
            for b in batches:
                times[b].append(decode_seconds(consumer, rows, b, args.tokens))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} CPU threads"
    print(f"decode loop, {args.specialist}, caches {source}, prefixes {lengths} tokens, {args.tokens} tokens "
          f"each, {where}, medians of {args.repeats}")
    print(f"{'batch':>5} {'tokens/s':>10} {'x batch 1':>10} {'ms/step':>8}")
    out, base = [], None
    for b in batches:
        med = statistics.median(times[b])
        tps = b * args.tokens / med
        base = base or tps
        out.append({"batch": b, "tokens_per_s": round(tps, 1), "vs_batch_1": round(tps / base, 2),
                    "ms_per_step": round(med / args.tokens * 1e3, 2)})
        print(f"{b:5d} {tps:10.1f} {tps / base:10.2f} {med / args.tokens * 1e3:8.2f}")
    return out


if __name__ == "__main__":
    main()
