"""The interface of an answering engine, and the one config object it is built from.

As Ray Serve LLM keeps its engine (`LLMEngine`: start, completions, health, stop) apart from the server that
holds it, an engine here is plain Python and its Ray actor a shim: the actor receives an `EngineConfig`, builds
the engine in its own process (`build`: the model is loaded where it computes), and then only asks it to
answer, to report its status and to stop. Two engines implement it: `SpecialistEngine` (a model of its own,
its prefix rebuilt from a producer's codes) and `GroupEngine` (a LoRA group: one base and its adapters, the
prefix's base layers computed once for all). The producer's engine encodes instead of answering
(engines/producer.py); its actor builds it from a `ProducerConfig` the same way.

Also here, with no torch, for the processes that only forward requests: an E-first payload as it arrives
(`Arriving`) and a request for an adapter a group does not hold (`NotServed`).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Protocol

from actors.messages import PRODUCER_NAME, SpecialistRequest
from actors.transport import INLINE_BYTES

if TYPE_CHECKING:
    from scd.online import e_first

log = logging.getLogger(__name__)


class NotServed(ValueError):
    """A request names an adapter the group does not hold (never loaded, or unloaded)."""


@dataclass(frozen=True)
class EngineConfig:
    """What an answering engine and the actor that holds it are made from (one per Serve deployment)."""
    kind: Literal["specialist", "group"]
    name: str                              # the specialist's, or the group's
    model_path: str                        # the specialist's model or adapter folder; a group's: its base's
    base: str | None = None                # an adapter specialist's base folder (None: the one it names)
    members: dict[str, str] = field(default_factory=dict)   # a group: specialist name -> its adapter folder
    max_batch: int = 4                     # rows in one decode step
    max_input_tokens: int | None = None    # prefix + prompt tokens of a request (None: the model's context)
    max_tokens: int = 512                  # most tokens a request generates
    # where the actor finds what its engine serves from, and how it reports
    producer: str = ""                     # the producer's name: pairs are producer:specialist
    store_uri: str = ""                    # the artifact store
    namespace: str | None = None           # the Ray namespace of the producer, registry and book
    transport: str = "object_store"        # how a specialist receives its codes
    control_timeout_s: float = 5.0         # the actor's calls to the producer and registry
    telemetry: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ProducerConfig:
    """What a producer's engine and the actor that holds it are made from (one per producer of the pool)."""
    model_path: str                        # the producer's (base) model folder
    pairs: dict[str, str]                  # pair -> "latest" or a pinned version: the artifacts it encodes for
    store_uri: str                         # the artifact store
    namespace: str | None = None           # the Ray namespace of the registry
    name: str = PRODUCER_NAME              # its actor name: tickets say whom to pull from
    transport: str = "object_store"        # how the specialists receive its codes
    families: dict[str, str] = field(default_factory=dict)   # family id -> "latest" or a pinned version
    cache_bytes: int = 64 << 20            # the prefix code cache
    stage_bytes: int = 256 << 20           # payloads staged for pulls (nixl, cuda_ipc)
    inline_bytes: int = INLINE_BYTES       # a payload up to this size rides in its ticket
    watch_s: float = 10.0                  # how often it looks for new artifact versions (0: never)
    link_gbps: dict[str, float] | None = None     # the links to the specialists, for modeled TTFT
    ttft_target_ms: float | None = None


class Arriving:
    """An E-first payload (e_first.Parts) as a replica receives it: the entry part in hand, the rest a receive
    away. `receive()` -> (the rest or None, the fallback reason when None, ms it took) runs once, from
    `rest()` or from `close()` when nothing asked for it (a staged payload is released when taken)."""

    def __init__(self, entry, receive: Callable[[], tuple]):
        self.entry, self._receive, self._rest = entry, receive, None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, parts: e_first.Parts) -> "Arriving":
        """Both parts already in hand (in process)."""
        return cls(parts.entry, lambda: (parts.rest, None, 0.0))

    def rest(self) -> tuple:
        with self._lock:
            if self._rest is None:
                self._rest = self._receive()
            return self._rest

    close = rest

    def __len__(self) -> int:
        rest = self._rest[0] if self._rest is not None else None
        return len(self.entry) + (len(rest) if rest is not None else 0)


class AnsweringEngine(Protocol):
    """What an engine actor asks of its engine."""

    def answer(self, req: SpecialistRequest, put: Callable[[tuple], None], cancelled: threading.Event,
               payload=None, timings: dict | None = None) -> None:
        """Start answering `req`: its prefix cache (from `payload`, the codes received for it, where the engine
        rebuilds from codes), its suffix, then its decode steps in the engine's batch. Events go to put():
        ("token", text piece, logprobs entry or None, tokens so far)..., then ("done", info, finish_reason) or
        ("error", message). Setting `cancelled` ends it at its next token."""

    def status(self, name: str | None = None) -> dict:
        """What /healthz shows of the engine (of its member `name`, for a group)."""

    def stop(self) -> None:
        """Stop its decode loop and its threads; running rows end."""


def build(config: EngineConfig, device: str) -> AnsweringEngine:
    """The engine `config` describes, its models loaded on `device` (in the calling process)."""
    from scd.online import activated
    from scd.online.models import load
    if config.kind == "group":
        from engines.group import GroupEngine
        from scd.online.lora_group import LoraGroup, read_adapter
        base, tok, _ = load(config.model_path)
        base = base.to(device).eval()
        adapters = [read_adapter(name, path, base) for name, path in config.members.items()]
        return GroupEngine(LoraGroup(base, adapters), tok, device=device, max_batch=config.max_batch)
    from engines.specialist import SpecialistEngine
    model, tok, _ = load(config.model_path, base=config.base, device=device)
    model = activated.to(model, device)
    return SpecialistEngine(config.name, model, tok, device=device, max_batch=config.max_batch,
                            static_capacity=static_capacity(model, config, device))


def static_capacity(model, config: EngineConfig, device: str, free_bytes: int | None = None) -> int | None:
    """Positions of a row's static decode cache (scd.online.decode.StaticBatch: CUDA graphs) on a GPU, for a
    model fast_decode covers: the longest request's input and answer. None (one batch grown per step) on a CPU,
    for any other model, or where the caches of `max_batch` such rows would take over half the device's free
    memory (`free_bytes`, default: measured), which is logged with the limit that would make them fit."""
    from scd.online import fast_decode
    from scd.online.models import ModelSpec
    if not device.startswith("cuda") or fast_decode.step_for(model) is None:
        return None
    context = model.config.max_position_embeddings
    capacity = min(config.max_input_tokens or context, context) + config.max_tokens + 1
    per_token = ModelSpec.from_config(model.config).kv_bytes_per_token // 2 * next(model.parameters()).element_size()
    need = config.max_batch * capacity * per_token
    if free_bytes is None:
        import torch
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    if need > free_bytes / 2:
        log.warning("%s: static decode caches of %d rows x %d positions need %.1f GiB, over half the %.1f GiB "
                    "free; decoding without them (set limits.max_input_tokens to fit them)", config.name,
                    config.max_batch, capacity, need / 2**30, free_bytes / 2**30)
        return None
    return capacity
