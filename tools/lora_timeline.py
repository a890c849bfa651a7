"""An adapter loaded into a running LoRA group, followed from its load to its unload, with requests throughout.

    python -m tools.lora_timeline --path ADAPTER [--name NAME] [--url http://127.0.0.1:8000] [--others qa,qa_top]

Against a running `scd serve` whose config has a LoRA group and a Jobs API (`ray.dashboard_port`):
1. `POST /v1/load_lora_adapter`; from then on a thread asks the adapter, one request after another, and another
   thread asks each of `--others` in turn (a prefix of about --prefix-tokens, a few tokens each);
2. `/healthz` is polled every second: the adapter's calibration job status and its artifact;
3. once the adapter has answered `scd` from its artifact --after times, --unload-under long requests are sent
   to it and the adapter is unloaded while they run; the run ends when they have finished.
Prints each event with its time since the load, then one JSON line: the events, every answer's outcome counted
by model and mode, the adapter's latency before and after its switch, and the failed requests (non-200 answers
and lost ones: the figure to read, which should be 0).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

from cli.loadtest import Shape, prompt


def call(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, str]:
    """(HTTP status, body text); status 0 when no answer came."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"},
                                 method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, f"{type(e).__name__}: {e}"


class Timeline:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.answers: list[dict] = []                  # model, t (issued), s (latency), status, mode
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def event(self, what: str) -> None:
        self.events.append((self.now(), what))
        print(f"{self.now():8.1f} s  {what}", flush=True)

    def ask(self, model: str, i: int, max_tokens: int = 4, **extra) -> dict:
        prefix, question = prompt(i, Shape(prefix_tokens=self.args.prefix_tokens, prefixes=4))
        t = time.monotonic()
        status, text = call(self.args.url + "/v1/completions", {"model": model, "prefix": prefix, "prompt": question,
                                                                "max_tokens": max_tokens, **extra})
        scd = json.loads(text).get("scd", {}) if status == 200 else {}
        mode = scd.get("mode", "?") + (f":{scd['reason']}" if scd.get("reason") else "")
        row = {"model": model, "t": round(t - self.t0, 1), "s": round(time.monotonic() - t, 2), "status": status,
               "mode": mode, "artifact": scd.get("artifact"), "max_tokens": max_tokens}
        with self.lock:
            self.answers.append(row)
        if status != 200:
            self.event(f"{model}: HTTP {status} {text[:200]}")
        return row

    def loop(self, models: list[str]) -> None:
        """Ask `models` in turn until stopped; a model that answers 404 (unloaded) is asked no more."""
        i = 0
        while not self.stop.is_set() and models:
            for model in list(models):
                if self.ask(model, i)["status"] == 404:
                    models.remove(model)
                i += 1

    def health(self) -> dict | None:
        """The adapter's `/healthz` entry; None while it is not known (no answer, or its engine too busy to
        report within the control timeout)."""
        status, text = call(self.args.url + "/healthz", timeout=30)
        h = json.loads(text).get("specialists", {}).get(self.args.name) if status in (200, 503) else None
        return None if h is None or "busy" in h else h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--path", required=True, help="the PEFT adapter folder to load")
    p.add_argument("--name", default="loaded", help="its lora_name")
    p.add_argument("--others", default="", help="comma-separated models asked in turn meanwhile")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--after", type=int, default=3, help="answers from the artifact before the unload")
    p.add_argument("--unload-under", type=int, default=3, help="long requests running when it is unloaded")
    p.add_argument("--bound-s", type=float, default=4 * 3600, help="give up waiting for the switch after this")
    args = p.parse_args(argv)
    tl = Timeline(args)
    status, text = call(args.url + "/v1/load_lora_adapter", {"lora_name": args.name, "lora_path": args.path})
    tl.event(f"load: HTTP {status} {text.strip()[:200]}")
    if status != 200:
        return 1
    threads = [threading.Thread(target=tl.loop, args=([args.name],), daemon=True)]
    if args.others:
        threads.append(threading.Thread(target=tl.loop, args=(args.others.split(","),), daemon=True))
    for th in threads:
        th.start()
    job, artifact, first, switch = None, None, False, False
    deadline = time.monotonic() + args.bound_s
    while time.monotonic() < deadline:
        own = [a for a in tl.answers if a["model"] == args.name]
        if own and not first:
            first = True
            tl.event(f"first answer: {own[0]['mode']} in {own[0]['s']} s")
        h = tl.health()
        if h is None:
            time.sleep(1)
            continue
        if h.get("calibration") != job:
            job = h.get("calibration")
            tl.event(f"calibration: {job}")
        if h.get("artifact") != artifact:
            artifact = h.get("artifact")
            tl.event(f"healthz artifact: {artifact}")
        switched = [a for a in own if a["mode"] == "scd" and a["artifact"]]
        if switched and not switch:
            switch = True
            tl.event(f"switch: first answer from {switched[0]['artifact']} (issued at {switched[0]['t']} s)")
        if len(switched) >= args.after or (job or "").endswith((": FAILED", ": STOPPED")):
            break
        time.sleep(1)
    own = [a for a in tl.answers if a["model"] == args.name]       # the short requests, before the unload's
    long = [threading.Thread(target=tl.ask, args=(args.name, 1000 + k), kwargs={"max_tokens": 200, "ignore_eos": True})
            for k in range(args.unload_under)]
    for th in long:
        th.start()
    running = 0
    while running < args.unload_under and any(th.is_alive() for th in long):
        running = (tl.health() or {}).get("running", running)
        time.sleep(0.05)
    unload_t = tl.now()
    tl.event(f"unload asked with {running} requests running")
    status, text = call(args.url + "/v1/unload_lora_adapter", {"lora_name": args.name})
    tl.event(f"unload answered: HTTP {status} {text.strip()[:200]}")
    for th in long:
        th.join()
    tl.event("the requests running at the unload finished: " + ", ".join(
        f"HTTP {a['status']}" for a in tl.answers if a["model"] == args.name and a["max_tokens"] > 4))
    tl.stop.set()
    for th in threads:
        th.join(timeout=600)
    after_unload = [a for a in tl.answers if a["model"] == args.name and a["t"] + a["s"] >= unload_t]
    switch_t = next((a["t"] for a in tl.answers if a["model"] == args.name and a["mode"] == "scd" and a["artifact"]),
                    None)
    before = [a["s"] for a in own if switch_t is None or a["t"] < switch_t]
    after = [a["s"] for a in own if switch_t is not None and a["t"] >= switch_t]
    failed = [a for a in tl.answers if a["status"] != 200 and not (a in after_unload and a["status"] == 404)]
    out = {"events": tl.events,
           "answers": {m: dict(collections.Counter(a["mode"] if a["status"] == 200 else f"HTTP {a['status']}"
                                                   for a in tl.answers if a["model"] == m))
                       for m in sorted({a["model"] for a in tl.answers})},
           "adapter_latency_s": {"before_switch_p50": statistics.median(before) if before else None,
                                 "after_switch_p50": statistics.median(after) if after else None},
           "after_unload": [a["status"] for a in after_unload][:5],
           "failed": failed}
    print(json.dumps(out), flush=True)
    return 1 if failed or switch_t is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
