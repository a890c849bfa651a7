"""ProducerActor: the Ray shim around ProducerEngine. Detached and named, pinned by cluster/ (num_gpus).

It loads each pair's artifact, and each configured family's (one code for several pairs), through the
registry actor (verified, fingerprints checked against the base model it holds), prefills a prefix once per
request, and puts every payload on the transport once (`Transport.offer`: in Ray's object store at once, or
staged until each serving replica pulls it through Ray Direct Transport: `pull` for nixl, `pull_ipc` for
cuda_ipc).

Encodes run one at a time; stats, fault drills and the pulls run in a small "control" group of threads beside
them, so health checks and transfers never wait behind a long prefill. Each start of the actor (first start or
a restart by Ray) gets a new `incarnation` (what the fault drills tell restarts by).

The module imports no torch: the model, the engine and the codecs load in the actor's own process, so the pool
and the router, which only create producers or name them, stay light.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import uuid
from collections import deque

import ray
from ray.util.metrics import Counter, Gauge

from actors.messages import Codes, FallbackReason, PairCodes, one_line
from actors.registry import fetch, fetch_family, registry
from actors.transport import RDT_TRANSPORTS, TransportError, make_transport, warm
from artifacts_store.errors import ArtifactStoreError
from artifacts_store.fingerprints import Fingerprints
from cluster.runtime import cpu_threads, device
from engines.interface import ProducerConfig

class Busy:
    """How much of the last `window_s` seconds the producer spent encoding (its prefill load), and how long
    encodes waited in its queue: what the pool autoscales on. Encodes run one at a time, so the spans kept are
    disjoint and in order: their summed length is kept as they come and go, and only the oldest can reach back
    past the window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s, self.spans, self.since, self.total = window_s, deque(), None, 0.0
        self.waits: deque = deque(maxlen=64)

    def start(self, waited_s: float | None) -> None:
        self.since = time.monotonic()
        if waited_s is not None:
            self.waits.append(max(0.0, waited_s))

    def stop(self) -> None:
        now = time.monotonic()
        self.spans.append((self.since, now))
        self.total += now - self.since
        self.since = None
        self._drop(now - self.window_s)

    def _drop(self, lo: float) -> None:
        """Forget the spans that ended before `lo`."""
        while self.spans and self.spans[0][1] < lo:
            a, b = self.spans.popleft()
            self.total -= b - a

    def fraction(self) -> float:
        now = time.monotonic()
        lo = now - self.window_s
        self._drop(lo)
        busy = self.total - (max(0.0, lo - self.spans[0][0]) if self.spans else 0.0)
        if self.since is not None:
            busy += now - max(self.since, lo)
        return min(1.0, max(0.0, busy) / self.window_s)

    def queue_wait_ms(self) -> float:
        return round(statistics.median(self.waits) * 1e3, 2) if self.waits else 0.0


