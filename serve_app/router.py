"""The HTTP ingress: OpenAI-compatible completions and chat completions, fan-out of one shared prefix, models, health.

The router never touches tensors. It tokenizes once (the family shares one tokenizer), checks every limit of
the config before any model work, asks the producer for codes (one prefill for every specialist a request
names), hands each specialist its request and gathers the answers. A producer that is missing or slow does
not fail a request: the specialists prefill themselves and the response says why. A specialist replica that
dies under a request is asked once more on another replica when nothing was streamed yet; what still fails
comes back as an OpenAI-shaped error, and one failed item of a fan-out leaves the others answered.
"""

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import contextmanager

import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError

from actors.adapter_book import SYNC_S, book
from actors.messages import Codes, FallbackReason, GenParams, Output, SpecialistRequest, one_line, pair_id
from cluster.config import DeploymentConfig
from engines.interface import NotServed
from scd.online.api import AdapterError
from serve_app import adapters, responses, telemetry
from serve_app.errors import ApiError, Guard, install, overloaded
from serve_app.health import deployment_state, problem_lines, problems
from serve_app.producer_client import Producers
from serve_app.schemas import (ChatCompletionRequest, CompletionRequest, FanoutRequest, LoadLoraRequest, Sampling,
                               UnloadLoraRequest)

log = logging.getLogger(__name__)

api = FastAPI(title="SCD Serve")
api.add_middleware(Guard)
install(api)


