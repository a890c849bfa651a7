"""What one Ray actor call costs with what the request path's messages carry, side by side in one run.

    python -m tools.bench_hops [--tokens 3519] [--n 300]

An async caller actor (as the router and the replicas are) awaits calls to another actor that answers at once,
interleaved in a new order each round, and reports the median round trip of each kind: an empty call; a
prefix's token ids as a list of ints (what the router sends the producer and the replicas), and as 64-bit bytes;
an object reference nested in the arguments (what a ticket to a payload in the object store is, passed on by
router and replica) and in the return value (the producer answering with such a ticket); the ids with
`--tokens` tokens and with 110 (the demo's prefix). What `tools.bench_overhead` reports per hop above its
floor is the sum of such costs.
"""
from __future__ import annotations

import argparse
import array
import random
import statistics
import time

import ray


@ray.remote(num_cpus=0)
class Answerer:
    def __init__(self, payload_bytes: int):
        self.ref = ray.put(b"\0" * payload_bytes)

    def call(self, x):
        return 1

    def ticket(self, x):
        """A ticket holding a reference this actor owns."""
        return {"ref": [self.ref]}


@ray.remote(num_cpus=0)
class Caller:
    async def time(self, answerer, calls: list[tuple[str, str, object]], n: int) -> dict[str, float]:
        """Median ms of each (label, method, argument), the labels' calls interleaved n times, in a new order
        each round (a call's place in a round shifts its time)."""
        out: dict[str, list[float]] = {label: [] for label, _, _ in calls}
        order = random.Random(0)
        for _ in range(n):
            for label, method, arg in order.sample(calls, len(calls)):
                t0 = time.perf_counter()
                await getattr(answerer, method).remote(arg)
                out[label].append((time.perf_counter() - t0) * 1e3)
        return {label: statistics.median(v) for label, v in out.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=3519, help="the long prefix's token count")
    ap.add_argument("--n", type=int, default=300, help="calls of each kind")
    ap.add_argument("--payload-bytes", type=int, default=252_000, help="the referenced object's size")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.n < 1:
        ap.error("--tokens and --n must be >= 1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        answerer, caller = Answerer.remote(args.payload_bytes), Caller.remote()
        ref = ray.put(b"\0" * args.payload_bytes)
        calls = [("empty", "call", 0)]
        for t in (110, args.tokens):
            ids = list(range(t))
            calls += [(f"ids, {t} tokens, list", "call", ids),
                      (f"ids, {t} tokens, bytes", "call", array.array("q", ids).tobytes())]
        calls += [("a reference in the arguments", "call", {"ref": [ref]}),
                  ("a reference in the return value", "ticket", 0)]
        ray.get(caller.time.remote(answerer, calls, 5))                     # warm: workers, connections
        r = ray.get(caller.time.remote(answerer, calls, args.n))
    finally:
        ray.shutdown()
    base = r["empty"]
    print(f"one actor call from an async actor, medians of {args.n} (interleaved):")
    for label, ms in r.items():
        print(f"  {label:36s} {ms:6.3f} ms" + (f"  ({ms - base:+.3f})" if label != "empty" else ""))
    return r


if __name__ == "__main__":
    main()
