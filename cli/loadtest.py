"""`scd loadtest`: N requests at C concurrent against a running SCD Serve service; one JSON line of results.

A benchmark, not a test. The mix of plain completions, streamed completions (SSE) and fan-outs (one prefix,
one item per specialist of `GET /v1/models`) is exact: counts by largest remainder of N x mix, order shuffled
with a fixed seed (0), so two runs send the same requests. Each request ends as one of
  ok     HTTP 200 and a complete body (a stream saw `data: [DONE]`, a fan-out has a result per item)
  error  an HTTP answer other than 200, or a 200 carrying an `error` object or an incomplete body
  lost   no answer: connection refused or dropped, timeout, a stream cut before [DONE]
`status_codes` counts the HTTP status of every request that got one; `modes` counts `scd.mode` (`scd`,
`fallback:<reason>`, `oracle`) of every answered item, each item of a fan-out. `latency_ms` is wall time
over the ok requests, `ttft_ms` time to the first chunk carrying text over the ok streams only (a completion's
or fan-out's time to first token is its latency). `health` polls `/healthz` once a second: [seconds since start,
status or HTTP code] at each change. `--kill-producer-at K` kills one producer of the pool (a crash: Ray
restarts it) when the K-th request is issued, and reports what that cost (`after_kill`): requests in flight,
fallbacks after it, and how long until requests issued after it were served by `scd` again.
`first_token_ms` is time to first token over every ok request (a stream's first text chunk, else the whole answer).
`overhead_ms` is the serving overhead of ok completions and fan-outs: latency minus the model work their `scd`
timings report (producer prefill + encode, the slowest specialist's cache build to last token).
`--compare` runs the same requests twice against the one service, first as they are (SCD) and then with
`"oracle": true` (every specialist prefills the prefix itself), and reports both with their ratios.
`machine` (when the service runs on this machine, else null): the local Ray cluster's processes and their
threads at the run's start and at its peak, by role (`cli/processes.py`), the 1-minute load average (at the end
and the highest), and the CPU milliseconds each role spent per request: where the cores went.
`--prefix-tokens N` pads every prefix with further notes to about N tokens (4 characters a token; the report's
`prompt_tokens` is what the service counted). `--prefixes K` makes request i ask prefix number i % K.
Exit code 0 when no request failed or got lost, else 1.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from tqdm import tqdm

from cli import processes
from serve_app.schemas import model_compute_ms

KINDS = ("completions", "streams", "fanouts")
FACTS = [("Clara Petrov", "Galen Cross", "a brewer"), ("Tilda Vance", "Hythe", "a potter"),
         ("Omar Reyes", "Dunmore", "a pilot"), ("Ines Walsh", "Port Ellis", "a baker")]
QUESTIONS = ["Question: Where does {} live?\nAnswer:", "Question: What does {} do?\nAnswer:", "Summary:"]


@dataclass
class Result:
    kind: str
    issued: float                      # seconds since the run started
    outcome: str = "lost"              # ok | error | lost
    status: int | None = None
    modes: list[str] = field(default_factory=list)
    done: float = 0.0
    ttft: float | None = None          # streams only
    prompt_tokens: int | None = None   # completions only (the service's usage)
    overhead: float | None = None      # completions and fan-outs: latency minus the model work the service reports

    def first_token(self) -> float:
        """Seconds from issue to the first token: a stream's first text chunk, else the whole answer."""
        return self.ttft if self.ttft is not None else self.done - self.issued


