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


def serve_family(tmp_path_factory, demo_work_dir, transport: str, namespace: str, qa: dict | None = None,
                 gpus: float = 0):
    """qa and prose (calibrated, and published as the family "fam") served with `transport` in `namespace`;
    `qa`: more settings of the qa specialist; `gpus`: each model's share of a GPU (0: on CPU). Yields (url,
    the producer's handle); Serve stops after."""
    from actors.producer_actor import PRODUCER_NAME
    tmp = tmp_path_factory.mktemp(f"serve-{transport}")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1, work_dir=demo_work_dir)
    for pair in ("base:qa", "base:prose"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    family_job(["--config", str(cfg_path), "--members", "qa,prose", "--name", "fam", "--publish", "--repeats", "1",
                "--out", str(tmp / "family")])
    raw = yaml.safe_load(cfg_path.read_text())
    place = {"num_cpus": 0.25, "num_gpus": gpus}
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), **place, **(qa or {})},
                          {"name": "prose", "path": str(DEMO / "prose"), **place}]
    raw.update(transport=transport, ray={"namespace": namespace}, http={"port": free_port()}, producer_timeout_s=5,
               limits={"request_timeout_s": 600, "specialist_max_ongoing": 8}, families=[{"name": "fam"}])
    raw["producer"].update(place)
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, ray.get_actor(PRODUCER_NAME, namespace=namespace)
    from ray import serve
    serve.shutdown()


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
def served_nccl(ray_cluster, tmp_path_factory, demo_work_dir):
    yield from serve_family(tmp_path_factory, demo_work_dir, "nccl_fake", NS, {"autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
        "downscale_delay_s": 2}})


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
    codes_again_after_a_producer_crash(url, producer)         # communicators are gone with the old process
    stats = ray.get(producer.stats.remote())
    assert stats["incarnation"] != before and any(r.startswith("prose#") for r in stats["channels"]), stats
