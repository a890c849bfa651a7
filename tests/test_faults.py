"""Faults on a real local Ray + Serve: the producer killed under requests in flight at it (by the test, and by
`scd loadtest --kill-producer-at`), a specialist replica killed under its requests, a damaged artifact
published while serving, gc while serving. Nothing a client sent is lost:
every request gets an answer, a fallback says why, and the service comes back to `scd` by itself."""
import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import time

import pytest
import ray
import yaml

from artifacts_store import ArtifactStore
from serve_app.app import undeploy
from tests.conftest import DEMO, REPO, serving_config
from tests.test_serve import PREFIX, _get, _post, deploy_and_wait, holding_qa, wait_for

NS = "scd-test-faults"
BACK_WITHIN_S = 240         # producer restart + model and artifact load, on a 2-core machine as busy as two
                            # CPU-bound processes beside the test (the test prints the time it took)
PRODUCER_TIMEOUT_S = 30     # the router's wait for codes: far longer than a kill takes to reach the requests
STALL_S = 300               # the producer drill's stall: requests wait at the producer until it dies
HELD = 4                    # requests in flight at the producer when it is killed


@pytest.fixture(scope="module")
def served_faults(ray_cluster, tmp_path_factory, demo_store, demo_work_dir):
    tmp = tmp_path_factory.mktemp("faults")
    cfg_path = serving_config(tmp, demo_store, demo_work_dir)
    raw = yaml.safe_load(cfg_path.read_text())
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25,
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1}}]
    raw["producer"]["num_cpus"] = 0.25
    raw.update(ray={"namespace": NS}, producer_timeout_s=PRODUCER_TIMEOUT_S,
               artifacts={"uri": str(tmp / "store"), "watch_s": 0},    # the tests ask the producer to refresh
               limits={"request_timeout_s": 300, "producer_retry_s": 0.5, "router_max_ongoing": 6,
                       "retry_after_s": 2})
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, cfg, tmp / "store", cfg_path
    undeploy(cfg, keep_serve=True)


def _producer():
    from actors.messages import producer_name
    return ray.get_actor(producer_name(0), namespace=NS)


