"""The nixl transport through real Serve replicas, on CPU: the producer stages each payload (a `codec.Wire`)
and the replica that serves the request pulls it through Ray Direct Transport (NIXL over UCX). A fan-out
answers from codes, a family's one payload is encoded once and pulled by every member, replicas that come
and go with autoscaling pull with nothing to join or leave, and after a producer crash the replicas pull from
the new one. (The same on a GPU, and over cuda_ipc: tests/test_gpu.py.)"""
import time

import pytest
import ray
import yaml

from serve_app.app import undeploy
from tests.conftest import DEMO, serving_config
from tests.test_serve import (PREFIX, _get, _post, deploy_and_wait, running_replicas, scale_up_with_held_requests,
                              wait_for)

NS = "scd-test-nixl"


def serve_family(tmp_path_factory, demo_store, demo_work_dir, transport: str, namespace: str, qa: dict | None = None,
                 gpus: float = 0):
    """qa and prose (calibrated, and published as the family "fam": the session's demo_store) served with
    `transport` in `namespace`; `qa`: more settings of the qa specialist; `gpus`: each model's share of a GPU
    (0: on CPU). Yields (url, the producer's handle); Serve stops after."""
    from actors.messages import producer_name
    tmp = tmp_path_factory.mktemp(f"serve-{transport}")
    cfg_path = serving_config(tmp, demo_store, demo_work_dir)
    raw = yaml.safe_load(cfg_path.read_text())
    place = {"num_cpus": 0.25, "num_gpus": gpus}
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), **place, **(qa or {})},
                          {"name": "prose", "path": str(DEMO / "prose"), **place}]
    # ray.cores: autoscaling's mechanics on any machine (on 2 real cores the engines would stay at one replica)
    raw.update(transport=transport, transport_inline_bytes=0, ray={"namespace": namespace, "cores": 16},
              
               producer_timeout_s=5,
               limits={"request_timeout_s": 600, "specialist_max_ongoing": 8}, families=[{"name": "fam"}])
    raw["producer"].update(place)
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, ray.get_actor(producer_name(0), namespace=namespace)
    undeploy(cfg, keep_serve=True)


def codes_again_after_a_producer_crash(url: str, producer) -> list:
    """Kill the producer (Ray restarts it) and wait until prose answers from codes again; while it is down every
    answer is a stated fallback, never an error. Returns the fallback reasons seen; fails after 120 s."""
    ray.kill(producer, no_restart=False)
    reasons = []

    def scd_again():
        status, out = _post(url + "/v1/completions", {"model": "prose", "prompt": PREFIX + "After restart. The",
                                                      "max_tokens": 2})
        assert status == 200, out
        reasons.append(out["scd"].get("reason"))
        return out["scd"]["mode"] == "scd"
    assert wait_for(scd_again, 120, every_s=0.5), f"prose never served from codes again: {reasons[-3:]}"
    return reasons


@pytest.fixture(scope="module")
def served_nixl(ray_cluster, tmp_path_factory, demo_store, demo_work_dir):
    yield from serve_family(tmp_path_factory, demo_store, demo_work_dir, "nixl", NS, {"autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
        "downscale_delay_s": 2, "look_back_period_s": 3}})


def test_a_fanout_is_served_from_payloads_each_replica_pulls(served_nixl):
    url, producer = served_nixl
    for i in range(3):
        before = ray.get(producer.stats.remote())
        status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + f"Round {i}. ", "requests": [
            {"specialist": "qa", "suffix": "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in",
             "max_tokens": 4},
            {"specialist": "prose", "suffix": "The", "max_tokens": 4},
            {"specialist": "qa", "suffix": "Question: Where does Clara Petrov live?\nAnswer:", "max_tokens": 4}]})
        assert status == 200, out
        # qa and prose are one family: one staged payload, pulled by each of the three requests' replicas
        assert [(r["scd"]["mode"], r["scd"]["family"]) for r in out["results"]] == [("scd", "base:fam")] * 3, [r["scd"].get("reason") for r in out["results"]]
        assert all(r["scd"]["payload_bytes"] > 0 and r["text"] for r in out["results"]), out
        after = ray.get(producer.stats.remote())       # one prefill and one encode (one cached payload) for three
        assert (after["prefills"] - before["prefills"], after["cache_entries"] - before["cache_entries"]) == (1, 1), \
            (before, after)
    stats = ray.get(producer.stats.remote())
    assert stats["transport"] == "nixl" and stats["staged"] == 0, stats   # every copy went to every receiver
    health = _get(url + "/healthz")
    assert {s["transport"] for s in health["specialists"].values()} == {"nixl"}, health


def test_replicas_pull_from_a_restarted_producer(served_nixl):
    url, producer = served_nixl
    before = ray.get(producer.stats.remote())["incarnation"]
    t0 = time.monotonic()
    reasons = codes_again_after_a_producer_crash(url, producer)   # its staged payloads are gone with the old process
    print(f"scd again {time.monotonic() - t0:.1f} s after the producer was killed ({len(reasons)} answers)")
    assert ray.get(producer.stats.remote())["incarnation"] != before


def test_a_replica_killed_under_its_requests_loses_none(served_nixl, ray_cluster):
    """A request held at qa's one replica (one: more in flight would scale qa up, and the replica killed might
    not be the one holding it); the replica is killed, and with it its engine actor: the request is answered
    on the replacement."""
    import concurrent.futures

    from ray.util.state import list_actors

    from tests.test_serve import holding_qa
    url, _ = served_nixl
    body = {"model": "qa", "prompt": PREFIX + "Killed. Question:", "max_tokens": 2}
    alive = lambda: [a for a in list_actors(address=ray_cluster, filters=[("state", "=", "ALIVE")])  # noqa: E731
                     if a.class_name.endswith("specialist-qa")]
    assert wait_for(lambda: len(alive()) == 1, 180), f"qa replicas alive: {alive()}"   # qa has not scaled up yet
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with holding_qa(NS) as gate:
            future = pool.submit(_post, url + "/v1/completions", body, 600)
            assert wait_for(lambda: ray.get(gate.held.remote()) == 1, 300, every_s=0.2), "the request never held"
            (replica,) = alive()
            ray.kill(ray.get_actor(replica.name, namespace="serve"), no_restart=True)
        status, out = future.result()                # (the gate is open by now, whichever replica held it)
    assert status == 200, out                        # retried on the replacement
    status, out = _post(url + "/v1/completions", body)
    assert status == 200 and out["scd"]["mode"] == "scd", out


def test_replicas_added_and_removed_by_autoscaling_pull_with_nothing_to_join(served_nixl):
    """qa scales 1 -> 2 under held requests, every one answered from codes pulled by whichever replica Serve
    picked, then back to 1; answers from codes again after."""
    url, _ = served_nixl
    peak, timeline, answers = scale_up_with_held_requests(url, NS, running_replicas, body={
        "model": "qa", "prompt": PREFIX + "Load. Question:", "max_tokens": 4})
    assert peak >= 2, f"qa never reached 2 replicas; (t s, replicas, held): {timeline}"
    assert all(status == 200 and out["scd"]["mode"] == "scd" for status, out in answers), answers
    assert wait_for(lambda: running_replicas() == 1, 180), f"qa stayed at {running_replicas()} replicas"
    status, out = _post(url + "/v1/completions", {"model": "qa", "prompt": PREFIX + "After. Question:",
                                                   "max_tokens": 2})
    assert status == 200 and out["scd"]["mode"] == "scd", out
