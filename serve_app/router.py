"""The HTTP ingress: OpenAI-compatible completions, fan-out of one shared prefix, models, health.

The router never touches tensors: it asks the producer actor for codes (one prefill for every specialist a
request names), hands each specialist its ticket, and gathers the answers. A producer that is missing or
slow does not fail the request: the specialists prefill themselves and the response says why.
"""

import asyncio
import json
import time
import uuid

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from serve_app import telemetry
from serve_app.schemas import CompletionRequest, FanoutRequest

api = FastAPI(title="SCD Serve")


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError):
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    return _error(400, f"{where}: {first['msg']}" if where else first["msg"], where or None)


def _split(prompt: str) -> tuple[str, str]:
    """Without an explicit prefix, the producer prefills all but the prompt's last line (or last word),
    and the specialist reads that tail itself: it needs at least one token of its own to start decoding.
    The separator stays with the tail, where the tokenizer would have put it."""
    for sep in ("\n", " "):
        cut = prompt.rstrip(sep).rfind(sep)
        if cut > 0:
            return prompt[:cut], prompt[cut:]
    return "", prompt


@serve.deployment
@serve.ingress(api)
class Router:
    def __init__(self, specialists: dict, producer: str, namespace: str, producer_pair_prefix: str,
                 timeout_s: float = 10.0, telemetry_settings: dict | None = None):
        telemetry.setup(**(telemetry_settings or {}), service="router")
        self.handles = specialists                              # name -> DeploymentHandle
        self.producer_name, self.namespace = producer, namespace
        self.base, self.timeout_s = producer_pair_prefix, timeout_s

    # -- producer -----------------------------------------------------------------------------------
    async def _encode(self, prefix: str, names: list[str]) -> tuple[dict | None, str | None]:
        """(encoded, None) or (None, fallback reason)."""
        try:
            producer = ray.get_actor(self.producer_name, namespace=self.namespace)
        except ValueError:
            return None, "producer_unavailable"
        try:
            out = await asyncio.wait_for(producer.encode.remote(prefix, [f"{self.base}:{n}" for n in names]),
                                         timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return None, "producer_timeout"
        except ray.exceptions.RayError:
            return None, "producer_unavailable"
        return out, None

    async def _tokenize_fallback(self, name: str, prefix: str) -> list[int]:
        """Without a producer the prefix ids come from the specialist's own tokenizer (same vocabulary)."""
        return await self.handles[name].tokenize.remote(prefix)

    async def _request(self, name: str, prefix: str, suffix: str, params: dict, enc: dict | None,
                       reason: str | None, trace: dict) -> dict:
        if enc is None:
            prefix_ids, entry, timings = await self._tokenize_fallback(name, prefix), {}, {}
        else:
            prefix_ids, timings = enc["prefix_ids"], dict(enc["timings"])
            entry = enc["per_pair"][f"{self.base}:{name}"]
            reason = reason or entry["error"]
        if not prefix_ids:
            reason = "prefix_too_short"
        return {"prefix_ids": prefix_ids, "suffix": suffix, "params": params, "ticket": entry.get("ticket"),
                "version": entry.get("version"), "reason": reason, "timings": timings, "trace": trace}

    # -- routes ---------------------------------------------------------------------------------------
    @api.get("/healthz")
    async def healthz(self):
        try:
            producer = ray.get_actor(self.producer_name, namespace=self.namespace)
            stats = await asyncio.wait_for(producer.stats.remote(), timeout=self.timeout_s)
        except Exception as e:                                   # health reports, never raises
            stats = {"error": f"{type(e).__name__}: {e}"}
        specialists = {n: await h.status.remote() for n, h in self.handles.items()}
        ok = "error" not in stats
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "degraded", "producer": stats, "specialists": specialists})

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "scd-serve"}
                                           for n in self.handles]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        if body.model not in self.handles:
            return _error(404, f"model {body.model!r} does not exist; have {sorted(self.handles)}", "model",
                          "not_found_error")
        try:
            stops = body.stops()
        except ValueError as e:
            return _error(400, str(e), "stop")
        # prefix: the explicit scd field, else the prompt minus its last character-run the specialist reads
        prefix, suffix = (body.prefix, body.prompt) if body.prefix else _split(body.prompt)
        params = {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                  "stop": stops, "seed": body.seed}
        with telemetry.span("router.completions", model=body.model):
            trace = telemetry.carrier()
            if body.oracle:
                enc, reason = None, "oracle"
            elif prefix:
                enc, reason = await self._encode(prefix, [body.model])
            else:
                enc, reason = None, "prefix_too_short"
            req = await self._request(body.model, prefix, suffix, params, enc, reason, trace)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            handle = self.handles[body.model].options(stream=True)

            async def sse():
                async for ev in handle.stream.remote(req):
                    choice = {"text": ev.get("text", ""), "index": 0, "logprobs": None,
                              "finish_reason": ev.get("finish_reason")}
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                             "choices": [choice]}
                    if "scd" in ev:
                        chunk["scd"] = ev["scd"]
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        out = await self.handles[body.model].generate.remote(req)
        return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                "choices": [{"text": out["text"], "index": 0, "logprobs": None, "finish_reason": out["finish_reason"]}],
                "usage": {"prompt_tokens": len(req["prefix_ids"]), "completion_tokens": None, "total_tokens": None},
                "scd": out["scd"]}

    @api.post("/v1/fanout")
    async def fanout(self, body: FanoutRequest):
        unknown = sorted({r.specialist for r in body.requests} - set(self.handles))
        if unknown:
            return _error(404, f"unknown specialist(s) {unknown}; have {sorted(self.handles)}", "requests",
                          "not_found_error")
        names = sorted({r.specialist for r in body.requests})
        with telemetry.span("router.fanout", specialists=",".join(names)):
            trace = telemetry.carrier()
            enc, reason = await self._encode(body.prefix, names)        # exactly one producer prefill
            reqs = [await self._request(r.specialist, body.prefix, r.suffix,
                                        {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p,
                                         "stop": r.stop, "seed": None}, enc, reason, trace) for r in body.requests]
            outs = await asyncio.gather(*(self.handles[r.specialist].generate.remote(q)
                                          for r, q in zip(body.requests, reqs)))
        return {"object": "fanout", "prefilled": bool(enc and enc["prefilled"]),
                "results": [{"specialist": r.specialist, "text": o["text"], "finish_reason": o["finish_reason"],
                             "scd": o["scd"]} for r, o in zip(body.requests, outs)]}

