"""Throughput with 1 and with N producers on a prefix-heavy mix, in one run on one machine.

    python -m tools.bench_producers [--config ray_config.yaml] [--producers 1,2] [--requests 240]
                                    [--concurrency 8] [--prefixes 40] [--prefix-tokens 512] [--autoscale MAX]

For each pool size the config's app is deployed on an embedded Ray cluster with `producer.replicas` set to it,
and `scd loadtest`'s requests (completions, request i asking prefix number i % prefixes, so each prefix comes
back requests / prefixes times) run against it; then it is taken down. Reported per pool size: requests/s,
latency p50 / p99, the producers' prefills and prefix cache hits (from /healthz: prefills per request, hit
rate) and how the requests split over the producers. On 2 cores a second producer adds no compute, so the
hit rate and prefills per request say more than the speed; on a machine with a core (or GPU) per producer
the speed ratio is the figure. Needs the config's pairs calibrated (`make demo` does it once).

`--autoscale MAX` instead runs the load once on a pool that autoscales between 1 and MAX producers
(target_busy 0.5, upscale after 2 s, downscale after 10 s) and prints its size second by second, during the
load and for 20 s after, with the pool's scaling events.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli import loadtest
from cluster.config import DeploymentConfig, load_config

REPO = Path(__file__).resolve().parents[1]


def counters(url: str) -> dict[str, dict]:
    from serve_app.app import health_report
    return {n: {"prefills": p.get("prefills", 0), "cache_hits": p.get("cache_hits", 0), "routed": p.get("routed", 0)}
            for n, p in (health_report(url) or {}).get("producers", {}).items()}


def one(cfg: DeploymentConfig, n: int, args) -> dict:
    """Deploy with n producers, run the load, take it down; the figures."""
    from actors.producer_pool import stop_pool
    from ray import serve
    from serve_app.app import deploy, wait_healthy
    cfg = cfg.model_copy(update={"producer": cfg.producer.model_copy(update={"replicas": n, "autoscaling": None})})
    deploy(cfg)
    url = f"http://{cfg.http.host}:{cfg.http.port}"
    try:
        if not wait_healthy(url, 300):
            raise SystemExit(f"the app with {n} producers did not come up")
        client = loadtest.Client(url, None, 120.0)
        models = [s.name for s in cfg.specialists]
        kinds = loadtest.plan(args.requests, loadtest.parse_mix("completions=1"))
        before = counters(url)
        results, _, wall, _ = loadtest.run(client, models, kinds, args.concurrency, None, None,
                                           loadtest.Shape(args.prefix_tokens, args.prefixes))
        after = counters(url)
    finally:
        serve.shutdown()
        stop_pool(cfg.ray.namespace)
    ok = [r for r in results if r.outcome == "ok"]
    d = {k: {m: after[k][m] - before.get(k, {}).get(m, 0) for m in after[k]} for k in after}
    prefills, hits = sum(x["prefills"] for x in d.values()), sum(x["cache_hits"] for x in d.values())
    return {"producers": n, "ok": len(ok), "errors": len(results) - len(ok), "wall_s": round(wall, 2),
            "requests_per_s": round(len(results) / wall, 2),
            "latency_ms": loadtest.percentiles([r.done - r.issued for r in ok]),
            "prefills": prefills, "cache_hits": hits, "prefills_per_request": round(prefills / len(results), 3),
            "hit_rate": round(hits / (hits + prefills), 3) if hits + prefills else None,
            "routed": {k: x["routed"] for k, x in d.items()},
            "modes": {m: sum(m in r.modes for r in ok) for m in {m for r in ok for m in r.modes}}}


def autoscaled(cfg: DeploymentConfig, most: int, args) -> dict:
    """The load on an autoscaling pool; its size every second and its events."""
    import threading
    import time

    import ray
    from ray import serve

    from actors.producer_pool import POOL_NAME, stop_pool
    from cluster.config import ProducerAutoscaling
    from serve_app.app import deploy, wait_healthy
    scaling = ProducerAutoscaling(min_replicas=1, max_replicas=most, target_busy=0.5, upscale_delay_s=2,
                                  downscale_delay_s=10)
    cfg = cfg.model_copy(update={"producer": cfg.producer.model_copy(update={"replicas": 1, "autoscaling": scaling})})
    deploy(cfg)
    url = f"http://{cfg.http.host}:{cfg.http.port}"
    timeline, done = [], threading.Event()
    try:
        if not wait_healthy(url, 300):
            raise SystemExit("the autoscaling app did not come up")
        pool, t0 = ray.get_actor(POOL_NAME, namespace=cfg.ray.namespace), time.monotonic()

        def sample():
            while not done.is_set():
                st = ray.get(pool.status.remote())
                timeline.append((round(time.monotonic() - t0), len(st["live"]),
                                 round(sum(x.get("busy", 0) for x in st["load"].values()), 2)))
                time.sleep(1)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results, _, wall, _ = loadtest.run(loadtest.Client(url, None, 120.0), [s.name for s in cfg.specialists],
                                           loadtest.plan(args.requests, loadtest.parse_mix("completions=1")),
                                           args.concurrency, None, None,
                                           loadtest.Shape(args.prefix_tokens, args.prefixes))
        load_s = time.monotonic() - t0
        time.sleep(20)
        done.set()
        sampler.join()
        events = ray.get(pool.status.remote())["events"]
    finally:
        serve.shutdown()
        stop_pool(cfg.ray.namespace)
    return {"load_s": round(load_s, 1), "ok": sum(r.outcome == "ok" for r in results), "requests": len(results),
            "timeline": timeline, "events": [e["what"] for e in events]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "ray_config.yaml"))
    ap.add_argument("--producers", default="1,2", help="pool sizes, in order (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefixes", type=int, default=40, help="distinct prefixes (default: %(default)s)")
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--autoscale", type=int, default=0, metavar="MAX",
                    help="run once on a pool autoscaling between 1 and MAX producers and print its size over time")
    args = ap.parse_args(argv)
    import ray
    cfg = load_config(args.config)
    sizes = [int(x) for x in args.producers.split(",")]
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or 8, include_dashboard=False,
             namespace=cfg.ray.namespace, log_to_driver=False)
    try:
        if args.autoscale:
            r = autoscaled(cfg, args.autoscale, args)
        else:
            rows = [one(cfg, n, args) for n in sizes]
    finally:
        ray.shutdown()
    if args.autoscale:
        print(f"{r['ok']} of {r['requests']} ok; load over after {r['load_s']} s. Producers (and their summed busy) "
              f"each second:", file=sys.stderr)
        print("  " + " ".join(f"{t}s:{n}({b})" for t, n, b in r["timeline"]), file=sys.stderr)
        print("  events: " + "; ".join(r["events"]), file=sys.stderr)
        print(json.dumps(r))
        return [r]
    print(f"{args.requests} completions at {args.concurrency} concurrent, {args.prefixes} prefixes of about "
          f"{args.prefix_tokens} tokens:", file=sys.stderr)
    print(f"{'producers':>9} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'prefills':>8} {'hit rate':>8} "
          f"{'prefills/req':>12}  requests per producer", file=sys.stderr)
    for r in rows:
        print(f"{r['producers']:>9} {r['requests_per_s']:>7} {r['latency_ms']['p50']:>8} {r['latency_ms']['p99']:>8} "
              f"{r['prefills']:>8} {r['hit_rate']:>8} {r['prefills_per_request']:>12}  {r['routed']}", file=sys.stderr)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
