"""The router's side of the producer: create it, ask it for codes within a deadline, notice when it is gone
and bring it back.

The producer is a detached named actor with `max_restarts=-1`: Ray restarts it after a crash or the loss of
its node, and its constructor reloads every pair's artifact. A producer killed for good (its name freed) is
created again from the config by the first router that notices. While it is down, requests do not wait for
it: they fall back at once (`producer_unavailable`), and one background probe per router asks it for its
stats until it answers.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from actors.messages import Codes, FallbackReason, pair_id
from actors.producer_actor import PRODUCER_NAME, ProducerActor
from cluster.config import DeploymentConfig
from cluster.runtime import actor_options

log = logging.getLogger("scd.router")


def start_producer(cfg: DeploymentConfig):
    """The detached, named producer actor (reused if it already runs with the same transport, links and
    families; one left by a deployment with another transport is replaced, since replicas must speak the
    producer's transport, and so is one with other link or family settings)."""
    pairs = {pair_id(cfg.producer.name, s.name): s.artifact for s in cfg.specialists}
    transport = cfg.resolved_transport()
    opts = actor_options(cfg.producer.num_gpus, name=PRODUCER_NAME, detached=True, namespace=cfg.ray.namespace,
                         num_cpus=cfg.producer.num_cpus, resources=cfg.producer.resources,
                         node_labels=cfg.producer.node_labels)
    try:
        old = ray.get_actor(PRODUCER_NAME, namespace=cfg.ray.namespace)
    except ValueError:
        old = None
    if old is not None:
        try:
            st = ray.get(old.stats.remote(), timeout=cfg.limits.control_timeout_s * 6)
            same = (st.get("transport"), st.get("link"), st.get("wanted_families")) == (
                transport, {"gbps": cfg.link_gbps(), "ttft_target_ms": cfg.link.ttft_target_ms}, cfg.family_refs())
        except ray.exceptions.RayError:                     # dead or wedged: replace it
            same = False
        if same:
            return old
        ray.kill(old)
        for _ in range(100):                        # the name is free once the kill has gone through
            try:
                ray.get_actor(PRODUCER_NAME, namespace=cfg.ray.namespace)
            except ValueError:
                break
            time.sleep(0.1)
    return ProducerActor.options(**opts, max_restarts=-1, max_task_retries=0).remote(
        cfg.producer.path, pairs, cfg.artifacts.uri, cfg.ray.namespace, transport=transport,
        watch_s=cfg.artifacts.watch_s, link_gbps=cfg.link_gbps(), ttft_target_ms=cfg.link.ttft_target_ms,
        families=cfg.family_refs())


class ProducerClient:
    def __init__(self, cfg: DeploymentConfig):
        self.cfg = cfg
        self.timeout_s, self.control_s = cfg.producer_timeout_s, cfg.limits.control_timeout_s
        self.handle = None
        self.encode_method = None                    # handle.encode, bound once
        self.down_since: float | None = None        # monotonic time of the failure that marked it down
        self.last_error: str | None = None
        self.probe: asyncio.Task | None = None

    # -- state ------------------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.down_since is None

    def _mark_down(self, why: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("producer marked down: %s", why)
        self.last_error = why
        if self.probe is None or self.probe.done():
            self.probe = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        """Until the producer answers stats: look it up, recreate it if its name is gone, ask again."""
        while self.down_since is not None:
            await asyncio.sleep(self.cfg.limits.producer_retry_s)
            try:
                handle = await self._lookup(create=True)
                await asyncio.wait_for(handle.stats.remote(), timeout=self.control_s)
            except Exception as e:                    # still down: keep probing
                self.last_error = f"{type(e).__name__}: {e}"
                continue
            log.warning("producer back after %.1f s", time.monotonic() - self.down_since)
            self.down_since = None

    async def _lookup(self, create: bool = False):
        if self.handle is None:
            try:
                self.handle = await asyncio.to_thread(ray.get_actor, PRODUCER_NAME, namespace=self.cfg.ray.namespace)
            except ValueError:
                if not create:
                    raise
                log.warning("producer is gone for good; creating it again from the config")
                self.handle = await asyncio.to_thread(start_producer, self.cfg)
        return self.handle

    # -- calls ------------------------------------------------------------------------------------------
    async def encode(self, prefix_ids: list[int], pairs: list[str]) -> tuple[Codes | None, str | None]:
        """(codes, None) or (None, fallback reason). Never waits past producer_timeout_s, and the producer
        skips an encode whose deadline passed while it was queued (the router has fallen back by then)."""
        if not self.up:
            return None, FallbackReason.PRODUCER_UNAVAILABLE
        try:
            handle = await self._lookup()
        except ValueError:
            self._mark_down("no producer actor")
            return None, FallbackReason.PRODUCER_UNAVAILABLE
        if self.encode_method is None:                # bound once per handle (a lookup builds a new one each time)
            self.encode_method = handle.encode
        ref = self.encode_method.remote(prefix_ids, pairs, time.time() + self.timeout_s)
        try:
            out = await asyncio.wait_for(ref, timeout=self.timeout_s)
        except asyncio.TimeoutError:
            ray.cancel(ref)                           # dropped if still queued; skipped by its deadline otherwise
            return None, FallbackReason.PRODUCER_TIMEOUT
        except ray.exceptions.RayActorError as e:
            self.handle = self.encode_method = None
            self._mark_down(f"{type(e).__name__}")
            return None, FallbackReason.PRODUCER_UNAVAILABLE
        except ray.exceptions.RayError as e:
            self._mark_down(f"{type(e).__name__}: {e}")
            return None, FallbackReason.PRODUCER_UNAVAILABLE
        if out is None:                               # skipped: its deadline passed while it was queued
            return None, FallbackReason.PRODUCER_TIMEOUT
        return out, None

    async def stats(self) -> dict:
        """The producer's stats, or {"error": ...}; never raises, never waits past control_timeout_s."""
        if not self.up:
            return {"error": f"down for {time.monotonic() - self.down_since:.1f} s ({self.last_error})"}
        try:
            handle = await self._lookup()
            return await asyncio.wait_for(handle.stats.remote(), timeout=self.control_s)
        except Exception as e:
            self._mark_down(f"{type(e).__name__}: {e}")
            return {"error": f"{type(e).__name__}: {e}"}
