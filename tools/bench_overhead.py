"""The request path against Serve's floor, side by side in one run on one machine.

    python -m tools.bench_overhead [--config ray_config.yaml] [--model qa] [--n 200]

Ours: one-token completions (`max_tokens: 1`) of one specialist through the deployed app, the prefix's codes
already in the producer's cache. The floor: a bare Serve app of our shape, each step returning at once: a
FastAPI ingress, one actor call (the producer), one handle call (the specialist replica), one actor call from
the replica (its engine actor). Both are asked over one keep-alive HTTP connection, in interleaved blocks of 10,
after a warm-up. Reported: medians of the floor, of ours, of ours less the model work its answer reports
(`serve_app.schemas.model_compute_ms`), their difference, and where ours went (`overhead_parts_ms`).
Needs the config's pairs calibrated (`make demo` does it once).
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlparse

import ray
from fastapi import FastAPI
from ray import serve

from actors.messages import pair_id
from cli.demo import demo_prompts, usable
from cluster.config import load_config
from scd.data.samples import domain
from serve_app.schemas import model_compute_ms, overhead_parts_ms

floor_api = FastAPI()


@ray.remote(num_cpus=0)
class Instant:
    """Stands in for the producer and for an engine actor: answers at once."""

    def call(self, x):
        return x


@serve.deployment(ray_actor_options={"num_cpus": 0})
class FloorReplica:
    def __init__(self):
        self.engine = Instant.remote()

    async def generate(self, x):
        t0 = time.perf_counter()
        await self.engine.call.remote(x)
        return {"replica": (time.perf_counter() - t0) * 1e3, "engine": 0.0, "total": 0.0}


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(floor_api)
class FloorRouter:
    def __init__(self, replica):
        self.replica, self.producer = replica, Instant.remote()

    @floor_api.post("/v1/completions")
    async def completions(self, body: dict) -> dict:
        t0 = time.perf_counter()
        codes = await self.producer.call.remote(body.get("prefix"))
        t1 = time.perf_counter()
        t = await self.replica.generate.remote(codes)
        t.update(producer_call=(t1 - t0) * 1e3, specialist_call=(time.perf_counter() - t1) * 1e3)
        return {"scd": {"mode": "floor", "timings_ms": t}}


class Client:
    """One keep-alive HTTP connection; post() -> (latency ms, JSON answer)."""

    def __init__(self, url: str):
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)

    def post(self, path: str, body: dict) -> tuple[float, dict]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        out = r.read()
        ms = (time.perf_counter() - t0) * 1e3
        if r.status != 200:
            raise SystemExit(f"{path} answered {r.status}: {out[:300]!r}")
        return ms, json.loads(out)


def measure(url: str, body: dict, n: int, block: int = 10) -> dict:
    client = Client(url)
    for _ in range(block):                                      # warm-up: codes cached, connections open
        client.post("/v1/completions", body)
        client.post("/floor/v1/completions", body)
    floor, ours, overhead, parts, floor_parts, modes = [], [], [], [], [], set()
    for _ in range(max(1, n // block)):
        for _ in range(block):
            ms, out = client.post("/v1/completions", body)
            scd = out["scd"]
            modes.add(scd["mode"])
            ours.append(ms)
            overhead.append(ms - model_compute_ms([scd]))
            parts.append(overhead_parts_ms(ms, scd))
        for _ in range(block):
            ms, out = client.post("/floor/v1/completions", body)
            floor.append(ms)
            floor_parts.append(overhead_parts_ms(ms, out["scd"]))
    med = statistics.median
    return {"n": len(ours), "modes": sorted(modes), "floor_ms": round(med(floor), 2), "ours_ms": round(med(ours), 2),
            "ours_overhead_ms": round(med(overhead), 2), "over_floor_ms": round(med(overhead) - med(floor), 2),
            "parts_ms": {k: round(med(p[k] for p in parts), 2) for k in parts[0]},
            "floor_parts_ms": {k: round(med(p[k] for p in floor_parts), 2) for k in floor_parts[0]}}


def main(argv: list[str] | None = None) -> dict:
    from pathlib import Path
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "ray_config.yaml"))
    ap.add_argument("--model", default=None, help="the specialist (default: the config's first)")
    ap.add_argument("--n", type=int, default=200, help="requests to each app")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    name = args.model or cfg.specialists[0].name
    if name not in {s.name for s in cfg.specialists}:
        raise SystemExit(f"--model {name!r} is not a specialist of {args.config}")
    from artifacts_store import ArtifactStore
    if not usable(ArtifactStore(cfg.artifacts.uri), pair_id(cfg.producer.name, name)):
        raise SystemExit(f"{name} has no published artifact in {cfg.artifacts.uri}: run `make demo` once first")
    from transformers import AutoTokenizer

    from serve_app.app import deploy, undeploy, wait_healthy
    tok = AutoTokenizer.from_pretrained(cfg.producer.path, local_files_only=True)
    prefix, suffixes = demo_prompts(tok)
    body = {"model": name, "prefix": prefix, "prompt": suffixes.get(domain(name), "\nThe"), "max_tokens": 1}
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or 8, include_dashboard=False, namespace=cfg.ray.namespace,
             log_to_driver=False)
    try:
        deploy(cfg)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        wait_healthy(url)
        serve.run(FloorRouter.bind(FloorReplica.bind()), name="floor", route_prefix="/floor")
        r = measure(url, body, args.n)
    finally:
        undeploy(cfg)
        ray.shutdown()
    print(f"one-token completions of {name} ({r['n']} each, medians, modes {r['modes']}):\n"
          f"  floor (bare Serve app of our shape)  {r['floor_ms']:7.2f} ms\n"
          f"  ours                                 {r['ours_ms']:7.2f} ms\n"
          f"  ours less its model work             {r['ours_overhead_ms']:7.2f} ms   "
          f"(+{r['over_floor_ms']:.2f} ms over the floor)\n"
          f"  where ours went:      " + ", ".join(f"{k} {v}" for k, v in r["parts_ms"].items()) + "\n"
          f"  where the floor went: " + ", ".join(f"{k} {v}" for k, v in r["floor_parts_ms"].items()))
    return r


if __name__ == "__main__":
    main()
