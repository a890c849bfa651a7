"""SpecialistActor: a specialist's engine in its own Ray actor, the one each Serve replica owns.

As Ray Serve LLM keeps its engine out of its server, the replica (serve_app/specialist.py) is a thin async shim
and this actor does the work: it holds the model on its device (placed by cluster/: GPUs, resources, labels),
loads its pair artifact through the registry actor (fingerprints checked against its own weights) and takes a
new version on `reconfigure` without a restart, pulls each request's codes itself (`Transport.receiver`: the
object store, or Ray Direct Transport from the producer; RDT needs the consuming process to be the one that
calls the producer), rebuilds the prefix cache and decodes in the engine's batch. It runs threaded: requests
block their own thread while receiving and rebuilding, and the decode loop has a thread of its own.

It decodes codes with the artifact version the producer encoded them with: when a publish reaches the producer
first, it loads that version (fingerprints checked) instead of falling back. It also loads its member of every
configured family it belongs to: a fan-out's one family payload is rebuilt with this specialist's own
decoders, at the family version the codes name.

The replica creates it and owns it, so it dies with its replica and a new replica makes a new one.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Iterator

import ray

from actors.drills import hold_until_open
from actors.messages import PRODUCER_NAME, FallbackReason, Output, SpecialistRequest, pair_id
from actors.registry import fetch, fetch_family, registry, unavailable_reason
from engines.interface import Arriving, EngineConfig, build
from actors.transport import TransportError, make_transport, warm
from artifacts_store.errors import ArtifactNotFound, ArtifactStoreError
from artifacts_store.fingerprints import Fingerprints
from cluster.runtime import cpu_threads, device, lower_cpu_priority
from serve_app import telemetry

log = logging.getLogger("scd.specialist")

CONTROL_CALLS = 8             # status, ready, cancel, reconfigure and drills beside the requests (threads)


def concurrency(max_ongoing: int) -> int:
    """The engine actor's threads: each request its replica runs at once blocks one while it receives, rebuilds
    and waits on its tokens, twice that many allowing for requests whose thread is still ending (a cancelled
    stream), and the control calls beside them. Idle threads cost nothing but memory, and a count a replica
    cannot fill is noise in every thread count of the process."""
    return 2 * max_ongoing + CONTROL_CALLS


def _coalesced(ev: tuple, events: queue.Queue) -> tuple[Output, tuple | None]:
    """A token event and every token event already queued behind it, as one Output, and the event after them
    (None: none queued yet). Tokens the decode loop made while the last piece was handed on travel together:
    under load one Ray stream item (and one chunk at every hop) carries several tokens, not one each."""
    text, logprobs, tokens = [ev[1]], [ev[2]] if ev[2] else [], ev[3]
    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            return Output("".join(text), tokens=tokens, logprobs=logprobs), None
        if ev[0] != "token":
            return Output("".join(text), tokens=tokens, logprobs=logprobs), ev
        text.append(ev[1])
        logprobs += [ev[2]] if ev[2] else []
        tokens = ev[3]


def pieces(events: queue.Queue):
    """Yields an answer's text as Outputs (tokens queued together travel as one, `_coalesced`); returns its
    last event, ("done", info, finish_reason) or ("error", message)."""
    ev = events.get()
    while ev[0] == "token":
        piece, ev = _coalesced(ev, events)
        yield piece
        ev = ev or events.get()
    return ev


def last_output(ev: tuple, t_in: float, specialist: str, failed: str, **scd) -> Output:
    """An answer's last Output from its last event (an error raises, `failed` naming who), its timings
    completed with the engine actor's whole time since t_in and recorded; `scd` adds to its scd object."""
    if ev[0] == "error":
        raise RuntimeError(f"{failed}: {ev[1]}")
    _, info, finish = ev
    info.timings["engine"] = (time.perf_counter() - t_in) * 1e3      # everything the engine actor did
    telemetry.record_phases(info.timings, telemetry.carrier(), specialist=specialist)
    return Output(finish_reason=finish, tokens=info.tokens, scd={**info.as_dict(), **scd})


def joined(outputs: Iterator[Output]) -> Output:
    """A stream's Outputs as one: the text and logprobs of every piece, the last one's finish and `scd`."""
    text, logprobs, last = [], [], None
    for ev in outputs:
        text.append(ev.text)
        logprobs += ev.logprobs
        last = ev
    return dataclasses.replace(last, text="".join(text), logprobs=logprobs)


