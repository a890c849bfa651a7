"""GroupActor: a LoRA group's engine (actors/group.py) in its own Ray actor, the one each of the group's Serve
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
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import ray
import torch

from actors.adapter_book import SYNC_S, book
from actors.group import GroupEngine
from actors.messages import Output, SpecialistRequest
from actors.specialist_actor import Answering, concurrency, last_output, pieces
from cluster.runtime import cpu_threads, device, lower_cpu_priority
from scd.online.lora_group import LoraGroup, read_adapter
from scd.online.models import load
from serve_app import telemetry


@ray.remote(max_concurrency=concurrency(16))       # the replica sets it from its own limit (concurrency())
class GroupActor(Answering):
    def __init__(self, group: str, base_path: str, members: dict[str, str],
                 telemetry_settings: dict | None = None, max_batch: int = 4, namespace: str | None = None):
        """members: specialist name -> its adapter folder (the config's; the book's come on top)."""
        torch.set_num_threads(cpu_threads())
        lower_cpu_priority()
        telemetry.setup(**(telemetry_settings or {}), service=f"group-{group}")
        dev = device()
        base, tok, _ = load(base_path)
        self.base = base.to(dev).eval()
        adapters = [read_adapter(name, path, self.base) for name, path in members.items()]
        self.engine = GroupEngine(LoraGroup(self.base, adapters), tok, device=dev, max_batch=max_batch)
        self.group = group
        self.running: dict[str, callable] = {}             # stream key -> cancel() of its row
        self.book = book(namespace)
        self.from_book: set[str] = set()                   # adapters loaded at run time
        self.book_lock = threading.RLock()               # sync() loads under it; so does load_adapter
        self.sync()
        threading.Thread(target=self._sync_forever, daemon=True, name="adapter-book").start()

    def _sync_forever(self) -> None:
        while True:
            time.sleep(SYNC_S)
            try:
                self.sync()
            except Exception:                              # noqa: BLE001 - the book is back at the next read
                pass

    def sync(self) -> None:
        """Hold what the book lists for this group: load the adapters it added, unload those it dropped (their
        running requests finish first)."""
        listed = {n: path for n, (g, path) in ray.get(self.book.listing.remote()).items() if g == self.group}
        with self.book_lock:
            for name, path in listed.items():
                self.load_adapter(name, path)                 # a no-op for one held already
            for name in [n for n in self.from_book if n not in listed]:
                self.unload_adapter(name)

    def load_adapter(self, name: str, path: str) -> None:
        """Serve adapter `name` from `path` (AdapterError: the group cannot hold it, said in one line)."""
        with self.book_lock:
            if name in self.from_book or name in self.engine.names:
                return
            self.engine.load(read_adapter(name, path, self.base))
            self.from_book.add(name)

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
        share = self.engine.share(name) if name in self.engine.names else None
        return {"specialist": name, "group": self.group, "members": self.engine.names, "adapter_share": share,
                "running": self.engine.active.get(name, 0) if name else sum(self.engine.active.values()),
                "unavailable_reason": "group_own_prefill" if share == 1.0 else None,
                "decode": self.engine.decoder.stats()}

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
                self.engine.start(req.model, req.prefix_ids, req.suffix_ids, req.params, events.put, req.timings,
                                  cancelled=cancelled, oracle=req.reason == "oracle")
                ev = yield from pieces(events)
            finally:
                self.running.pop(key)()
            yield last_output(ev, t_in, req.model, f"group {self.group} ({req.model})", producer=None,
                              timing_only=False)

