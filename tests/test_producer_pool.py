"""A pool of two producers serving the demo family: each prefix goes to the producer that owns it on the ring
(so its cache keeps hitting), a producer killed under load costs no lost request and no fallback beyond what was
inside it, and the pool grows from one producer to two and back under load with each prefix changing owner at
most once per step."""
import concurrent.futures
import threading
import time

import pytest
import ray
import yaml

from serve_app.app import undeploy
from tests.conftest import DEMO, serving_config
from tests.test_serve import PREFIX, _get, _post, deploy_and_wait, wait_for

NS = "scd-test-pool"


@pytest.fixture(scope="module")
def served_pool(ray_cluster, tmp_path_factory, demo_store, demo_work_dir):
    """qa (calibrated) and nocal (no artifact) behind two producers. Yields (url, the pool actor)."""
    from actors.producer_pool import POOL_NAME
    tmp = tmp_path_factory.mktemp("pool")
    cfg_path = serving_config(tmp, demo_store, demo_work_dir)
    raw = yaml.safe_load(cfg_path.read_text())
    one = {"num_cpus": 0.25, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), **one},
                          {"name": "nocal", "path": str(DEMO / "qa"), **one}]
    raw["producer"].update(num_cpus=0.25, replicas=2)
    raw.update(ray={"namespace": NS}, producer_timeout_s=60,
               limits={"request_timeout_s": 600, "specialist_max_ongoing": 8, "producer_retry_s": 0.5})
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, ray.get_actor(POOL_NAME, namespace=NS)
    undeploy(cfg, keep_serve=True)


def ask(url: str, prefix: int, tag: str = "") -> dict:
    """qa, asked after prefix number `prefix`; returns the answer's scd object (status and mode checked by
    the caller)."""
    status, out = _post(url + "/v1/completions", {"model": "qa", "prefix": PREFIX + f"Note {prefix}. ",
                                                   "prompt": f"Question{tag}: Where does Tilda Vance live?\nAnswer:",
                                                   "max_tokens": 2})
    return {"status": status, **(out.get("scd") or {"error": out})}


def producers(url: str) -> dict:
    return _get(url + "/healthz")["producers"]


def test_each_prefix_goes_to_its_owner_and_hits_its_cache(served_pool):
    url, pool = served_pool
    assert len(ray.get(pool.members.remote())["live"]) == 2
    before = producers(url)
    owners = {}
    for round_ in range(3):
        for p in range(10):
            out = ask(url, p)
            assert out["status"] == 200 and out["mode"] == "scd", out
            owners.setdefault(p, set()).add(out["producer"])
    assert all(len(o) == 1 for o in owners.values()), f"a prefix moved between producers: {owners}"
    assert len({next(iter(o)) for o in owners.values()}) == 2, f"ten prefixes all went to one producer: {owners}"
    after = producers(url)
    prefills = sum(after[n]["prefills"] - before[n]["prefills"] for n in after)
    hits = sum(after[n]["cache_hits"] - before[n]["cache_hits"] for n in after)
    assert prefills == 10 and hits == 20, f"30 requests on 10 prefixes: {prefills} prefills, {hits} cache hits"
    assert abs(sum(p["share"] for p in after.values()) - 1) < 1e-3, after


def test_health_reports_each_problem_in_one_line_and_is_degraded_for_a_pair_without_artifact(served_pool):
    url, _ = served_pool
    health = _get(url + "/healthz")
    assert health["status"] == "degraded", health
    lines = [line for line in health["problems"] if line.startswith("base:nocal")]
    assert lines, health["problems"]
    for line in health["problems"]:
        assert "\n" not in line and "\x1b" not in line and "Traceback" not in line and "since 20" in line, line
    assert all(p["state"] == "up" for p in health["producers"].values()), health["producers"]


def load(url: str, stop: threading.Event, prefixes: int, workers: int = 4) -> list[tuple[float, int, dict]]:
    """Requests on `prefixes` prefixes round-robin from `workers` threads until stopped: (time asked, prefix, scd)."""
    seen, lock, counter = [], threading.Lock(), iter(range(10**9))

    def worker():
        while not stop.is_set():
            with lock:
                i = next(counter)
            t = time.monotonic()
            out = ask(url, i % prefixes, "L")
            with lock:
                seen.append((t, i % prefixes, out))
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(worker) for _ in range(workers)]:
            f.result()
    return seen


def test_a_producer_killed_under_load_loses_nothing_and_the_pool_comes_back(served_pool):
    """Its in-flight encodes fail over to the next producer on the ring; nothing is lost; what falls back is
    at most what was inside it (here: nothing should, as every encode is retried within its deadline)."""
    url, pool = served_pool
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        running = ex.submit(load, url, stop, 12)
        time.sleep(4)
        victim = ray.get(pool.members.remote())["live"][0]
        inflight = producers(url)[victim]["inflight"]
        ray.kill(ray.get_actor(victim, namespace=NS), no_restart=False)        # a crash: Ray restarts it
        t_kill = time.monotonic()
        time.sleep(6)
        stop.set()
        seen = running.result()
    assert all(out["status"] == 200 for _, _, out in seen), [o for _, _, o in seen if o["status"] != 200][:3]
    fallbacks = [out for t, _, out in seen if out["mode"] != "scd"]
    assert len(fallbacks) <= max(inflight, 4), \
        f"{len(fallbacks)} fallbacks ({[o.get('reason') for o in fallbacks]}), {inflight} were in flight in it"
    after = [out for t, _, out in seen if t > t_kill + 0.5]
    assert after and all(out["mode"] == "scd" for out in after), "requests after the kill were not all scd"
    assert wait_for(lambda: all(p["state"] == "up" for p in producers(url).values()), 120), producers(url)
    assert len(producers(url)) == 2


def test_the_pool_grows_and_shrinks_under_load_each_prefix_moving_at_most_once_a_step(served_pool):
    url, pool = served_pool
    ray.get(pool.scale.remote(1))
    assert wait_for(lambda: len(producers(url)) == 1, 30), producers(url)
    stop = threading.Event()
    marks = []
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        running = ex.submit(load, url, stop, 8)
        time.sleep(3)
        for n in (2, 1):
            marks.append(time.monotonic())
            ray.get(pool.scale.remote(n))
            assert wait_for(lambda: len(producers(url)) == n, 120), producers(url)
            time.sleep(4)
        stop.set()
        seen = running.result()
    missed = [{k: o.get(k) for k in ("status", "mode", "reason", "producer", "error")}
              for _, _, o in seen if o["status"] != 200 or o["mode"] != "scd"]
    assert not missed, f"{len(missed)} of {len(seen)} requests not served by scd, e.g. {missed[:3]}"
    steps = [(float("-inf"), marks[0]), (marks[0], marks[1]), (marks[1], float("inf"))]
    for lo, hi in steps[1:]:
        for p in range(8):
            owners = [out["producer"] for t, q, out in sorted(seen, key=lambda x: x[0]) if q == p and lo <= t < hi]
            changes = sum(a != b for a, b in zip(owners, owners[1:]))
            assert changes <= 1, f"prefix {p} changed owner {changes} times in one step: {owners}"
    assert ray.get(pool.members.remote())["target"] == 1
