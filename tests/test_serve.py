"""The Serve app on a real local Ray + Serve: OpenAI client, fan-out, every fallback, metrics, autoscaling."""
import concurrent.futures
import contextlib
import dataclasses
import json
import time
import urllib.request

import pytest
import ray
import yaml

from artifacts_store import ArtifactStore
from cluster.config import load_config
from serve_app.app import undeploy
from tests.conftest import DEMO, free_port, serving_config

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


# One HTTP port for every module's app on the session's cluster: Serve (its controller and proxy) starts with the
# first and keeps running between them (`undeploy(cfg, keep_serve=True)`), as it would for apps on one cluster.
SERVE_PORT = free_port()


def deploy_and_wait(cfg_path, raw: dict):
    """Write the config (on SERVE_PORT), deploy the app on the session's Ray, wait until everything it started
    answers (serve_app.app.wait_healthy): (cfg, url)."""
    from serve_app.app import deploy, wait_healthy
    raw["http"] = {**raw.get("http", {}), "port": SERVE_PORT}
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg = load_config(cfg_path)
    deploy(cfg)
    url = f"http://127.0.0.1:{cfg.http.port}"
    wait_healthy(url, timeout_s=120)
    return cfg, url


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, demo_store, demo_work_dir):
    from actors.messages import producer_name
    tmp = tmp_path_factory.mktemp("serve")
    cfg_path = serving_config(tmp, demo_store, demo_work_dir)
    store = ArtifactStore(tmp / "store")
    art, manifest = store.load("base:qa")                  # calibrated for qa's weights, published for "wrong"
    store.publish(dataclasses.replace(art, pair="base:wrong"), manifest.fingerprints, manifest.calibration)
    raw = yaml.safe_load(cfg_path.read_text())
    fast = {"min_replicas": 1, "max_replicas": 1}
    raw["specialists"] = [
        {"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25,
         "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                         "upscale_delay_s": 0.5, "downscale_delay_s": 2,
                         "look_back_period_s": 3}},
        *({"name": n, "path": str(DEMO / p), "num_cpus": 0.25, "autoscaling": fast}
          for n, p in (("prose", "prose"), ("code", "code"), ("nocal", "qa"), ("wrong", "prose")))]
    raw["producer"]["num_cpus"] = 0.25
    raw["ray"] = {"namespace": "scd-test"}
    raw["producer_timeout_s"] = 1.5
    raw["families"] = [{"name": "fam"}, {"name": "ghost"}]           # ghost: configured, never published
    raw["limits"] = {"request_timeout_s": 600, "specialist_max_ongoing": 8}    # room for the held-requests drill
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url, cfg, ray.get_actor(producer_name(0), namespace="scd-test")
    undeploy(cfg, keep_serve=True)


def test_openai_client_lists_models_and_completes_plain_and_streamed(served):
    import openai
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {"qa", "prose", "code", "nocal", "wrong"}
    prompt = PREFIX + "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in"
    r = client.completions.create(model="qa", prompt=prompt, max_tokens=6, stop=["\n"])
    assert r.choices[0].text.strip() and r.model_extra["scd"]["mode"] == "scd", r
    assert set(r.model_extra["scd"]["level"]) == {"r_k", "r_v"}, r.model_extra["scd"]   # no link set: full ranks
    pieces, last = [], None
    for chunk in client.completions.create(model="qa", prompt=prompt, max_tokens=6, stop=["\n"], stream=True):
        pieces.append(chunk.choices[0].text)
        last = chunk
    assert "".join(pieces) == r.choices[0].text and last.model_extra["scd"]["mode"] == "scd"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x y", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="qa", prompt="x y", max_tokens=0)