def parse_mix(text: str) -> dict[str, float]:
    mix = dict.fromkeys(KINDS, 0.0)
    for part in text.split(","):
        kind, eq, value = part.partition("=")
        kind = kind.strip()
        if kind not in KINDS or not eq:
            raise argparse.ArgumentTypeError(f"{part!r}: expected KIND=FRACTION with KIND one of {', '.join(KINDS)}")
        try:
            mix[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: {value!r} is not a number") from None
        if not 0.0 <= mix[kind] <= 1.0:
            raise argparse.ArgumentTypeError(f"{part!r}: a fraction is between 0 and 1")
    if abs(sum(mix.values()) - 1.0) > 1e-6:
        raise argparse.ArgumentTypeError(f"{text!r}: the fractions add up to {sum(mix.values()):g}, not 1")
    return mix


def plan(n: int, mix: dict[str, float], seed: int = 0) -> list[str]:
    """Exactly round(n x fraction) of each kind (largest remainder), in a seeded shuffled order."""
    counts = {k: int(n * f) for k, f in mix.items()}
    by_remainder = sorted(KINDS, key=lambda k: n * mix[k] - counts[k], reverse=True)
    for k in by_remainder[:n - sum(counts.values())]:
        counts[k] += 1
    kinds = [k for k in KINDS for _ in range(counts[k])]
    random.Random(seed).shuffle(kinds)
    return kinds


@dataclass(frozen=True)
class Shape:
    """What the prompts look like: prefixes padded to about `prefix_tokens` tokens; `prefixes` > 0: request i
    uses prefix number i % prefixes (each asked requests / prefixes times: a prefix-heavy mix); `salt` makes the
    requests' own prefixes new to a service that saw a run with another salt (its producer prefills them)."""
    prefix_tokens: int = 0
    prefixes: int = 0
    salt: str = ""


def prompt(i: int, shape: Shape = Shape()) -> tuple[str, str]:
    """(prefix, suffix) for request i: by default even requests share four prefixes, odd ones have a prefix of
    their own, so the producer's prefix code cache answers some requests and the others need a prefill. With
    prefix_tokens, further notes about the others pad the prefix to about that many tokens."""
    key = i % shape.prefixes if shape.prefixes else i // 2
    name, place, job = FACTS[key % len(FACTS)]
    other = FACTS[(key + 1) % len(FACTS)]
    prefix = (f"Notes:\n{name} lives in {place}. {other[0]} works as {other[2]}. {name} works as {job}. "
              f"{other[0]} lives in {other[1]}.\n")
    k = 0
    while len(prefix) < 4 * shape.prefix_tokens:
        who, where, what = FACTS[(key + 1 + k) % len(FACTS)]
        prefix += f"On day {k + 1}, {who} worked as {what} in {where}.\n"
        k += 1
    if shape.prefixes:
        prefix += f"Entry {key}.\n"
    elif i % 2:
        prefix += f"Entry {shape.salt}{i}.\n"
    return prefix, QUESTIONS[i % len(QUESTIONS)].format(name)


def mode_of(scd: dict) -> str:
    mode = scd.get("mode", "?")
    return f"{mode}:{scd['reason']}" if mode == "fallback" and scd.get("reason") else mode


class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def local(self) -> bool:
        """Whether the service runs on this machine (its processes can then be counted)."""
        from urllib.parse import urlparse
        return urlparse(self.url).hostname in ("127.0.0.1", "localhost", "0.0.0.0", "::1")

    def open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, self.headers, method="GET" if body is None else "POST")
        return urllib.request.urlopen(req, timeout=self.timeout)

    def run(self, r: Result, body: dict, path: str, items: int, t0: float) -> Result:
        """Send one request and classify what comes back (its outcome, status, modes, timings) into r."""
        try:
            with self.open(path, body) as resp:
                r.status = resp.status
                if r.kind == "streams":
                    self._stream(r, resp, t0)
                else:
                    out = json.loads(resp.read())
                    results = out.get("results", []) if r.kind == "fanouts" else [out]
                    complete = len(results) == items and all("scd" in x for x in results)
                    r.outcome = "error" if "error" in out or not complete else "ok"
                    r.modes = [mode_of(x["scd"]) for x in results if "scd" in x]   # a failed item has none
                    r.prompt_tokens = out.get("usage", {}).get("prompt_tokens")
                    if r.outcome == "ok":
                        r.overhead = time.monotonic() - t0 - r.issued - model_compute_ms([x["scd"] for x in results]) / 1e3
        except urllib.error.HTTPError as e:
            r.outcome, r.status = "error", e.code
        except (OSError, http.client.HTTPException):             # refused, dropped, timed out, truncated
            r.outcome = "lost"
        except ValueError:                                       # a 200 whose body is not JSON
            r.outcome = "error"
        r.done = time.monotonic() - t0
        return r

    def _stream(self, r: Result, resp, t0: float) -> None:
        deadline = time.monotonic() + self.timeout
        for raw in resp:                                         # SSE: `data: {...}` lines, then `data: [DONE]`
            if time.monotonic() > deadline:
                return                                           # lost: too slow
            line = raw.decode()
            if not line.endswith("\n") or not line.startswith("data:"):
                continue                                         # blank separators; a line cut mid-way
            data = line[5:].strip()
            if data == "[DONE]":
                r.outcome = "error" if r.outcome == "error" else "ok"
                return
            chunk = json.loads(data)
            if "error" in chunk:
                r.outcome = "error"
            if r.ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                r.ttft = time.monotonic() - t0 - r.issued
            if "scd" in chunk:
                r.modes = [mode_of(chunk["scd"])]
        if r.outcome != "error":
            r.outcome, r.modes = "lost", []                      # ended without [DONE]


