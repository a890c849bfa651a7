"""GroupActor: a LoRA group's engine (engines/group.py) in its own Ray actor, the one each of the group's Serve
replicas owns, as a SpecialistActor is a specialist's.

It loads the producer's base model once and every member's PEFT adapter unmerged (`read_adapter` refuses one
the group cannot hold, in one line, and the replica does not start), and answers the same calls a
SpecialistActor does (ready, status, stream, generate, cancel, reconfigure, inject), each request for the
member it names (`SpecialistRequest.model`). A group needs no codes and no artifact: the prefix's base layers
are its own.

Adapters loaded at run time are listed in the deployment's AdapterBook (actors/adapter_book.py): a thread
loads and unloads what the book says for this group, so that every replica, a new one too, holds the same
adapters; `load_adapter` (the router's call) loads one here at once, refusing it in one line when the group
cannot hold it.

An adapter that changes every layer is served from its pair's artifact (producer:adapter in the store, the
consumer's fingerprint that of the adapter merged into the base) once one is published: the same thread looks
for new versions every ARTIFACT_S, through the registry, and switches the adapter to it between requests.
Until then it prefills the prefix itself, as its answers say.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import ray

from actors.adapter_book import SYNC_S, book
from actors.messages import FallbackReason, Output, SpecialistRequest, pair_id
from actors.registry import fetch, registry, unavailable_reason
from actors.specialist_actor import Answering, concurrency, last_output, pieces
from artifacts_store.errors import ArtifactStoreError
from artifacts_store.fingerprints import Fingerprints, ModelFingerprint
from cluster.runtime import cpu_threads, device, lower_cpu_priority
from engines.interface import EngineConfig, build
from serve_app import telemetry

ARTIFACT_S = 10.0             # how often a replica looks for newly published artifacts of its adapters


@ray.remote(max_concurrency=concurrency(16))       # the replica sets it from its own limit (concurrency())
class GroupActor(Answering):
    def __init__(self, config: EngineConfig):
        """config: a group's (kind "group"): its base, the members' adapter folders (the config's; the book's
        come on top), and where its members' pair artifacts are published (no store: every adapter is served
        by what sharing leaves it)."""
        import torch

        from scd.online.models import ModelSpec, tokenizer_fingerprint
        torch.set_num_threads(cpu_threads())
        lower_cpu_priority()
        telemetry.setup(**config.telemetry, service=f"group-{config.name}")
        self.engine = build(config, device())
        self.base, self.base_path = self.engine.group.base, config.model_path
        self.group = config.name
        self.running: dict[str, callable] = {}             # stream key -> cancel() of its row
        self.book = book(config.namespace)
        self.from_book: set[str] = set()                   # adapters loaded at run time
        self.book_lock = threading.RLock()               # sync() loads under it; so does load_adapter
        self.registry = registry(config.store_uri, config.namespace) if config.store_uri and config.producer \
            else None
        self.producer, self.config_hash = config.producer, ModelSpec.from_config(self.base.config).fingerprint()
        self.tokenizer_print = tokenizer_fingerprint(self.engine.tok)
        self.artifact_notes: dict[str, str] = {}           # adapter -> why it has none (a fallback reason)
        self.refused: dict[str, str] = {}                  # adapter folder -> the artifact ref that did not fit it
        self.expected: dict[str, Fingerprints] = {}        # adapter folder -> what its artifact must fit
        self.sync()
        self.refresh_artifacts()
        threading.Thread(target=self._sync_forever, daemon=True, name="adapter-book").start()

    def _sync_forever(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(SYNC_S)
            try:
                self.sync()
                if time.monotonic() - last >= ARTIFACT_S:
                    last = time.monotonic()
                    self.refresh_artifacts()
            except Exception:                              # noqa: BLE001 - the book is back at the next read
                pass

    def refresh_artifacts(self) -> None:
        """Serve each adapter that changes every layer from its pair's newest artifact, when there is one newer
        than the one it has (fingerprints checked: the adapter merged into this base); note why not when not.
        A version refused once is not fetched again."""
        if self.registry is None:
            return
        for name, path in self.engine.paths().items():
            if self.engine.group.prefill_share([name])[name] < 1.0:
                continue                                      # shares layers with the base: needs no artifact
            ref = None
            try:
                ref = ray.get(self.registry.resolve.remote(f"{pair_id(self.producer, name)}@latest"), timeout=30)
                if ref.split("@", 1)[1] == self.engine.status(name)["artifact"] or self.refused.get(path) == ref:
                    continue
                art, manifest = fetch(self.registry, ref, self._expect(path), timeout_s=120)
            except (ArtifactStoreError, ray.exceptions.RayError) as e:
                self.artifact_notes[name] = unavailable_reason(e)
                if ref is not None and self.artifact_notes[name] == FallbackReason.ARTIFACT_MISMATCH:
                    self.refused[path] = ref
                continue
            self.engine.set_artifact(name, art.to(self.engine.device), manifest.version)
            self.artifact_notes.pop(name, None)

    def _expect(self, path: str) -> Fingerprints:
        """What an artifact for the adapter at `path` must have been calibrated for (its digest made once: it
        reads the base's weight files)."""
        from scd.online.models import merged_digest
        if path not in self.expected:
            consumer = ModelFingerprint(config_hash=self.config_hash, weights_digest=merged_digest(self.base_path, path))
            self.expected[path] = Fingerprints(consumer=consumer, tokenizer=self.tokenizer_print)
        return self.expected[path]

    def sync(self) -> None:
        """Hold what the book lists for this group: load the adapters it added, unload those it dropped (their
        running requests finish first)."""
        listed = {n: path for n, (g, path) in ray.get(self.book.listing.remote()).items() if g == self.group}
        with self.book_lock:
            for name, path in listed.items():
                self.load_adapter(name, path)                 # a no-op for one held already
            for name in [n for n in self.from_book if n not in listed]:
                self.unload_adapter(name)

    def load_adapter(self, name: str, path: str) -> float:
        """Serve adapter `name` from `path` (AdapterError: the group cannot hold it, said in one line); returns
        the share of a prefill it computes itself over a prefix (1.0: its own prefill, until its artifact)."""
        from scd.online.lora_group import read_adapter
        with self.book_lock:
            if name not in self.from_book and name not in self.engine.names:
                self.engine.load(read_adapter(name, path, self.base))
                self.from_book.add(name)
        return self.engine.share(name)

    def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter loaded at run time; returns once its running requests finished."""
        with self.book_lock:
            if name in self.from_book:
                self.engine.unload(name)
                self.from_book.discard(name)

    def ready(self) -> bool:
        return True

    def reconfigure(self, user_config: dict) -> None:
        """Serve's user_config (an artifact version) means nothing to a group: its prefixes are its own."""

    def inject(self, fault: str | None) -> None:
        if fault is not None:
            raise ValueError(f"group {self.group!r} takes no drills (asked {fault!r})")

    def status(self, name: str | None = None) -> dict:
        """What /healthz shows of one member (`name`) or of the group: the adapter's share of a prefill it
        computes itself (1.0: its own prefill, the reason says so)."""
        return {"specialist": name, "group": self.group, **self.engine.status(name),
                "artifact_problem": self.artifact_notes.get(name)}

    def stop(self) -> None:
        self.engine.stop()

    def stream(self, req: SpecialistRequest, key: str) -> Iterator[Output]:
        """The answer of the member `req.model` as it is generated, as SpecialistActor.stream's."""
        events: queue.Queue = queue.Queue()
        t_in = time.perf_counter()
        if req.model not in self.engine.names:
            self.sync()                          # loaded into the book a moment ago, not read here yet
        with telemetry.span("group.generate", req.trace, specialist=req.model):
            cancelled = threading.Event()
            self.running[key] = cancelled.set
            try:
                self.engine.answer(req, events.put, cancelled)
                ev = yield from pieces(events)
            finally:
                self.running.pop(key)()
            yield last_output(ev, t_in, req.model, f"group {self.group} ({req.model})", producer=None,
                              timing_only=False)

