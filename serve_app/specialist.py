"""One Serve deployment per specialist: each replica is a thin async shim over its own engine actor.

The replica creates a `SpecialistActor` (actors/specialist_actor.py) when it starts, placed where cluster/ says
the specialist goes (GPUs, resources, labels; on the replica's node when it can be), and forwards to it: each
request (`generate`, `stream`), artifact versions from Serve's user_config (`reconfigure`), drills (`inject`)
and `status`. The engine actor holds the model, pulls the codes and decodes; the replica keeps Serve's side:
its metrics, and its health check, which fails when the engine actor is gone, so that Serve replaces the
replica and with it the engine. The engine actor is owned by the replica and dies with it.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import ray
from ray.serve.metrics import Counter, Histogram
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.messages import Output, SpecialistRequest
from actors.group_actor import GroupActor
from actors.specialist_actor import SpecialistActor, concurrency
from engines.interface import EngineConfig

PHASE_BOUNDS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]


class SpecialistServer:
    def __init__(self, config: EngineConfig, engine_options: dict | None = None):
        """config: the engine its actor builds (a specialist's, or a LoRA group's: its engine is then a
        GroupActor). engine_options: the engine actor's Ray options (cluster.runtime.actor_options)."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.name = config.name
        opts = {"scheduling_strategy": here, "max_concurrency": concurrency(config.max_batch),
                **(engine_options or {})}
        actor = GroupActor if config.kind == "group" else SpecialistActor
        self.engine = actor.options(**opts).remote(config)
        ray.get(self.engine.ready.remote())              # a model that cannot load fails the replica's start
        tags = ("specialist",)
        self.m_requests = Counter("scd_requests_total", "requests by serving mode", tag_keys=tags + ("mode",))
        self.m_fallbacks = Counter("scd_fallbacks_total", "fallbacks by reason", tag_keys=tags + ("reason",))
        self.m_payload = Counter("scd_payload_bytes_total", "code payload bytes received", tag_keys=tags)
        self.m_phase = Histogram("scd_phase_ms", "phase latency (ms)", boundaries=PHASE_BOUNDS,
                                 tag_keys=tags + ("phase",))

    async def reconfigure(self, user_config: dict) -> None:
        """Serve calls this on deploy and whenever user_config changes: the engine picks up a new version."""
        await self.engine.reconfigure.remote(user_config)

    async def load_adapter(self, name: str, path: str) -> float:
        """A LoRA group's replica: serve one more adapter (the others read it from the adapter book); returns
        the share of a prefill it computes itself over a prefix."""
        return await self.engine.load_adapter.remote(name, path)

    async def unload_adapter(self, name: str) -> None:
        await self.engine.unload_adapter.remote(name)

    async def inject(self, fault: str | None) -> None:
        await self.engine.inject.remote(fault)

    async def status(self, name: str | None = None) -> dict:
        """The engine's status; a group's, of its member `name`."""
        return await (self.engine.status.remote(name) if name else self.engine.status.remote())

    async def check_health(self) -> None:
        """Serve's health check: the engine actor answers (else Serve replaces this replica, and the engine)."""
        await self.engine.ready.remote()

    def _finish(self, scd: dict, t0: float, name: str) -> None:
        """An answer's last event: its timings gain the replica's share (`replica`: the request in this replica,
        the engine actor's call included), and its metrics are recorded."""
        scd["timings_ms"]["replica"] = round((time.perf_counter() - t0) * 1e3, 3)
        tags = {"specialist": name}
        self.m_requests.inc(tags={**tags, "mode": scd["mode"]})
        if scd["mode"] == "fallback":
            self.m_fallbacks.inc(tags={**tags, "reason": scd["reason"]})
        if scd["payload_bytes"]:
            self.m_payload.inc(scd["payload_bytes"], tags=tags)
        for phase, ms in scd["timings_ms"].items():
            self.m_phase.observe(ms, tags={**tags, "phase": phase})

    async def generate(self, req: SpecialistRequest) -> Output:
        """The whole answer in one Output."""
        key, t0 = uuid.uuid4().hex, time.perf_counter()
        try:
            out = await self.engine.generate.remote(req, key)
        except BaseException:                          # cancelled (client gone) or failed: free its row
            self.engine.cancel.remote(key)
            raise
        self._finish(out.scd, t0, req.model or self.name)
        return out

    async def stream(self, req: SpecialistRequest) -> AsyncIterator[Output]:
        key, done, t0 = uuid.uuid4().hex, False, time.perf_counter()
        try:
            async for ref in self.engine.stream.remote(req, key):
                ev = await ref
                if ev.finish_reason is not None:
                    done = True
                    self._finish(ev.scd, t0, req.model or self.name)
                yield ev
        finally:
            if not done:                               # the client left mid-answer: its row leaves the batch
                self.engine.cancel.remote(key)
