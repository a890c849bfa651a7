"""ProducerPool: the producers of one deployment, kept at their count, recreated when lost, autoscaled.

A detached, named actor (`scd-producer-pool`) owns the producers (`scd-producer-0`, `-1`, ...: detached,
named, `max_restarts=-1`, placed by cluster/ like any model). Routers read its membership (`members`, a few
bytes, once a second) and route each prefix to its owner on a hash ring (serve_app/ring.py); they never
create producers themselves.

- Count: `producer.replicas`, or between `autoscaling.min_replicas` and `max_replicas` from the producers'
  load: the pool asks each for the fraction of the last 10 s it spent encoding (`busy`) and wants
  ceil(sum of busy / target_busy) producers, after `upscale_delay_s` (`downscale_delay_s`) of wanting more
  (fewer). `scale(n)` sets the count by hand (tests, operators).
- Removal drains: a producer leaves the membership first, and is killed `drain_s` later, when no router
  routes to it any more and what it was asked has been answered.
- Loss: a producer Ray restarts (a crash, its node lost) keeps its name and comes back by itself; routers pass
  over it meanwhile. One killed for good (its name gone) is created again under the same name, so its
  prefixes come back to it.
"""
from __future__ import annotations

import logging
import math
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.messages import PRODUCER_NAME, pair_id, producer_name
from cluster.config import DeploymentConfig
from cluster.runtime import actor_options

POOL_NAME = "scd-producer-pool"
CHECK_S = 1.0                  # the pool's loop: liveness, load, drains
REFRESH_S = 1.0                # routers read the membership this often
MAX_PRODUCERS = 64             # names scd-producer-0 .. -63 (the config allows at most 64 replicas)

log = logging.getLogger("scd.producers")


def producer_spec(cfg: DeploymentConfig) -> dict:
    """What makes two pools interchangeable: a running pool with another spec is replaced."""
    return {"path": cfg.producer.path, "num_gpus": cfg.producer.num_gpus, "num_cpus": cfg.producer.num_cpus,
            "resources": cfg.producer.resources, "node_labels": cfg.producer.node_labels,
            # a LoRA group's members get no codes: their group's engine prefills
            "pairs": {pair_id(cfg.producer.name, s.name): s.artifact for s in cfg.specialists if not s.group},
            "families": cfg.family_refs(), "transport": cfg.resolved_transport(),
            "inline_bytes": cfg.transport_inline_bytes, "store": cfg.artifacts.uri,
            "watch_s": cfg.artifacts.watch_s, "link_gbps": cfg.link_gbps(), "ttft_target_ms": cfg.link.ttft_target_ms,
            "memory_bytes": list(cfg.producer.memory_bytes())}