def test_openai_client_chat_shares_the_conversation_before_the_last_user_turn(served):
    """The demo family's own chat template renders a chat as the QA text its specialist learned (notes,
    "Question: ...", "Answer:"): the answer names the city the notes give, as the oracle's does."""
    import openai
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "Where does Tilda Vance live?"}]
    r = client.chat.completions.create(model="qa", messages=messages, max_tokens=6)
    scd = r.model_extra["scd"]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant", r
    assert scd["mode"] == "scd" and r.choices[0].message.content, r
    oracle = client.chat.completions.create(model="qa", messages=messages, max_tokens=8, extra_body={"oracle": True})
    assert oracle.model_extra["scd"]["mode"] == "oracle"
    assert "Tilda Vance lives in" in oracle.choices[0].message.content, oracle.choices[0].message.content
    # the prefix is the rendered system turn: it holds the notes, the user turn is read by the specialist
    assert r.usage.prompt_tokens > r.usage.completion_tokens and r.usage.completion_tokens <= 6
    pieces, roles, last = [], [], None
    for chunk in client.chat.completions.create(model="qa", messages=messages, max_completion_tokens=6, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        roles.append(chunk.choices[0].delta.role)
        last = chunk
    assert "".join(pieces) == r.choices[0].message.content and roles[0] == "assistant"
    assert last.object == "chat.completion.chunk" and last.model_extra["scd"]["mode"] == "scd"
    only_user = client.chat.completions.create(model="qa", messages=messages[1:], max_tokens=2)
    assert only_user.model_extra["scd"]["reason"] == "prefix_too_short", only_user.model_extra
    for bad in ({"messages": messages + [{"role": "assistant", "content": "x"}]}, {"messages": []},
                {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]},
                {"messages": [{"role": "robot", "content": "x"}]}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="qa", max_tokens=2, **bad)


