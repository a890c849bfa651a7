"""The request path against Serve's floor, side by side in one run on one machine.

    python -m tools.bench_overhead [--config ray_config.yaml] [--model qa] [--n 200] [--prefix-tokens N]
                                   [--computing-floor]

Ours: one-token completions (`max_tokens: 1`) of one specialist through the deployed app, the prefix's codes
already in the producer's cache (the demo's prefix, or with --prefix-tokens one of about N tokens, padded as `scd
loadtest --prefix-tokens` pads them: what the path does per prefix token shows there). The floor: a bare Serve app
of our shape, each step returning at once: a FastAPI ingress, one actor call (the producer), one handle call (the
specialist replica), one actor call from the replica (its engine actor). A third app is the floor whose engine
actor waits as long as our model work takes (the median of ours in the warm-up) before it answers: every process
on the path then waits as long as ours do, and waking from such a wait costs more than answering at once (on this
2-core VM, ~1 ms per waiting process). With --computing-floor a fourth app's engine actor computes (matmuls on
the host) for as long instead: on a machine whose cores our model work fills, what the busy cores alone cost
the other processes on the path. All of them are asked over one keep-alive HTTP connection, in interleaved
blocks of 10, after a warm-up. Reported: medians of the floors, of ours, of ours less the model work its answer
reports (`serve_app.schemas.model_compute_ms`), the differences, and where each went (`overhead_parts_ms`).
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
from cli import loadtest
from cli.demo import demo_prompts, usable
from cluster.config import load_config
from scd.data.samples import domain
from serve_app.schemas import model_compute_ms, overhead_parts_ms

floor_api = FastAPI()


@ray.remote(num_cpus=0)
class Instant:
    """Stands in for the producer and for an engine actor: answers at once, or after `wait_ms`."""

    def call(self, x, wait_ms: float = 0.0, compute: bool = False):
        """x, after waiting `wait_ms` (asleep, or with `compute` computing on the host's cores all along)."""
        if compute:
            import torch
            a, end = torch.randn(256, 256), time.perf_counter() + wait_ms / 1e3
            while time.perf_counter() < end:
                a @ a
        elif wait_ms:
            time.sleep(wait_ms / 1e3)
        return x


@serve.deployment(ray_actor_options={"num_cpus": 0})
class FloorReplica:
    def __init__(self):
        self.engine = Instant.remote()

    async def generate(self, x, wait_ms: float, compute: bool):
        t0 = time.perf_counter()
        await self.engine.call.remote(x, wait_ms, compute)
        return {"replica": (time.perf_counter() - t0) * 1e3, "engine": wait_ms, "total": wait_ms}


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
        t = await self.replica.generate.remote(codes, float(body.get("wait_ms", 0.0)), bool(body.get("compute")))
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


def measure(url: str, body: dict, n: int, block: int = 10, computing: bool = False) -> dict:
    """Medians of ours, the floor and the floor that waits (and, `computing`, the one that computes); their
    parts."""
    client = Client(url)
    warm = [client.post("/v1/completions", body)[1]["scd"] for _ in range(3 * block)]   # codes cached, links open
    wait_ms = statistics.median(model_compute_ms([x]) for x in warm)
    apps = {"ours": ("/v1/completions", body), "floor": ("/floor/v1/completions", body),
            "floor_waiting": ("/floor/v1/completions", {**body, "wait_ms": wait_ms})}
    if computing:
        apps["floor_computing"] = ("/floor/v1/completions", {**body, "wait_ms": wait_ms, "compute": True})
    for path, b in apps.values():
        client.post(path, b)
    latency = {k: [] for k in apps}
    overhead = {k: [] for k in apps}
    parts = {k: [] for k in apps}
    modes = set()
    for _ in range(max(1, n // block)):
        for name, (path, b) in apps.items():
            for _ in range(block):
                ms, out = client.post(path, b)
                scd = out["scd"]
                if name == "ours":
                    modes.add(scd["mode"])
                work = model_compute_ms([scd]) if name == "ours" else scd["timings_ms"]["total"]
                latency[name].append(ms)
                overhead[name].append(ms - work)
                parts[name].append(overhead_parts_ms(ms, scd))
    med = statistics.median
    r = {"n": len(latency["ours"]), "modes": sorted(modes), "model_work_ms": round(wait_ms, 2)}
    for k in apps:
        r[k] = {"ms": round(med(latency[k]), 2), "less_work_ms": round(med(overhead[k]), 2),
                "parts_ms": {p: round(med(x[p] for x in parts[k]), 2) for p in parts[k][0]}}
    for k in apps:                                   # over_floor_ms, over_floor_waiting_ms, ...
        if k != "ours":
            r[f"over_{k}_ms"] = round(r["ours"]["less_work_ms"] - r[k]["less_work_ms"], 2)
    return r


def main(argv: list[str] | None = None) -> dict:
    from pathlib import Path
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "ray_config.yaml"))
    ap.add_argument("--model", default=None, help="the specialist (default: the config's first)")
    ap.add_argument("--n", type=int, default=200, help="requests to each app")
    ap.add_argument("--prefix-tokens", type=int, default=0, metavar="N",
                    help="a prefix of about N tokens (default: the demo's)")
    ap.add_argument("--computing-floor", action="store_true",
                    help="also a floor whose engine actor computes on the host as long as our model work")
    args = ap.parse_args(argv)
    if args.prefix_tokens < 0:
        ap.error("--prefix-tokens must be >= 0")
    cfg = load_config(args.config)
    name = args.model or cfg.specialists[0].name
    if name not in {s.name for s in cfg.specialists}:
        raise SystemExit(f"--model {name!r} is not a specialist of {args.config}")
    from artifacts_store import ArtifactStore
    if not usable(ArtifactStore(cfg.artifacts.uri), pair_id(cfg.producer.name, name)):
        raise SystemExit(f"{name} has no published artifact in {cfg.artifacts.uri}: run `make demo` once first")
    from scd.online.model_files import load_tokenizer
    from serve_app.app import deploy, undeploy, wait_healthy
    tok = load_tokenizer(cfg.producer.path)
    if args.prefix_tokens:
        prefix, suffix = loadtest.prompt(0, loadtest.Shape(prefix_tokens=args.prefix_tokens))
    else:
        prefix, suffixes = demo_prompts(tok)
        suffix = suffixes.get(domain(name), "\nThe")
    body = {"model": name, "prefix": prefix, "prompt": suffix, "max_tokens": 1}
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or 8, include_dashboard=False, namespace=cfg.ray.namespace,
             log_to_driver=False)
    try:
        deploy(cfg)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        wait_healthy(url)
        serve.run(FloorRouter.bind(FloorReplica.bind()), name="floor", route_prefix="/floor")
        r = measure(url, body, args.n, computing=args.computing_floor)
    finally:
        undeploy(cfg)
        ray.shutdown()
    n_prefix = len(tok(prefix, add_special_tokens=False)["input_ids"])
    print(f"one-token completions of {name} after a prefix of {n_prefix} tokens ({r['n']} each, medians, "
          f"modes {r['modes']}, model work {r['model_work_ms']} ms):")
    floors = {"floor": "floor (bare Serve app of our shape)",
              "floor_waiting": "floor waiting as long as our model work",
              "floor_computing": "floor computing as long as our model work"}
    apps = [k for k in (*floors, "ours") if k in r]
    for k in apps:
        print(f"  {floors.get(k, k):42s} {r[k]['ms']:7.2f} ms, less model work {r[k]['less_work_ms']:7.2f} ms")
    over = {"floor": "the floor", "floor_waiting": "the waiting floor", "floor_computing": "the computing floor"}
    print("  ours over " + "; over ".join(f"{over[k]}: +{r[f'over_{k}_ms']:.2f} ms" for k in floors if k in r))
    for k in apps:
        print(f"  where {k} went: " + ", ".join(f"{p} {v}" for p, v in r[k]["parts_ms"].items()))
    return r


if __name__ == "__main__":
    main()