async def within(call, timeout_s: float):
    """asyncio.wait_for for a Serve handle call: Serve answers the cancellation of a call that timed out with
    RequestCancelledError rather than CancelledError, which wait_for then raises instead of TimeoutError
    (a busy specialist's status read as a failure, a slow answer as a 500 instead of a 504)."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except RequestCancelledError as e:
        raise asyncio.TimeoutError(f"no answer within {timeout_s} s") from e


def _split(prompt: str) -> tuple[str, str]:
    """Without an explicit prefix, the producer prefills all but the prompt's last line (or last word),
    and the specialist reads that tail itself: it needs at least one token of its own to start decoding.
    The separator stays with the tail, where the tokenizer would have put it."""
    for sep in ("\n", " "):
        cut = prompt.rstrip(sep).rfind(sep)
        if cut > 0:
            return prompt[:cut], prompt[cut:]
    return "", prompt


TOKENIZED_TEXTS = 256           # recent texts whose token ids the router keeps (shared prefixes come back)
INLINE_TOKENIZE_CHARS = 2000    # a text this short is tokenized on the event loop (a thread hop costs more)
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)


def _raised(e: BaseException, kind: type) -> BaseException | None:
    """The exception of type `kind` that a remote call raised (a RayTaskError's cause), or `e` itself when
    it is one; else None."""
    for x in (getattr(e, "cause", None), e):
        if isinstance(x, kind):
            return x
    return None


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@serve.deployment
@serve.ingress(api)
class Router:
    def __init__(self, specialists: dict, config: dict, key_sha: str | None = None):
        from scd.online.model_files import context_length, load_tokenizer
        self.cfg = cfg = DeploymentConfig.model_validate(config)
        self.limits = cfg.limits
        telemetry.setup(**cfg.telemetry.model_dump(exclude={"access_log"}), service="router")
        Guard.configure(key_sha, cfg.limits.max_body_bytes)
        self.handles = specialists                              # name -> DeploymentHandle
        # LoRA groups' members: their group's engine prefills the prefix itself (no producer, no codes)
        self.grouped = {m.name for members in cfg.groups().values() for m in members}
        self.group_handles = {g: specialists[members[0].name] for g, members in cfg.groups().items()}
        self.book = book(cfg.ray.namespace) if self.group_handles else None
        self.from_book: set[str] = set()                        # adapters loaded at run time (any router's)
        self.book_read_at = 0.0
        self.base = cfg.producer.name
        self.producers = Producers(cfg)
        self.tok = load_tokenizer(cfg.producer.path)
        self.context = context_length(cfg.producer.path)
        self.max_input = min(cfg.limits.max_input_tokens or self.context, self.context)
        # no token stands for more characters than the longest one: a text longer than max_input times that is
        # over any token budget, and is refused before a tokenizer spends time on it (a 200 KB prompt)
        self.max_chars = self.max_input * max(len(self.tok.convert_tokens_to_string([t]))
                                              for t in self.tok.convert_ids_to_tokens(list(range(len(self.tok)))))
        self.inflight = 0
        self.tokenized: OrderedDict[str, tuple[int, ...]] = OrderedDict()    # recent texts -> token ids

    # -- admission and limits ---------------------------------------------------------------------------
    @contextmanager
    def _admitted(self):
        """A slot among router_max_ongoing, or 503 + Retry-After. Yields a list: a stream appends its
        generator, which then holds the slot until the stream ends."""
        if self.inflight >= self.limits.router_max_ongoing:
            raise overloaded("the router", self.limits.retry_after_s)
        self.inflight += 1
        handed_to_stream: list = []
        try:
            yield handed_to_stream
        finally:
            if not handed_to_stream:
                self.inflight -= 1

    async def _tokenize(self, text: str) -> list[int]:
        """Token ids of `text`. A text seen lately (a shared prefix asked again) is not tokenized again; a short
        one is tokenized here, a long one on a thread (the event loop keeps serving meanwhile)."""
        if not text:
            return []
        ids = self.tokenized.get(text)
        if ids is not None:
            self.tokenized.move_to_end(text)
            return list(ids)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = (await asyncio.to_thread(self.tok, text, add_special_tokens=False))["input_ids"]
        self.tokenized[text] = tuple(ids)
        while len(self.tokenized) > TOKENIZED_TEXTS:
            self.tokenized.popitem(last=False)
        return ids

    def _check(self, name: str, n_prefix: int, n_suffix: int, p: Sampling, where: str = "") -> None:
        if p.max_tokens > self.limits.max_tokens:
            raise ApiError(400, f"{where}max_tokens: at most {self.limits.max_tokens} (limits.max_tokens)",
                           where + "max_tokens")
        if p.min_tokens > p.max_tokens:
            raise ApiError(400, f"{where}min_tokens {p.min_tokens} exceeds max_tokens {p.max_tokens}",
                           where + "min_tokens")
        if n_suffix == 0:
            raise ApiError(400, f"{where}the text after the prefix holds no token", where + "prompt")
        if n_prefix + n_suffix > self.max_input:
            raise ApiError(400, f"{where}the input is {n_prefix + n_suffix} tokens ({n_prefix} prefix + {n_suffix} "
                                f"prompt); {name} takes at most {self.max_input}", where + "prompt",
                           "context_length_exceeded")
        if n_prefix + n_suffix + p.max_tokens > self.context:
            raise ApiError(400, f"{where}{n_prefix + n_suffix} input tokens + max_tokens {p.max_tokens} exceed the "
                                f"model's context of {self.context} tokens", where + "max_tokens",
                           "context_length_exceeded")

    def _check_chars(self, name: str, chars: int, where: str = "", param: str = "prompt") -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"{where}the input is {chars} characters, more than {name}'s {self.max_input} tokens "
                                "could hold", where + param, "context_length_exceeded")

    async def _sync_book(self) -> None:
        """Serve the adapters the book lists (loaded through any router replica), stop serving those it
        dropped."""
        if self.book is None:
            return
        self.book_read_at = time.monotonic()
        try:
            listed = await within(self.book.listing.remote(), self.limits.control_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:    # served as last read, until it answers
            log.warning("the adapter book did not answer: %s", one_line(e))
            return
        for name, (group, _) in listed.items():
            if name not in self.handles and group in self.group_handles:
                self.handles[name] = self.group_handles[group]
                self.grouped.add(name)
                self.from_book.add(name)
        for name in [n for n in self.from_book if n not in listed]:
            self.handles.pop(name, None)
            self.grouped.discard(name)
            self.from_book.discard(name)

    async def _known(self, name: str, param: str) -> None:
        """_model, after reading the adapter book when the name is not served yet, or is an adapter loaded at
        run time and the book was last read more than SYNC_S ago (another router may have unloaded it)."""
        stale = time.monotonic() - self.book_read_at > SYNC_S
        if self.book is not None and (name not in self.handles or (name in self.from_book and stale)):
            await self._sync_book()
        self._model(name, param)

    def _model(self, name: str, param: str) -> None:
        if name not in self.handles:
            raise ApiError(404, f"model {name!r} does not exist; have {sorted(self.handles)}", param,
                           "model_not_found")

    # -- one specialist request -------------------------------------------------------------------------
    def _request(self, name: str, prefix_ids: list[int], suffix_ids: list[int], p: Sampling, enc: Codes | None,
                 reason: str | None, trace: dict, producer_ms: float) -> SpecialistRequest:
        """producer_ms: the router's wait for the producer's codes (its prefill and encode, and the hop)."""
        codes = enc.per_pair[pair_id(self.base, name)] if enc is not None and name not in self.grouped else None
        if name in self.grouped and reason != "oracle":
            reason = None                               # its group's engine prefills: no codes to wait for
        if not prefix_ids:
            reason = FallbackReason.PREFIX_TOO_SHORT
        return SpecialistRequest(
            prefix_ids, suffix_ids, GenParams(p.max_tokens, p.temperature, p.top_p, tuple(p.stops()), p.seed,
                                              p.min_tokens, p.ignore_eos, p.n_logprobs),
            codes, reason or (codes and codes.reason),
            {**(enc.timings if enc else {}), "producer_call": producer_ms}, trace, enc.producer if enc else None,
            p.exact if p.exact is not None else name not in self.from_book and self.cfg.specialist(name).exact, name)

    def _failure(self, name: str, e: BaseException) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if _raised(e, NotServed):
            return ApiError(404, f"model {name!r} does not exist (it was unloaded)", "model", "model_not_found")
        if isinstance(e, BackPressureError):
            return overloaded(f"specialist {name!r}", self.limits.retry_after_s)
        if isinstance(e, DeploymentUnavailableError):
            return ApiError(503, f"specialist {name!r} has no running replica", code="unavailable",
                            headers={"Retry-After": str(self.limits.retry_after_s)})
        if isinstance(e, asyncio.TimeoutError):
            return ApiError(504, f"specialist {name!r} did not answer within its time limit", code="timeout")
        if isinstance(e, REPLICA_GONE):
            return ApiError(502, f"the replica of {name!r} serving this request died ({type(e).__name__}); "
                                 "retry the request", code="replica_failed")
        return ApiError(500, f"specialist {name!r} failed: {type(e).__name__}", code="internal_error")

    async def _once_more_if_replica_died(self, name: str, attempt):
        """await attempt(); a replica that died under it is tried once more (Serve picks another). The same
        request: its codes are still where the ticket says (in the ticket, the object store, or staged in the
        producer until every receiver pulled them; a pull the dead replica made is not owed again, so the new
        one may fall back with transport_error). Any other failure is an ApiError."""
        for retry in (False, True):
            try:
                return await attempt()
            except REPLICA_GONE as e:
                if retry:
                    raise self._failure(name, e) from None
            except Exception as e:
                raise self._failure(name, e) from None

    async def _generate(self, name: str, req: SpecialistRequest) -> Output:
        """The whole answer; its timings gain the router's wait for it (`specialist_call`)."""
        t0 = time.perf_counter()
        out = await self._once_more_if_replica_died(name, lambda: within(
            self.handles[name].generate.remote(req), self.limits.request_timeout_s))
        if out.scd is not None:
            out.scd["timings_ms"]["specialist_call"] = round(_ms_since(t0), 3)
        return out

    async def _first_event(self, name: str, req: SpecialistRequest):
        """(stream, its first event): nothing has reached the client yet, so a dead replica can be retried."""
        async def attempt():
            gen = self.handles[name].options(stream=True).stream.remote(req)
            try:
                return gen, await within(gen.__anext__(), self.limits.first_token_timeout_s)
            except BaseException:
                gen.cancel()
                raise
        return await self._once_more_if_replica_died(name, attempt)

    # -- routes ---------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """The probe vLLM and SGLang serve (load balancers, Kubernetes, benchmark clients): 200 while answers
        come (ok or degraded), 503 when no specialist can answer; /healthz says why."""
        state = (await self._health())["status"]
        return JSONResponse(status_code=503 if state == "down" else 200, content={"status": state})

    @api.get("/healthz")
    async def healthz(self):
        report = await self._health()
        return JSONResponse(status_code=503 if report["status"] == "down" else 200, content=report)

    async def _health(self) -> dict:
        """status ok: every producer and specialist answers and every pair can be served by SCD; degraded:
        answers still come, but some of them fall back or wait (a producer down or none left, a pair without
        an artifact, specialists too busy to report); down: no specialist can answer. `problems` says why, one
        line each: what, why, since when."""
        async def status(name, h):
            try:
                call = h.status.remote(name) if name in self.grouped else h.status.remote()
                return await within(call, self.limits.control_timeout_s)
            except asyncio.TimeoutError:                # its replicas are all busy: alive, but full
                return {"busy": f"no status within {self.limits.control_timeout_s} s"}
            except Exception as e:
                return {"error": one_line(e)}
        await self._sync_book()
        producers, answers = await asyncio.gather(self.producers.stats(), asyncio.gather(
            *(status(n, h) for n, h in self.handles.items())))
        specialists = dict(zip(self.handles, answers))
        if self.from_book:                          # adapters loaded at run time: their calibration jobs
            try:
                notes = await within(self.book.calibrations.remote(), self.limits.control_timeout_s)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                notes = {}
            for name, job in notes.items():
                if name in specialists:
                    specialists[name]["calibration"] = job
        found = problems(producers["producers"], specialists, self.base, self.grouped)
        return {"status": deployment_state(specialists, found), "problems": problem_lines(found),
                "producers": producers["producers"], "failovers": producers["failovers"],
                "specialists": specialists, "inflight": self.inflight}

    @api.get("/v1/models")
    async def models(self):
        await self._sync_book()
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "scd-serve"}
                                           for n in self.handles]}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        await self._known(body.model, "model")
        with self._admitted() as slot:
            # prefix: the explicit scd field, else the prompt minus its last character-run the specialist reads
            prefix, suffix = (body.prefix, body.text) if body.prefix else _split(body.text)
            self._check_chars(body.model, len(prefix) + len(suffix))
            return await self._answer(body, await self._tokenize(prefix), await self._tokenize(suffix), slot, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        await self._known(body.model, "model")
        if not getattr(self.tok, "chat_template", None):
            raise ApiError(400, "this model family's tokenizer has no chat template; use /v1/completions",
                           "messages", "chat_not_supported")
        with self._admitted() as slot:
            prefix, suffix = await asyncio.to_thread(self._render_chat, body.messages)
            self._check_chars(body.model, len(prefix) + len(suffix), param="messages")
            return await self._answer(body, await self._tokenize(prefix), await self._tokenize(suffix), slot, chat=True)

    def _render_chat(self, messages) -> tuple[str, str]:
        """(shared prefix, suffix) of a conversation in the chat template: the prefix is everything before
        the last user turn (system prompt, documents, earlier turns), the suffix that turn and the assistant
        header. A template that does not render the shorter conversation as a prefix of the longer one
        leaves everything to the specialist (stated as prefix_too_short)."""
        turns = [{"role": m.role, "content": m.text} for m in messages]
        try:
            full = self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            head = self.tok.apply_chat_template(turns[:-1], tokenize=False) if len(turns) > 1 else ""
        except Exception as e:                              # the template's own checks (e.g. role order)
            raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
        return (head, full[len(head):]) if full.startswith(head) else ("", full)

    async def _answer(self, body, prefix_ids: list[int], suffix_ids: list[int], slot: list, chat: bool):
        """One specialist request from tokenized prefix/suffix: codes, then the whole answer or a stream,
        shaped as a text completion or a chat completion."""
        self._check(body.model, len(prefix_ids), len(suffix_ids), body)
        with telemetry.span("router.chat" if chat else "router.completions", model=body.model):
            trace = telemetry.carrier()
            t0 = time.perf_counter()
            if body.oracle:
                enc, reason = None, "oracle"
            elif body.model in self.grouped:
                enc, reason = None, None
            elif prefix_ids:
                enc, reason = await self.producers.encode(prefix_ids, [pair_id(self.base, body.model)])
            else:
                enc, reason = None, FallbackReason.PREFIX_TOO_SHORT
            req = self._request(body.model, prefix_ids, suffix_ids, body, enc, reason, trace, _ms_since(t0))
        cid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        n_in = len(prefix_ids) + len(suffix_ids)
        if body.stream:
            gen, first = await self._first_event(body.model, req)
            slot.append(gen)
            return StreamingResponse(self._sse(gen, first, cid, created, body, n_in, chat),
                                     media_type="text/event-stream")
        out = await self._generate(body.model, req)
        # plain types throughout: sent as they are, not walked again by FastAPI's jsonable_encoder
        return JSONResponse({"id": cid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": body.model,
                             "choices": [responses.choice(out, chat, body.n_logprobs is not None)],
                             "usage": responses.usage(n_in, out.tokens), "scd": out.scd})

    async def _sse(self, gen, first: Output, cid: str, created: int, body, n_in: int, chat: bool = False):
        """Server-sent events; a failure after the first byte becomes an error event, then [DONE]. With
        stream_options.include_usage a last chunk with no choices carries the usage, as OpenAI's does (and
        every chunk carries the usage so far with continuous_usage_stats)."""
        options, n_out = body.stream_options, 0
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": body.model}

        def chunk(ev: Output, i: int) -> str:
            nonlocal n_out
            n_out = max(n_out, ev.tokens)
            out = {**head, "choices": [responses.choice(ev, chat, body.n_logprobs is not None, first=i == 0,
                                                        delta=True)]}
            if options and (options.include_usage or options.continuous_usage_stats):
                out["usage"] = responses.usage(n_in, n_out) if options.continuous_usage_stats else None
            if ev.scd is not None:
                out["scd"] = ev.scd
            return f"data: {json.dumps(out)}\n\n"
        try:
            yield chunk(first, 0)
            deadline = time.monotonic() + self.limits.request_timeout_s
            i = 1
            while True:
                try:
                    ev = await within(gen.__anext__(), min(self.limits.first_token_timeout_s,
                                                           max(0.0, deadline - time.monotonic())))
                except StopAsyncIteration:
                    break
                yield chunk(ev, i)
                i += 1
            if options and options.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': responses.usage(n_in, n_out)})}\n\n"
        except Exception as e:
            yield f"data: {json.dumps(self._failure(body.model, e).body())}\n\n"
        finally:
            gen.cancel()
            self.inflight -= 1                        # the slot _admitted handed to this stream
        yield "data: [DONE]\n\n"

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoraRequest):
        """vLLM's run-time LoRA loading, into a LoRA group: served from the answer on (every replica of the
        group loads it, a new one too), each request as the group serves an adapter of its shape
        (docs/lora-groups.md)."""
        await self._sync_book()
        name, group, path = adapters.load_target(body, {*self.handles, self.base, *self.group_handles},
                                                 list(self.group_handles), self.cfg.producer.path)
        try:
            share = await within(self.group_handles[group].load_adapter.remote(name, path),
                                 self.limits.request_timeout_s)
        except Exception as e:
            if (refused := _raised(e, AdapterError)) is not None:     # the group cannot hold it
                raise ApiError(400, f"lora_path: {refused}", "lora_path") from None
            raise self._failure(group, e) from None
        await within(self.book.add.remote(name, group, path), self.limits.control_timeout_s)
        await self._sync_book()
        if share == 1.0:                      # it changes every layer: its pair's artifact is calibrated meanwhile
            asyncio.get_running_loop().run_in_executor(None, adapters.calibrate, self.cfg, self.book, name, path,
                                                       self.limits.control_timeout_s)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoraRequest):
        """vLLM's run-time LoRA unloading, of an adapter loaded at run time: new requests for it get 404 at
        once, the running ones finish first."""
        name = body.lora_name
        await self._sync_book()
        adapters.unload_check(name, self.from_book, set(self.handles))
        handle = self.handles[name]
        await within(self.book.remove.remote(name), self.limits.control_timeout_s)
        await self._sync_book()
        try:
            await within(handle.unload_adapter.remote(name), self.limits.request_timeout_s)
        except Exception as e:
            raise self._failure(name, e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @api.post("/v1/fanout")
    async def fanout(self, body: FanoutRequest):
        if len(body.requests) > self.limits.max_fanout:
            raise ApiError(400, f"requests: at most {self.limits.max_fanout} items (limits.max_fanout)", "requests")
        for i, r in enumerate(body.requests):
            await self._known(r.specialist, f"requests.{i}.specialist")
        with self._admitted():
            for i, r in enumerate(body.requests):
                self._check_chars(r.specialist, len(body.prefix) + len(r.suffix), f"requests.{i}.", "suffix")
            prefix_ids = await self._tokenize(body.prefix)
            suffixes = [await self._tokenize(r.suffix) for r in body.requests]
            for i, (r, s) in enumerate(zip(body.requests, suffixes)):
                self._check(r.specialist, len(prefix_ids), len(s), r, f"requests.{i}.")
            names = sorted({r.specialist for r in body.requests})
            with telemetry.span("router.fanout", specialists=",".join(names)):
                trace = telemetry.carrier()
                t0 = time.perf_counter()
                coded = [r.specialist for r in body.requests if r.specialist not in self.grouped]
                if body.oracle:
                    enc, reason = None, "oracle"
                elif coded:
                    # a pair once per request: an RDT transport stages the one payload for that many pulls
                    enc, reason = await self.producers.encode(prefix_ids, [pair_id(self.base, n) for n in coded])
                else:                         # LoRA groups' members only: their engines prefill
                    enc, reason = None, None
                producer_ms = _ms_since(t0)
                reqs = [self._request(r.specialist, prefix_ids, s, r, enc, reason, trace, producer_ms)
                        for r, s in zip(body.requests, suffixes)]
                outs = await asyncio.gather(*(self._generate(r.specialist, q) for r, q in zip(body.requests, reqs)),
                                            return_exceptions=True)
        errors = [o for o in outs if isinstance(o, BaseException)]
        if len(errors) == len(outs):                      # nothing answered: the request as a whole failed
            raise self._failure(body.requests[0].specialist, errors[0])
        results = []
        for r, o in zip(body.requests, outs):
            if isinstance(o, BaseException):
                results.append({"specialist": r.specialist, **self._failure(r.specialist, o).body()})
            else:
                results.append({"specialist": r.specialist, "text": o.text, "finish_reason": o.finish_reason,
                                "scd": o.scd})
        return JSONResponse({"object": "fanout", "prefilled": bool(enc and enc.prefilled), "results": results})
