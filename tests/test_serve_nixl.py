"""The nixl transport through real Serve replicas, on CPU: the producer stages each payload as a tensor and the
replica that serves the request pulls it through Ray Direct Transport (NIXL over UCX). A fan-out answers from
codes, a family's one payload is pulled by every member, and after a producer crash the replicas pull from
the new one."""
import pytest
import ray
import yaml

from jobs.calibrate import main as calibrate
from jobs.family import main as family_job
from tests.conftest import DEMO, free_port, write_config
from tests.test_serve import PREFIX, _get, _post, deploy_and_wait, wait_for

NS = "scd-test-nixl"


@pytest.fixture(scope="module")
def served_nixl(ray_cluster, tmp_path_factory, demo_work_dir):
    from actors.producer_actor import PRODUCER_NAME
    tmp = tmp_path_factory.mktemp("serve-nixl")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1, work_dir=demo_work_dir)
    for pair in ("base:qa", "base:prose"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    family_job(["--config", str(cfg_path), "--members", "qa,prose", "--name", "fam", "--publish", "--repeats", "1",
                "--out", str(tmp / "family")])
    raw = yaml.safe_load(cfg_path.read_text())
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25},
                          {"name": "prose", "path": str(DEMO / "prose"), "num_cpus": 0.25}]
    raw.update(transport="nixl", ray={"namespace": NS}, http={"port": free_port()}, producer_timeout_s=5,
               limits={"request_timeout_s": 600, "specialist_max_ongoing": 8}, families=[{"name": "fam"}])
    raw["producer"]["num_cpus"] = 0.25
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, ray.get_actor(PRODUCER_NAME, namespace=NS)
    from ray import serve
    serve.shutdown()


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
    ray.kill(producer, no_restart=False)                      # a crash: Ray restarts it, its staged payloads are gone

    reasons = []

    def scd_again():
        status, out = _post(url + "/v1/completions", {"model": "prose", "prompt": PREFIX + "After restart. The",
                                                      "max_tokens": 2})
        assert status == 200, out                             # while it is down: a stated fallback, never an error
        reasons.append(out["scd"].get("reason"))
        return out["scd"]["mode"] == "scd"
    assert wait_for(scd_again, 120, every_s=0.5), f"prose never served from codes again: {reasons[-3:]}"
    assert ray.get(producer.stats.remote())["incarnation"] != before
