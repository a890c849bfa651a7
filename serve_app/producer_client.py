"""The router's side of the producers: which one owns a prefix, asking it within a deadline, passing over one
that is down or slow, and noticing when it is back.

The pool actor (actors/producer_pool.py) owns the producers; each router reads its membership once a second
and routes a prefix to its owner on a hash ring with bounded loads (serve_app/ring.py), so a producer's prefix
cache keeps hitting as the pool grows. A producer that dies under a request, or is gone when asked, is passed
over at once: the request goes to the next producer on the ring within the same deadline, and the dead one is
probed in the background until it answers (Ray restarts a crashed producer; the pool recreates one killed for
good). One that does not answer in time is passed over for `producer_retry_s` while another serves. Requests
never wait for a producer that is known to be down: with none left they fall back at once
(`producer_unavailable`). An encode the producer has begun when its deadline comes is waited for, up to
`producer_timeout_s` more: falling back then would prefill the same prefix twice on a machine that is short of
compute already (a producer's queue is long under load, and the request that times out is at its head).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import ray
from ray.serve.metrics import Counter, Gauge

from actors.messages import Codes, FallbackReason, one_line
from actors.producer_pool import POOL_NAME, REFRESH_S
from cluster.config import DeploymentConfig
from serve_app.ring import HashRing, prefix_hash

log = logging.getLogger("scd.router")


@dataclass
class Member:
    """One producer as this router sees it."""
    name: str
    handle: object = None
    encode: object = None                      # handle.encode, bound once
    down_since: float | None = None            # monotonic time of the failure that marked it down
    slow_until: float = 0.0                    # monotonic: passed over while another serves (it timed out)
    last_error: str | None = None
    inflight: int = 0                          # this router's encodes waiting on it
    routed: int = 0                            # encodes this router sent it
    probe: asyncio.Task | None = None


class Producers:
    def __init__(self, cfg: DeploymentConfig):
        self.cfg = cfg
        self.timeout_s, self.control_s = cfg.producer_timeout_s, cfg.limits.control_timeout_s
        self.retry_s = cfg.limits.producer_retry_s
        self.factor, self.slack = cfg.producer.load_bound, cfg.producer.load_slack
        self.members: dict[str, Member] = {}
        self.ring = HashRing()
        self.version = -1                          # the pool's membership version this router has
        self.pool = None
        self.pool_error: str | None = None
        self.failovers = 0                         # encodes sent on to the next producer after a failure
        self.refresher: asyncio.Task | None = None
        self.m_failovers = Counter("scd_producer_failovers_total", "encodes sent on to the next producer on the "
                                   "ring after this one failed", tag_keys=("producer",))
        self.m_share = Gauge("scd_producer_ring_share", "fraction of the ring (of prefixes) each producer owns",
                             tag_keys=("producer",))

    # -- membership -------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the pool's membership; a changed one rebuilds the ring (members kept keep their state)."""
        try:
            if self.pool is None:
                self.pool = await asyncio.to_thread(ray.get_actor, POOL_NAME, namespace=self.cfg.ray.namespace)
            m = await asyncio.wait_for(self.pool.members.remote(), timeout=self.control_s)
        except Exception as e:                      # the pool restarting: keep routing on what we know
            self.pool, self.pool_error = None, one_line(e)
            return
        self.pool_error = None
        if m["version"] == self.version:
            return
        gone = set(self.members) - set(m["live"])
        self.members = {n: self.members.get(n) or Member(n) for n in m["live"]}
        self.ring.set(m["live"])
        self.version = m["version"]
        for name, share in [*((n, 0.0) for n in gone), *self.ring.shares().items()]:
            self.m_share.set(share, tags={"producer": name})

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh()

    async def _ready(self) -> None:
        if self.refresher is None or self.refresher.done():
            self.refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        if self.version < 0:
            await self.refresh()

    async def _handle(self, m: Member):
        if m.handle is None:
            m.handle = await asyncio.to_thread(ray.get_actor, m.name, namespace=self.cfg.ray.namespace)
            m.encode = m.handle.encode
        return m.handle

    def _mark_down(self, m: Member, why: str) -> None:
        m.handle = m.encode = None
        if m.down_since is None:
            m.down_since = time.monotonic()
            log.warning("producer %s marked down: %s", m.name, why)
        m.last_error = why
        if m.probe is None or m.probe.done():
            m.probe = asyncio.get_running_loop().create_task(self._probe(m))

    async def _probe(self, m: Member) -> None:
        """Until it answers stats: look it up again and ask."""
        while m.down_since is not None and self.members.get(m.name) is m:
            await asyncio.sleep(self.retry_s)
            try:
                handle = await self._handle(m)
                await asyncio.wait_for(handle.stats.remote(), timeout=self.control_s)
            except Exception as e:                  # still down: keep probing
                m.handle = m.encode = None
                m.last_error = one_line(e)
                continue
            log.warning("producer %s back after %.1f s", m.name, time.monotonic() - m.down_since)
            m.down_since = None

    # -- calls ------------------------------------------------------------------------------------------
    def route(self, prefix_ids: list[int]) -> list[str]:
        """The producers to ask for this prefix, in order (its owner on the ring first, unless down or full)."""
        now = time.monotonic()
        down = {n for n, m in self.members.items() if m.down_since is not None}
        slow = {n for n, m in self.members.items() if m.slow_until > now}
        load = {n: m.inflight for n, m in self.members.items()}
        key = prefix_hash(prefix_ids)
        return (self.ring.choose(key, load, self.factor, down | slow, self.slack)
                or self.ring.choose(key, load, self.factor, down, self.slack))

    async def encode(self, prefix_ids: list[int], pairs: list[str]) -> tuple[Codes | None, str | None]:
        """(codes, None) or (None, fallback reason). Never waits past producer_timeout_s in all; a producer
        that fails is passed over for the next one on the ring within that time, and a producer skips an
        encode whose deadline passed while it was queued (the router has fallen back by then)."""
        await self._ready()
        deadline = time.time() + self.timeout_s
        for name in self.route(prefix_ids):
            m = self.members.get(name)
            remaining = deadline - time.time()
            if m is None or remaining <= 0:
                break
            try:
                await self._handle(m)
            except ValueError:
                self._mark_down(m, "no producer actor")
                continue
            key = uuid.uuid4().hex
            ref = m.encode.remote(prefix_ids, pairs, deadline, time.time(), key)
            m.inflight += 1
            m.routed += 1
            done = asyncio.ensure_future(ref)
            try:
                try:
                    out = await asyncio.wait_for(asyncio.shield(done), timeout=remaining)
                except asyncio.TimeoutError:
                    if not await self._started(m, key):
                        raise
                    out = await asyncio.wait_for(done, timeout=self.timeout_s)
            except asyncio.TimeoutError:
                ray.cancel(ref)                        # dropped if still queued; skipped by its deadline otherwise
                m.slow_until = time.monotonic() + self.retry_s
                return None, FallbackReason.PRODUCER_TIMEOUT
            except ray.exceptions.RayError as e:       # died under it, restarting, or failed: the next one
                self._mark_down(m, one_line(e))
                self.failovers += 1
                self.m_failovers.inc(tags={"producer": name})
                continue
            finally:
                m.inflight -= 1
            if out is None:                            # skipped: its deadline passed while it was queued
                return None, FallbackReason.PRODUCER_TIMEOUT
            return out, None
        return None, (FallbackReason.PRODUCER_TIMEOUT if time.time() >= deadline
                      else FallbackReason.PRODUCER_UNAVAILABLE)

    async def _started(self, m: Member, key: str) -> bool:
        """Whether the producer has begun the encode named `key` (running, or its codes on their way; False when
        it cannot say in time)."""
        try:
            return await asyncio.wait_for(m.handle.started.remote(key), timeout=self.control_s)
        except Exception:                              # noqa: BLE001 - gone or busy: treated as not started
            return False

    async def stats(self) -> dict:
        """Each producer's stats with this router's view of it (state, share of the ring, routed, in flight);
        never raises, never waits past control_timeout_s."""
        await self._ready()
        shares = self.ring.shares()

        async def one(m: Member) -> dict:
            mine = {"share": round(shares.get(m.name, 0.0), 3), "routed": m.routed, "inflight": m.inflight}
            if m.down_since is not None:
                return {"state": "down", "down_for_s": round(time.monotonic() - m.down_since, 1),
                        "error": m.last_error, **mine}
            try:
                handle = await self._handle(m)
                st = await asyncio.wait_for(handle.stats.remote(), timeout=self.control_s)
            except asyncio.TimeoutError:
                return {"state": "busy", "error": f"no stats within {self.control_s} s", **mine}
            except Exception as e:
                self._mark_down(m, one_line(e))
                return {"state": "down", "down_for_s": 0.0, "error": m.last_error, **mine}
            hits, misses = st.get("cache_hits", 0), st.get("cache_misses", 0)
            return {"state": "up", **st, "cache_hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
                    **mine}
        names = list(self.members)
        got = await asyncio.gather(*(one(self.members[n]) for n in names))
        return {"producers": dict(zip(names, got)), "failovers": self.failovers, "pool_error": self.pool_error}
