"""One Serve deployment per specialist: a thin shim holding a SpecialistEngine.

The replica loads its model once, its pair artifact through the registry actor (fingerprints checked against
its own weights), takes a new artifact version on `reconfigure` (Serve user_config) without a restart,
receives payloads from the transport and reports every phase and every fallback in metrics and spans.
With an NCCL transport the replica registers with the producer when it starts (a two-rank communicator
is built between them), asks the producer to push each request's staged codes to it, and unregisters in
`__del__`, which Serve calls when the replica stops (scale-down, redeploy, shutdown).
"""
from __future__ import annotations

import threading
import time
import uuid

import ray
import torch
from ray.serve.metrics import Counter, Histogram

from actors.registry import fetch, registry
from actors.specialist import GenParams, SpecialistEngine
from actors.producer_actor import PRODUCER_NAME
from actors.transport import NcclTransport, TransportError, make_transport
from artifacts_store import ArtifactNotFound, ArtifactStoreError, Fingerprints
from cluster.runtime import cpu_threads, device
from scd.models import load
from serve_app import telemetry

PHASE_BOUNDS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]


class SpecialistServer:
    def __init__(self, name: str, model_path: str, pair: str, store_uri: str, namespace: str | None,
                 telemetry_settings: dict | None = None, transport: str = "object_store",
                 producer_timeout_s: float = 10.0):
        torch.set_num_threads(cpu_threads())
        telemetry.setup(**(telemetry_settings or {}), service=f"specialist-{name}")
        dev = device()
        model, tok, _ = load(model_path)
        self.engine = SpecialistEngine(name, model.to(dev), tok, device=dev)
        self.name, self.pair = name, pair
        self.registry = registry(store_uri, namespace)
        self.expect = Fingerprints.of(consumer=model, tokenizer=tok)
        self.namespace, self.timeout_s = namespace, producer_timeout_s
        self.transport_kind = transport
        self.transport = make_transport(transport, namespace)
        self.replica_id, self.registered = self._replica_id(name), False
        self.nccl_lock = threading.Lock()                  # one push + receive at a time on the communicator
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

    def _register(self) -> bool:
        """Build this replica's communicator with the producer (rank 1 here). False if the producer is not
        reachable: requests then fall back with transport_error, and the next request tries again."""
        try:
            uid = ray.get(self._producer().register.remote(self.replica_id), timeout=self.timeout_s)
            self.transport.join(self.replica_id, uid)
        except Exception:
            self.registered = False
        else:
            self.registered = True
        return self.registered

    def __del__(self):
        """Serve calls this when the replica stops: leave the communicator so the producer frees its side."""
        if getattr(self, "registered", False):
            self.registered = False
            try:
                self._producer().unregister.remote(self.replica_id)
            except Exception:
                pass
            self.transport.leave(self.replica_id)

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this on deploy and whenever user_config changes: picks up a new artifact version."""
        ref = f"{self.pair}@{user_config.get('artifact', 'latest')}"
        try:
            art, manifest = fetch(self.registry, ref, self.expect)
        except ArtifactNotFound:
            self.engine.set_artifact(None, None, "no_artifact")
        except ArtifactStoreError:                           # fingerprints, checksums, manifest problems
            self.engine.set_artifact(None, None, "artifact_mismatch")
        else:
            self.engine.set_artifact(art.to(self.engine.device), manifest.version)

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def status(self) -> dict:
        return {"specialist": self.name, "artifact": self.engine.version, "transport": self.transport_kind,
                "unavailable_reason": None if self.engine.art else self.engine.unavailable_reason}

    def _receive(self, req: dict) -> tuple[bytes | None, str | None, float]:
        if req.get("reason"):
            return None, req["reason"], 0.0
        t0 = time.perf_counter()
        try:
            ticket = req["ticket"]
            if isinstance(self.transport, NcclTransport):
                with self.nccl_lock:
                    if not self.registered and not self._register():
                        raise TransportError(f"replica {self.replica_id} has no communicator with the producer")
                    ticket = ray.get(self._producer().push.remote(ticket.key, self.replica_id), timeout=self.timeout_s)
                    payload = self.transport.recv(ticket, timeout_s=self.timeout_s)
            else:
                payload = self.transport.recv(ticket)
        except (TransportError, ray.exceptions.RayError, ValueError):
            return None, "transport_error", (time.perf_counter() - t0) * 1e3
        return payload, None, (time.perf_counter() - t0) * 1e3

    def _events(self, req: dict):
        with telemetry.span("specialist.generate", req.get("trace"), specialist=self.name):
            payload, reason, transfer_ms = self._receive(req)
            if payload is not None and req.get("version") and self.engine.version != req["version"]:
                reason, payload = "artifact_mismatch", None    # codes from another artifact version
            timings = {**req.get("timings", {}), "transfer": transfer_ms}
            p = req["params"]
            params = GenParams(p["max_tokens"], p["temperature"], p["top_p"], p.get("stop", []), p.get("seed"))
            suffix = self.engine.tokenize(req["suffix"])
            for kind, value in self.engine.stream(req["prefix_ids"], suffix, payload, reason, params, timings):
                if kind == "token":
                    yield {"text": value}
                else:
                    info, finish = value
                    self._record(info)
                    telemetry.record_phases(info.timings, telemetry.carrier(), specialist=self.name)
                    yield {"finish_reason": finish, "scd": info.as_dict()}

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