def producer_killer(address: str, namespace: str):
    """Connect to the running cluster now (Ray is imported only here); return (kill, disconnect). kill() asks
    Ray to kill the pool's first live producer and allows a restart (a crash: Ray brings it back) and returns
    its name."""
    import ray

    from cluster.runtime import use_token_auth
    use_token_auth()
    from actors.producer_pool import POOL_NAME
    try:
        with contextlib.redirect_stdout(sys.stderr):             # stdout carries the one JSON line
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
        raise SystemExit(f"scd loadtest: cannot connect to Ray at {address!r}: {e}") from None
    try:
        pool = ray.get_actor(POOL_NAME, namespace=namespace)
    except ValueError:
        ray.shutdown()
        raise SystemExit(f"scd loadtest: no producer pool {POOL_NAME!r} in namespace {namespace!r} at {address}")

    def kill() -> str:
        name = ray.get(pool.members.remote(), timeout=30)["live"][0]
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=False)
        return name
    return kill, ray.shutdown


def percentiles(seconds: list[float]) -> dict:
    """Nearest-rank p50 and p99 in milliseconds, and how many samples."""
    xs = sorted(seconds)
    at = lambda q: round(1000 * xs[math.ceil(q * len(xs)) - 1], 1) if xs else None
    return {"p50": at(0.50), "p99": at(0.99), "n": len(xs)}


def segments(samples: list[tuple[float, object]]) -> list[list]:
    """[[t, state], ...] with consecutive equal states merged into the first of the run."""
    return [[round(t, 1), s] for i, (t, s) in enumerate(samples) if i == 0 or samples[i - 1][1] != s]


def poll_health(client: Client, t0: float, stop: threading.Event, out: list, sampler=None) -> None:
    """Once a second until stopped: (seconds since start at the poll, status or HTTP code or "unreachable"), and
    a sample of the machine's Ray processes when `sampler` is given."""
    while True:
        if sampler is not None:
            sampler.sample()
        t = time.monotonic() - t0
        try:
            with client.open("/healthz") as resp:
                state = json.loads(resp.read()).get("status", resp.status)
        except urllib.error.HTTPError as e:                      # 503 "degraded" comes with a JSON body
            try:
                state = json.loads(e.read()).get("status", e.code)
            except ValueError:
                state = e.code
        except (OSError, http.client.HTTPException, ValueError):
            state = "unreachable"
        out.append((t, state))
        if stop.wait(max(0.0, t + 1.0 - (time.monotonic() - t0))):
            return


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scd loadtest", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="default: %(default)s")
    p.add_argument("--requests", type=_positive, default=500, metavar="N")
    p.add_argument("--concurrency", type=_positive, default=16, metavar="C")
    p.add_argument("--mix", type=parse_mix, default="completions=0.4,streams=0.3,fanouts=0.3",
                   help="fractions adding up to 1 (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--api-key", default=os.environ.get("SCD_API_KEY"), help="default: $SCD_API_KEY")
    p.add_argument("--kill-producer-at", type=_positive, metavar="K",
                   help="kill the producer actor once the K-th request is issued")
    p.add_argument("--config", default="ray_config.yaml", help="where the Ray namespace of the producer is")
    p.add_argument("--ray-address", default="auto", help="default: %(default)s")
    p.add_argument("--compare", action="store_true", help="run the requests as SCD, then as the oracle, and compare")
    p.add_argument("--prefix-tokens", type=int, default=0, metavar="N", help="pad prefixes to about N tokens")
    p.add_argument("--salt", default="", help="text in every request's own prefix: a run with a new salt finds none "
                   "of them in the producer's cache (default: none)")
    p.add_argument("--prefixes", type=_positive, default=0, metavar="K",
                   help="request i asks prefix number i %% K (default: four shared prefixes, and one of its own "
                        "for every odd request)")
    args = p.parse_args(argv)
    if args.compare and args.kill_producer_at:
        p.error("--compare and --kill-producer-at do not go together")
    if args.prefix_tokens < 0:
        p.error("--prefix-tokens must be >= 0")
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    if args.kill_producer_at and args.kill_producer_at > args.requests:
        p.error(f"--kill-producer-at {args.kill_producer_at} is beyond --requests {args.requests}")
    return args


