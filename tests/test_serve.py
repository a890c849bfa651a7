"""The Serve app on a real local Ray + Serve: OpenAI client, fan-out, every fallback, metrics, autoscaling."""
import concurrent.futures
import dataclasses
import json
import time
import urllib.request

import pytest
import ray
import yaml

from artifacts_store import ArtifactStore
from cluster.config import load_config
from jobs.calibrate import main as calibrate
from tests.conftest import DEMO, free_port, write_config

PREFIX = ("Notes:\nClara Petrov lives in Galen Cross. Tilda Vance works as a brewer. Clara Petrov owns a teal "
          "kettle. Tilda Vance lives in Hythe.\n")


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def deploy_and_wait(cfg_path, raw: dict):
    """Write the config, deploy the app on the session's Ray, wait until /healthz says ok: (cfg, url)."""
    from serve_app.app import deploy, wait_healthy
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg = load_config(cfg_path)
    deploy(cfg)
    url = f"http://127.0.0.1:{cfg.http.port}"
    wait_healthy(url, timeout_s=120)
    return cfg, url


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    from actors.producer_actor import PRODUCER_NAME
    tmp = tmp_path_factory.mktemp("serve")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1)
    for pair in ("base:qa", "base:prose", "base:code"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    store = ArtifactStore(tmp / "store")
    art, manifest = store.load("base:qa")                  # calibrated for qa's weights, published for "wrong"
    store.publish(dataclasses.replace(art, pair="base:wrong"), manifest.fingerprints, manifest.calibration)
    raw = yaml.safe_load(cfg_path.read_text())
    fast = {"min_replicas": 1, "max_replicas": 1}
    raw["specialists"] = [
        {"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25,
         "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                         "upscale_delay_s": 0.5, "downscale_delay_s": 2}},
        *({"name": n, "path": str(DEMO / p), "num_cpus": 0.25, "autoscaling": fast}
          for n, p in (("prose", "prose"), ("code", "code"), ("nocal", "qa"), ("wrong", "prose")))]
    raw["producer"]["num_cpus"] = 0.25
    raw["ray"] = {"namespace": "scd-test"}
    raw["http"] = {"port": free_port()}
    raw["producer_timeout_s"] = 1.5
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, cfg, ray.get_actor(PRODUCER_NAME, namespace="scd-test")
    from ray import serve
    serve.shutdown()


def test_openai_client_lists_models_and_completes_plain_and_streamed(served):
    import openai
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {"qa", "prose", "code", "nocal", "wrong"}
    prompt = PREFIX + "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in"
    r = client.completions.create(model="qa", prompt=prompt, max_tokens=6, stop=["\n"])
    assert r.choices[0].text.strip() and r.model_extra["scd"]["mode"] == "scd", r
    pieces, last = [], None
    for chunk in client.completions.create(model="qa", prompt=prompt, max_tokens=6, stop=["\n"], stream=True):
        pieces.append(chunk.choices[0].text)
        last = chunk
    assert "".join(pieces) == r.choices[0].text and last.model_extra["scd"]["mode"] == "scd"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x y", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="qa", prompt="x y", max_tokens=0)


def test_fanout_to_three_specialists_is_one_prefill_and_all_scd(served):
    url, _, producer = served
    before = ray.get(producer.stats.remote())["prefills"]
    status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + "Fresh text. ", "requests": [
        {"specialist": "qa", "suffix": "Question: What is the job of Tilda Vance?\nAnswer: Tilda Vance works as a",
         "max_tokens": 4},
        {"specialist": "prose", "suffix": "The", "max_tokens": 8},
        {"specialist": "code", "suffix": "def", "max_tokens": 8}]})
    assert status == 200, out
    assert ray.get(producer.stats.remote())["prefills"] == before + 1
    assert [r["scd"]["mode"] for r in out["results"]] == ["scd"] * 3, out
    for r in out["results"]:
        t = r["scd"]["timings_ms"]
        assert {"prefill", "encode", "transfer", "decode", "rebuild", "patch", "first_token"} <= set(t), t
        assert r["scd"]["payload_bytes"] > 0 and r["scd"]["artifact"]


def _reason(url, model, prompt=PREFIX + "Question: Where does Clara Petrov live?"):
    status, out = _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 3})
    assert status == 200, out
    return out["scd"]["mode"], out["scd"]["reason"]


def test_every_fallback_reason_on_purpose_in_response_and_metrics(served):
    url, cfg, producer = served
    assert _reason(url, "nocal") == ("fallback", "no_artifact")
    assert _reason(url, "wrong") == ("fallback", "artifact_mismatch")
    assert _reason(url, "qa", prompt="word") == ("fallback", "prefix_too_short")
    for fault, reason in (("corrupt", "codec_error"), ("misdeliver", "transport_error"),
                          ("delay:4", "producer_timeout")):
        ray.get(producer.inject.remote(fault))
        try:
            assert _reason(url, "qa", PREFIX + f"{fault} Question:") == ("fallback", reason), fault
        finally:
            ray.get(producer.inject.remote(None))
    time.sleep(4)                                           # let the delayed encode drain
    ray.kill(producer)
    assert _reason(url, "qa") == ("fallback", "producer_unavailable")
    from serve_app.app import start_producer
    ray.get(start_producer(cfg).stats.remote())             # wait until the new producer has loaded
    assert _reason(url, "qa", PREFIX + "Back again.") == ("scd", None)
    # the reasons reach Prometheus through ray.serve.metrics (exported every few seconds)
    want = {"no_artifact", "artifact_mismatch", "codec_error", "transport_error", "producer_timeout",
            "producer_unavailable", "prefix_too_short"}
    port = ray._private.worker.global_worker.node.metrics_export_port
    seen = set()
    for _ in range(40):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        seen = {line.split('reason="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("ray_scd_fallbacks_total") and 'reason="' in line}
        if want <= seen:
            break
        time.sleep(1)
    assert want <= seen, f"missing from metrics: {want - seen}"


def test_qa_scales_up_under_load_and_back_down(served):
    from ray import serve
    url, _, _ = served

    def replicas():
        dep = serve.status().applications["scd"].deployments["specialist-qa"]
        return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")

    stop = time.time() + 25
    peak = 1

    def load():
        while time.time() < stop:
            _post(url + "/v1/completions", {"model": "qa", "prompt": PREFIX + "Load test", "max_tokens": 16})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load) for _ in range(6)]
        while time.time() < stop:
            peak = max(peak, replicas())
            if peak >= 2:
                break
            time.sleep(0.5)
        stop = time.time()
        for f in futures:
            f.result()
    assert peak >= 2, f"qa never scaled past {peak} replica(s)"
    for _ in range(60):
        if replicas() == 1:
            break
        time.sleep(1)
    assert replicas() == 1, "qa did not scale back down to 1 replica"
