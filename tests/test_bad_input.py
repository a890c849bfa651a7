"""Malformed and hostile requests against a real local Ray + Serve deployment: every refusal is OpenAI-shaped
JSON with the right 4xx, and the service still answers normally afterwards.

One table, one deployment (two uncalibrated specialists: they answer in `fallback` mode, reason `no_artifact`,
which is a normal 200), an API key and small limits so the size cases stay cheap. What a long prompt costs
the router (how often it tokenizes) is counted on the router class itself, without Ray.
"""
import http.client
import json
from typing import NamedTuple
from urllib.parse import urlparse

import pytest
import yaml

from serve_app.app import undeploy
from tests.conftest import DEMO, write_config
from tests.test_serve import deploy_and_wait

KEY = "scd-bad-input-key-0123456789"
NS = "scd-test-input"
MAX_BODY, MAX_FANOUT, MAX_TOKENS = 262144, 4, 64
CONTEXT = 4096                                     # the demo family's max_position_embeddings
THE = " the"                                       # one token of the demo tokenizer, however often repeated

JSON_CT = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {KEY}"}
ANY = object()                                     # expected param/code not checked
DROP = object()                                    # drop this key from the base body


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    cfg_path = write_config(tmp)
    raw = yaml.safe_load(cfg_path.read_text())
    one = {"min_replicas": 1, "max_replicas": 1}
    raw["specialists"] = [{"name": n, "path": str(DEMO / n), "num_cpus": 0.25, "autoscaling": one}
                          for n in ("qa", "prose")]
    raw["producer"]["num_cpus"] = 0.25
    raw.update(ray={"namespace": NS}, auth={"api_key": KEY},
               limits={"max_body_bytes": MAX_BODY, "max_fanout": MAX_FANOUT, "max_tokens": MAX_TOKENS})
    cfg, url = deploy_and_wait(cfg_path, raw)
    yield url
    undeploy(cfg, keep_serve=True)


