"""A LoRA group behind the router (Serve on the session's Ray): two adapters of the producer's model served by
one engine under their own names, beside a specialist served from codes; one fan-out over all three."""
import time

import pytest
import yaml

from cluster.config import ConfigError, load_config
from serve_app.app import undeploy
from tests.conftest import DEMO, serving_config
from tests.test_group_engine import ADAPTERS, _random_lora
from tests.test_serve import PREFIX, _get, _post, deploy_and_wait, wait_for

FIXED = {"min_replicas": 1, "max_replicas": 1}


def group_config(tmp, demo_store, demo_work_dir) -> dict:
    cfg_path = serving_config(tmp, demo_store, demo_work_dir)
    for seed, name in enumerate(("every", "top", "act"), start=1):          # every: loaded at run time
        _random_lora(seed, ADAPTERS[name]).save_pretrained(str(tmp / name))
    raw = yaml.safe_load(cfg_path.read_text())
    raw["specialists"] = [{"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25, "autoscaling": FIXED},
                          *({"name": n, "path": str(tmp / n), "group": "g", "num_cpus": 0.25, "autoscaling": FIXED}
                            for n in ("top", "act"))]
    raw["producer"]["num_cpus"] = 0.25
    raw["ray"] = {"namespace": "scd-test"}
    return raw


@pytest.fixture(scope="module")
def served_group(ray_cluster, tmp_path_factory, demo_store, demo_work_dir):
    tmp = tmp_path_factory.mktemp("serve-group")
    raw = group_config(tmp, demo_store, demo_work_dir)
    cfg, url = deploy_and_wait(tmp / "group.yaml", raw)
    yield url, tmp
    undeploy(cfg, keep_serve=True)


def test_each_member_answers_by_its_name_from_the_groups_own_prefill(served_group):
    import openai
    url, _ = served_group
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {"qa", "top", "act"}
    out = client.completions.create(model="top", prompt="Question: Where does Tilda Vance live?\nAnswer:",
                                    max_tokens=6, extra_body={"prefix": PREFIX, "ignore_eos": True})
    assert out.usage.completion_tokens == 6, out
    scd = out.model_extra["scd"]
    assert scd["mode"] == "scd" and scd["group"]["adapter_share"] == pytest.approx(3 / 8) and \
        scd["payload_bytes"] == 0 and scd["producer"] is None, scd
    status, r = _post(url + "/v1/completions", {"model": "act", "prefix": PREFIX, "prompt": " Answer:",
                                                "max_tokens": 4, "exact": True})
    assert status == 200 and r["scd"]["mode"] == "scd" and r["scd"]["group"] == {
        "base_cached": True, "adapter_share": 0.0}, r        # top's request prefilled this prefix's base layers
    status, r = _post(url + "/v1/completions", {"model": "act", "prefix": PREFIX, "prompt": " Answer:",
                                                "max_tokens": 4, "oracle": True})
    assert status == 200 and r["scd"]["mode"] == "oracle", r


def test_a_fan_out_over_a_group_and_a_coded_specialist_prefills_the_groups_base_once(served_group):
    url, _ = served_group
    prefix = PREFIX + "Ilse Moreau keeps bees in Orrin Vale. "
    status, out = _post(url + "/v1/fanout", {"prefix": prefix, "requests": [
        {"specialist": n, "suffix": "Question: Who keeps bees?\nAnswer:", "max_tokens": 4}
        for n in ("qa", "top", "act")]})
    assert status == 200, out
    by = {r["specialist"]: r["scd"] for r in out["results"]}
    assert by["qa"]["mode"] == "scd" and by["qa"]["payload_bytes"] > 0, by["qa"]       # codes from the producer
    assert sorted(by[n]["group"]["base_cached"] for n in ("top", "act")) == [False, True], by


def test_health_reports_the_members_of_a_group(served_group):
    report = _get(served_group[0] + "/healthz")
    assert report["status"] == "ok", report["problems"]
    for n in ("top", "act"):
        st = report["specialists"][n]
        assert st["group"] == "g" and st["members"] == ["top", "act"] and st["specialist"] == n, st


def test_a_group_member_that_is_not_an_adapter_of_the_producer_is_refused_in_one_line(tmp_path, demo_store,
                                                                                       demo_work_dir):
    from serve_app.app import build
    raw = group_config(tmp_path, demo_store, demo_work_dir)
    raw["specialists"][1]["path"] = str(DEMO / "prose")            # a full model, not an adapter
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="group 'g': top: .* is not a PEFT adapter folder"):
        build(load_config(tmp_path / "bad.yaml"))