def _health(url) -> tuple[int, dict]:
    """(status, body) of /healthz, whatever the status (a body that is not JSON, e.g. Serve's own 503, as
    {"raw": its text})."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")[:500]}


def _ask(url, i: int):
    """(seconds since epoch when sent, status, mode or error). Every third request asks for exact output."""
    sent = time.time()
    status, out = _post(url + "/v1/completions", {"model": "qa", "prompt": PREFIX + f"Load {i}. Question:",
                                                   "max_tokens": 4, "exact": i % 3 == 0}, timeout=600)
    if status != 200:
        return sent, status, out.get("error", out)
    return sent, status, out["scd"]["mode"] + (f":{out['scd']['reason']}" if out["scd"]["reason"] else "")


def _fallbacks_counted(reason: str) -> dict[str, float]:
    """The specialists' `scd_fallbacks_total` series for qa and `reason` as Prometheus exports them (every few
    seconds): {labels: count}."""
    import urllib.request
    port = ray._private.worker.global_worker.node.metrics_export_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("ray_scd_fallbacks_total{") and f'reason="{reason}"' in line
            and 'specialist="qa"' in line}


def _counted_since(before: dict[str, float], reason: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in _fallbacks_counted(reason).items())


def _stall_producer():
    """The producer's drill: every encode waits STALL_S, so requests stay in flight at the producer. Returns
    the incarnation it has now."""
    producer = _producer()
    ray.get(producer.inject.remote(f"delay:{STALL_S}"))
    return ray.get(producer.stats.remote())["incarnation"]


def _incarnation_now() -> str | None:
    try:
        return ray.get(_producer().stats.remote(), timeout=10)["incarnation"]
    except (ray.exceptions.RayError, ValueError):
        return None


def _unstall():
    """The drill off again (a no-op on a producer Ray restarted: it starts without it)."""
    if _incarnation_now():
        ray.get(_producer().inject.remote(None), timeout=60)


def test_producer_killed_mid_load_every_request_answered_and_scd_again(served_faults):
    """HELD requests wait at a stalled producer; it is killed under them. Each is answered at once by its
    specialist's own prefill (`producer_unavailable`, not a timeout) and counted in the fallback metrics; the
    load sent while Ray restarts the producer is answered too, and `scd` comes back by itself. A third of the
    requests ask for exact output: they are answered the same way (the own prefill alone is exact)."""
    url, *_ = served_faults
    before = _fallbacks_counted("producer_unavailable")
    incarnation = _stall_producer()
    try:
        with concurrent.futures.ThreadPoolExecutor(HELD) as pool:         # within router_max_ongoing
            held = [pool.submit(_ask, url, i) for i in range(HELD)]
            assert wait_for(lambda: _health(url)[1].get("inflight") == HELD, 120, every_s=0.1), _health(url)
            time.sleep(1.0)                                       # past the tokenizer: all wait on the producer
            assert not any(f.done() for f in held), [f.result() for f in held if f.done()]
            killed = time.time()
            ray.kill(_producer(), no_restart=False)               # a crash: Ray restarts it
            results = [f.result() for f in held]
            answered_s = time.time() - killed
            later = [pool.submit(_ask, url, i) for i in range(HELD, HELD + 16)]   # while it restarts
            results_later = [f.result() for f in later]
    finally:
        _unstall()
    modes = [m for _, _, m in results]
    assert [status for _, status, _ in results] == [200] * HELD, results
    assert set(modes) == {"fallback:producer_unavailable"}, f"in flight at the kill: {results}"
    assert answered_s < PRODUCER_TIMEOUT_S, f"answered {answered_s:.1f} s after the kill: by the timeout, not the kill"
    bad = [r for r in results_later if r[1] != 200]
    assert not bad, f"{len(bad)} of {len(results_later)} requests during the restart not answered 200: {bad[:3]}"
    later_modes = {m for _, _, m in results_later}
    assert later_modes <= {"scd", "fallback:producer_unavailable", "fallback:producer_timeout",
                           "fallback:transport_error"}, later_modes
    assert wait_for(lambda: _counted_since(before, "producer_unavailable") >= HELD, 60), \
        f"the fallbacks under the kill were not counted: {_counted_since(before, 'producer_unavailable')} of {HELD}"
    assert wait_for(lambda: _ask(url, 999)[2] == "scd", BACK_WITHIN_S, every_s=0.5), \
        f"not serving scd again {BACK_WITHIN_S} s after the kill"
    back = time.time() - killed
    assert _incarnation_now() not in (None, incarnation), "the producer serving now is the one that was killed"
    print(f"\nin-flight requests answered {answered_s:.1f} s after the kill, producer back to scd after {back:.1f} s; "
          f"modes during the restart: { {m: sum(r[2] == m for r in results_later) for m in later_modes} }")
    health = _get(url + "/healthz")
    assert health["status"] == "ok", health


def test_loadtests_kill_producer_at_kills_the_served_producer(served_faults):
    """`scd loadtest --kill-producer-at` for real (its killer is mocked elsewhere): a subprocess joins the
    session's cluster by its address and kills the served producer mid-load; every request is answered and
    Ray restarts the producer (a new incarnation)."""
    url, _, _, cfg_path = served_faults
    assert wait_for(lambda: _ask(url, 700)[2] == "scd", BACK_WITHIN_S, every_s=0.5), "not serving scd before"
    incarnation = _incarnation_now()
    p = subprocess.run([sys.executable, "-m", "cli.main", "loadtest", "--url", url, "--requests", "12",
                        "--concurrency", "2", "--mix", "completions=1", "--kill-producer-at", "3",
                        "--config", str(cfg_path), "--ray-address", ray.get_runtime_context().gcs_address,
                        "--timeout", "300"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert (out["ok"], out["errors"], out["lost"]) == (12, 0, 0), out
    assert out["producer_killed_at_s"] is not None and out["producer_killed_at_s"] >= 0, out
    assert set(out["modes"]) <= {"scd", "fallback:producer_unavailable", "fallback:producer_timeout",
                                 "fallback:transport_error"}, out["modes"]
    assert wait_for(lambda: _incarnation_now() not in (None, incarnation), BACK_WITHIN_S), \
        f"the producer was not restarted: the killer did not kill it (modes {out['modes']})"
    assert wait_for(lambda: _ask(url, 701)[2] == "scd", BACK_WITHIN_S, every_s=0.5), "not serving scd again"


def test_specialist_replica_killed_under_its_requests_loses_none(served_faults, ray_cluster):
    from ray.util.state import list_actors
    url, *_ = served_faults
    with holding_qa(NS) as gate, concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_ask, url, 100 + i) for i in range(3)]
        assert wait_for(lambda: ray.get(gate.held.remote()) == 3, 300, every_s=0.2), "requests never held"
        (replica,) = [a for a in list_actors(address=ray_cluster, filters=[("state", "=", "ALIVE")])
                      if a.class_name.endswith("specialist-qa")]
        ray.kill(ray.get_actor(replica.name, namespace="serve"), no_restart=True)
        results = [f.result() for f in futures]
    assert [status for _, status, _ in results] == [200] * 3, results      # retried on the replacement
    assert _ask(url, 200)[1] == 200


def test_damaged_publish_is_refused_and_a_good_one_is_picked_up_by_producer_and_replica(served_faults):
    url, _, store_dir, _ = served_faults
    store = ArtifactStore(store_dir)
    art, manifest = store.load("base:qa@latest")
    served_version = manifest.version
    damaged = store.publish(art, manifest.fingerprints, manifest.calibration)
    path = next(p for p in store_dir.rglob("*.safetensors") if damaged.version in str(p))
    path.write_bytes(path.read_bytes()[:-8] + b"\x00" * 8)           # same size, wrong bytes
    versions = ray.get(_producer().refresh.remote())
    stats = ray.get(_producer().stats.remote())
    assert versions["base:qa"] == served_version, (versions, stats["problems"])
    assert any(damaged.version in ref for ref in stats["refused"]), stats
    _, status, mode = _ask(url, 300)
    assert (status, mode) == (200, "scd"), mode

    good = store.publish(dataclasses.replace(art), manifest.fingerprints, manifest.calibration)
    assert ray.get(_producer().refresh.remote())["base:qa"] == good.version
    status, out = _post(url + "/v1/completions", {"model": "qa", "prompt": PREFIX + "New version. Question:",
                                                   "max_tokens": 4})
    assert status == 200 and out["scd"]["mode"] == "scd", out          # the replica followed, no mismatch
    assert out["scd"]["artifact"] == good.version, (out["scd"]["artifact"], good.version)


def test_gc_while_serving_keeps_the_version_the_producer_serves(served_faults):
    url, _, store_dir, _ = served_faults
    store = ArtifactStore(store_dir)
    in_use = ray.get(_producer().refresh.remote())["base:qa"]          # renews the producer's lease
    art, manifest = store.load("base:qa@latest")
    newer = store.publish(art, manifest.fingerprints, manifest.calibration)   # LATEST moves past what we serve
    report = store.gc(keep=0)
    left = {v.version for v in store.list("base:qa")}
    assert in_use in left and newer.version in left, (in_use, left, report)
    assert any(k.version == in_use and k.why == "leased" for k in report.kept), report
    _, status, mode = _ask(url, 400)
    assert (status, mode) == (200, "scd"), mode


def _one_too_many(url) -> tuple[int, str | None, str]:
    """(status, Retry-After, body text) of a request to a router that should be full."""
    import urllib.request
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"model": "qa", "prompt": PREFIX + "One too many.", "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, None, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Retry-After"], e.read().decode(errors="replace")


def test_overload_answers_503_with_retry_after_and_then_serves_again(served_faults):
    """Six requests held open fill the router (limits.router_max_ongoing: 6): a burst of twelve more, sent at
    once, is refused at once, each with the router's own OpenAI-shaped 503 and Retry-After (never Serve's
    plain-text backpressure answer), and once the six finish the next request is served."""
    from serve_app.app import wait_healthy
    url, *_ = served_faults
    # the fault drills before this one kill replicas and the producer: start from a whole app again (while
    # Serve restarts them, /healthz may say "down" with a 503)
    assert wait_healthy(url, 300), "the app did not recover from the previous drills"
    with holding_qa(NS) as gate, concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_ask, url, 500 + i) for i in range(6)]
        seen = []                   # /healthz bodies: the count is there with a 503 too (a "down" app)

        def full():
            seen.append(_health(url))
            return seen[-1][1].get("inflight") == 6
        assert wait_for(full, 300, every_s=0.2), (f"router never full; last /healthz: {seen[-1]}; requests that "
                                                  f"already returned: {[f.result() for f in futures if f.done()]}")
        with concurrent.futures.ThreadPoolExecutor(12) as burst:
            refused = list(burst.map(lambda _: _one_too_many(url), range(12)))
        ray.get(gate.open.remote())
        results = [f.result() for f in futures]
    for status, retry_after, body in refused:
        assert status == 503 and retry_after == "2", (status, retry_after, body)
        err = json.loads(body)["error"]
        assert err["code"] == "overloaded" and err["type"] == "server_error" and err["message"], err
    assert [status for _, status, _ in results] == [200] * 6, results
    assert _ask(url, 600)[1] == 200
