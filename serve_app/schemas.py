"""HTTP bodies (OpenAI-compatible where OpenAI defines them) and the scd extension fields.

Strict types: `"16"` or `true` is not a max_tokens. Fields OpenAI clients send that this server does not
implement are accepted only at their neutral value (`n: 1`, `echo: false`, `logprobs: null`, ...) and refused
with 400 otherwise; any other unknown field is refused. `null` for a field that has a default means that
default, as in OpenAI's API (`"max_tokens": null` is 16); a required field is never null. Text must be valid
Unicode: a lone surrogate (`"\\ud800"` in JSON) cannot be tokenized and is refused with 400. Limits that
depend on the deployment (max_tokens, prompt tokens, fan-out width) are checked by the router against the
config.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64 = 2 ** 63
MAX_STOP_CHARS = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        field = cls.model_fields[info.field_name]
        return field.get_default(call_default_factory=True) if v is None and not field.is_required() else v

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, v):
        for s in [v] if isinstance(v, str) else v if isinstance(v, list) else ():
            if isinstance(s, str) and not s.isascii():
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"not valid Unicode: a lone surrogate {s[e.start]!r} at character "
                                     f"{e.start}") from None
        return v


def _texts(v, what: str):
    """A union's own errors name its members (`stop.str`, `stop.list[str]`): check the shape first, so that
    a wrong type is one error on the field itself."""
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return v
    raise ValueError(f"must be {what}")


class Sampling(_Body):
    max_tokens: int = Field(16, ge=1, description="tokens to generate (upper bound: limits.max_tokens)")
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, description="up to 4 non-empty stop strings")
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="sampling seed (a signed 64-bit integer)")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: end-of-sequence is masked until this many tokens")
    ignore_eos: bool = Field(False, description="vLLM extension: end-of-sequence is always masked (benchmarks fix "
                                                "output lengths with it); max_tokens or a stop string ends the answer")
    exact: bool | None = Field(None, description="scd extension: the specialist's own output (token for token when "
                               "greedy): codes only draft, verified on the specialist's own prefill; null: the "
                               "specialist's configured default")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v):
        return v if v is None else _texts(v, "a string or a list of strings")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def n_logprobs(self) -> int | None:
        """How many alternatives per generated token to report with its logprob (None: no logprobs)."""
        return None


class StreamOptions(_Body):
    """OpenAI's stream_options (vLLM adds continuous_usage_stats)."""
    include_usage: bool = Field(False, description="a last chunk, with empty choices, carries the usage")
    continuous_usage_stats: bool = Field(False, description="vLLM extension: every chunk carries the usage so far")


class _Streamed(Sampling):
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):          # stream is validated first (field order)
            raise ValueError("only allowed when stream is true")
        return v


NO_PROMPT_LOGPROBS = ("prompt logprobs are not served: the specialist rebuilds the prefix's cache from the "
                      "producer's codes and never computes logits over the prompt")


def _no_prompt_logprobs(value, neutral):
    if value is not None and value != neutral:
        raise ValueError(NO_PROMPT_LOGPROBS)
    return value


def _only_neutral(value, neutral):
    """An OpenAI field this server does not implement: null, its neutral value, or (for a field whose neutral
    value is null) an empty {} / [] / 0 pass; anything else is refused."""
    if value is not None and value != neutral and not (neutral is None and value in ({}, [], 0)):
        raise ValueError(f"{value!r} is not supported by this server (only {neutral!r})")
    return value


# OpenAI completion fields this server does not implement, with the only value it accepts for each
NEUTRAL: dict[str, Any] = {"n": 1, "best_of": 1, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
                           "logit_bias": None}
MAX_LOGPROBS = 20


class CompletionRequest(_Streamed):
    model: str = Field(min_length=1, max_length=64, description="specialist name")
    prompt: str | list[str] = Field(description="text to complete (one string, or a list of exactly one)")
    prefix: str | None = Field(None, min_length=1, description="scd extension: a shared prefix the producer "
                               "prefills; the prompt is then the suffix the specialist reads after it")
    oracle: bool = Field(False, description="scd extension: the specialist prefills the prefix itself (the "
                                            "reference path), e.g. to compare time to first token")
    user: str | None = Field(None, max_length=256, description="end-user id (accepted, recorded nowhere)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each generated token's logprob and "
                                 "this many most likely alternatives")
    echo: bool | None = Field(None, description="only false: prompt logprobs are not served")
    prompt_logprobs: int | None = Field(None, description="vLLM extension; only null: prompt logprobs are not served")
    n: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("echo", "prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value, info):
        return _no_prompt_logprobs(value, False if info.field_name == "echo" else None)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        return _texts(v, "a string or a list of one string")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt string is supported (send several requests, or /v1/fanout)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, value, info):
        return _only_neutral(value, NEUTRAL[info.field_name])

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(_Body):
    role: str = Field(pattern="^(system|developer|user|assistant)$", description="who speaks this turn")
    content: str | list[dict] = Field(description="the turn's text, or a list of {type: text, text} parts")
    name: str | None = Field(None, max_length=64, description="accepted, not used")

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                       and set(p) <= {"type", "text"} for p in v):
            return v
        raise ValueError("must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p["text"] for p in self.content)


# OpenAI chat fields this server does not implement, with the only value it accepts for each
CHAT_NEUTRAL: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                                "tools": None, "tool_choice": None, "response_format": None,
                                "parallel_tool_calls": None}


