"""GroupEngine: a LoRA group's engine, one base model and the PEFT adapters of several specialists, unmerged.

Each adapter is served under its specialist's name. A prefix's base layers run once for every adapter in the
group (and stay cached for the next requests on that prefix: there is no producer and no transfer inside a
group); each adapter then computes what sharing leaves to it (`LoraGroup.adapter_prefix`):
- an activated LoRA: nothing, the base's cache is its prefix's (up to the prefix's own invocation, if any);
- a LoRA that leaves the layers below s to the base: its layers from s, from the base's residual entering s,
  over a cache whose layers below s are the base's own tensors;
- a LoRA on every layer: its pair's artifact when it has one (`set_artifact`): codes of the base's prefill
  (the producer's side, `rebuild.encode`) and the adapter's cache rebuilt from them on its view of the base
  (`lora_group.adapter_view`: recompute blocks and tails included), all in memory, with no wire format and no
  transfer; without one, its own prefill of the prefix, stated as a fallback (`no_artifact`).
Every answer but a rebuilt one equals the adapter merged into the base (up to float rounding); `exact` makes
an adapter with an artifact prefill the prefix itself (`group_own_prefill`). Rows of every adapter decode in one
batch (`scd.online.decode.Batch` over the group).

Plain Python, tested without Ray; a GroupActor (actors/group_actor.py) holds one in a Serve replica.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from engines.batching import BatchDecoder
from actors.messages import FallbackReason
from engines.interface import NotServed
from engines.prefix_cache import PrefixCodeCache, prefix_key
from engines.specialist import ServedInfo, TextStream, answer_events, collected, events_as_text
from scd.fitting import points
from scd.online import selective
from scd.online.artifacts import PairArtifacts
from scd.online.cache import id_row
from scd.online.decode import GenParams, Row
from scd.online.lora_group import LoraGroup, adapter_view
from scd.online.rebuild import encode, prepare, rebuild
from scd.online.trace import capture


def _nbytes(kept: tuple) -> int:
    """Bytes of a kept prefix: the base's prefill and every adapter's codes of it."""
    (_, keys, values, taps), codes = kept
    coded = [x for c in codes.values() for layer in c.layers.values() for x in layer.values()
             if isinstance(x, torch.Tensor)]
    return sum(t.nbytes for t in [*keys, *values, *(x for x in taps.values() if x is not None), *coded])


class GroupEngine:
    def __init__(self, group: LoraGroup, tokenizer, device: str = "cpu", max_batch: int = 8,
                 prefix_cache_bytes: int = 256 << 20):
        self.group, self.tok, self.device = group, tokenizer, device
        self.decoder = BatchDecoder(group, tokenizer.eos_token_id, max_batch)
        self.cache_bytes = prefix_cache_bytes
        self.prefixes = PrefixCodeCache(prefix_cache_bytes, size=_nbytes)   # base prefills, least recent out
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)   # notified when a request ends (an unload waits on it)
        self.pending: dict[str, Future] = {}          # prefixes whose base prefill is running: joined, not redone
        self.active: dict[str, int] = {}              # adapter -> its requests from start() to their last event
        self.leaving: set[str] = set()                # adapters being unloaded: no new requests
        # adapter -> (its artifact, version, its view of the base); traces of the base are taken one at a time
        # (capture hooks the base's modules)
        self.plans: dict[str, tuple[PairArtifacts, str, torch.nn.Module]] = {}
        self.trace_lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [n for n in self.group.names[1:] if n is not None]

    def paths(self) -> dict[str, str]:
        """Each adapter's folder, by name."""
        return {n: self.group.adapter(n).path for n in self.names}

    def share(self, name: str) -> float:
        """The share of a prefill that adapter `name` computes itself over a prefix (1.0: its own prefill), by
        layer count: an artifact's blocks, and its tail's share of the tokens (the attention rule's window
        included)."""
        plan = self.plans.get(name)                   # (read once: an artifact may be set meanwhile)
        if plan is not None:
            art, n = plan[0], self.group.layers
            return points.consumer_ratio(n - art.consumer_layers, art.tail_tokens if art.tail_of else 0, n,
                                         art.tail_of or 1, art.tail_rule)
        return self.group.prefill_share([name])[name]

    def set_artifact(self, name: str, art: PairArtifacts | None, version: str | None = None) -> None:
        """Serve adapter `name` from its pair's artifact (None: by what sharing leaves it, again) from the next
        request on. The prefixes kept so far lack its codes: they are dropped."""
        view = self.plans[name][2] if name in self.plans else None
        if art is not None:
            view = view or adapter_view(self.group.base, self.group.adapter(name))
            prepare(view, art)                    # its lookup tables and fused patches now, not on a request
        with self.lock:
            if name not in self.names:
                raise NotServed(f"{name!r} is not an adapter of this group; it holds {self.names}")
            if art is None:
                self.plans.pop(name, None)
            else:
                self.plans[name] = (art, version, view)
            self.prefixes = PrefixCodeCache(self.cache_bytes, size=_nbytes)

    def load(self, adapter) -> None:
        """Serve one more adapter (`read_adapter` against this group's base) from the next request on. The
        base prefills kept so far lack the residual its first layer needs: they are dropped."""
        with self.lock:
            self.group.add(adapter)
            self.prefixes = PrefixCodeCache(self.cache_bytes, size=_nbytes)

    def unload(self, name: str, timeout_s: float | None = None) -> None:
        """Stop serving an adapter: new requests for it are refused at once, the running ones finish first (at
        most `timeout_s`: then TimeoutError, and it stays loaded)."""
        with self.lock:
            if name not in self.names or name in self.leaving:
                raise ValueError(f"{name!r} is not an adapter of this group; it holds {self.names}")
            self.leaving.add(name)
            try:
                if not self.idle.wait_for(lambda: not self.active.get(name), timeout_s):
                    raise TimeoutError(f"{name!r} still has {self.active[name]} request(s) running")
                self.group.remove(name)
                self.plans.pop(name, None)
            finally:
                self.leaving.discard(name)

    def _ended(self, name: str) -> None:
        with self.lock:
            self.active[name] -= 1
            self.idle.notify_all()

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor) -> tuple[tuple, dict]:
        """The base's prefill of a prefix (`LoraGroup.base_prefill`'s tuple) and, for each adapter served from
        its artifact, the codes of it. Those need the base's states (scd.online.trace.capture), which its fast
        prefill does not keep."""
        plans = dict(self.plans)
        if not plans:
            return self.group.base_prefill(ids), {}
        with self.trace_lock:
            trace = capture(self.group.base, ids, want_hidden=True)
        return self.group.base_from_trace(trace), {n: encode(art, trace, ids) for n, (art, _, _) in plans.items()}

    def _base(self, prefix_ids: list[int], ids: torch.Tensor) -> tuple[tuple, bool]:
        """((the base's prefill of the prefix, the codes of it by adapter), whether it was cached). Requests on
        one prefix that arrive while its prefill runs wait for that one (a fan-out to the group's adapters
        prefills once)."""
        key = prefix_key(prefix_ids, "group", "base")
        with self.lock:
            # (a prefill that ran while an artifact came lacks its codes: done again)
            if (hit := self.prefixes.get(key)) is not None and set(self.plans) <= set(hit[1]):
                return hit, True
            running = self.pending.get(key)
            if running is None:
                running = self.pending[key] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return running.result(), True
        try:
            base = self._prefill(ids)
            with self.lock:
                self.prefixes.put(key, base)
            running.set_result(base)
            return base, False
        except BaseException as e:
            running.set_exception(e)
            raise
        finally:
            with self.lock:
                self.pending.pop(key, None)

    @torch.no_grad()
    def _row(self, name: str, prefix_ids: list[int], suffix_ids: list[int], params: GenParams, timings: dict,
             oracle: bool = False, exact: bool = False) -> tuple[Row, ServedInfo]:
        """The row of a request to adapter `name`: its prefix cache from the base's (rebuilt from its codes,
        when it is served from an artifact; its own prefill for the oracle, and for `exact` where the cache
        would be rebuilt), its suffix on top, the first next-token logits."""
        i = self.group.index(name)
        ids = id_row(prefix_ids, self.device)
        keys = values = self.group.fast.empty()
        cached, plan = False, None
        own = oracle or (exact and name in self.plans)
        t0 = time.perf_counter()
        if prefix_ids and own:
            _, keys, values = self.group.extend(keys, values, ids, i)
            timings["prefill"] = (time.perf_counter() - t0) * 1e3
        elif prefix_ids:
            (base, codes), cached = self._base(prefix_ids, ids)
            timings["group_base"] = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            if name in codes:                      # (a prefix prefilled before its artifact came has none)
                plan = self.plans.get(name)
            if plan is not None:
                kv, phases = rebuild(plan[2], plan[0], codes[name],
                                     reader=selective.request_reader(plan[0], suffix_ids, self.device))
                keys, values = [k for k, _ in kv], [v for _, v in kv]
                timings.update(rebuild=phases["rebuild_ms"], patch=phases["patch_ms"],
                               recompute=phases["recompute_ms"], tail=phases["tail_ms"])
            else:
                _, keys, values = self.group.adapter_prefix(base, ids, name)
            timings["group_adapter"] = (time.perf_counter() - t1) * 1e3
        if oracle:
            info = ServedInfo("oracle", None, None, 0, timings)
        else:
            share = 1.0 if own else self.share(name) if plan is not None else self.group.prefill_share([name])[name]
            reason = FallbackReason.PREFIX_TOO_SHORT if not prefix_ids else self._own_prefill(name, share)
            info = ServedInfo("fallback" if reason else "scd", reason, plan[1] if plan else None, 0, timings,
                              group={"base_cached": cached, "adapter_share": share})
        t2 = time.perf_counter()
        logits, keys, values = self.group.extend(keys, values, torch.tensor([suffix_ids], device=self.device), i)
        timings["suffix"] = (time.perf_counter() - t2) * 1e3
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        return Row(keys, values, logits[0], params, generator=gen, adapter=i), info

    def start(self, name: str, prefix_ids: list[int], suffix_ids: list[int], params: GenParams,
              put: Callable[[tuple], None], timings: dict | None = None,
              cancelled: threading.Event | None = None, oracle: bool = False, exact: bool = False
              ) -> Callable[[], None]:
        """As SpecialistEngine.start, for the adapter `name`: its prefix cache (the base's, shared, or rebuilt
        from its codes; `oracle`: its own prefill; `exact`: its own where it would be rebuilt), its suffix, then
        its decode steps in the group's batch; events go to put(). Returns cancel()."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token")
        with self.lock:
            if name not in self.names or name in self.leaving:
                raise NotServed(f"{name!r} is not an adapter of this group; it holds "
                                 f"{[n for n in self.names if n not in self.leaving]}")
            self.active[name] = self.active.get(name, 0) + 1
        t_start = time.perf_counter()
        try:
            row, info = self._row(name, prefix_ids, suffix_ids, params, dict(timings or {}), oracle, exact)
        except BaseException:
            self._ended(name)
            raise
        cancelled = cancelled or threading.Event()
        row.on_token, on_done = answer_events(self.tok, info, TextStream(self.tok, params.stop), put,
                                              cancelled, t_start)

        def done(finish: str, n_out: int) -> None:
            try:
                on_done(finish, n_out)
            finally:
                self._ended(name)
        row.on_done = done
        self.decoder.submit(row)
        return cancelled.set

    def answer(self, req, put: Callable[[tuple], None], cancelled: threading.Event, payload=None,
               timings: dict | None = None) -> None:
        """engines.interface.AnsweringEngine.answer: `start` for the adapter the request names (`req.model`);
        a group receives no codes (`payload` is None)."""
        self.start(req.model, req.prefix_ids, req.suffix_ids, req.params, put,
                   req.timings if timings is None else timings, cancelled=cancelled, oracle=req.reason == "oracle",
                   exact=req.exact)

    def status(self, name: str | None = None) -> dict:
        """Of one adapter (`name`) or of the group: its share of a prefill it computes itself over a prefix
        (1.0: its own prefill, the reason says so), the artifact it is served from, its running requests."""
        share = self.share(name) if name in self.names else None
        plan = self.plans.get(name)
        return {"members": self.names, "adapter_share": share, "artifact": plan[1] if plan else None,
                "running": self.active.get(name, 0) if name else sum(self.active.values()),
                "unavailable_reason": self._own_prefill(name, share),
                "decode": self.decoder.stats()}

    def _own_prefill(self, name: str | None, share: float | None) -> FallbackReason | None:
        """Why adapter `name` prefills a prefix itself when its share of a prefill is 1.0: it has no artifact
        (`no_artifact`, as a specialist outside a group), or it has one and prefilled anyway (`exact`, or a prefix
        the base prefilled before the artifact came: `group_own_prefill`); None when it shares the prefix."""
        if share != 1.0:
            return None
        return FallbackReason.GROUP_OWN_PREFILL if name in self.plans else FallbackReason.NO_ARTIFACT

    def stop(self) -> None:
        self.decoder.stop()

    def complete(self, name: str, prefix_ids: list[int], suffix_ids: list[int], params: GenParams,
                 oracle: bool = False, exact: bool = False) -> tuple[str, ServedInfo, str]:
        """(text, info, finish_reason) of a whole completion by the adapter `name`."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        cancel = self.start(name, prefix_ids, suffix_ids, params, events.put, oracle=oracle, exact=exact)
        return collected(events_as_text(events, cancel))