def request(i: int, kind: str, models: list[str], shape: Shape = Shape(), oracle: bool = False) -> tuple[str, dict, int]:
    """(path, body, items expected back) of request i."""
    prefix, suffix = prompt(i, shape)
    mode = {"oracle": True} if oracle else {}
    if kind == "fanouts":
        items = [{"specialist": m, "suffix": suffix, "max_tokens": 8} for m in models]
        return "/v1/fanout", {"prefix": prefix, "requests": items, **mode}, len(models)
    body = {"model": models[i % len(models)], "prefix": prefix, "prompt": suffix, "max_tokens": 8, **mode}
    return "/v1/completions", {**body, "stream": kind == "streams"}, 1


def run(client: Client, models: list[str], kinds: list[str], concurrency: int, kill_at: int | None, kill,
        shape: Shape = Shape(), oracle: bool = False):
    """Every planned request at `concurrency`; `kill` runs right after the kill_at-th request is issued, under
    the issuing lock, so every later request is issued after it returned.
    Returns (results, health samples, wall seconds, (seconds at which the kill returned, what it killed) or
    None)."""
    issued, lock, killed_at = itertools.count(1), threading.Lock(), []
    stop, health, t0 = threading.Event(), [], time.monotonic()
    sampler = processes.Sampler() if client.local() else None

    def one(i: int, kind: str) -> Result:
        path, body, items = request(i, kind, models, shape, oracle)
        with lock:
            r = Result(kind, time.monotonic() - t0)
            if next(issued) == kill_at:
                try:
                    killed_name = kill()
                    killed_at.append((time.monotonic() - t0, killed_name))
                except Exception as e:                           # the load goes on; the report says null
                    print(f"scd loadtest: killing the producer failed: {type(e).__name__}: {e}", file=sys.stderr)
        return client.run(r, body, path, items, t0)

    poller = threading.Thread(target=poll_health, args=(client, t0, stop, health, sampler), daemon=True)
    poller.start()
    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(kinds), file=sys.stderr, unit="req") as bar:
        results = []
        for f in as_completed([pool.submit(one, i, k) for i, k in enumerate(kinds)]):
            results.append(f.result())
            bar.update()
    wall = time.monotonic() - t0
    stop.set()
    poller.join()
    return results, health, wall, (killed_at or [None])[0], sampler and sampler.report(len(kinds))


def main(argv: list[str] | None = None) -> int:
    """Stdout carries the one JSON line: anything else printed meanwhile (Ray's own warnings, once connected
    for --kill-producer-at) goes to stderr."""
    report_out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        report = _main(parse_args(argv))
    print(json.dumps(report), file=report_out, flush=True)
    runs = [report["scd"], report["oracle"]] if "scd_over_oracle" in report else [report]
    return 0 if all(r["errors"] == r["lost"] == 0 for r in runs) else 1


def _main(args) -> dict:
    client = Client(args.url, args.api_key, args.timeout)
    try:
        with client.open("/v1/models") as resp:
            models = [m["id"] for m in json.loads(resp.read())["data"]]
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"scd loadtest: cannot list the models at {args.url}/v1/models: {e}") from None
    if not models:
        raise SystemExit(f"scd loadtest: {args.url} serves no models")
    kill, disconnect = None, lambda: None
    if args.kill_producer_at:
        from cluster.config import ConfigError, load_config
        try:
            namespace = load_config(args.config).ray.namespace
        except ConfigError as e:
            raise SystemExit(f"scd loadtest: {e}") from None
        kill, disconnect = producer_killer(args.ray_address, namespace)   # connected before the load starts

    kinds = plan(args.requests, args.mix)
    shape = Shape(args.prefix_tokens, args.prefixes, args.salt)
    if args.compare:
        reports = {}
        for mode in ("scd", "oracle"):
            results, health, wall, _, machine = run(client, models, kinds, args.concurrency, None, None, shape,
                                                    mode == "oracle")
            reports[mode] = summary(args, kinds, results, health, wall, machine)
        s, o = reports["scd"], reports["oracle"]
        ratio = lambda a, b: round(a / b, 3) if a and b else None       # noqa: E731
        report = {**reports, "scd_over_oracle": {
            "requests_per_s": ratio(s["requests_per_s"], o["requests_per_s"]),
            "first_token_p50": ratio(s["first_token_ms"]["p50"], o["first_token_ms"]["p50"]),
            "first_token_p99": ratio(s["first_token_ms"]["p99"], o["first_token_ms"]["p99"])}}
        print(comparison_table(report), file=sys.stderr)
        return report
    try:
        results, health, wall, killed, machine = run(client, models, kinds, args.concurrency,
                                                     args.kill_producer_at, kill, shape)
    finally:
        disconnect()
    report = summary(args, kinds, results, health, wall, machine)
    if args.kill_producer_at:
        report.update(after_kill(results, killed))
    return report


