"""Selective recompute in chunks against one pass over every column, side by side on one prefix: wall time
and counted multiply-adds (`selective.cost`), and the consumer's own prefill for scale.

    python -m tools.bench_selective_chunks [--config configs/smollm2.yaml] [--pair smollm2:code]
                                           [--tokens 2048] [--fraction 0.35] [--repeats 2]

The positions are the attention rule's over the producer's raw KV of one random-token prefix. A benchmark,
not a test.
"""
from __future__ import annotations

import argparse
import time

import torch

from scd.online import selective
from scd.online.cache import cache_of


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tools.bench_selective_chunks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--pair", default="smollm2:code", help="PRODUCER:CONSUMER of the config")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--fraction", type=float, default=0.35)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.tokens < 2 or not 0 < args.fraction <= 1 or args.repeats < 1:
        raise SystemExit("--tokens >= 2, --fraction in (0, 1], --repeats >= 1")
    from tools.pairs import config_pair
    _, _, producer, consumer, _, _ = config_pair(args.config, args.pair)
    t = args.tokens
    ids = torch.randint(100, consumer.config.vocab_size - 100, (1, t), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, t, dtype=torch.long)
    with torch.no_grad():
        out = producer(input_ids=ids, attention_mask=mask, use_cache=True)
        kv = [(lay.keys, lay.values) for lay in cache_of(out).layers]
    sel = selective.attention(consumer, kv, ids, mask, args.fraction)
    print(f"{args.pair}, {t} tokens, {sel.shape[1]} positions (the attention rule at {args.fraction:g})")
    for chunk in [t + sel.shape[1], selective.CHUNK] * args.repeats:          # alternated: one pass, chunks
        t0 = time.perf_counter()
        selective.recompute_tokens(consumer, kv, ids, mask, sel, chunk=chunk)
        counted = selective.cost(consumer.config, t, sel.shape[1], columns=sel[0].tolist(), chunk=chunk)
        what = "one pass" if chunk > t else f"chunks of {chunk}"
        print(f"  {what:16s} {time.perf_counter() - t0:6.2f} s   counted {counted:.3f} of a prefill")
    t0 = time.perf_counter()
    with torch.no_grad():
        consumer(input_ids=ids, attention_mask=mask)
    print(f"  {'own prefill':16s} {time.perf_counter() - t0:6.2f} s")


if __name__ == "__main__":
    main()