def send(url: str, method: str, path: str, body=None, headers: dict | None = None, chunked: bool = False,
         timeout: float = 60):
    """(status, headers, raw body) over http.client: any method, raw bytes, chunked transfer encoding."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        if chunked:
            pieces = [body[i:i + 16384] for i in range(0, len(body), 16384)]
            conn.request(method, path, body=iter(pieces), headers=headers or {}, encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def assert_error(status: int, headers: dict, raw: bytes, want: int, param=ANY, code=ANY) -> dict:
    assert status == want, f"want {want}, got {status}: {raw[:500]!r}"
    assert headers.get("content-type", "").startswith("application/json"), (headers, raw[:500])
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert "Traceback" not in err["message"], err
    if param is not ANY:
        assert err["param"] == param, err
    if code is not ANY:
        assert err["code"] == code, err
    return err


# -- the table -------------------------------------------------------------------------------------------
def comp(**over) -> dict:
    body = {"model": "qa", "prompt": "Notes: Tilda Vance lives in Hythe.\nTilda Vance lives in", "max_tokens": 2}
    body.update(over)
    return _drop(body)


def fan(items=None, **over) -> dict:
    item = {"specialist": "qa", "suffix": "Tilda Vance lives in", "max_tokens": 2}
    body = {"prefix": "Notes: Tilda Vance lives in Hythe.\n",
            "requests": [_drop({**item, **i}) for i in items] if items is not None else [item]}
    body.update(over)
    return _drop(body)


def _drop(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not DROP}


class Case(NamedTuple):
    id: str
    status: int
    body: object = None               # dict/list/str: sent as JSON; bytes: sent as is; None: no body
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict | None = None       # None: JSON content type + the right key
    param: object = ANY
    code: object = ANY


C, F = "/v1/completions", "/v1/fanout"
CASES = [
    # -- types: /v1/completions -------------------------------------------------------------------------
    Case("max_tokens-string", 400, comp(max_tokens="16"), param="max_tokens"),
    Case("max_tokens-bool", 400, comp(max_tokens=True), param="max_tokens"),
    Case("max_tokens-float", 400, comp(max_tokens=16.0), param="max_tokens"),
    Case("max_tokens-array", 400, comp(max_tokens=[16]), param="max_tokens"),
    Case("max_tokens-object", 400, comp(max_tokens={"n": 16}), param="max_tokens"),
    Case("max_tokens-null-is-default", 200, comp(max_tokens=None)),
    Case("temperature-string", 400, comp(temperature="0.5"), param="temperature"),
    Case("temperature-bool", 400, comp(temperature=True), param="temperature"),
    Case("temperature-array", 400, comp(temperature=[0.5]), param="temperature"),
    Case("temperature-null-is-default", 200, comp(temperature=None)),
    Case("top_p-string", 400, comp(top_p="1"), param="top_p"),
    Case("top_p-object", 400, comp(top_p={}), param="top_p"),
    Case("stop-number", 400, comp(stop=5), param="stop"),
    Case("stop-list-of-numbers", 400, comp(stop=[1]), param="stop"),
    Case("stop-object", 400, comp(stop={"a": 1}), param="stop"),
    Case("seed-string", 400, comp(seed="1"), param="seed"),
    Case("seed-float", 400, comp(seed=1.5), param="seed"),
    Case("seed-bool", 400, comp(seed=True), param="seed"),
    Case("model-number", 400, comp(model=123), param="model"),
    Case("model-null", 400, comp(model=None), param="model"),
    Case("model-array", 400, comp(model=["qa"]), param="model"),
    Case("model-missing", 400, comp(model=DROP), param="model"),
    Case("prompt-number", 400, comp(prompt=123), param="prompt"),
    Case("prompt-null", 400, comp(prompt=None), param="prompt"),
    Case("prompt-object", 400, comp(prompt={"text": "x"}), param="prompt"),
    Case("prompt-token-ids", 400, comp(prompt=[1, 2, 3]), param="prompt"),
    Case("prompt-two-strings", 400, comp(prompt=["a b", "c d"]), param="prompt"),
    Case("prompt-empty-list", 400, comp(prompt=[]), param="prompt"),
    Case("prompt-empty-string", 400, comp(prompt=""), param="prompt"),
    Case("prompt-missing", 400, comp(prompt=DROP), param="prompt"),
    Case("prefix-number", 400, comp(prefix=5), param="prefix"),
    Case("prefix-empty", 400, comp(prefix=""), param="prefix"),
    Case("oracle-string", 400, comp(oracle="true"), param="oracle"),
    Case("oracle-int", 400, comp(oracle=1), param="oracle"),
    Case("stream-string", 400, comp(stream="true"), param="stream"),
    Case("stream-int", 400, comp(stream=1), param="stream"),
    Case("user-number", 400, comp(user=5), param="user"),
    Case("user-too-long", 400, comp(user="u" * 257), param="user"),
    # -- OpenAI fields not implemented: only their neutral value -----------------------------------------
    Case("neutral-values-accepted", 200, comp(n=1, best_of=1, echo=False, logprobs=None, suffix=None,
                                             presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                             stream_options=None, user="end-user-1")),
    Case("n-2", 400, comp(n=2), param="n"),
    Case("n-string", 400, comp(n="1"), param="n"),
    Case("best_of-3", 400, comp(best_of=3), param="best_of"),
    Case("echo-true", 400, comp(echo=True), param="echo"),
    Case("logprobs-21", 400, comp(logprobs=21), param="logprobs"),
    Case("suffix-text", 400, comp(suffix="tail"), param="suffix"),
    Case("presence_penalty", 400, comp(presence_penalty=0.5), param="presence_penalty"),
    Case("frequency_penalty", 400, comp(frequency_penalty=-1), param="frequency_penalty"),
    Case("logit_bias", 400, comp(logit_bias={"50256": -100}), param="logit_bias"),
    Case("logit_bias-array", 400, comp(logit_bias=[]), param="logit_bias"),
    Case("stream_options", 400, comp(stream_options={"include_usage": True}), param="stream_options"),
    Case("unknown-field", 400, comp(foo=1), param="foo"),
    Case("unknown-functions", 400, comp(functions=[]), param="functions"),
    Case("chat-body-on-completions", 400, {"model": "qa", "messages": [{"role": "user", "content": "hi"}]}),
    # -- ranges -----------------------------------------------------------------------------------------
    Case("max_tokens-zero", 400, comp(max_tokens=0), param="max_tokens"),
    Case("max_tokens-negative", 400, comp(max_tokens=-1), param="max_tokens"),
    Case("max_tokens-over-limit", 400, comp(max_tokens=MAX_TOKENS + 1), param="max_tokens"),
    Case("max_tokens-at-limit", 200, comp(max_tokens=MAX_TOKENS, stop=["\n"])),
    Case("max_tokens-huge", 400, comp(max_tokens=10 ** 30), param="max_tokens"),
    Case("max_tokens-1e400", 400, b'{"model": "qa", "prompt": "a b", "max_tokens": 1e400}', param="max_tokens"),
    Case("max_tokens-5000-digits", 400, b'{"model": "qa", "prompt": "a b", "max_tokens": ' + b"9" * 5000 + b"}"),
    Case("temperature-negative", 400, comp(temperature=-0.1), param="temperature"),
    Case("temperature-too-high", 400, comp(temperature=5.01), param="temperature"),
    Case("temperature-NaN", 400, b'{"model": "qa", "prompt": "a b", "temperature": NaN}', param="temperature"),
    Case("temperature-Infinity", 400, b'{"model": "qa", "prompt": "a b", "temperature": Infinity}',
         param="temperature"),
    Case("top_p-zero", 400, comp(top_p=0), param="top_p"),
    Case("top_p-above-one", 400, comp(top_p=1.5), param="top_p"),
    Case("seed-int64-max-accepted", 200, comp(seed=2 ** 63 - 1, temperature=1.0)),
    Case("seed-beyond-int64", 400, comp(seed=2 ** 63), param="seed"),
    Case("seed-below-int64", 400, comp(seed=-2 ** 63 - 1), param="seed"),
    Case("stop-five-strings", 400, comp(stop=["a", "b", "c", "d", "e"]), param="stop"),
    Case("stop-four-strings-accepted", 200, comp(stop=["a", "b", "c", "d"])),
    Case("stop-empty-string", 400, comp(stop=""), param="stop"),
    Case("stop-empty-in-list", 400, comp(stop=["\n", ""]), param="stop"),
    Case("stop-too-long", 400, comp(stop="s" * 129), param="stop"),
    Case("model-unknown", 404, comp(model="gpt-4"), param="model", code="model_not_found"),
    Case("model-too-long", 400, comp(model="m" * 65), param="model"),
    Case("input-over-context", 400, comp(prefix=THE * (CONTEXT + 10), prompt=THE),
         param="prompt", code="context_length_exceeded"),
    Case("input-plus-max_tokens-over-context", 400,
         comp(prefix=THE * (CONTEXT - 50), prompt=THE * 10, max_tokens=MAX_TOKENS),
         param="max_tokens", code="context_length_exceeded"),
    # -- /v1/fanout -------------------------------------------------------------------------------------
    Case("fanout-prefix-missing", 400, fan(prefix=DROP), F, param="prefix"),
    Case("fanout-prefix-number", 400, fan(prefix=5), F, param="prefix"),
    Case("fanout-prefix-empty", 400, fan(prefix=""), F, param="prefix"),
    Case("fanout-requests-missing", 400, fan(requests=DROP), F, param="requests"),
    Case("fanout-requests-object", 400, fan(requests={"specialist": "qa"}), F, param="requests"),
    Case("fanout-requests-string", 400, fan(requests="qa"), F, param="requests"),
    Case("fanout-zero-items", 400, fan([]), F, param="requests"),
    Case("fanout-too-many-items", 400, fan([{}] * (MAX_FANOUT + 1)), F, param="requests"),
    Case("fanout-item-number", 400, fan(requests=[5]), F, param="requests.0"),
    Case("fanout-item-null", 400, fan(requests=[None]), F, param="requests.0"),
    Case("fanout-specialist-number", 400, fan([{"specialist": 5}]), F, param="requests.0.specialist"),
    Case("fanout-specialist-unknown", 404, fan([{}, {"specialist": "nope"}]), F, param="requests.1.specialist",
         code="model_not_found"),
    Case("fanout-suffix-missing", 400, fan([{"suffix": DROP}]), F, param="requests.0.suffix"),
    Case("fanout-suffix-empty", 400, fan([{"suffix": ""}]), F, param="requests.0.suffix"),
    Case("fanout-suffix-number", 400, fan([{"suffix": 7}]), F, param="requests.0.suffix"),
    Case("fanout-max_tokens-string", 400, fan([{"max_tokens": "2"}]), F, param="requests.0.max_tokens"),
    Case("fanout-max_tokens-zero", 400, fan([{"max_tokens": 0}]), F, param="requests.0.max_tokens"),
    Case("fanout-max_tokens-over-limit", 400, fan([{}, {"max_tokens": MAX_TOKENS + 1}]), F,
         param="requests.1.max_tokens"),
    Case("fanout-temperature-bool", 400, fan([{"temperature": True}]), F, param="requests.0.temperature"),
    Case("fanout-top_p-two", 400, fan([{"top_p": 2}]), F, param="requests.0.top_p"),
    Case("fanout-seed-beyond-int64", 400, fan([{"seed": 2 ** 63}]), F, param="requests.0.seed"),
    Case("fanout-stop-six", 400, fan([{"stop": list("abcdef")}]), F, param="requests.0.stop"),
    Case("fanout-item-unknown-field", 400, fan([{"model": "qa"}]), F, param="requests.0.model"),
    Case("fanout-top-unknown-field", 400, fan(model="qa"), F, param="model"),
    Case("fanout-max-items-accepted", 200, fan([{}, {"specialist": "prose"}, {}, {"specialist": "prose"}]), F),
    # -- sizes ------------------------------------------------------------------------------------------
    Case("body-over-limit", 413, comp(prompt="x " * (150 * 1024)), code="request_too_large"),
    Case("fanout-body-over-limit", 413, fan(prefix="x " * (150 * 1024)), F, code="request_too_large"),
    Case("content-length-lies-huge", 413, comp(), headers={**JSON_CT, **AUTH, "Content-Length": str(10 ** 12)},
         code="request_too_large"),
    # -- encodings --------------------------------------------------------------------------------------
    Case("json-truncated", 400, b'{"model": "qa", "prompt": ', param=None),
    Case("json-single-quotes", 400, b"{'model': 'qa', 'prompt': 'a b'}", param=None),
    Case("json-trailing-garbage", 400, json.dumps(comp()).encode() + b" }{", param=None),
    Case("json-deeply-nested", 400, b"[" * 100000 + b"]" * 100000, param=None),
    Case("invalid-utf8-bytes", 400, b'{"model": "qa", "prompt": "a \xff\xfe b"}', param=None),
    Case("body-is-array", 400, [comp()], param=None),
    Case("body-is-string", 400, "hello", param=None),
    Case("body-is-number", 400, 42, param=None),
    Case("body-is-null", 400, b"null", param=None),
    Case("body-empty", 400, b"", param=None),
    Case("no-body-at-all", 400, None, param=None),
    Case("content-type-text-plain", 415, json.dumps(comp()).encode(), headers={"Content-Type": "text/plain", **AUTH}),
    Case("content-type-form", 415, b"model=qa&prompt=hello+world",
         headers={"Content-Type": "application/x-www-form-urlencoded", **AUTH}),
    Case("content-type-multipart", 415, b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nqa\r\n--b--\r\n',
         headers={"Content-Type": "multipart/form-data; boundary=b", **AUTH}),
    Case("content-type-missing", 415, json.dumps(comp()).encode(), headers=AUTH),
    Case("content-type-json-charset", 200, json.dumps(comp()).encode(),
         headers={"Content-Type": "application/json; charset=utf-8", **AUTH}),
    Case("nul-in-prompt-accepted", 200, comp(prompt="Tilda\u0000 Vance lives\u0000 in")),
    Case("nul-in-model", 404, comp(model="q\u0000a"), param="model"),
    Case("lone-surrogate-in-prompt", 400, comp(prompt="Tilda \ud800 lives in"), param="prompt"),
    Case("lone-surrogate-in-prefix", 400, comp(prefix="Notes \udfff.", prompt="a b"), param="prefix"),
    Case("lone-surrogate-in-stop", 400, comp(stop=["\ud800"]), param="stop"),
    Case("lone-surrogate-in-model", 400, comp(model="q\ud800"), param="model"),
    Case("lone-surrogate-in-fanout-suffix", 400, fan([{"suffix": "x \ud800"}]), F, param="requests.0.suffix"),
    Case("surrogate-pair-accepted", 200, comp(prompt="Tilda \ud83d\ude00 lives in")),
    # -- methods and paths ------------------------------------------------------------------------------
    Case("GET-completions", 405, path=C, method="GET"),
    Case("GET-fanout", 405, path=F, method="GET"),
    Case("DELETE-completions", 405, path=C, method="DELETE"),
    Case("PUT-completions", 405, comp(), C, method="PUT"),
    Case("PATCH-fanout", 405, fan(), F, method="PATCH"),
    Case("OPTIONS-completions", 405, path=C, method="OPTIONS"),
    Case("POST-models", 405, {}, "/v1/models"),
    Case("DELETE-models", 405, path="/v1/models", method="DELETE"),
    Case("POST-healthz", 405, {}, "/healthz"),
    Case("unknown-path", 404, path="/v1/nothing", method="GET"),
    Case("chat-completions-no-messages", 400, {"model": "qa", "messages": []}, "/v1/chat/completions"),
    Case("model-retrieve-not-served", 404, path="/v1/models/qa", method="GET"),
    Case("root", 404, path="/", method="GET"),
    Case("completions-trailing-slash", 404, comp(), "/v1/completions/"),
    Case("models-trailing-slash", 404, path="/v1/models/", method="GET"),
    # -- auth -------------------------------------------------------------------------------------------
    Case("auth-none", 401, comp(), headers=JSON_CT, code="invalid_api_key"),
    Case("auth-none-models", 401, path="/v1/models", method="GET", headers={}, code="invalid_api_key"),
    Case("auth-none-unknown-path", 401, path="/v1/nothing", method="GET", headers={}, code="invalid_api_key"),
    Case("auth-basic", 401, comp(), headers={**JSON_CT, "Authorization": f"Basic {KEY}"}, code="invalid_api_key"),
    Case("auth-token-scheme", 401, comp(), headers={**JSON_CT, "Authorization": f"Token {KEY}"}),
    Case("auth-empty-bearer", 401, comp(), headers={**JSON_CT, "Authorization": "Bearer "}, code="invalid_api_key"),
    Case("auth-bare-key", 401, comp(), headers={**JSON_CT, "Authorization": KEY}, code="invalid_api_key"),
    Case("auth-wrong-key", 401, comp(), headers={**JSON_CT, "Authorization": "Bearer sk-wrong-0123456789"},
         code="invalid_api_key"),
    Case("auth-key-prefix", 401, comp(), headers={**JSON_CT, "Authorization": f"Bearer {KEY[:-1]}"}),
    Case("auth-key-space-inside", 401, comp(), headers={**JSON_CT, "Authorization": f"Bearer {KEY[:5]} {KEY[5:]}"}),
    Case("auth-key-in-query", 401, path=f"/v1/models?api_key={KEY}", method="GET", headers={}),
    # RFC 7235: `credentials = auth-scheme 1*SP token68`, and the scheme is case-insensitive
    Case("auth-extra-spaces-accepted", 200, path="/v1/models", method="GET",
         headers={"Authorization": f"Bearer   {KEY}  "}),
    Case("auth-lowercase-scheme-accepted", 200, path="/v1/models", method="GET",
         headers={"Authorization": f"bearer {KEY}"}),
    Case("auth-right-key", 200, path="/v1/models", method="GET", headers=AUTH),
    Case("healthz-without-key", 200, path="/healthz", method="GET", headers={}),
    Case("healthz-with-wrong-key", 200, path="/healthz", method="GET", headers={"Authorization": "Bearer nope"}),
]


def encode(body) -> bytes | None:
    return body if body is None or isinstance(body, bytes) else json.dumps(body).encode()


def assert_ok(case: Case, status: int, headers: dict, raw: bytes) -> None:
    assert status == 200, f"want 200, got {status}: {raw[:500]!r}"
    body = json.loads(raw)
    if case.path == C:
        assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str), body
        assert body["scd"]["mode"] == "fallback" and body["scd"]["reason"] == "no_artifact", body["scd"]
    elif case.path == F:
        assert [r["scd"]["reason"] for r in body["results"]] == ["no_artifact"] * len(case.body["requests"]), body
    elif case.path == "/v1/models":
        assert {m["id"] for m in body["data"]} == {"qa", "prose"}, body
    else:                               # nothing calibrated here: answers come, each a stated fallback
        assert body["status"] == "degraded", body
        assert {line.split(":")[0] + ":" + line.split(":")[1] for line in body["problems"]} >= \
            {"base:qa", "base:prose"}, body["problems"]
        assert not any("\n" in line or "Traceback" in line or "/" + "root" in line for line in body["problems"]), \
            body["problems"]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_request(served, case):
    headers = {**JSON_CT, **AUTH} if case.headers is None else case.headers
    status, got, raw = send(served, case.method, case.path, encode(case.body), headers)
    if case.status == 200:
        assert_ok(case, status, got, raw)
    else:
        assert_error(status, got, raw, case.status, case.param, case.code)


def test_200kb_prompt_is_refused_quickly(served):
    """Over HTTP: the refusal (what "quickly" means is checked on the router itself, below)."""
    prompt = "Tilda Vance lives in Hythe. " * (200 * 1024 // 28)          # ~200 KB, ~50k tokens
    status, headers, raw = send(served, "POST", C, encode(comp(prompt=prompt)), {**JSON_CT, **AUTH})
    assert_error(status, headers, raw, 400, "prompt", "context_length_exceeded")


# -- the router's tokenizer, counted (the router class itself, no Ray: its limits run before any model work) --
class CountingTokenizer:
    """The router's tokenizer, recording the length of every text it is asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, text, **kw):
        self.calls.append(len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """A Router built from a config as Serve would build it, its specialists never called, its tokenizer
    counted; yields a function that sends it a body and returns (the ApiError it raised, the texts' lengths
    it tokenized)."""
    import asyncio

    from cluster.config import load_config
    from serve_app.errors import ApiError
    from serve_app.router import Router
    from serve_app.schemas import CompletionRequest, FanoutRequest

    tmp = tmp_path_factory.mktemp("router")
    raw = yaml.safe_load(write_config(tmp).read_text())
    raw["specialists"] = [{"name": n, "path": str(DEMO / n)} for n in ("qa", "prose")]
    raw["limits"] = {"max_fanout": MAX_FANOUT, "max_tokens": MAX_TOKENS}
    (tmp / "ray_config.yaml").write_text(yaml.safe_dump(raw))
    cls = Router.func_or_class.__mro__[1]            # the class under Serve's ingress wrapper
    r = cls.__new__(cls)
    cls.__init__(r, {"qa": None, "prose": None}, load_config(tmp / "ray_config.yaml").model_dump())
    tok = r.tok

    def refused(path: str, body: dict):
        r.tok = counting = CountingTokenizer(tok)
        call = r.completions(CompletionRequest.model_validate(body)) if path == C else \
            r.fanout(FanoutRequest.model_validate(body))
        with pytest.raises(ApiError) as e:
            asyncio.run(call)
        return e.value, counting.calls
    refused.tok, refused.max_input = tok, r.max_input
    return refused


def _longest_token_chars(tok) -> int:
    """No token of this tokenizer stands for more characters: a text of C characters is >= C / this tokens."""
    return max(len(tok.convert_tokens_to_string([t])) for t in tok.convert_ids_to_tokens(list(range(len(tok)))))


def test_a_prompt_longer_than_any_token_budget_is_refused_before_it_is_tokenized(router):
    prompt = "Tilda Vance lives in Hythe. " * (200 * 1024 // 28)
    bound = router.max_input * _longest_token_chars(router.tok)
    assert len(prompt) > bound, (len(prompt), bound)         # at least len / longest tokens: over the budget
    err, calls = router(C, comp(prompt=prompt))
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded"), err.message
    assert calls == [], f"tokenized texts of {calls} characters before refusing"


def test_a_prompt_that_needs_tokenizing_is_tokenized_once(router):
    """Under the character bound, over the token budget: each piece of the prompt is tokenized once (the
    prefix the producer would prefill, the tail the specialist reads), then refused."""
    prompt = "Tilda Vance lives in Hythe. " * 600                  # 16.8k characters, ~4.8k tokens
    assert len(prompt) < router.max_input * _longest_token_chars(router.tok)
    err, calls = router(C, comp(prompt=prompt))
    assert (err.status, err.code) == (400, "context_length_exceeded"), err.message
    assert len(calls) == 2 and sum(calls) == len(prompt), calls
    err, calls = router(C, comp(prefix=prompt, prompt="Where does Tilda Vance live?"))
    assert err.code == "context_length_exceeded" and calls == [len(prompt), len("Where does Tilda Vance live?")], calls


def test_a_fanout_prefix_is_tokenized_once_for_all_its_specialists(router):
    prefix = "Notes: Tilda Vance lives in Hythe. " * 500              # ~4.5k tokens: over the budget
    items = [{"specialist": s, "suffix": f"Question {i}: where?", "max_tokens": 2}
             for i, s in enumerate(["qa", "prose"] * (MAX_FANOUT // 2))]
    err, calls = router(F, {"prefix": prefix, "requests": items})
    assert (err.status, err.code) == (400, "context_length_exceeded"), err.message
    assert calls == [len(prefix)] + [len(i["suffix"]) for i in items], calls


def test_chunked_body_over_limit_is_413(served):
    body = encode(comp(prompt="x " * (150 * 1024)))                    # ~300 KB, no Content-Length
    status, headers, raw = send(served, "POST", C, body, {**JSON_CT, **AUTH}, chunked=True)
    assert_error(status, headers, raw, 413, code="request_too_large")


def test_chunked_body_under_limit_is_served(served):
    status, headers, raw = send(served, "POST", C, encode(comp()), {**JSON_CT, **AUTH}, chunked=True)
    assert_ok(Case("chunked", 200, comp()), status, headers, raw)


def test_openai_client_right_key_works_wrong_key_is_authentication_error(served):
    import openai
    ok = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0)
    r = ok.completions.create(model="qa", prompt="Notes: Tilda Vance lives in Hythe.\nTilda", max_tokens=2)
    assert r.choices[0].text is not None and r.model_extra["scd"]["reason"] == "no_artifact", r
    with pytest.raises(openai.BadRequestError) as e:
        ok.completions.create(model="qa", prompt="a b", max_tokens=MAX_TOKENS + 1)
    assert e.value.body["param"] == "max_tokens", e.value.body
    bad = openai.OpenAI(base_url=served + "/v1", api_key="sk-wrong-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="qa", prompt="a b", max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key", e.value.body
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_still_serves_after_everything(served):
    """Last in the module: nothing above wedged the router, the producer or a specialist."""
    status, headers, raw = send(served, "POST", C, encode(comp()), {**JSON_CT, **AUTH})
    assert_ok(Case("after", 200, comp()), status, headers, raw)
    status, headers, raw = send(served, "GET", "/healthz", None, {})
    assert status == 200 and json.loads(raw)["status"] == "degraded", raw[:500]     # nothing calibrated here
