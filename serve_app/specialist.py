"""One Serve deployment per specialist: a thin shim holding a SpecialistEngine.

The replica loads its model once, its pair artifact through the registry actor (fingerprints checked against
its own weights), takes a new artifact version on `reconfigure` (Serve user_config) without a restart,
receives payloads from the transport and reports every phase and every fallback in metrics and spans.
With an NCCL transport the replica registers with the producer when it starts (a two-rank communicator
is built between them), asks the producer to push each request's staged codes to it, and unregisters in
`__del__`, which Serve calls when the replica stops (scale-down, redeploy, shutdown). It registers again
when the codes come from a new producer incarnation (a restarted producer), and drops its communicator after
any failed push or receive, so a half-finished exchange never leaves the two ends counting differently.

The replica decodes codes with the artifact version the producer encoded them with: when a publish reaches
the producer first, the replica loads that version (fingerprints checked) instead of falling back.
"""
from __future__ import annotations

import threading
import time
import uuid

import ray
import torch
from ray.serve.metrics import Counter, Histogram

from actors.drills import hold_until_open
from actors.messages import FallbackReason
from actors.registry import fetch, registry
from actors.specialist import GenParams, SpecialistEngine
from actors.producer_actor import PRODUCER_NAME
from actors.transport import NcclTransport, TransportError, make_transport
from artifacts_store import ArtifactNotFound, ArtifactStore, ArtifactStoreError, Fingerprints
from cluster.runtime import cpu_threads, device, lower_cpu_priority
from scd.models import load
from serve_app import telemetry

PHASE_BOUNDS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]