class ChatCompletionRequest(_Streamed):
    """OpenAI chat completions. The shared prefix (prefilled once by the producer, reusable across requests
    and specialists) is the conversation rendered with the model's chat template up to the last user turn;
    the specialist reads that turn and the assistant header itself."""
    model: str = Field(min_length=1, max_length=64, description="specialist name")
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    oracle: bool = Field(False, description="scd extension: the specialist prefills the prompt itself")
    user: str | None = Field(None, max_length=256, description="end-user id (accepted, recorded nowhere)")
    logprobs: bool = Field(False, description="each generated token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: this many most "
                                     "likely alternatives per token")
    prompt_logprobs: int | None = Field(None, description="vLLM extension; only null: prompt logprobs are not served")
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, v):
        if v[-1].role != "user":
            raise ValueError("the last message must be the user's turn (the one to answer)")
        return v

    @field_validator(*CHAT_NEUTRAL)
    @classmethod
    def _neutral(cls, value, info):
        return _only_neutral(value, CHAT_NEUTRAL[info.field_name])

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value):
        return _no_prompt_logprobs(value, None)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    def model_post_init(self, _):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class FanoutItem(Sampling):
    specialist: str = Field(min_length=1, max_length=64)
    suffix: str = Field(min_length=1)


class FanoutRequest(_Body):
    prefix: str = Field(min_length=1, description="the shared prefix: prefilled once by the producer")
    requests: list[FanoutItem] = Field(min_length=1, description="one per answer (at most limits.max_fanout)")
    oracle: bool = Field(False, description="every specialist prefills the prefix itself (the reference path); "
                                            "nothing is asked of the producer")


def _producer_work_ms(scd: dict) -> float:
    """The producer's prefill and encode behind an answer served by scd (a fallback's `prefill` is its own)."""
    t = scd.get("timings_ms") or {}
    return t.get("prefill", 0.0) + t.get("encode", 0.0) if scd.get("mode") == "scd" else 0.0


def model_compute_ms(items: list[dict]) -> float:
    """The model work behind one answered request, from the `scd` objects of its answers (one per fan-out
    item): the producer's prefill and encode (once, for scd-served items; a cache hit reports 0) plus the
    slowest specialist's own work, from the start of its prefix cache (rebuild or prefill) to its last token.
    What a request's latency holds beyond this is serving overhead: HTTP, routing, hops between processes,
    queueing, moving the codes."""
    producer = max((_producer_work_ms(x) for x in items), default=0.0)
    return producer + max(((x.get("timings_ms") or {}).get("total", 0.0) for x in items), default=0.0)


def overhead_parts_ms(latency_ms: float, scd: dict) -> dict[str, float]:
    """Where one completion's serving overhead went, from its `scd` timings (they sum to latency minus
    model_compute_ms): HTTP, the Serve proxy and the router's own work; the router's call to the producer
    beyond the producer's prefill and encode; the Serve handle hop to the specialist replica; the replica's call
    to its engine actor; the engine actor receiving the codes (its `transfer`: read from the ticket, or pulled
    from the producer); the engine actor's other work around the model (thread hand-offs, loading an artifact
    version)."""
    t = scd.get("timings_ms") or {}
    return {"http_and_router": latency_ms - t.get("specialist_call", 0.0) - t.get("producer_call", 0.0),
            "producer_hop": t.get("producer_call", 0.0) - _producer_work_ms(scd),
            "specialist_hop": t.get("specialist_call", 0.0) - t.get("replica", 0.0),
            "engine_hop": t.get("replica", 0.0) - t.get("engine", 0.0),
            "codes_in": t.get("transfer", 0.0),
            "engine": t.get("engine", 0.0) - t.get("total", 0.0) - t.get("transfer", 0.0)}


class LoadLoraRequest(_Body):
    """vLLM's `POST /v1/load_lora_adapter` body, plus the LoRA group to load into when the config has several."""
    lora_name: str = Field(min_length=1, description="the name it is served under (the `model` of requests)")
    lora_path: str = Field(min_length=1, description="a PEFT adapter folder on the serving machines")
    load_inplace: bool = Field(False, description="vLLM: replace a loaded adapter of that name (not supported)")
    group: str | None = Field(None, description="scd extension: the LoRA group (default: the config's only one)")


class UnloadLoraRequest(_Body):
    """vLLM's `POST /v1/unload_lora_adapter` body."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's numeric id: not used here")
