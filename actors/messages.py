"""What the processes of the request path say to each other, typed: a pair's id, why a request fell back to
a prefill, the producer's answer to an encode (Codes), what the router asks a specialist replica
(SpecialistRequest) and what the replica answers (Output: one per streamed piece, or the whole answer); the
ticket to a payload on a transport (Ticket), an error as the one line health reports show (one_line), and the
producers' actor names.

    router --encode(prefix ids, pairs)--> producer --Codes (a PairCodes per pair: ticket or reason)--> router
    router --SpecialistRequest (ids, GenParams, that pair's PairCodes)--> replica --Output...--> router
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

import ray

from scd.online.api import GenParams

__all__ = ["GenParams", "Codes", "PairCodes", "SpecialistRequest", "Output", "FallbackReason", "Ticket", "pair_id",
           "one_line", "PRODUCER_NAME", "producer_name"]

PRODUCER_NAME = "scd-producer"        # the producers' actor names: the pool's are scd-producer-0, scd-producer-1, ...


def producer_name(index: int) -> str:
    return f"{PRODUCER_NAME}-{index}"


def pair_id(producer: str, consumer: str) -> str:
    """The id of a producer->consumer pair (artifact registry, payload headers, the producer's per-pair answers)."""
    return f"{producer}:{consumer}"


class FallbackReason(StrEnum):
    """Why a specialist prefilled instead of rebuilding from codes; the value is what responses carry."""
    NO_ARTIFACT = "no_artifact"                     # no calibrated artifact for the pair
    ARTIFACT_MISMATCH = "artifact_mismatch"         # producer and specialist hold different artifact versions
    ARTIFACT_UNAVAILABLE = "artifact_unavailable"   # the registry could not be read
    PRODUCER_UNAVAILABLE = "producer_unavailable"   # the producer actor is gone or failed
    PRODUCER_TIMEOUT = "producer_timeout"           # no codes within producer_timeout_s
    TRANSPORT_ERROR = "transport_error"             # the codes did not arrive intact
    CODEC_ERROR = "codec_error"                     # the payload did not parse or did not match the request
    PREFIX_TOO_SHORT = "prefix_too_short"           # nothing shared to rebuild
    QUALITY_GATE = "quality_gate"                   # calibration refused to publish an artifact for the pair
    INVOCATION_IN_PREFIX = "invocation_in_prefix"   # an activated LoRA switched on inside the shared prefix
    GROUP_OWN_PREFILL = "group_own_prefill"         # a LoRA group's adapter with an artifact prefilled the prefix


@dataclass(frozen=True)
class Ticket:
    kind: str                      # "object_store" | "nixl" | "cuda_ipc"
    nbytes: int
    ref: list | None = None        # object_store: [ObjectRef] (in a list so Ray does not resolve it in transit)
    data: bytes | None = None      # a small payload itself (at most inline_bytes), carried in the ticket: the
                                   # payload's bytes (object_store), a Wire's body as host bytes (nixl, cuda_ipc)
    head: bytes | None = None      # nixl, cuda_ipc, carried in the ticket: the Wire's header
    key: str | None = None         # nixl, cuda_ipc: the staged payload a replica pulls
    producer: str | None = None    # nixl, cuda_ipc: the producer (actor name) that staged it


@dataclass(frozen=True)
class PairCodes:
    """The producer's codes of one prefix for one pair: a ticket to the payload on the transport, or why
    there is none (reason)."""
    version: str | None
    ticket: Ticket | None = None
    payload_bytes: int = 0
    cache_hit: bool = False
    reason: FallbackReason | None = None
    family: str | None = None                   # the family whose one payload this is (version: the family's)
    entry_ticket: Ticket | None = None          # E-first: the entry part, received before `ticket`'s rest


@dataclass(frozen=True)
class Codes:
    """The producer's answer to one encode: one PairCodes per pair asked for, from at most one prefill."""
    per_pair: dict[str, PairCodes]
    prefilled: bool
    incarnation: str                            # the producer's start (a restart is a new one)
    producer: str = ""                          # the producer's actor name (one of the pool's)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SpecialistRequest:
    """What the router asks one specialist replica: token ids (tokenized once, at the router), sampling, and
    either that pair's codes or the reason it prefills."""
    prefix_ids: list[int]
    suffix_ids: list[int]
    params: GenParams
    codes: PairCodes | None = None
    reason: str | None = None                   # a fallback reason, or "oracle": prefill on purpose
    timings: dict[str, float] = field(default_factory=dict)
    trace: dict = field(default_factory=dict)   # telemetry context carrier
    producer: str | None = None                 # the producer that encoded the codes (the answer says so)
    exact: bool = False                         # the specialist's own output: codes only draft (exact mode)
    model: str = ""                             # the specialist asked (a LoRA group's engine serves several)


@dataclass(frozen=True)
class Output:
    """What a replica answers: a streamed piece of text (with the tokens generated so far), or (the last event
    of a stream, and a whole answer) the finish reason, how it was served (`scd`) and the generated tokens."""
    text: str = ""
    finish_reason: str | None = None
    scd: dict | None = None
    tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)   # asked for: one entry per generated token (engine's shape)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(e: BaseException) -> str:
    """An exception as one line for health reports: its type and its message's first line, without the remote
    traceback a RayTaskError carries or terminal colour codes (/healthz answers without authentication)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        e = cause
    text = _ANSI.sub("", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