def _events(url, body, timeout=120) -> list[dict]:
    """The JSON events of a streamed response, [DONE] left out."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        lines = [ln.decode().removeprefix("data: ").strip() for ln in r if ln.startswith(b"data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


def test_what_serving_benchmarks_send_health_ignore_eos_and_usage_in_streams(served):
    """guidellm's and vLLM's benchmark request shapes: GET /health first, then fixed output lengths with
    ignore_eos, streams with include_usage and continuous_usage_stats."""
    url, _, _ = served
    # a 200 (urlopen raises on any other): answers come; degraded, as nocal and wrong have no artifact to use
    assert _get(url + "/health") == {"status": "degraded"}
    prompt = PREFIX + "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in"
    body = {"model": "qa", "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stop": None}
    status, r = _post(url + "/v1/completions", body)
    assert status == 200 and r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length", r
    events = _events(url + "/v1/completions", {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12, last
    assert last["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12, counts           # running totals, as vLLM sends them
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    plain = _events(url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 12
    status, err = _post(url + "/v1/completions", {**body, "min_tokens": 13})
    assert status == 400 and err["error"]["param"] == "min_tokens", err
    status, err = _post(url + "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 400 and "stream" in err["error"]["message"], err


def test_logprobs_of_generated_tokens_and_prompt_logprobs_refused(served):
    import openai
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    prompt = PREFIX + "Question: Where does Tilda Vance live?\nAnswer: Tilda Vance lives in"
    r = client.completions.create(model="qa", prompt=prompt, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == r.usage.completion_tokens == 6 and "".join(lp.tokens) == text, (lp, text)
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs), lp
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)], lp.text_offset
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):    # greedy: the chosen token leads
        assert abs(max(top.values()) - v) < 1e-5 and top.get(tok) == pytest.approx(v, abs=1e-5), (tok, v, top)
    messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "Where does Tilda Vance live?"}]
    c = client.chat.completions.create(model="qa", messages=messages, max_tokens=5, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert "".join(t.token for t in content) == c.choices[0].message.content and len(content) == 5, content
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content), content
    streamed = list(client.chat.completions.create(model="qa", messages=messages, max_tokens=5, logprobs=True,
                                                   stream=True, stream_options={"include_usage": True}))
    got = [t.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert got == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert streamed[-1].usage.completion_tokens == 5 and streamed[-1].choices == []
    for bad in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 1}):
        status, err = _post(url + "/v1/completions", {"model": "qa", "prompt": prompt, "max_tokens": 2, **bad})
        assert status == 400 and "prompt logprobs are not served" in err["error"]["message"], err


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
        # the hops around the model work: each wait holds the one inside it
        assert t["specialist_call"] >= t["replica"] >= t["engine"] >= t["total"] >= t["first_token"], t
        assert t["producer_call"] >= t["prefill"] + t["encode"], t
        assert r["scd"]["payload_bytes"] > 0 and r["scd"]["artifact"]


def test_exact_requests_answer_the_oracles_tokens_from_codes_that_only_draft(served):
    """`exact: true` (the openai client's extra_body): completions (every specialist; a short and a long
    prefix), a stream and a fan-out's items answer what the specialist's own prefill answers (greedy), served
    from codes that drafted (`scd` with drafted and accepted counts)."""
    import openai
    url, _, _ = served
    prefix, suffix = PREFIX + "Exact. ", "Question: What is the job of Tilda Vance?\nAnswer:"
    for model, pre in (("qa", prefix), ("prose", prefix), ("code", prefix), ("qa", PREFIX * 4 + "Long. ")):
        body = {"model": model, "prefix": pre, "prompt": suffix, "max_tokens": 12, "ignore_eos": True}
        status, exact = _post(url + "/v1/completions", {**body, "exact": True})
        assert status == 200 and exact["scd"]["mode"] == "scd", exact
        ex = exact["scd"]["exact"]
        assert ex and 0 <= ex["accepted"] <= ex["drafted"], exact["scd"]
        _, oracle = _post(url + "/v1/completions", {**body, "oracle": True})
        assert exact["choices"][0]["text"] == oracle["choices"][0]["text"], (model, exact["scd"], oracle["choices"])
    status, out = _post(url + "/v1/fanout", {"prefix": prefix, "requests": [
        {"specialist": "qa", "suffix": suffix, "max_tokens": 8, "exact": True},
        {"specialist": "prose", "suffix": "The", "max_tokens": 8, "exact": True},
        {"specialist": "code", "suffix": "def", "max_tokens": 8}]})
    assert status == 200, out
    assert [bool(r["scd"]["exact"]) for r in out["results"]] == [True, True, False], out["results"]
    for r, suffix_ in zip(out["results"][:2], (suffix, "The")):
        _, oracle = _post(url + "/v1/completions", {"model": r["specialist"], "prefix": prefix, "prompt": suffix_,
                                                    "max_tokens": 8, "oracle": True})
        assert r["text"] == oracle["choices"][0]["text"], (r, oracle["choices"])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    pieces = [c.choices[0].text for c in client.completions.create(
        model="qa", prompt=suffix, max_tokens=12, stream=True, extra_body={"prefix": prefix, "exact": True,
                                                                          "ignore_eos": True})]
    _, oracle = _post(url + "/v1/completions", {"model": "qa", "prefix": prefix, "prompt": suffix, "max_tokens": 12,
                                                "ignore_eos": True, "oracle": True})
    assert "".join(pieces) == oracle["choices"][0]["text"], (pieces, oracle["choices"])


def test_a_fanout_to_one_familys_members_sends_one_payload_that_each_rebuilds_with_its_own_decoders(served):
    url, _, producer = served
    stats = ray.get(producer.stats.remote())
    fam = stats["family_versions"]["base:fam"]
    assert fam["members"] == ["base:prose", "base:qa"], fam
    assert "base:ghost" not in stats["family_versions"] and "ArtifactNotFound" in stats["problems"]["base:ghost"]["reason"]
    health = _get(url + "/healthz")
    assert "no published version" in health["specialists"]["qa"]["family_problems"]["base:ghost"], health
    status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + "A family fan-out. ", "requests": [
        {"specialist": "qa", "suffix": "Question: Where does Clara Petrov live?\nAnswer:", "max_tokens": 3},
        {"specialist": "prose", "suffix": "The", "max_tokens": 3},
        {"specialist": "qa", "suffix": "Question: What does Clara Petrov own?\nAnswer:", "max_tokens": 3}]})
    assert status == 200, out
    infos = [r["scd"] for r in out["results"]]
    assert [(i["mode"], i["family"], i["artifact"]) for i in infos] == [("scd", "base:fam", fam["version"])] * 3, infos
    assert len({i["payload_bytes"] for i in infos}) == 1                  # one payload for all three requests
    status, out = _post(url + "/v1/fanout", {"prefix": PREFIX + "Not one family. ", "requests": [
        {"specialist": "qa", "suffix": "Question:", "max_tokens": 2}, {"specialist": "code", "suffix": "def", "max_tokens": 2}]})
    assert status == 200 and [(r["scd"]["mode"], r["scd"]["family"]) for r in out["results"]] == [("scd", None)] * 2, out


def _reason(url, model, prompt=PREFIX + "Question: Where does Clara Petrov live?"):
    status, out = _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 3})
    assert status == 200, out
    return out["scd"]["mode"], out["scd"]["reason"]


def test_an_encode_begun_before_its_deadline_is_waited_for_not_prefilled_twice(served):
    """producer_timeout_s is 1.5 s here; the producer's encode takes 2 s (the drill's delay), begun at once:
    the router waits for it (up to another 1.5 s) and answers from its codes, where falling back would have
    the specialist prefill the same prefix again."""
    url, cfg, producer = served
    before = ray.get(producer.stats.remote())["prefills"]
    ray.get(producer.inject.remote("delay:2"))
    try:
        t0 = time.monotonic()
        got = _reason(url, "qa", PREFIX + "Begun. Question:")
        took = time.monotonic() - t0
    finally:
        ray.get(producer.inject.remote(None))
    assert got == ("scd", None), f"{got} after {took:.1f} s"
    assert took > cfg.producer_timeout_s, f"answered in {took:.1f} s: the drill's delay never ran"
    assert ray.get(producer.stats.remote())["prefills"] - before == 1


def test_every_fallback_reason_on_purpose_in_response_and_metrics(served):
    url, cfg, producer = served
    assert _reason(url, "nocal") == ("fallback", "no_artifact")
    assert _reason(url, "wrong") == ("fallback", "artifact_mismatch")
    assert _reason(url, "qa", prompt="word") == ("fallback", "prefix_too_short")
    for fault, reason in (("corrupt", "codec_error"), ("misdeliver", "transport_error")):
        ray.get(producer.inject.remote(fault))
        try:
            assert _reason(url, "qa", PREFIX + f"{fault} Question:") == ("fallback", reason), fault
        finally:
            ray.get(producer.inject.remote(None))
    # a stalled producer: three requests give up on it; the two encodes queued behind the stalled one are
    # dropped or skipped by their deadline, never run after their requests have fallen back
    prefills = ray.get(producer.stats.remote())["prefills"]
    ray.get(producer.inject.remote("delay:4"))
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            reasons = list(pool.map(lambda i: _reason(url, "qa", PREFIX + f"Stalled {i}. Question:"), range(3)))
    finally:
        ray.get(producer.inject.remote(None))
    assert reasons == [("fallback", "producer_timeout")] * 3, reasons
    ray.get(producer.encode.remote([], []))                 # queued after everything above: the queue drained
    assert ray.get(producer.stats.remote())["prefills"] - prefills <= 1
    ray.kill(producer)                                      # for good: the router creates it again
    assert _reason(url, "qa") == ("fallback", "producer_unavailable")
    assert wait_for(lambda: _reason(url, "qa", PREFIX + "Back again.") == ("scd", None), 120), \
        "the router never brought the producer back"
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


def running_replicas(deployment: str = "specialist-qa") -> int:
    from ray import serve
    dep = serve.status().applications["scd"].deployments[deployment]
    return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


@contextlib.contextmanager
def holding_qa(namespace: str):
    """A drill gate that qa's replicas (the one running now) hold every request on until it opens; yields
    the gate, and opens and removes it on the way out."""
    import uuid

    from ray import serve

    from actors.drills import Gate
    name = f"gate-{uuid.uuid4().hex[:8]}"
    gate = Gate.options(name=name, namespace=namespace).remote()
    serve.get_deployment_handle("specialist-qa", app_name="scd").inject.remote(f"hold:{name}").result()
    try:
        yield gate
    finally:
        ray.get(gate.open.remote())
        ray.kill(gate)


def scale_up_with_held_requests(url: str, namespace: str, count, want: int = 2, held: int = 6,
                                bound_s: float = 300, body: dict | None = None):
    """Drive autoscaling of qa on any machine: qa's only replica holds every request it starts (a drill gate),
    so `held` requests stay in flight for as long as it takes a second replica to start. Returns (peak of
    `count()`, timeline of what was seen, the held requests' answers once the gate opened)."""
    body = body or {"model": "qa", "prompt": PREFIX + "Held. Question:", "max_tokens": 4}
    timeline, peak, t0 = [], 0, time.monotonic()
    with holding_qa(namespace) as gate, concurrent.futures.ThreadPoolExecutor(held) as pool:
        futures = [pool.submit(_post, url + "/v1/completions", body, bound_s + 120) for _ in range(held)]
        while time.monotonic() - t0 < bound_s:
            seen = count()
            if not timeline or timeline[-1][1:] != (seen, ray.get(gate.held.remote())):
                timeline.append((round(time.monotonic() - t0, 1), seen, ray.get(gate.held.remote())))
            peak = max(peak, seen)
            if peak >= want:
                break
            time.sleep(0.5)
        ray.get(gate.open.remote())
        answers = [f.result() for f in futures]
    return peak, timeline, answers


def wait_for(predicate, bound_s: float, every_s: float = 1.0) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def test_serve_started_again_does_not_say_it_found_serve_running(served, caplog):
    """serve.run after our serve.start (and any later start) finds Serve running and says so at INFO, adding
    that it applies no new http_options, which reads as if ours were lost: deploy keeps that line out."""
    import logging
    from ray import serve
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
            serve_logger.info("another message")
    finally:
        serve_logger.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records if r.name == "ray.serve"]
    assert messages == ["another message"], messages


