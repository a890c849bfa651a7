"""GroupActor: a LoRA group's engine (actors/group.py) in its own Ray actor, the one each of the group's Serve
replicas owns, as a SpecialistActor is a specialist's.

It loads the producer's base model once and every member's PEFT adapter unmerged (`read_adapter` refuses one
the group cannot hold, in one line, and the replica does not start), and answers the same calls a
SpecialistActor does (ready, status, stream, generate, cancel, reconfigure, inject), each request for the
member it names (`SpecialistRequest.model`). A group needs no codes and no artifact: the prefix's base layers
are its own.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import ray
import torch

from actors.group import GroupEngine
from actors.messages import Output, SpecialistRequest
from actors.specialist_actor import _coalesced, concurrency, joined
from cluster.runtime import cpu_threads, device, lower_cpu_priority
from scd.online.lora_group import LoraGroup, read_adapter
from scd.online.models import load
from serve_app import telemetry


@ray.remote(max_concurrency=concurrency(16))       # the replica sets it from its own limit (concurrency())
class GroupActor:
    def __init__(self, group: str, base_path: str, members: dict[str, str],
                 telemetry_settings: dict | None = None, max_batch: int = 4):
        """members: specialist name -> its adapter folder."""
        torch.set_num_threads(cpu_threads())
        lower_cpu_priority()
        telemetry.setup(**(telemetry_settings or {}), service=f"group-{group}")
        dev = device()
        base, tok, _ = load(base_path)
        base = base.to(dev).eval()
        adapters = [read_adapter(name, path, base) for name, path in members.items()]
        self.engine = GroupEngine(LoraGroup(base, adapters), tok, device=dev, max_batch=max_batch)
        self.group = group
        self.running: dict[str, callable] = {}             # stream key -> cancel() of its row

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
        share = self.engine.share.get(name) if name else None
        return {"specialist": name, "group": self.group, "members": self.engine.names, "adapter_share": share,
                "unavailable_reason": "group_own_prefill" if share == 1.0 else None,
                "decode": self.engine.decode_stats()}

    def stream(self, req: SpecialistRequest, key: str) -> Iterator[Output]:
        """The answer of the member `req.model` as it is generated, as SpecialistActor.stream's."""
        events: queue.Queue = queue.Queue()
        t_in = time.perf_counter()
        with telemetry.span("group.generate", req.trace, specialist=req.model):
            cancelled = threading.Event()
            self.running[key] = cancelled.set
            try:
                self.engine.start(req.model, req.prefix_ids, req.suffix_ids, req.params, events.put, req.timings,
                                  cancelled=cancelled, oracle=req.reason == "oracle")
                ev = events.get()
                while ev[0] == "token":
                    piece, ev = _coalesced(ev, events)
                    yield piece
                    ev = ev or events.get()
            finally:
                self.running.pop(key)()
            if ev[0] == "error":
                raise RuntimeError(f"group {self.group} ({req.model}): {ev[1]}")
            _, info, finish = ev
            info.timings["engine"] = (time.perf_counter() - t_in) * 1e3
            telemetry.record_phases(info.timings, telemetry.carrier(), specialist=req.model)
            yield Output(finish_reason=finish, tokens=info.tokens,
                         scd={**info.as_dict(), "producer": None, "timing_only": False})

    def generate(self, req: SpecialistRequest, key: str) -> Output:
        return joined(self.stream(req, key))

    def cancel(self, key: str) -> None:
        cancel = self.running.get(key)
        if cancel is not None:
            cancel()