class SpecialistServer:
    def __init__(self, name: str, model_path: str, pair: str, store_uri: str, namespace: str | None,
                 telemetry_settings: dict | None = None, transport: str = "object_store",
                 control_timeout_s: float = 5.0, model_base: str | None = None):
        torch.set_num_threads(cpu_threads())
        lower_cpu_priority()
        telemetry.setup(**(telemetry_settings or {}), service=f"specialist-{name}")
        dev = device()
        model, tok, _ = load(model_path, base=model_base)
        self.engine = SpecialistEngine(name, model.to(dev), tok, device=dev)
        self.name, self.pair = name, pair
        self.registry, self.store_uri = registry(store_uri, namespace), store_uri
        self.expect = Fingerprints.of(consumer=model, tokenizer=tok)
        self.namespace, self.timeout_s = namespace, control_timeout_s
        self.transport_kind = transport
        self.transport = make_transport(transport, namespace)
        self.replica_id = self._replica_id(name)
        self.registered: str | None = None                 # producer incarnation our communicator belongs to
        self.nccl_lock = threading.Lock()                  # one push + receive at a time on the communicator
        self.artifact_lock = threading.Lock()
        self.refused: dict[str, str | None] = {}          # version -> why it could not be used
        self.hold: str | None = None                       # drill: name of a gate actor requests wait on
        tags = ("specialist",)
        self.m_requests = Counter("scd_requests_total", "requests by serving mode", tag_keys=tags + ("mode",))
        self.m_fallbacks = Counter("scd_fallbacks_total", "fallbacks by reason", tag_keys=tags + ("reason",))
        self.m_payload = Counter("scd_payload_bytes_total", "code payload bytes received", tag_keys=tags)
        self.m_phase = Histogram("scd_phase_ms", "phase latency (ms)", boundaries=PHASE_BOUNDS,
                                 tag_keys=tags + ("phase",))
        self.reconfigure({"artifact": "latest"})
        if isinstance(self.transport, NcclTransport):
            self._register()

    @staticmethod
    def _replica_id(name: str) -> str:
        try:
            from ray import serve
            return f"{name}#{serve.get_replica_context().replica_id.unique_id}"
        except Exception:                                    # outside Serve (tests of the class itself)
            return f"{name}#{uuid.uuid4().hex[:8]}"

    def _producer(self):
        return ray.get_actor(PRODUCER_NAME, namespace=self.namespace)

    # -- NCCL communicator with the producer --------------------------------------------------------
    def _register(self) -> bool:
        """Build this replica's communicator with the producer (rank 1 here). False if the producer is not
        reachable: requests then fall back with transport_error, and the next request tries again."""
        self._drop_comm()
        try:
            producer = self._producer()
            incarnation = ray.get(producer.stats.remote(), timeout=self.timeout_s)["incarnation"]
            uid = ray.get(producer.register.remote(self.replica_id), timeout=self.timeout_s)
            self.transport.join(self.replica_id, uid)
        except Exception:
            return False
        self.registered = incarnation
        return True

    def _drop_comm(self) -> None:
        """Forget our communicator (the producer's side is replaced when we register again)."""
        self.registered = None
        self.transport.leave(self.replica_id)

    def __del__(self):
        """Serve calls this when the replica stops: leave the communicator so the producer frees its side."""
        if getattr(self, "registered", None):
            try:
                self._producer().unregister.remote(self.replica_id)
            except Exception:
                pass
            self._drop_comm()

    def _receive_nccl(self, req: dict) -> bytes:
        if not self.nccl_lock.acquire(timeout=self.timeout_s):
            raise TransportError(f"replica {self.replica_id}: communicator busy for {self.timeout_s}s")
        try:
            if self.registered != req.get("incarnation") and not self._register():
                raise TransportError(f"replica {self.replica_id} has no communicator with the producer")
            try:
                ticket = ray.get(self._producer().push.remote(req["ticket"].key, self.replica_id),
                                 timeout=self.timeout_s)
                return self.transport.recv(ticket, timeout_s=self.timeout_s)
            except BaseException:
                self._drop_comm()          # a push may have gone out unread: start the next exchange afresh
                raise
        finally:
            self.nccl_lock.release()

    # -- artifacts ----------------------------------------------------------------------------------
    def _load(self, version: str) -> str | None:
        """Load `pair@version` (fingerprints checked); None when it worked, else the fallback reason. A
        storage or registry failure is stated (artifact_unavailable), never a dead replica."""
        try:
            art, manifest = fetch(self.registry, f"{self.pair}@{version}", self.expect, timeout_s=120)
        except ArtifactNotFound:
            return FallbackReason.QUALITY_GATE if self._refused() else FallbackReason.NO_ARTIFACT
        except ArtifactStoreError:                           # fingerprints, checksums, manifest problems
            return FallbackReason.ARTIFACT_MISMATCH
        except ray.exceptions.RayError:                      # the registry actor or the store failed
            return FallbackReason.ARTIFACT_UNAVAILABLE
        self.engine.set_artifact(art.to(self.engine.device), manifest.version)
        return None

    def _refused(self) -> bool:
        """Whether the pair's last calibration failed its quality gate (so none was published)."""
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

    def _follow(self, version: str) -> str | None:
        """Use the version the producer encoded with (a publish reaches the producer first)."""
        with self.artifact_lock:
            if self.engine.version == version:
                return None
            if version not in self.refused:               # a version that failed once is not fetched again
                self.refused[version] = self._load(version)
            return self.refused[version]

    def inject(self, fault: str | None) -> None:
        """Fault drill: "hold:<gate actor name>" makes every request this replica starts wait until that
        gate actor opens (tests hold requests open, e.g. to drive autoscaling on any machine); None clears."""
        if fault is not None and not fault.startswith("hold:"):
            raise ValueError(f"unknown fault {fault!r}")
        self.hold = fault and fault.split(":", 1)[1]

    def status(self) -> dict:
        return {"specialist": self.name, "artifact": self.engine.version, "transport": self.transport_kind,
                "unavailable_reason": None if self.engine.art else self.engine.unavailable_reason}

    def _receive(self, req: dict) -> tuple[bytes | None, str | None, float]:
        if req.get("reason"):
            return None, req["reason"], 0.0
        t0 = time.perf_counter()
        try:
            if isinstance(self.transport, NcclTransport):
                payload = self._receive_nccl(req)
            else:
                payload = self.transport.recv(req["ticket"], timeout_s=self.timeout_s)
        except (TransportError, ray.exceptions.RayError, ValueError):
            return None, FallbackReason.TRANSPORT_ERROR, (time.perf_counter() - t0) * 1e3
        return payload, None, (time.perf_counter() - t0) * 1e3

    def _events(self, req: dict):
        if self.hold:
            hold_until_open(self.hold, self.namespace)
        with telemetry.span("specialist.generate", req.get("trace"), specialist=self.name):
            payload, reason, transfer_ms = self._receive(req)
            if payload is not None and req.get("version"):
                reason = self._follow(req["version"])
                payload = None if reason else payload
            timings = {**req.get("timings", {}), "transfer": transfer_ms}
            p = req["params"]
            params = GenParams(p["max_tokens"], p["temperature"], p["top_p"], p.get("stop", []), p.get("seed"))
            for kind, value in self.engine.stream(req["prefix_ids"], req["suffix_ids"], payload, reason, params,
                                                  timings):
                if kind == "token":
                    yield {"text": value}
                else:
                    info, finish = value
                    self._record(info)
                    telemetry.record_phases(info.timings, telemetry.carrier(), specialist=self.name)
                    yield {"finish_reason": finish, "scd": info.as_dict(), "tokens": info.tokens}

    def _record(self, info) -> None:
        tags = {"specialist": self.name}
        self.m_requests.inc(tags={**tags, "mode": info.mode})
        if info.mode == "fallback":
            self.m_fallbacks.inc(tags={**tags, "reason": info.reason})
        if info.payload_bytes:
            self.m_payload.inc(info.payload_bytes, tags=tags)
        for phase, ms in info.timings.items():
            self.m_phase.observe(ms, tags={**tags, "phase": phase})

    def generate(self, req: dict) -> dict:
        text, last = [], None
        for ev in self._events(req):
            if "text" in ev:
                text.append(ev["text"])
            else:
                last = ev
        return {"text": "".join(text), **last}

    def stream(self, req: dict):
        yield from self._events(req)