def test_a_timed_out_handle_call_is_a_timeout_even_when_serve_answers_the_cancel_with_its_own_error():
    """Serve raises RequestCancelledError from a handle call that asyncio.wait_for cancels, and wait_for
    passes it on; `within` makes it the timeout it is (a busy specialist is 'busy' in /healthz, a slow
    answer a 504), and leaves answers and other errors alone."""
    import asyncio
    from ray.serve.exceptions import RequestCancelledError
    from serve_app.router import within

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RequestCancelledError("r1") from None

    async def run():
        with pytest.raises(RequestCancelledError):            # what plain wait_for does
            await asyncio.wait_for(slow(), 0.01)
        with pytest.raises(asyncio.TimeoutError):
            await within(slow(), 0.01)
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7

        async def broken():
            raise ValueError("no")
        with pytest.raises(ValueError):
            await within(broken(), 1.0)
    asyncio.run(run())


def test_a_replica_takes_up_and_drops_families_as_its_config_changes(served):
    """The replica's user_config names the configured families: it loads its own member of each (and
    refuses one it is not a member of), and a family taken out of the config is no longer used."""
    from engines.interface import EngineConfig
    from serve_app.specialist import SpecialistServer
    _, cfg, _ = served
    replica_cls = ray.remote(num_cpus=0)(SpecialistServer)          # a replica outside Serve, in its own worker
    of = lambda n: EngineConfig("specialist", n, str(DEMO / n), producer="base", store_uri=cfg.artifacts.uri,  # noqa: E731
                                namespace="scd-test")
    qa, code = replica_cls.remote(of("qa")), replica_cls.remote(of("code"))
    try:
        status = lambda r: ray.get(r.status.remote())                  # noqa: E731
        assert status(qa)["families"] == {}                            # built with the pair only
        ray.get(qa.reconfigure.remote({"artifact": "latest", "families": {"base:fam": "latest",
                                                                          "base:ghost": "latest"}}))
        st = status(qa)
        assert list(st["families"]) == ["base:fam"] and "base:ghost" in st["family_problems"], st
        ray.get(code.reconfigure.remote({"artifact": "latest", "families": {"base:fam": "latest"}}))
        assert status(code)["families"] == {} and "no member 'code'" in status(code)["family_problems"]["base:fam"]
        ray.get(qa.reconfigure.remote({"artifact": "latest", "families": {}}))
        assert status(qa)["families"] == {}
    finally:
        ray.kill(qa)
        ray.kill(code)