class Answering:
    """What every engine actor answers beside its own stream(req, key): the whole answer, and cancel(key) of a
    running stream (its cancel() kept in self.running while it runs)."""
    running: dict

    def generate(self, req: SpecialistRequest, key: str) -> Output:
        """The whole answer in one Output."""
        return joined(self.stream(req, key))

    def cancel(self, key: str) -> None:
        cancel = self.running.get(key)
        if cancel is not None:
            cancel()


@ray.remote(max_concurrency=concurrency(16))       # the replica sets it from its own limit (concurrency())
class SpecialistActor(Answering):
    def __init__(self, config: EngineConfig):
        import torch
        torch.set_num_threads(cpu_threads())
        lower_cpu_priority()
        telemetry.setup(**config.telemetry, service=f"specialist-{config.name}")
        self.engine = build(config, device())
        model = self.engine.model
        self.timing_only = bool(getattr(model, "scd_timing_only", False))   # random weights: timings only
        self.name, self.pair = config.name, pair_id(config.producer, config.name)
        self.registry, self.store_uri = registry(config.store_uri, config.namespace), config.store_uri
        self.expect = Fingerprints.of(consumer=model, tokenizer=self.engine.tok)
        self.namespace, self.timeout_s = config.namespace, config.control_timeout_s
        self.transport_kind = config.transport
        self.producers: dict = {}                          # producer name -> its handle (RDT pulls)
        self.receiver = make_transport(config.transport).receiver(self._producer, config.control_timeout_s)
        warm(config.transport)
        self.artifact_lock = threading.Lock()
        self.refused: dict[str, str | None] = {}          # version -> why it could not be used
        self.family_notes: dict[str, str] = {}             # family id -> why this engine does not use it
        self.hold: str | None = None                       # drill: name of a gate actor requests wait on
        self.running: dict[str, callable] = {}             # stream key -> cancel() of its row
        self.reconfigure({"artifact": "latest"})

    def ready(self) -> bool:
        return True

    def _producer(self, name: str | None):
        """The producer that staged a payload (its ticket names it), looked up once; a producer recreated under
        its name (after a crash Ray gave up on) is looked up again."""
        name = name or PRODUCER_NAME
        handle = self.producers.get(name)
        if handle is None:
            handle = self.producers[name] = ray.get_actor(name, namespace=self.namespace)
        return handle

    def _forget_producer(self, name: str | None) -> None:
        self.producers.pop(name or PRODUCER_NAME, None)

    # -- artifacts ----------------------------------------------------------------------------------
    def _load(self, version: str) -> str | None:
        """Load `pair@version` (fingerprints checked); None when it worked, else the fallback reason. A
        storage or registry failure is stated (artifact_unavailable), never a dead replica."""
        try:
            art, manifest = fetch(self.registry, f"{self.pair}@{version}", self.expect, timeout_s=120)
        except (ArtifactStoreError, ray.exceptions.RayError) as e:
            reason = unavailable_reason(e)
            return FallbackReason.QUALITY_GATE if reason == FallbackReason.NO_ARTIFACT and self._refused() else reason
        self.engine.set_artifact(art.to(self.engine.device), manifest.version)
        return None

    def _load_family(self, fid: str, version: str) -> str | None:
        """Load this specialist's member of family `fid` at `version` (its own fingerprint checked); None when
        it worked, else the fallback reason (also when this specialist is not one of its members)."""
        try:
            fam, manifest = fetch_family(self.registry, f"{fid}@{version}", self.expect,
                                         member=self.pair.split(":", 1)[1], timeout_s=120)
        except ArtifactNotFound as e:
            self.family_notes[fid] = str(e)
            return FallbackReason.NO_ARTIFACT
        except ArtifactStoreError as e:
            self.family_notes[fid] = f"{type(e).__name__}: {e}"
            return FallbackReason.ARTIFACT_MISMATCH
        except ray.exceptions.RayError as e:
            self.family_notes[fid] = f"{type(e).__name__}"
            return FallbackReason.ARTIFACT_UNAVAILABLE
        self.engine.set_family(fam.members[self.pair].to(self.engine.device), manifest.version)
        self.family_notes.pop(fid, None)
        return None

    def _refused(self) -> bool:
        """Whether the pair's last calibration failed its quality gate (so none was published)."""
        from artifacts_store.store import ArtifactStore
        try:
            return ArtifactStore(self.store_uri).refusal(self.pair) is not None
        except Exception:                  # storage trouble: the plain no_artifact reason is still true
            return False

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this on deploy and whenever user_config changes: picks up a new artifact version."""
        with self.artifact_lock:
            reason = self._load(user_config.get("artifact", "latest"))
            if reason:
                self.engine.set_artifact(None, None, reason)
            families = user_config.get("families", {})
            for fid in set(self.engine.families) - set(families):       # no longer configured
                self.engine.families.pop(fid)
            for fid, version in families.items():
                self._load_family(fid, version)

    def _follow(self, version: str, family: str | None = None) -> str | None:
        """Use the version (of the pair's artifact, or of `family`'s) the producer encoded with: a publish
        reaches the producer first."""
        with self.artifact_lock:
            loaded = self.engine.families.get(family, (None, None))[1] if family else self.engine.version
            if loaded == version:
                return None
            key = f"{family}@{version}" if family else version
            if key not in self.refused:                   # a version that failed once is not fetched again
                self.refused[key] = self._load_family(family, version) if family else self._load(version)
            return self.refused[key]

    def inject(self, fault: str | None) -> None:
        """Fault drill: "hold:<gate actor name>" makes every request this replica starts wait until that
        gate actor opens (tests hold requests open, e.g. to drive autoscaling on any machine); None clears."""
        if fault is not None and not fault.startswith("hold:"):
            raise ValueError(f"unknown fault {fault!r}")
        self.hold = fault and fault.split(":", 1)[1]

    def status(self) -> dict:
        return {"specialist": self.name, "transport": self.transport_kind, **self.engine.status(),
                "family_problems": dict(self.family_notes)}

    def stop(self) -> None:
        self.engine.stop()

    def _receive(self, req: SpecialistRequest) -> tuple:
        """(payload or None, fallback reason or None, ms). An E-first payload's entry part is received here,
        its rest when the engine asks (Arriving)."""
        if req.reason or req.codes is None or req.codes.ticket is None:
            return None, req.reason or FallbackReason.TRANSPORT_ERROR, 0.0
        if req.codes.entry_ticket is None:
            return self._pull(req.codes.ticket)
        entry, reason, ms = self._pull(req.codes.entry_ticket)
        if entry is None:
            self._pull(req.codes.ticket)                     # taken all the same: a staged rest is released
            return None, reason, ms
        return Arriving(entry, lambda: self._pull(req.codes.ticket)), None, ms

    def _pull(self, ticket) -> tuple:
        t0 = time.perf_counter()
        try:
            payload = self.receiver.receive(ticket)
        except (TransportError, ray.exceptions.RayError, ValueError) as e:
            log.warning("specialist %s: codes from %s not received (%s), falling back to its own prefill",
                        self.name, ticket.producer, e)
            self._forget_producer(ticket.producer)
            return None, FallbackReason.TRANSPORT_ERROR, (time.perf_counter() - t0) * 1e3
        return payload, None, (time.perf_counter() - t0) * 1e3

    def _prepare(self, req: SpecialistRequest) -> tuple[bytes | None, str | None, dict]:
        """Blocking part before decoding: receive the codes and make sure their artifact version is loaded."""
        if self.hold:
            hold_until_open(self.hold, self.namespace)
        payload, reason, transfer_ms = self._receive(req)
        if payload is not None and req.codes.version:
            reason = self._follow(req.codes.version, req.codes.family)
            if reason and isinstance(payload, Arriving):
                payload.close()                             # the rest taken all the same, and dropped
            payload = None if reason else payload
        return payload, reason, {**req.timings, "transfer": transfer_ms}

    def stream(self, req: SpecialistRequest, key: str) -> Iterator[Output]:
        """The answer as it is generated: an Output per piece of text, then one with the finish reason and how it
        was served (`scd`). `cancel(key)` makes the request's row leave at its next token (the client left)."""
        events: queue.Queue = queue.Queue()
        t_in = time.perf_counter()
        with telemetry.span("specialist.generate", req.trace, specialist=self.name):
            payload, reason, timings = self._prepare(req)
            cancelled = threading.Event()
            self.running[key] = cancelled.set                # cancel() works while an exact request prefills
            try:
                self.engine.answer(dataclasses.replace(req, reason=reason), events.put, cancelled, payload, timings)
                if isinstance(payload, Arriving):
                    payload.close()                          # its rest taken, whether the engine used it or not
                ev = yield from pieces(events)
            finally:
                self.running.pop(key)()
                if isinstance(payload, Arriving):
                    payload.close()
            yield last_output(ev, t_in, self.name, f"specialist {self.name}", producer=req.producer,
                              timing_only=self.timing_only)

