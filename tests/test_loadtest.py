"""`scd loadtest` against a fake SCD Serve in this process (no Ray): counts, modes, mix, auth, health, kill."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cli import loadtest
from cluster.runtime import use_token_auth
from tests.conftest import send_json

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qa", "prose", "code"]
SLOW_S = 0.5                  # a slow answer of the fake; its fast ones take a few milliseconds


class FakeService:
    """What the router answers, and faults on demand: `faults[kind]` lists what the first requests of that
    kind get ("503", "error200", "drop", "cut", "partial"); later ones are served. A fan-out's `code` item is
    always a fallback (no_artifact), so modes must be counted per item."""

    def __init__(self):
        self.faults = {"completions": [], "streams": [], "fanouts": []}
        self.hits, self.auth, self.lock = Counter(), [], threading.Lock()
        self.health = (200, "ok")
        self.fallbacks = 0                                       # the next this many requests: producer gone
        self.bodies = []
        self.delay_s = dict.fromkeys(self.faults, 0.0)           # each answer of that kind waits this long

    def answer(self, h: BaseHTTPRequestHandler, body: dict | None):
        with self.lock:
            self.auth.append(h.headers.get("Authorization"))
        if h.command == "GET":
            if h.path == "/v1/models":
                return send_json(h, 200, {"object": "list", "data": [{"id": m} for m in MODELS]})
            return send_json(h, self.health[0], {"status": self.health[1]})
        kind = "fanouts" if h.path == "/v1/fanout" else "streams" if body.get("stream") else "completions"
        with self.lock:
            n, self.hits[kind] = self.hits[kind], self.hits[kind] + 1
            self.bodies.append(body)
            fault = self.faults[kind][n] if n < len(self.faults[kind]) else None
            scd = {"mode": "fallback", "reason": "producer_unavailable"} if self.fallbacks else {"mode": "scd"}
            if body.get("oracle"):
                scd = {"mode": "oracle"}
            self.fallbacks -= self.fallbacks > 0
        time.sleep(self.delay_s[kind])
        if fault == "503":
            return send_json(h, 503, {"error": {"message": "overloaded", "type": "server_error"}})
        if fault == "error200":
            return send_json(h, 200, {"error": {"message": "odd", "type": "server_error"}})
        if fault == "drop":
            h.close_connection = True
            return h.connection.shutdown(socket.SHUT_RDWR)
        if kind == "fanouts":
            results = [{"specialist": r["specialist"], "text": " x", "finish_reason": "length",
                        "scd": {"mode": "fallback", "reason": "no_artifact"}
                        if r["specialist"] == "code" and not body.get("oracle") else scd}
                       for r in body["requests"]]
            if fault == "partial":                               # one item failed, the others answered
                results[-1] = {"specialist": results[-1]["specialist"], "error": {"message": "replica died"}}
            return send_json(h, 200, {"object": "fanout", "results": results})
        if kind == "completions":
            return send_json(h, 200, {"choices": [{"text": " Hythe", "index": 0}], "scd": scd,
                                      "usage": {"prompt_tokens": len(body["prefix"]) // 4}})
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        chunks = [{"choices": [{"text": " Hy"}]}, {"choices": [{"text": "the"}]},
                  {"choices": [{"text": "", "finish_reason": "length"}], "scd": scd}]
        for c in chunks[:1] if fault == "cut" else chunks:
            h.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        if fault != "cut":
            h.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake():
    service = FakeService()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            service.answer(self, None)

        def do_POST(self):
            service.answer(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    service.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield service
    server.shutdown()
    server.server_close()
    thread.join()


def run(capsys, *argv) -> tuple[int, dict]:
    rc = loadtest.main(list(argv))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines                                # exactly one JSON line on stdout
    return rc, json.loads(lines[0])


def test_all_served_counts_mix_and_modes_per_item(fake, capsys, monkeypatch):
    monkeypatch.delenv("SCD_API_KEY", raising=False)
    fake.delay_s["completions"] = SLOW_S                         # 16 of 40 answers slow, the other 24 not
    rc, out = run(capsys, "--url", fake.url, "--requests", "40", "--concurrency", "4")
    assert rc == 0
    assert (out["ok"], out["errors"], out["lost"]) == (40, 0, 0)
    assert out["mix"] == {"completions": 16, "streams": 12, "fanouts": 12}
    assert dict(fake.hits) == out["mix"]                         # what the server saw, not just what we say
    assert out["status_codes"] == {"200": 40}
    # 16 completions + 12 streams + 12 fan-outs x (qa, prose scd; code fallback)
    assert out["modes"] == {"scd": 16 + 12 + 24, "fallback:no_artifact": 12}
    assert out["latency_ms"]["n"] == 40 and out["ttft_ms"]["n"] == 12
    # nearest rank: the 20th of 40 latencies is one of the 24 fast answers, the 40th one of the 16 slow
    assert out["latency_ms"]["p50"] < 1000 * SLOW_S <= out["latency_ms"]["p99"], out["latency_ms"]
    assert [state for _, state in out["health"]] == ["ok"]      # one segment: ok throughout
    assert "producer_killed_at_s" not in out
    assert set(fake.auth) == {None}                              # no key, no header


def test_errors_and_lost_are_classified_and_exit_1(fake, capsys):
    fake.faults = {"completions": ["503", "503", "error200", "drop"], "streams": ["cut", "503", "cut"],
                   "fanouts": ["partial", "drop"]}
    fake.health = (503, "down")                                  # the router: no specialist answers
    rc, out = run(capsys, "--url", fake.url, "--requests", "40", "--concurrency", "4")
    assert rc == 1
    # errors: two 503 completions, a 200 with an error object, a 503 stream, a fan-out with a failed item
    # lost: a dropped completion, two streams cut before [DONE], a dropped fan-out
    assert (out["ok"], out["errors"], out["lost"]) == (31, 5, 4)
    assert out["status_codes"] == {"200": 35, "503": 3}         # cut streams had a 200; drops had nothing
    # answered items only: the partial fan-out's qa and prose count, its failed code item does not
    assert out["modes"] == {"scd": 12 + 9 + 2 * 10 + 2, "fallback:no_artifact": 10}
    assert out["ttft_ms"]["n"] == 9
    assert [state for _, state in out["health"]] == ["down"]


def test_api_key_reaches_every_endpoint(fake, capsys, monkeypatch):
    monkeypatch.delenv("SCD_API_KEY", raising=False)
    rc, _ = run(capsys, "--url", fake.url, "--requests", "6", "--concurrency", "2", "--api-key", "sk-test-123")
    assert rc == 0 and set(fake.auth) == {"Bearer sk-test-123"} and len(fake.auth) >= 1 + 6 + 1
    fake.auth.clear()
    monkeypatch.setenv("SCD_API_KEY", "sk-from-env")
    run(capsys, "--url", fake.url, "--requests", "3", "--concurrency", "1")
    assert set(fake.auth) == {"Bearer sk-from-env"}


@pytest.mark.parametrize("back", [True, False])
def test_kill_producer_reports_when_scd_is_back(fake, capsys, monkeypatch, back):
    calls = []

    def killer(address, namespace):
        calls.append((address, namespace))

        def kill():                                              # the next 3 requests fall back, or all do
            fake.fallbacks = 3 if back else 10**6
            return "scd-producer-0"
        return kill, lambda: calls.append("disconnected")

    monkeypatch.setattr(loadtest, "producer_killer", killer)
    rc, out = run(capsys, "--url", fake.url, "--requests", "40", "--concurrency", "2", "--mix", "completions=1",
                  "--kill-producer-at", "5", "--config", str(ROOT / "ray_config.yaml"), "--ray-address", "ray://x:1")
    assert rc == 0 and calls == [("ray://x:1", "scd"), "disconnected"]
    assert out["producer_killed_at_s"] >= 0 and out["producer_killed"] == "scd-producer-0"
    assert 0 <= out["inflight_at_kill"] <= 2, "at most --concurrency requests were in flight"
    # 35 requests are issued after the kill returned (it runs under the issuing lock): at most 3 fall back
    if back:
        assert out["scd_again_after_kill_s"] >= 0 and out["modes"]["fallback:producer_unavailable"] == 3
        assert out["fallbacks_after_kill"] == 3 and 0 <= out["all_scd_after_kill_s"] < out["wall_s"]
    else:
        assert out["scd_again_after_kill_s"] is None and out["modes"]["fallback:producer_unavailable"] >= 35
        assert out["fallbacks_after_kill"] >= 35


def test_plan_is_exact_and_seeded():
    mix = loadtest.parse_mix("completions=0.5,streams=0.25,fanouts=0.25")
    assert Counter(loadtest.plan(10, mix)) == {"completions": 5, "streams": 3, "fanouts": 2}   # remainder tie: order
    assert loadtest.plan(100, mix) == loadtest.plan(100, mix, seed=0)          # the default seed: runs repeat
    orders = {tuple(loadtest.plan(100, mix, seed=s)) for s in range(5)}
    assert len(orders) == 5, "different seeds gave the same order"
    assert all(Counter(o) == {"completions": 50, "streams": 25, "fanouts": 25} for o in orders)
    grouped = sorted(loadtest.plan(100, mix), key=list(mix).index)
    assert loadtest.plan(100, mix) != grouped, "not shuffled: the kinds come in blocks"
    assert Counter(loadtest.plan(7, loadtest.parse_mix("fanouts=1"))) == {"fanouts": 7}


def test_health_segments_merge_equal_states():
    samples = [(0.0, "ok"), (1.01, "ok"), (2.0, "degraded"), (3.04, 503), (4.0, 503), (5.0, "ok")]
    assert loadtest.segments(samples) == [[0.0, "ok"], [2.0, "degraded"], [3.0, 503], [5.0, "ok"]]


@pytest.mark.parametrize("argv, message", [
    (["--mix", "completions=0.5,streams=0.6"], "add up to 1.1"),
    (["--mix", "chats=1"], "KIND one of completions, streams, fanouts"),
    (["--mix", "completions=lots"], "'lots' is not a number"),
    (["--mix", "completions=1.5,streams=-0.5"], "between 0 and 1"),
    (["--concurrency", "0"], "--concurrency: '0' is not a positive integer"),
    (["--requests", "-3"], "--requests"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--requests", "5", "--kill-producer-at", "9"], "beyond --requests 5"),
])
def test_invalid_flags_exit_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        loadtest.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unreachable_service_is_a_message(capsys):
    with socket.socket() as s:                                   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        loadtest.main(["--url", f"http://127.0.0.1:{port}", "--requests", "1"])
    assert "cannot list the models" in str(e.value.code)


def test_token_auth_turns_token_mode_on_only_with_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {}
    use_token_auth(env)
    assert env == {}                                             # no token anywhere: leave Ray's default
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc\n")
    use_token_auth(env)
    assert env == {"RAY_AUTH_MODE": "token"}
    env = {"RAY_AUTH_MODE": "disabled"}
    use_token_auth(env)
    assert env == {"RAY_AUTH_MODE": "disabled"}                  # the user's choice stands
    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}
    use_token_auth(env)
    assert "RAY_AUTH_MODE" not in env


def test_ray_reads_the_token_once_token_auth_is_set(tmp_path):
    """The Ray behaviour the kill relies on (no cluster): with only ~/.ray/auth_token present, use_token_auth
    (called after Ray was imported) makes Ray's client side use token auth and find the token."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t0k3n\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
    code = ("from cluster.runtime import use_token_auth; use_token_auth(); import ray\n"
            "from ray._raylet import AuthenticationTokenLoader\n"
            "from ray._private.authentication.authentication_utils import is_token_auth_enabled\n"
            "print(is_token_auth_enabled(), AuthenticationTokenLoader.instance().has_token())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_compare_runs_the_same_requests_as_scd_then_as_the_oracle(fake, capsys):
    rc, out = run(capsys, "--url", fake.url, "--requests", "20", "--concurrency", "4", "--compare",
                  "--prefix-tokens", "300")
    assert rc == 0 and set(out) == {"scd", "oracle", "scd_over_oracle"}, out
    as_scd, as_oracle = fake.bodies[:20], fake.bodies[20:]
    assert len(as_oracle) == 20 and not any(b.get("oracle") for b in as_scd) and all(b["oracle"] for b in as_oracle)
    strip = lambda b: {k: v for k, v in b.items() if k != "oracle"}          # noqa: E731
    key = lambda b: json.dumps(strip(b), sort_keys=True)                     # noqa: E731
    assert sorted(map(key, as_scd)) == sorted(map(key, as_oracle)), "the two runs sent different requests"
    assert all(len(b["prefix"]) >= 4 * 300 for b in fake.bodies)
    assert set(out["oracle"]["modes"]) == {"oracle"} and "oracle" not in out["scd"]["modes"]
    for mode in ("scd", "oracle"):
        r = out[mode]
        assert (r["ok"], r["first_token_ms"]["n"]) == (20, 20) and r["prompt_tokens"] >= 300, r
    ratio = out["scd_over_oracle"]["requests_per_s"]
    assert abs(ratio - out["scd"]["requests_per_s"] / out["oracle"]["requests_per_s"]) < 0.01, out


def test_model_compute_of_a_fanout_is_one_producer_share_and_the_slowest_specialist():
    from serve_app.schemas import model_compute_ms
    items = [{"mode": "scd", "timings_ms": {"prefill": 5.0, "encode": 1.0, "rebuild": 2.0, "total": 7.0}},
             {"mode": "scd", "timings_ms": {"prefill": 5.0, "encode": 1.0, "total": 9.0}},
             {"mode": "fallback", "timings_ms": {"prefill": 15.0, "total": 20.0}}]   # its own prefill, in total
    assert model_compute_ms(items) == 5.0 + 1.0 + 20.0
    assert model_compute_ms(items[2:]) == 20.0 and model_compute_ms([{"mode": "oracle"}]) == 0.0


def test_overhead_is_reported_for_completions_and_fanouts_not_streams(fake, capsys):
    rc, out = run(capsys, "--url", fake.url, "--requests", "12", "--concurrency", "3",
                  "--mix", "completions=0.5,streams=0.25,fanouts=0.25")
    assert rc == 0 and out["overhead_ms"]["n"] == 6 + 3, out


def test_overhead_parts_add_up_to_latency_minus_model_work():
    from serve_app.schemas import model_compute_ms, overhead_parts_ms
    scd = {"mode": "scd", "timings_ms": {"prefill": 5.0, "encode": 1.0, "producer_call": 9.0, "total": 12.0,
                                         "transfer": 0.25, "engine": 12.5, "replica": 13.5, "specialist_call": 21.0}}
    parts = overhead_parts_ms(50.0, scd)
    assert parts == {"http_and_router": 20.0, "producer_hop": 3.0, "specialist_hop": 7.5, "engine_hop": 1.0,
                     "codes_in": 0.25, "engine": 0.25}
    assert sum(parts.values()) == 50.0 - model_compute_ms([scd])


def test_prefixes_makes_a_prefix_heavy_mix():
    shape = loadtest.Shape(prefixes=7)
    prefixes = [loadtest.prompt(i, shape)[0] for i in range(70)]
    assert len(set(prefixes)) == 7 and all(prefixes[i] == prefixes[i + 7] for i in range(63))
    default = [loadtest.prompt(i)[0] for i in range(40)]
    assert len({default[i] for i in range(0, 40, 2)}) == 4 and len({default[i] for i in range(1, 40, 2)}) == 20
