"""One Serve deployment per specialist: a thin shim holding a SpecialistEngine.

The replica loads its model once, its pair artifact through the registry actor (fingerprints checked against
its own weights), takes a new artifact version on `reconfigure` (Serve user_config) without a restart,
receives payloads from the transport and reports every phase and every fallback in metrics and spans.
"""
from __future__ import annotations

import time

import torch
from ray.serve.metrics import Counter, Histogram

from actors.registry import fetch, registry
from actors.specialist import GenParams, SpecialistEngine
from actors.transport import ObjectStoreTransport, TransportError
from artifacts_store import ArtifactNotFound, ArtifactStoreError, Fingerprints
from cluster.runtime import cpu_threads, device
from scd.models import load
from serve_app import telemetry

PHASE_BOUNDS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]


class SpecialistServer:
    def __init__(self, name: str, model_path: str, pair: str, store_uri: str, namespace: str | None,
                 telemetry_settings: dict | None = None):
        torch.set_num_threads(cpu_threads())
        telemetry.setup(**(telemetry_settings or {}), service=f"specialist-{name}")
        dev = device()
        model, tok, _ = load(model_path)
        self.engine = SpecialistEngine(name, model.to(dev), tok, device=dev)
        self.name, self.pair = name, pair
        self.registry = registry(store_uri, namespace)
        self.expect = Fingerprints.of(consumer=model, tokenizer=tok)
        self.transport = ObjectStoreTransport()
        tags = ("specialist",)
        self.m_requests = Counter("scd_requests_total", "requests by serving mode", tag_keys=tags + ("mode",))
        self.m_fallbacks = Counter("scd_fallbacks_total", "fallbacks by reason", tag_keys=tags + ("reason",))
        self.m_payload = Counter("scd_payload_bytes_total", "code payload bytes received", tag_keys=tags)
        self.m_phase = Histogram("scd_phase_ms", "phase latency (ms)", boundaries=PHASE_BOUNDS,
                                 tag_keys=tags + ("phase",))
        self.reconfigure({"artifact": "latest"})

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
        return {"specialist": self.name, "artifact": self.engine.version,
                "unavailable_reason": None if self.engine.art else self.engine.unavailable_reason}

    def _receive(self, req: dict) -> tuple[bytes | None, str | None, float]:
        if req.get("reason"):
            return None, req["reason"], 0.0
        t0 = time.perf_counter()
        try:
            payload = self.transport.recv(req["ticket"])
        except TransportError:
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