def after_kill(results: list[Result], killed: tuple[float, str] | None) -> dict:
    """What a producer kill cost: the requests in flight when it returned; the answered items that fell back
    among requests that finished after it; the first request issued after it that `scd` served
    (`scd_again_after_kill_s`), and from when on every request was served by `scd`
    (`all_scd_after_kill_s`: the issue time of the last later request with an item not served by scd, 0 when
    there was none)."""
    if killed is None:
        return {"producer_killed": None, "producer_killed_at_s": None, "scd_again_after_kill_s": None,
                "all_scd_after_kill_s": None, "inflight_at_kill": None, "fallbacks_after_kill": None}
    at, name = killed
    ok = [r for r in results if r.outcome == "ok"]
    back = [r.done for r in ok if r.issued >= at and "scd" in r.modes]
    not_scd = [r.issued for r in ok if r.issued >= at and any(m != "scd" for m in r.modes)]
    return {"producer_killed": name, "producer_killed_at_s": round(at, 3),
            "scd_again_after_kill_s": round(min(back) - at, 3) if back else None,
            "all_scd_after_kill_s": round(max(not_scd) - at, 3) if not_scd else 0.0,
            "inflight_at_kill": sum(r.issued < at <= r.done for r in results),
            "fallbacks_after_kill": sum(m.startswith("fallback") for r in ok if r.done >= at for m in r.modes)}


def summary(args, kinds: list[str], results: list[Result], health: list, wall: float,
            machine: dict | None = None) -> dict:
    """One run's report (see the module docstring)."""
    count = lambda xs: dict(sorted(((str(k), xs.count(k)) for k in set(xs)), key=lambda kv: -kv[1]))  # noqa: E731
    ok = [r for r in results if r.outcome == "ok"]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens]
    return {
        "requests": args.requests, "concurrency": args.concurrency, "mix": count(kinds),
        "ok": len(ok), "errors": sum(r.outcome == "error" for r in results),
        "lost": sum(r.outcome == "lost" for r in results),
        "status_codes": count([r.status for r in results if r.status is not None]),
        "modes": count([m for r in results for m in r.modes]),
        "latency_ms": percentiles([r.done - r.issued for r in ok]),
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "first_token_ms": percentiles([r.first_token() for r in ok]),
        "overhead_ms": percentiles([r.overhead for r in ok if r.overhead is not None]),
        "prompt_tokens": round(sum(prompt_tokens) / len(prompt_tokens), 1) if prompt_tokens else None,
        "health": segments(health), "wall_s": round(wall, 3), "requests_per_s": round(args.requests / wall, 2),
        "machine": machine}


def comparison_table(report: dict) -> str:
    rows = [("requests/s", "requests_per_s", None), ("first token p50 (ms)", "first_token_ms", "p50"),
            ("first token p99 (ms)", "first_token_ms", "p99")]
    lines = [f"{'':22}{'scd':>12}{'oracle':>12}{'scd/oracle':>12}"]
    for label, key, sub in rows:
        s, o = (report[m][key] if sub is None else report[m][key][sub] for m in ("scd", "oracle"))
        r = report["scd_over_oracle"]["requests_per_s" if sub is None else f"first_token_{sub}"]
        lines.append(f"{label:22}{s!s:>12}{o!s:>12}{r!s:>12}")
    return "\n".join(lines)
