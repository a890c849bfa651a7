"""The nixl transport through real Serve replicas, on CPU: the producer stages each payload as a tensor and the
replica that serves the request pulls it through Ray Direct Transport (NIXL over UCX). A fan-out answers from
codes, a family's one payload is pulled by every member, and after a producer crash the replicas pull from
the new one."""
import pytest
import ray

from tests.test_serve import PREFIX, _get, _post
from tests.test_serve_nccl import codes_again_after_a_producer_crash, serve_family

NS = "scd-test-nixl"


@pytest.fixture(scope="module")
def served_nixl(ray_cluster, tmp_path_factory, demo_work_dir):
    yield from serve_family(tmp_path_factory, demo_work_dir, "nixl", NS)


def test_a_fanout_is_served_from_payloads_each_replica_pulls(served_nixl):
    url, producer = served_nixl
    for i in range(3):
        status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + f"Round {i}. ", "requests": [
            {"specialist": "qa", "suffix": "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in",
             "max_tokens": 4},
            {"specialist": "prose", "suffix": "The", "max_tokens": 4},
            {"specialist": "qa", "suffix": "Question: Where does Clara Petrov live?\nAnswer:", "max_tokens": 4}]})
        assert status == 200, out
        # qa and prose are one family: one staged payload, pulled by each of the three requests' replicas
        assert [(r["scd"]["mode"], r["scd"]["family"]) for r in out["results"]] == [("scd", "base:fam")] * 3, [r["scd"].get("reason") for r in out["results"]]
        assert all(r["scd"]["payload_bytes"] > 0 and r["text"] for r in out["results"]), out
    stats = ray.get(producer.stats.remote())
    assert stats["transport"] == "nixl" and stats["staged"] == 0, stats   # every copy went to every receiver
    health = _get(url + "/healthz")
    assert {s["transport"] for s in health["specialists"].values()} == {"nixl"}, health


def test_replicas_pull_from_a_restarted_producer(served_nixl):
    url, producer = served_nixl
    before = ray.get(producer.stats.remote())["incarnation"]
    codes_again_after_a_producer_crash(url, producer)         # its staged payloads are gone with the old process
    assert ray.get(producer.stats.remote())["incarnation"] != before