def _job_report(dashboard: str, calibration: str) -> str:
    """The status and log tail of the adapter's calibration job ("Ray Job ID"), for a failure's message."""
    from ray.job_submission import JobSubmissionClient
    if not calibration.startswith("Ray Job "):
        return calibration
    client, job = JobSubmissionClient(dashboard), calibration.split()[2].rstrip(":")
    return f"{job}: {client.get_job_status(job)}\n{client.get_job_logs(job)[-3000:]}"


def test_an_adapter_loaded_and_unloaded_at_run_time_with_no_failed_request(served_group, ray_cluster):
    """vLLM's endpoints: the adapter is served from the answer on, by its own prefill, while its pair is
    calibrated as a Ray Job; it switches to the published artifact with no failed request (others and its
    own go on meanwhile), and its own requests running when it is unloaded finish; then its name is unknown."""
    import concurrent.futures
    import threading
    url, tmp = served_group
    body = {"model": "top", "prefix": PREFIX, "prompt": " Answer:", "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(_post, url + "/v1/completions", body) for _ in range(6)]
        status, r = _post_text(url + "/v1/load_lora_adapter", {"lora_name": "every", "lora_path": str(tmp / "every")})
        assert (status, r) == (200, "Success: LoRA adapter 'every' added successfully."), r
        assert all(f.result()[0] == 200 for f in others), [f.result() for f in others]
    assert "every" in {m["id"] for m in _get(url + "/v1/models")["data"]}
    status, r = _post(url + "/v1/completions", {**body, "model": "every"})
    assert status == 200 and (r["scd"]["mode"], r["scd"]["reason"]) == ("fallback", "no_artifact"), r

    answers, stop = [], threading.Event()            # requests for "every" and "top" through the switch

    def ask():                                       # a steady trickle: the job needs the cores more
        while not stop.wait(0.5):
            for model in ("every", "top"):
                answers.append(_post(url + "/v1/completions", {**body, "model": model}))
    asking = threading.Thread(target=ask)
    asking.start()
    try:
        deadline = time.monotonic() + 600                # the job on a 2-core machine beside the other tests
        while not any(s == 200 and o["scd"]["mode"] == "scd" and o["scd"]["artifact"] for s, o in answers[-2:]):
            st = _get(url + "/healthz")["specialists"]["every"]
            if time.monotonic() > deadline or st.get("calibration", "").endswith((": FAILED", ": STOPPED")):
                pytest.fail(f"every never switched to its artifact: {st}\n"
                            f"{_job_report(ray_cluster, st.get('calibration', ''))}")
            time.sleep(2)
    finally:
        stop.set()
        asking.join()
    assert all(s == 200 for s, _ in answers), [o for s, o in answers if s != 200][:3]
    switched = next(o["scd"] for s, o in answers if o["model"] == "every" and o["scd"]["mode"] == "scd")
    assert switched["group"]["adapter_share"] == 0.0 and switched["artifact"], switched      # codes alone
    health = lambda: _get(url + "/healthz")["specialists"]["every"]                    # noqa: E731
    assert wait_for(lambda: health()["calibration"].endswith(": SUCCEEDED"), 60), health()   # the job, followed
    assert health()["artifact"] == switched["artifact"], health()

    status, r = _post(url + "/v1/load_lora_adapter", {"lora_name": "every", "lora_path": str(tmp / "every")})
    assert status == 400 and r["error"]["param"] == "lora_name" and "already served" in r["error"]["message"], r
    status, r = _post(url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(DEMO / "prose")})
    assert status == 400 and r["error"]["param"] == "lora_path" and "not a PEFT adapter" in r["error"]["message"], r
    status, r = _post(url + "/v1/unload_lora_adapter", {"lora_name": "top"})
    assert status == 400 and "configured" in r["error"]["message"], r

    long = {**body, "model": "every", "max_tokens": 300, "ignore_eos": True}     # seconds each: still running
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_post, url + "/v1/completions", long) for _ in range(3)]
        deadline = time.monotonic() + 120
        while _get(url + "/healthz")["specialists"]["every"]["running"] < 3:     # all three in the engine
            assert time.monotonic() < deadline, "the three requests never reached the group's engine"
            time.sleep(0.05)
        status, r = _post_text(url + "/v1/unload_lora_adapter", {"lora_name": "every"})
        assert (status, r) == (200, "Success: LoRA adapter 'every' removed successfully."), r
        done = [f.result() for f in running]
    assert all(s == 200 and r["usage"]["completion_tokens"] == 300 for s, r in done), done
    status, r = _post(url + "/v1/completions", {**body, "model": "every"})
    assert status == 404 and r["error"]["code"] == "model_not_found", r


def _post_text(url, body, timeout=120):
    """(status, body text): the load and unload endpoints answer plain text, as vLLM's do."""
    import json as _json
    import urllib.request
    req = urllib.request.Request(url, _json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
