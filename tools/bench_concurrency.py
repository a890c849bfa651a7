"""Serving throughput under concurrency, SCD against the oracle, side by side in one run on one machine.

    python -m tools.bench_concurrency [--config ray_config.yaml] [--requests 160] [--levels 1,4,16]
                                      [--prefix-tokens 512] [--out FILE.json]

Starts `scd serve --config` (its own embedded Ray cluster), and from the moment it reports ready:
1. a cold run: `--requests` at the highest level at once (what a user who starts loading right away sees),
   with the health it reported and the fallbacks it served in the first minute;
2. at each level, `scd loadtest --compare` (the same requests as SCD, then as the oracle: every specialist
   prefills the prefix itself), at `--prefix-tokens`. Each run salts its requests' own prefixes (`--salt`):
   half of its requests bring a prefix the producer has not seen, as in a first run, and the other half share
   four prefixes.
Prints one table (requests/s of both, the ratios, p50/p99 time to first token, the processes and threads of the
cluster and the load average) and the CPU each process role spent per request, then stops the service.
Needs the config's pairs calibrated (`make demo` does it once); a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cli import loadtest

REPO = Path(__file__).resolve().parents[1]
FIRST_MINUTE_S = 60.0


def start_service(config: str, timeout_s: float = 600) -> subprocess.Popen:
    """`scd serve --config` in a session of its own, returned once it said ready."""
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--config", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, said = time.monotonic() + timeout_s, []
    for line in proc.stdout:
        if line.startswith("SCD Serve ready"):
            print(line.rstrip(), file=sys.stderr)
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # keep it drained
            return proc
        said = (said + [line])[-20:]
        if time.monotonic() > deadline:
            break
    stop_service(proc)
    raise SystemExit(f"bench_concurrency: `scd serve --config {config}` did not get ready; it said:\n" + "".join(said))


def stop_service(proc: subprocess.Popen) -> None:
    """SIGTERM, as a supervisor stops it (as Ctrl-C does: Serve, the producers and the embedded cluster stop);
    killed if it hangs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def loadtest_report(url: str, requests: int, concurrency: int, prefix_tokens: int, compare: bool, salt: str) -> dict:
    argv = ["--url", url, "--requests", str(requests), "--concurrency", str(concurrency), "--salt", salt,
            "--prefix-tokens", str(prefix_tokens), *(["--compare"] if compare else [])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        loadtest.main(argv)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def first_minute(report: dict) -> dict:
    """What the cold run (started at ready) saw within FIRST_MINUTE_S: health states other than ok, and
    fallbacks."""
    bad = [[t, s] for t, s in report["health"] if s != "ok" and t < FIRST_MINUTE_S]
    fallbacks = sum(n for m, n in report["modes"].items() if m.startswith("fallback"))
    return {"not_ok_health": bad, "fallbacks": fallbacks, "errors": report["errors"], "lost": report["lost"],
            "requests_per_s": report["requests_per_s"], "modes": report["modes"]}


def row(level: int, rep: dict) -> dict:
    s, o = rep["scd"], rep["oracle"]
    m = s.get("machine") or {}
    return {"concurrency": level, "scd_rps": s["requests_per_s"], "oracle_rps": o["requests_per_s"],
            "scd_over_oracle": rep["scd_over_oracle"]["requests_per_s"],
            "scd_ft_p50": s["first_token_ms"]["p50"], "scd_ft_p99": s["first_token_ms"]["p99"],
            "oracle_ft_p50": o["first_token_ms"]["p50"], "oracle_ft_p99": o["first_token_ms"]["p99"],
            "fallbacks": sum(n for k, n in s["modes"].items() if k.startswith("fallback")),
            "errors": (s.get("errors", 0), o.get("errors", 0)),
            "processes": m.get("at_peak", {}).get("processes"), "threads": m.get("at_peak", {}).get("threads"),
            "load_max": m.get("load_avg_1m", {}).get("max"), "cpu_ms_per_request": m.get("cpu_ms_per_request")}


def table(rows: list[dict]) -> str:
    base = rows[0]["scd_rps"]
    head = ("| concurrent | SCD req/s | oracle req/s | SCD / oracle | SCD / SCD at " + str(rows[0]["concurrency"]) +
            " | SCD first token p50 / p99 (ms) | oracle first token p50 / p99 (ms) | SCD fallbacks | errors SCD / "
            "oracle | processes / "
            "threads (peak) | load avg (max) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['scd_rps']} | {r['oracle_rps']} | {r['scd_over_oracle']} | "
                     f"{r['scd_rps'] / base:.2f} | {r['scd_ft_p50']} / {r['scd_ft_p99']} | "
                     f"{r['oracle_ft_p50']} / {r['oracle_ft_p99']} | {r['fallbacks']} | "
                     f"{r['errors'][0]} / {r['errors'][1]} | "
                     f"{r['processes']} / {r['threads']} | {r['load_max']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_concurrency", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--config", default=str(REPO / "ray_config.yaml"))
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--levels", default="1,4,16", help="concurrency levels, comma-separated (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--same-prefixes", action="store_true", help="no salt: every run asks the cold run's prefixes, "
                   "which the producer's cache then holds (as repeated `scd loadtest` runs do)")
    p.add_argument("--out", help="also write every report as JSON here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    from cluster.config import load_config
    cfg = load_config(args.config)
    url = f"http://{cfg.http.host.replace('0.0.0.0', '127.0.0.1')}:{cfg.http.port}"
    proc = start_service(args.config)
    try:
        cold = loadtest_report(url, args.requests, max(levels), args.prefix_tokens, compare=False, salt="cold-")
        cold_first = first_minute(cold)
        reports = {c: loadtest_report(url, args.requests, c, args.prefix_tokens, compare=True, salt="cold-" if args.same_prefixes else f"c{c}-")
                   for c in levels}
    finally:
        stop_service(proc)
    rows = [row(c, reports[c]) for c in levels]
    print(f"\n{args.requests} requests a level, prefixes of about {args.prefix_tokens} tokens, {os.cpu_count()} cores; "
          f"config {args.config}\n")
    print(table(rows))
    print(f"\ncold run at {max(levels)} concurrent from ready: {cold_first['requests_per_s']} req/s, "
          f"fallbacks {cold_first['fallbacks']}, health other than ok in the first minute: "
          f"{cold_first['not_ok_health'] or 'none'}, errors {cold_first['errors']}, lost {cold_first['lost']}")
    print("\nCPU ms per request by process role (SCD runs):")
    for r in rows:
        print(f"  {r['concurrency']:>3} concurrent: " + ", ".join(f"{k} {v}" for k, v in
                                                                (r["cpu_ms_per_request"] or {}).items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"cold": cold, "levels": reports}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