@ray.remote(concurrency_groups={"control": 4})
class ProducerActor:
    def __init__(self, config: ProducerConfig):
        import torch

        from engines.producer import ProducerEngine
        from scd.online.models import load
        torch.set_num_threads(cpu_threads())
        dev = device()
        c = config
        model, tok, _ = load(c.model_path, device=dev)
        # a transport that moves tensors (Ray Direct Transport) takes payloads as tensors where they are encoded
        self.engine = ProducerEngine(model.to(dev), tok, {}, c.cache_bytes, dev, c.link_gbps, c.ttft_target_ms,
                                     device_payloads=c.transport in RDT_TRANSPORTS)
        self.registry = registry(c.store_uri, c.namespace)
        self.store_uri, self.store = c.store_uri, None     # the store itself only for leases (registry reads)
        self.expect = Fingerprints.of(producer=model, tokenizer=tok)
        self.transport_kind = c.transport
        self.name = c.name                              # its actor name: tickets say whom to pull from
        self.transport = make_transport(c.transport, owner=c.name, inline_bytes=c.inline_bytes,
                                        stage_bytes=c.stage_bytes)
        warm(c.transport)
        self.busy = Busy()
        tags = {"producer": c.name}
        self.m_encodes = Counter("scd_producer_encodes_total", "encodes by how they were served (prefill: a new "
                                 "prefix; cache_hit)", tag_keys=("producer", "served")).set_default_tags(tags)
        self.m_busy = Gauge("scd_producer_busy", "fraction of the last 10 s spent prefilling and encoding",
                            tag_keys=("producer",)).set_default_tags(tags)
        self.m_wait = Gauge("scd_producer_queue_wait_ms", "median wait of the last 64 encodes in this producer's "
                            "queue", tag_keys=("producer",)).set_default_tags(tags)
        self.wanted = dict(c.pairs)                    # pair -> "latest" or a pinned version
        self.wanted_families = dict(c.families)        # family id -> "latest" or a pinned version
        self.problems: dict[str, dict] = {}            # what -> {"reason": one line, "since": unix time}
        self.refused: dict[str, str] = {}              # "pair@version" -> why it was not loaded (never retried)
        self.fault: str | None = None
        self.incarnation = uuid.uuid4().hex[:12]
        self.skipped = 0                               # encodes whose deadline passed while they were queued
        self.begun: deque = deque(maxlen=4096)         # the callers' keys of the latest encodes begun
        self.begun_lock = threading.Lock()             # encode appends, `started` (a control thread) reads
        self.watch_s = c.watch_s
        for pair, version in c.pairs.items():
            self.reload(pair, version)
        for fid, version in self.wanted_families.items():
            self.reload(fid, version)
        if c.watch_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="artifact-watch").start()

    def _problem(self, what: str, reason: str) -> None:
        """Note a problem in one line; `since` stays the first time while the reason is the same."""
        old = self.problems.get(what)
        since = old["since"] if old and old["reason"] == reason else time.time()
        self.problems[what] = {"reason": reason, "since": since}

    def _in_use(self, ref: str) -> str | None:
        """The version of a pair's artifact, or of a family's, that encodes now."""
        loaded = self.engine.families.get(ref) if ref in self.wanted_families else self.engine.artifacts.get(ref)
        return loaded[1] if loaded else None

    def reload(self, ref: str, version: str = "latest") -> str | None:
        """(Re)load a pair's artifact, or a family's (`ref` one of `families`); returns the version in use, or
        None. A version that cannot be used (damaged, wrong fingerprints, storage down) is refused with its
        reason in stats, and the version already loaded, if any, stays in use."""
        family = ref in self.wanted_families
        try:
            art, manifest = (fetch_family if family else fetch)(self.registry, f"{ref}@{version}", self.expect,
                                                                timeout_s=120)
        except (ArtifactStoreError, ray.exceptions.RayError) as e:
            self._problem(ref, f"version {version}: {one_line(e)}")
            if isinstance(e, ArtifactStoreError) and version != "latest":
                self.refused[f"{ref}@{version}"] = self.problems[ref]["reason"]
            return self._in_use(ref)
        art = art.to(self.engine.device)
        if family:
            self.engine.set_family(art, manifest.version)
        else:
            self.engine.set_artifact(ref, art, manifest.version)
        self.problems.pop(ref, None)
        return manifest.version

    # -- artifact versions while serving --------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            time.sleep(self.watch_s)
            try:
                self.refresh()
            except Exception as e:                    # noqa: BLE001 - the watcher must outlive any one failure
                self._problem("watch", one_line(e))

    @ray.method(concurrency_group="control")
    def refresh(self) -> dict[str, str | None]:
        """Pick up what each pair's (and family's) configured ref (`latest`, usually) names now, and renew this
        producer's lease on the versions it serves so that `scd artifacts gc` keeps them. Replicas follow:
        they decode with the version named in the codes. Returns pair or family -> version in use."""
        for ref, want in {**self.wanted, **self.wanted_families}.items():
            try:
                version = ray.get(self.registry.resolve.remote(f"{ref}@{want}"), timeout=60).split("@", 1)[1]
            except (ArtifactStoreError, ray.exceptions.RayError) as e:
                self._problem(ref, f"resolving version {want}: {one_line(e)}")
                continue
            if self._in_use(ref) != version and f"{ref}@{version}" not in self.refused:
                self.reload(ref, version)
        in_use = {ref: self._in_use(ref) for ref in (*self.wanted, *self.wanted_families)}
        try:
            from artifacts_store.store import ArtifactStore
            self.store = self.store or ArtifactStore(self.store_uri)   # opened on first use, then kept
            for ref, version in in_use.items():
                if version:
                    self.store.lease(f"{ref}@{version}", f"producer-{self.incarnation}", max(60.0, 3 * self.watch_s))
            self.problems.pop("lease", None)
        except ArtifactStoreError as e:
            self._problem("lease", one_line(e))
        return in_use

    @ray.method(concurrency_group="control")
    def inject(self, fault: str | None) -> None:
        """Fault drills, so every fallback path can be produced on purpose (tests, the demo, game days):
        "delay:<seconds>" stalls encode, "corrupt" flips a byte of each payload, "misdeliver" hands out
        tickets that disagree with what the transport holds; None clears."""
        if fault is not None and not (fault in ("corrupt", "misdeliver") or fault.startswith("delay:")):
            raise ValueError(f"unknown fault {fault!r}")
        self.fault = fault

    def encode(self, prefix_ids: list[int], pairs: list[str], deadline: float | None = None,
               sent_at: float | None = None, key: str | None = None) -> Codes | None:
        """Prefill once, encode for every pair, offer each payload on the transport; tickets come back. `pairs`
        names a pair once per request that will receive its codes (a fan-out may ask a specialist twice).
        `deadline` (time.time() of the caller's give-up): an encode still queued past it is skipped (None).
        `sent_at` (time.time() when the caller asked): how long it waited in this producer's queue. `key`: the
        caller's name for this encode, which `started` answers for once it has begun."""
        if deadline is not None and time.time() > deadline:
            self.skipped += 1
            return None
        self.busy.start(time.time() - sent_at if sent_at is not None else None)
        if key is not None:
            with self.begun_lock:
                self.begun.append(key)
        try:
            if self.fault and self.fault.startswith("delay:"):
                time.sleep(float(self.fault.split(":", 1)[1]))
            codes = self._encode(prefix_ids, pairs)
            self.m_encodes.inc(tags={"served": "prefill" if codes.prefilled else "cache_hit"})
            return codes
        finally:
            self.busy.stop()
            self.m_busy.set(self.busy.fraction())
            self.m_wait.set(self.busy.queue_wait_ms())

    @ray.method(concurrency_group="control")
    def started(self, key: str) -> bool:
        """Whether the encode the caller named `key` has begun (running, or its codes on their way): a caller
        at its deadline waits for one that has, where falling back would prefill the same prefix twice."""
        with self.begun_lock:
            return key in self.begun

    def _encode(self, prefix_ids: list[int], pairs: list[str]) -> Codes:
        res = self.engine.encode(list(prefix_ids), list(dict.fromkeys(pairs)))
        t0 = time.perf_counter()
        # each payload is offered once, for as many receiving requests as `pairs` names its pairs (a family's
        # one payload serves several pairs; a fan-out may ask one specialist twice)
        offers: dict[int, list[str]] = {}
        for pair, e in res.per_pair.items():
            offers.setdefault(id(e.payload) if e.payload is not None else id(e), []).append(pair)
        per_pair = {}
        for served in offers.values():
            codes = self._offer(res.per_pair[served[0]], sum(map(pairs.count, served)))
            per_pair.update({pair: codes for pair in served})
        return Codes(per_pair, res.prefilled, self.incarnation, self.name,
                     {"prefill": res.prefill_ms, "encode": res.encode_ms,
                      "transfer_put": (time.perf_counter() - t0) * 1e3})

    def _offer(self, e, receivers: int = 1) -> PairCodes:
        """A payload on the transport for `receivers` replicas (with the drills' damage), or why there is none."""
        from scd.online import codec, e_first
        if e.payload is None:
            return PairCodes(e.version, reason=e.error, cache_hit=e.cache_hit)
        payload = e.payload
        parts = [payload.entry, payload.rest] if isinstance(payload, e_first.Parts) else [payload]
        if self.fault == "corrupt":
            parts = [codec.corrupted(p) for p in parts]
        try:                                                 # E-first: the entry part goes first
            tickets = [self.transport.offer(p, receivers) for p in parts]
        except TransportError:
            return PairCodes(e.version, payload_bytes=len(payload), cache_hit=e.cache_hit,
                             reason=FallbackReason.TRANSPORT_ERROR, family=e.family)
        if self.fault == "misdeliver":                       # ticket and object disagree
            tickets = [dataclasses.replace(t, nbytes=t.nbytes + 1) for t in tickets]
        return PairCodes(e.version, tickets[-1], len(payload), e.cache_hit, family=e.family,
                         entry_ticket=tickets[0] if len(tickets) == 2 else None)

    # -- replicas' pulls (Ray Direct Transport) ---------------------------------------------------------
    @ray.method(concurrency_group="control", tensor_transport="nixl")
    def pull(self, key: str):
        """nixl: a staged payload (a tensor, or a device payload's head and body), moved to the calling replica
        by Ray Direct Transport."""
        return self.transport.take(key)

    @ray.method(concurrency_group="control", tensor_transport="cuda_ipc")
    def pull_ipc(self, key: str):
        """cuda_ipc: as `pull`, for a replica on this actor's GPU (it maps the staged body and copies it)."""
        return self.transport.take(key)

    @ray.method(concurrency_group="control")
    def stats(self) -> dict:
        return {**self.engine.stats(), "problems": dict(self.problems), "transport": self.transport_kind,
                "link": {"gbps": self.engine.link_gbps, "ttft_target_ms": self.engine.ttft_target_ms},
               "incarnation": self.incarnation, "wanted_families": dict(self.wanted_families),
               "skipped": self.skipped, "refused": dict(self.refused), "name": self.name,
               "busy": round(self.busy.fraction(), 3), "queue_wait_ms": self.busy.queue_wait_ms(),
               "versions": {pair: v for pair, (_, v) in self.engine.artifacts.items()},
               "family_versions": {fid: {"version": v, "members": sorted(fam.members)}
                                   for fid, (fam, v) in self.engine.families.items()},
               "staged": self.transport.staged()}