@ray.remote(num_cpus=0, max_concurrency=8)
class ProducerPool:
    def __init__(self, config: dict):
        self.cfg = cfg = DeploymentConfig.model_validate(config)
        self.spec, self.namespace = producer_spec(cfg), cfg.ray.namespace
        self.autoscaling = cfg.producer.autoscaling
        self.drain_s = 2 * REFRESH_S + cfg.producer_timeout_s + 1.0
        self.lock = threading.Lock()
        self.live: dict[str, object] = {}          # name -> handle, oldest first
        self.starting: dict[str, object] = {}      # added by a scale-up, not yet answering: routed to once they do
        self.probes: dict[str, object] = {}        # a starting producer's pending stats call
        self.draining: dict[str, tuple[object, float]] = {}   # name -> (handle, kill at: monotonic)
        self.version = 0                           # bumped on every membership change
        self.next_index = 0
        self.target = cfg.producer.initial_replicas()
        self.autoscaler = Autoscaler(self.autoscaling) if self.autoscaling else None
        self.events: list[dict] = []                # scaling and recreation, newest last (at most 50)
        self.load: dict[str, dict] = {}            # name -> its last stats
        self._adopt()                              # after a restart of this pool: its producers still run
        self._reconcile(wait=False)                # the first ones: the deployment waits for them to answer
        threading.Thread(target=self._loop, daemon=True, name="producer-pool").start()

    # -- membership -------------------------------------------------------------------------------------
    def _create(self, name: str):
        from actors.producer_actor import ProducerActor      # torch (Ray's tensor transports): in the pool alone
        from engines.interface import ProducerConfig
        s = self.spec
        opts = actor_options(s["num_gpus"], name=name, detached=True, namespace=self.namespace,
                             num_cpus=s["num_cpus"], resources=s["resources"], node_labels=s["node_labels"])
        return ProducerActor.options(**opts, max_restarts=-1, max_task_retries=0).remote(ProducerConfig(
            s["path"], s["pairs"], s["store"], self.namespace, name=name, transport=s["transport"],
            families=s["families"] or {}, cache_bytes=s["memory_bytes"][0], stage_bytes=s["memory_bytes"][1],
            inline_bytes=s["inline_bytes"], watch_s=s["watch_s"], link_gbps=s["link_gbps"],
            ttft_target_ms=s["ttft_target_ms"]))

    def _adopt(self) -> None:
        """Take over the producers a previous start of this pool left running (named in index order)."""
        for i in range(MAX_PRODUCERS):
            name = producer_name(i)
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue
            self.live[name] = handle
            self.next_index = i + 1
        if self.live:
            self._event(f"adopted {', '.join(self.live)}")

    def spec(self) -> dict:
        return _pool_key(self.cfg)

    def _event(self, what: str) -> None:
        self.events = (self.events + [{"at": time.time(), "what": what}])[-50:]
        log.warning("producer pool: %s", what)

    def _reconcile(self, wait: bool = True) -> None:
        """Add producers (new names) or take away the newest, until `target` are live or starting. A producer
        added with `wait` starts apart and joins the live ones (the routers' ring) once it answers (`_check`):
        until its model is loaded, the prefixes it would own stay with the producers that have theirs. Taking
        away drops a starting one first, else drains the newest live one."""
        with self.lock:
            while len(self.live) + len(self.starting) < self.target:
                name = producer_name(self.next_index)
                self.next_index += 1
                _kill_named(name, self.namespace)         # a leftover of an earlier pool under that name
                if wait:
                    self.starting[name] = self._create(name)
                    self._event(f"starting {name}")
                else:
                    self.live[name] = self._create(name)
                    self.version += 1
                    self._event(f"added {name} ({len(self.live)} live)")
            while len(self.live) + len(self.starting) > self.target and self.starting:
                name, handle = self.starting.popitem()
                ray.kill(handle, no_restart=True)
                self._event(f"stopped {name} before it started")
            while len(self.live) > self.target:
                name = list(self.live)[-1]
                self.draining[name] = (self.live.pop(name), time.monotonic() + self.drain_s)
                self.version += 1
                self._event(f"draining {name} ({len(self.live)} live)")

    def members(self) -> dict:
        with self.lock:
            return {"version": self.version, "live": list(self.live), "draining": list(self.draining),
                    "starting": list(self.starting), "target": self.target,
                    "autoscaling": self.autoscaling is not None}

    def scale(self, n: int) -> dict:
        """Set the number of producers by hand (autoscaling, if configured, moves it again from the load)."""
        if n < 1:
            raise ValueError(f"a pool needs at least one producer, not {n}")
        self.target = n
        self._reconcile()
        return self.members()

    def status(self) -> dict:
        return {**self.members(), "load": dict(self.load), "events": list(self.events)}

    def shutdown(self) -> None:
        """Kill every producer of the pool (undeploy)."""
        with self.lock:
            handles = [*self.live.values(), *self.starting.values(), *(h for h, _ in self.draining.values())]
            self.live, self.starting, self.draining, self.target = {}, {}, {}, 0
            self.version += 1
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:                      # already gone
                pass

    # -- the loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            time.sleep(CHECK_S)
            try:
                self._check()
            except Exception as e:                  # noqa: BLE001 - the pool must outlive any one failure
                log.warning("producer pool check failed: %s: %s", type(e).__name__, e)

    def _check(self) -> None:
        now = time.monotonic()
        with self.lock:
            done = [n for n, (_, at) in self.draining.items() if at <= now]
            handles = {n: self.draining.pop(n)[0] for n in done}
            live, starting = dict(self.live), dict(self.starting)
        for name, h in handles.items():
            ray.kill(h, no_restart=True)
            self._event(f"removed {name}")
        if starting:                               # those that answer now join the ring (one probe each)
            probes = {name: self.probes.get(name) or h.stats.remote() for name, h in starting.items()}
            answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=0.5)
            self.probes = {name: ref for name, ref in probes.items() if ref not in answered}
            for name, ref in probes.items():
                try:
                    ok = ref in answered and ray.get(ref) is not None
                except ray.exceptions.RayError:     # died while starting: Ray restarts it, ask again
                    ok = False
                with self.lock:
                    if ok and name in self.starting:
                        self.live[name] = self.starting.pop(name)
                        self.version += 1
                        self._event(f"added {name} ({len(self.live)} live)")
        refs = {name: h.stats.remote() for name, h in live.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        for name, ref in refs.items():
            if ref not in ready:
                continue
            try:
                self.load[name] = {k: v for k, v in ray.get(ref).items() if k in ("busy", "queue_wait_ms",
                                                                                   "prefills", "cache_hits")}
            except ray.exceptions.ActorDiedError:
                if not _exists(name, self.namespace):      # killed for good: Ray will not bring it back
                    with self.lock:
                        if name in self.live:
                            self.live[name] = self._create(name)
                    self._event(f"recreated {name} (it was killed for good)")
            except ray.exceptions.RayError:                  # restarting, or busy beyond 5 s: ask next time
                pass
        for name in set(self.load) - set(live):
            self.load.pop(name)
        if self.autoscaling is not None:
            self._autoscale(now, sum(x.get("busy", 0.0) for x in self.load.values()))

    def _autoscale(self, now: float, busy: float) -> None:
        want = self.autoscaler.decide(now, self.target, busy)
        if want is not None:
            self._event(f"autoscaling {self.target} -> {want} (busy {busy:.2f}, target "
                        f"{self.autoscaling.target_busy} each)")
            self.target = want
            self._reconcile()


class Autoscaler:
    """How many producers the load wants: ceil(sum of busy / target_busy) within [min_replicas, max_replicas],
    acted on once it has wanted the same other count for upscale_delay_s (more) or downscale_delay_s (fewer)."""

    def __init__(self, settings):
        self.a, self.wanted_since = settings, None        # (count wanted, since when)

    def decide(self, now: float, current: int, busy: float) -> int | None:
        """The new count, or None to stay."""
        a = self.a
        want = min(max(math.ceil(busy / a.target_busy), a.min_replicas), a.max_replicas)
        if want == current:
            self.wanted_since = None
            return None
        if self.wanted_since is None or self.wanted_since[0] != want:
            self.wanted_since = (want, now)
        if now - self.wanted_since[1] >= (a.upscale_delay_s if want > current else a.downscale_delay_s):
            self.wanted_since = None
            return want
        return None


def _exists(name: str, namespace: str | None) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def _kill_named(name: str, namespace: str | None) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:
        return
    for _ in range(100):                           # the name is free once the kill has gone through
        if not _exists(name, namespace):
            return
        time.sleep(0.1)


def start_pool(cfg: DeploymentConfig):
    """The detached, named pool (reused when one runs with the same producer spec and count settings; one
    with another spec is shut down with its producers and replaced)."""
    try:
        old = ray.get_actor(POOL_NAME, namespace=cfg.ray.namespace)
    except ValueError:
        old = None
    if old is not None:
        try:
            same = ray.get(old.spec.remote(), timeout=cfg.limits.control_timeout_s * 6) == _pool_key(cfg)
        except ray.exceptions.RayError:
            same = False
        if same:
            return old
        stop_pool(cfg.ray.namespace)
    for name in [PRODUCER_NAME] + [producer_name(i) for i in range(MAX_PRODUCERS)]:
        _kill_named(name, cfg.ray.namespace)        # left by a pool that was not shut down, or an older release
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ProducerPool.options(name=POOL_NAME, namespace=cfg.ray.namespace, lifetime="detached", max_restarts=-1,
                                scheduling_strategy=here).remote(cfg.model_dump())   # beside Serve's controller


def _pool_key(cfg: DeploymentConfig) -> dict:
    return {**producer_spec(cfg), "replicas": cfg.producer.replicas,
            "autoscaling": cfg.producer.autoscaling and cfg.producer.autoscaling.model_dump()}


def stop_pool(namespace: str | None) -> None:
    """Shut the pool and its producers down (safe when there is none)."""
    try:
        pool = ray.get_actor(POOL_NAME, namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(pool.shutdown.remote(), timeout=30)
    except ray.exceptions.RayError:
        pass
    _kill_named(POOL_NAME, namespace)
