"""The NCCL transport wired through real Serve replicas, on CPU: `transport: nccl_fake` runs the whole
protocol (register on start, staged payload, push to the serving replica, in-order receive, unregister
when the replica stops) over the fake communicator, whose hub actor stands in for the network."""
import pytest
import ray
import yaml

from jobs.calibrate import main as calibrate
from jobs.family import main as family_job
from tests.conftest import DEMO, free_port, write_config
from tests.test_serve import PREFIX, _get, _post, deploy_and_wait, scale_up_with_held_requests, wait_for

NS = "scd-test-nccl"


@pytest.fixture(scope="module")
def served_nccl(ray_cluster, tmp_path_factory, demo_work_dir):
    from actors.producer_actor import PRODUCER_NAME
    tmp = tmp_path_factory.mktemp("serve-nccl")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1, work_dir=demo_work_dir)
    for pair in ("base:qa", "base:prose"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    family_job(["--config", str(cfg_path), "--members", "qa,prose", "--name", "fam", "--publish", "--repeats", "1",
                "--out", str(tmp / "family")])
    raw = yaml.safe_load(cfg_path.read_text())
    raw["specialists"] = [
        {"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25,
         "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                         "upscale_delay_s": 0.5, "downscale_delay_s": 2}},
        {"name": "prose", "path": str(DEMO / "prose"), "num_cpus": 0.25}]
    raw.update(transport="nccl_fake", ray={"namespace": NS}, http={"port": free_port()}, producer_timeout_s=5,
               limits={"request_timeout_s": 600, "specialist_max_ongoing": 8}, families=[{"name": "fam"}])
    raw["producer"]["num_cpus"] = 0.25
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, ray.get_actor(PRODUCER_NAME, namespace=NS)
    from ray import serve
    serve.shutdown()


def _replicas(producer):
    return ray.get(producer.stats.remote())["channels"]


def test_fanout_codes_travel_over_per_replica_communicators(served_nccl):
    url, producer = served_nccl
    stats = ray.get(producer.stats.remote())
    assert stats["transport"] == "nccl_fake"
    assert sorted(r.split("#")[0] for r in stats["channels"]) == ["prose", "qa"], stats["channels"]
    hub = ray.get_actor("scd-fake-nccl", namespace=NS)
    assert ray.get(hub.open_communicators.remote()) == 2
    for i in range(3):                                        # several requests: in order on each communicator
        status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + f"Round {i}. ", "requests": [
            {"specialist": "qa", "suffix": "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in",
             "max_tokens": 4},
            {"specialist": "prose", "suffix": "The", "max_tokens": 4},
            {"specialist": "qa", "suffix": "Question: Where does Clara Petrov live?\nAnswer:", "max_tokens": 4}]})
        assert status == 200, out
        # qa and prose are one family: one staged payload, pushed to each of the three requests' replicas
        assert [(r["scd"]["mode"], r["scd"]["family"]) for r in out["results"]] == [("scd", "base:fam")] * 3, out
        assert all(r["scd"]["payload_bytes"] > 0 for r in out["results"])
    assert ray.get(producer.stats.remote())["staged"] == 0      # each staged copy went to every receiver
    assert all(r["text"] for r in out["results"]), out
    health = _get(url + "/healthz")
    assert {s["transport"] for s in health["specialists"].values()} == {"nccl_fake"}, health


def test_replicas_register_when_scaled_up_and_unregister_when_scaled_down(served_nccl):
    url, producer = served_nccl
    qa = lambda: sum(r.startswith("qa#") for r in _replicas(producer))   # noqa: E731
    peak, timeline, answers = scale_up_with_held_requests(url, NS, qa, body={
        "model": "qa", "prompt": PREFIX + "Load. Question:", "max_tokens": 4})
    assert peak >= 2, f"only {peak} qa replica(s) ever registered a communicator; (t s, registered, held): {timeline}"
    assert all(status == 200 and out["scd"]["mode"] == "scd" for status, out in answers), answers
    assert wait_for(lambda: qa() == 1, 180), f"scaled-down replica kept its communicator: {_replicas(producer)}"
    hub = ray.get_actor("scd-fake-nccl", namespace=NS)
    assert ray.get(hub.open_communicators.remote()) == 2


def test_replicas_register_again_with_a_restarted_producer(served_nccl):
    url, producer = served_nccl
    before = ray.get(producer.stats.remote())["incarnation"]
    ray.kill(producer, no_restart=False)                      # a crash: Ray restarts it, communicators are gone

    def scd_again():
        status, out = _post(url + "/v1/completions", {"model": "prose", "prompt": PREFIX + "After restart. The",
                                                      "max_tokens": 2})
        assert status == 200, out                             # while it is down: a stated fallback, never an error
        return out["scd"]["mode"] == "scd"
    assert wait_for(scd_again, 120, every_s=0.5), "prose never served from codes again after the producer restart"
    stats = ray.get(producer.stats.remote())
    assert stats["incarnation"] != before and any(r.startswith("prose#") for r in stats["channels"]), stats
