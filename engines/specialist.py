"""Specialist side of serving: rebuild the cache from codes (or prefill as a stated fallback) and decode.

SpecialistEngine is plain Python (tested without Ray); Serve replicas hold one. Every result says how it
was served: mode "scd", or "fallback" with the reason, plus the phase timings.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engines.batching import BatchDecoder
from engines.interface import Arriving
from actors.messages import FallbackReason
from engines.prefix_cache import PrefixCodeCache, prefix_key
from scd.online import activated, cache, codec, e_first, fast_decode, selective
from scd.online.artifacts import PairArtifacts
from scd.online.decode import GenParams, Row, TokenLogprobs, token_logprobs, verify
from scd.online.rebuild import Codes, prepare, rebuild, run_blocks
from scd.online.trace import capture


@dataclass
class ServedInfo:
    mode: str                                   # "scd" | "fallback" | "oracle" (prefill asked for)
    reason: str | None
    artifact: str | None
    payload_bytes: int
    timings: dict[str, float] = field(default_factory=dict)
    tokens: int = 0                             # generated tokens (usage), set when the answer is done
    level: dict[str, int] | None = None         # mode "scd": the Reuse ranks the codes arrived at
    family: str | None = None                   # mode "scd": the family whose one payload served this fan-out
    exact: dict | None = None                   # an exact request served from codes: drafted, accepted, takeover
    group: dict | None = None                   # a LoRA group's answer: base prefill cached, the adapter's share
    ids: list[int] = field(default_factory=list)  # the generated token ids (in process only: not in as_dict)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "artifact": self.artifact, "level": self.level,
                "family": self.family, "exact": self.exact, "group": self.group,
                "payload_bytes": self.payload_bytes, "timings_ms": {k: round(v, 3) for k, v in self.timings.items()}}


class IncrementalDetokenizer:
    """Text pieces of a growing sequence of generated tokens, each piece decoded from a short window of the
    latest tokens (vLLM's prefix/read offsets) instead of the whole output every token. A piece is held back
    while the window ends inside a multi-byte character (byte-level BPE); the concatenated pieces equal
    tokenizer.decode(all tokens)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(done):]

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD, as decode() would)."""
        rest = self.tok.decode(self.ids[self.prefix:])[len(self.tok.decode(self.ids[self.prefix:self.read])):]
        self.prefix = self.read = len(self.ids)
        return rest


class TextStream:
    """The text of one request's generated tokens: detokenized incrementally, cut before its first stop string."""

    def __init__(self, tokenizer, stop):
        self.detok, self.text = IncrementalDetokenizer(tokenizer), ""
        self.stop = [x for x in stop if x]
        self.longest = max((len(x) for x in self.stop), default=0)

    def add(self, token_id: int) -> tuple[str, bool]:
        """(the text piece to emit, whether a stop string ended here: then nothing more is emitted)."""
        piece = self.detok.add(token_id)
        tail = max(0, len(self.text) - self.longest + 1)        # a stop string can only end in the new piece
        self.text += piece
        hits = [i for i in (self.text.find(x, tail) for x in self.stop) if i >= 0]
        if hits:                                    # emit up to the stop string, never the string itself
            return piece[:max(0, len(piece) - (len(self.text) - min(hits)))], True
        return piece, False

    def flush(self) -> str:
        return self.detok.flush()


def logprobs_entry(tok, token_id: int, lp: TokenLogprobs, offset: int) -> dict:
    """A generated token's logprobs as the router formats them: its text, its logprob, the top alternatives
    and where its text starts in the answer (the token that completes a stop string has none)."""
    return {"token": tok.decode([token_id]), "logprob": lp.logprob,
            "top": [(tok.decode([t]), v) for t, v in lp.top], "offset": offset}


def answer_events(tok, info: ServedInfo, text: TextStream, put: Callable[[tuple], None],
                  cancelled: threading.Event, t_start: float) -> tuple[Callable, Callable]:
    """A row's (on_token, on_done) for the decode loop: they put the answer's events, as an engine's start()
    promises them (("token", text piece, logprobs entry or None, tokens so far)..., then ("done", info,
    finish_reason) or ("error", message)), and record its first token, total time and token count in info.
    on_token says to stop once a stop string appeared or the request was cancelled."""
    emitted = [0]                                   # characters of text put so far (logprobs' text offsets)
    generated = [0]                                 # tokens generated so far

    def on_token(token_id: int, lp: TokenLogprobs | None) -> bool:
        info.timings.setdefault("first_token", (time.perf_counter() - t_start) * 1e3)
        info.ids.append(token_id)
        piece, stop = text.add(token_id)
        entry = logprobs_entry(tok, token_id, lp, emitted[0]) if lp is not None and not stop else None
        emitted[0] += len(piece)
        generated[0] += 1
        if piece or entry:
            put(("token", piece, entry, generated[0]))
        return not (stop or cancelled.is_set())

    def on_done(finish: str, n_out: int) -> None:
        if finish.startswith("error"):
            put(("error", finish))
            return
        info.timings.setdefault("first_token", (time.perf_counter() - t_start) * 1e3)
        if finish == "length" and (rest := text.flush()):      # bytes of an unfinished character
            put(("token", rest, None, n_out))
        info.timings["total"] = (time.perf_counter() - t_start) * 1e3
        info.tokens = n_out
        put(("done", info, finish))
    return on_token, on_done


def events_as_text(events: queue.SimpleQueue, cancel: Callable[[], None]) -> Iterator[tuple[str, object]]:
    """An answer's events (answer_events) as a blocking generator of text: ("token", piece)..., then ("done",
    (info, finish_reason)); cancel() when the consumer stops early."""
    try:
        while (ev := events.get())[0] == "token":
            if ev[1]:
                yield ev[:2]
    finally:
        cancel()
    if ev[0] == "error":
        raise RuntimeError(f"decode failed: {ev[1]}")
    yield "done", (ev[1], ev[2])


def collected(events: Iterator[tuple[str, object]]) -> tuple[str, ServedInfo, str]:
    """(text, info, finish_reason) of a whole answer from events_as_text."""
    pieces = []
    for kind, value in events:
        if kind == "token":
            pieces.append(value)
        else:
            info, finish = value
    return "".join(pieces), info, finish


class SpecialistEngine:
    def __init__(self, name: str, model, tokenizer, art: PairArtifacts | None = None, version: str | None = None,
                 unavailable_reason: str = FallbackReason.NO_ARTIFACT, device: str = "cpu", max_batch: int = 8,
                 exact_cache_bytes: int = 256 << 20, static_capacity: int | None = None):
        """static_capacity: the decode loop's rows live in preallocated caches of that many positions, each step
        shape replayed from a CUDA graph on a GPU (scd.online.decode.StaticBatch); None: one batch grown per step."""
        self.name, self.model, self.tok, self.device = name, model, tokenizer, device
        self.eos_id = tokenizer.eos_token_id
        self.decoder = BatchDecoder(model, self.eos_id, max_batch, static_capacity,
                                    graphs=device.startswith("cuda"))
        self.min_drafts = 0           # exact mode: verify only once this many tokens are drafted (acceptance runs)
        self.accepted_avg = 4.0       # exact mode: drafts accepted per request, moving average (the draft budget)
        # exact mode: the own K and V of recent exact requests' prefixes (the next one on a prefix needs neither
        # codes nor a prefill)
        self.exact_cache = PrefixCodeCache(exact_cache_bytes, size=lambda kv: sum(k.nbytes + v.nbytes for k, v in kv))
        self.exact_lock = threading.Lock()
        self.exact_pool = ThreadPoolExecutor(4, thread_name_prefix="exact-prefill")
        # E-first payloads: a request's blocks run here while the rest of its codes arrive and are rebuilt
        self.block_pool = ThreadPoolExecutor(2, thread_name_prefix="blocks")
        self.families: dict[str, tuple[PairArtifacts, str]] = {}     # family id -> (this member's artifact, version)
        self.set_artifact(art, version, unavailable_reason)

    def set_artifact(self, art: PairArtifacts | None, version: str | None,
                     reason: str = FallbackReason.NO_ARTIFACT) -> None:
        if art is not None:
            prepare(self.model, art)          # lookup tables and fused patches now, not on the first request
        self.art, self.version, self.unavailable_reason = art, version, reason

    def set_family(self, member: PairArtifacts, version: str) -> None:
        """This specialist's member artifact of a family (member.pair is the family's id): payloads that carry
        the family's id are rebuilt with it."""
        prepare(self.model, member)
        self.families[member.pair] = (member, version)

    def _artifact_for(self, payload: bytes) -> tuple[PairArtifacts | None, str | None, str | None]:
        """(artifact, version, family id) that decodes `payload`: a family's when its header carries a family
        this specialist belongs to, else the pair's own (a damaged payload: the pair's, whose decode says so)."""
        try:
            carried = codec.header(payload, checksum=False).get("pair")
        except codec.PayloadError:
            carried = None
        if carried in self.families:
            return (*self.families[carried], carried)
        return self.art, self.version, None

    @torch.no_grad()
    def _prefix_kv(self, prefix_ids: list[int], payload, reason: str | None, timings: dict,
                   codes_ok: Callable[[], None] | None = None, suffix_ids: list[int] | None = None):
        """(kv, ServedInfo). Uses the codes when it can (calling codes_ok() once they check out, before the
        rebuild); otherwise prefills and says why. `payload`: bytes or a codec.Wire, or E-first (e_first.Parts
        in hand, or Arriving: the rest still on its way). `suffix_ids`: the request's tokens after the prefix,
        which a plan repaired by the suffix rule reads."""
        if not prefix_ids:                                      # nothing to cache: the suffix is the whole input
            return [], ServedInfo("fallback", FallbackReason.PREFIX_TOO_SHORT, self.version, 0, timings)
        ids = cache.id_row(prefix_ids, self.device)
        if reason == FallbackReason.NO_ARTIFACT and self.art is None:   # the producer has none; this side may know why
            reason = self.unavailable_reason
        if payload is not None and reason is None and activated.of(self.model) is not None and \
                activated.switch(self.model, ids) < len(prefix_ids):
            reason = FallbackReason.INVOCATION_IN_PREFIX    # the codes hold the base's cache: not past that point
        if isinstance(payload, e_first.Parts):
            payload = Arriving.of(payload)
        if payload is not None and reason is None:
            art, version, family = self._artifact_for(payload.entry if isinstance(payload, Arriving) else payload)
            if art is None:
                reason = self.unavailable_reason
            else:
                how = self._e_first if isinstance(payload, Arriving) else self._from_codes
                reader = selective.request_reader(art, suffix_ids, self.device)
                built = how(art, version, payload, prefix_ids, timings, codes_ok, reader=reader)
                if isinstance(built, str):
                    reason = built
                else:
                    kv, codes = built
                    return kv, ServedInfo("scd", None, version, len(payload), timings, level=codes.level,
                                          family=family)
        t0 = time.perf_counter()
        kv = self._prefill(ids)
        timings["prefill"] = (time.perf_counter() - t0) * 1e3
        if reason == "oracle":                                   # asked for the reference path on purpose
            return kv, ServedInfo("oracle", None, None, 0, timings)
        return kv, ServedInfo("fallback", reason or FallbackReason.NO_ARTIFACT, self.version, 0, timings)

    def _checked(self, decode: Callable[[], Codes], prefix_ids: list[int]) -> "Codes | str":
        """Codes decoded and on this device, or CODEC_ERROR when the payload is damaged, does not fit this
        artifact or holds another prefix."""
        try:
            codes = decode().to(self.device)
        except codec.PayloadError:
            return FallbackReason.CODEC_ERROR
        return codes if codes.token_ids.tolist() == [prefix_ids] else FallbackReason.CODEC_ERROR

    def _from_codes(self, art: PairArtifacts, version: str, payload, prefix_ids: list[int], timings: dict,
                    codes_ok: Callable[[], None] | None, plan: list[str] | None = None,
                    own: Callable[[], dict] | None = None, reader: torch.Tensor | None = None
                    ) -> "tuple[list, Codes] | str":
        """(kv, codes) rebuilt from one payload laid out by `plan` (default: the artifact's), or the fallback
        reason. `own`: the blocks' layers, running elsewhere (rebuild's `own`; E-first's rest); `reader`: the
        request's tokens after the prefix (rebuild's)."""
        t0 = time.perf_counter()
        codes = self._checked(lambda: codec.decode(payload, art.pair, version, plan or art.payload_plan,
                                                   codec.level_dims(art), art.x_codes), prefix_ids)
        if isinstance(codes, str):
            return codes
        timings["decode"] = (time.perf_counter() - t0) * 1e3
        if codes_ok is not None:
            codes_ok()
        kv, ph = rebuild(self.model, art, codes, own, reader)
        timings["rebuild"], timings["patch"] = ph["rebuild_ms"], ph["patch_ms"]
        if art.blocks:                                  # the consumer's own layers, run from the residual sent
            timings["recompute"] = ph["recompute_ms"]
        if art.tail_tokens:                             # and its own run of some of the prefix's tokens
            timings["tail"] = ph["tail_ms"]
        return kv, codes

    def _e_first(self, art: PairArtifacts, version: str, payload: Arriving, prefix_ids: list[int], timings: dict,
                 codes_ok: Callable[[], None] | None, reader: torch.Tensor | None = None
                 ) -> "tuple[list, Codes] | str":
        """(kv, codes) from an E-first payload: the blocks start from the entry part while the rest is received,
        decoded and rebuilt beside them; or the fallback reason."""
        plans = e_first.part_plans(art.payload_plan)
        if plans is None:                               # parts for a plan that enters no block
            return FallbackReason.CODEC_ERROR
        t0 = time.perf_counter()
        entry = self._checked(lambda: codec.decode(payload.entry, art.pair, version, plans[0],
                                                   codec.level_dims(art)), prefix_ids)
        if isinstance(entry, str):
            return entry
        timings["decode_entry"] = (time.perf_counter() - t0) * 1e3

        def blocks() -> tuple[dict, float]:
            t = time.perf_counter()
            return run_blocks(self.model, art, entry), (time.perf_counter() - t) * 1e3
        running = self.block_pool.submit(blocks)
        try:
            rest, reason, timings["transfer_rest"] = payload.rest()
            if rest is None:
                return reason
            built = self._from_codes(art, version, rest, prefix_ids, timings, codes_ok, plans[1],
                                     own=lambda: running.result()[0], reader=reader)
            if isinstance(built, str):
                return built
            timings["block_wait"] = timings["recompute"]        # rebuild's "recompute": its wait for the block
        finally:
            timings["recompute"] = running.result()[1]          # a fallback too waits for the block it started
        kv, codes = built
        return kv, e_first.merged(entry, codes, art.payload_plan)

    def _prefill(self, ids: torch.Tensor) -> list:
        """The specialist's own K and V of the prefix ids (1, T): the oracle's cache."""
        tr = capture(self.model, ids, torch.ones_like(ids), want_xnorm=False)
        return list(zip(tr.keys, tr.values))

    def start(self, prefix_ids: list[int], suffix_ids: list[int], payload: bytes | None, reason: str | None,
              params: GenParams, put: Callable[[tuple], None], timings: dict | None = None,
              exact: bool = False, cancelled: threading.Event | None = None) -> Callable[[], None]:
        """Build the request's own cache (codes or prefill) and run its suffix, in the calling thread; then its
        decode steps run in the engine's batch with every other running request (BatchDecoder). Events go to
        put(), from the decode loop's thread: ("token", text piece, logprobs entry or None, tokens so far) per
        generated token, then ("done", info, finish_reason) with finish_reason "stop" (stop string or EOS) or
        "length" (max_tokens), or ("error", message). Returns cancel(): the request's row leaves at its next
        token (a client gone).

        exact: the answer is the specialist's own (its prefill's), token for token when greedy: a cache rebuilt
        from codes only drafts (`_exact`). Without codes (a fallback, the oracle) the answer is exact anyway.
        Exact requests return after their own prefill: `cancelled`, set by the caller meanwhile, ends them too."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token")
        t_start = time.perf_counter()
        own = None
        if exact and prefix_ids:
            with self.exact_lock:
                own = self.exact_cache.get(prefix_key(prefix_ids, self.name, "exact"))
        prefill = None                      # exact mode's own prefill, started once the codes check out

        def start_prefill() -> None:
            nonlocal prefill
            prefill = self.exact_pool.submit(self._own_cache, prefix_ids, suffix_ids)
        row, info, text = self._row(prefix_ids, suffix_ids, payload, reason, params, dict(timings or {}), own,
                                    start_prefill if exact and own is None else None)
        cancelled = cancelled or threading.Event()      # the caller's, when it may cancel before start returns
        on_token, on_done = answer_events(self.tok, info, text, put, cancelled, t_start)
        if prefill is not None:
            self._exact(row, info, prefix_ids, suffix_ids, on_token, on_done, cancelled, prefill)
        else:
            row.on_token, row.on_done = on_token, on_done
            self.decoder.submit(row)
        return cancelled.set

    @torch.no_grad()
    def _own_cache(self, prefix_ids: list[int], suffix_ids: list[int]) -> tuple:
        """Exact mode's exact cache: (the specialist's own cache of prefix and suffix, its mask, the logits after
        the suffix, ms). The prefix's K and V are kept for the next exact request on it."""
        t0 = time.perf_counter()
        kv = self._prefill(cache.id_row(prefix_ids, self.device))
        with self.exact_lock:
            self.exact_cache.put(prefix_key(prefix_ids, self.name, "exact"), kv)
        c = cache.assemble(self.model, kv)
        mask = torch.ones(1, len(prefix_ids), dtype=torch.long, device=self.device)
        first, mask = cache.extend(self.model, c, mask, torch.tensor([suffix_ids], device=self.device))
        return c, mask, first, (time.perf_counter() - t0) * 1e3

    @torch.no_grad()
    def _exact(self, row: Row, info: ServedInfo, prefix_ids: list[int], suffix_ids: list[int],
               emit: Callable, finish: Callable, cancelled: threading.Event, own: Future) -> None:
        """Exact mode (VeriCache's draft and verify, across models): the row on the rebuilt cache drafts tokens
        in the engine's batch, unseen, while `own` (started when the codes checked out, before the rebuild)
        prefills the prefix with the specialist's own weights (the exact cache). Then
        one forward pass over the drafts on the exact cache verifies them (`decode.verify`); the accepted
        drafts and the exact cache's next token are emitted, and decoding goes on from the exact cache. Nothing
        unverified is emitted. info.exact says how many tokens were drafted and accepted."""
        p, drafts, asked_stop = row.params, [], [False]
        stop, ended, enough = threading.Event(), threading.Event(), threading.Event()
        wanted = min(self.min_drafts, p.max_tokens)
        # drafts past what gets accepted only slow the prefill they share the device with: at most twice the
        # recent acceptance, plus 4
        budget = max(wanted, 4 + int(2 * self.accepted_avg))

        def on_draft(token_id: int, _lp) -> bool:
            drafts.append(token_id)
            if len(drafts) >= wanted:
                enough.set()
            asked_stop[0] = stop.is_set() or cancelled.is_set() or len(drafts) >= budget
            return not asked_stop[0]

        def on_draft_done(how: str, _n: int) -> None:
            if how == "stop" and not asked_stop[0] and self.eos_id is not None:
                drafts.append(self.eos_id)          # the draft ended on eos: verified like any token
            if how.startswith("error"):
                drafts.clear()
            ended.set()
            enough.set()

        row.params = dataclasses.replace(p, logprobs=None, stop=())
        row.draft_probs = [] if p.temperature > 0 else None
        row.on_token, row.on_done = on_draft, on_draft_done
        self.decoder.submit(row)
        c, mask, first, info.timings["exact_prefill"] = own.result()
        if wanted:
            enough.wait()
        stop.set()
        ended.wait()
        t0, k = time.perf_counter(), len(drafts)
        logits = first[0, -1:]
        if k:
            more, _ = cache.forward_on_cache(self.model, c, mask, torch.tensor([drafts], device=self.device))
            logits = torch.cat([logits, more[0]])
        accepted, nxt = verify(drafts, row.draft_probs, logits, p, self.eos_id, row.generator)
        info.timings["verify"] = (time.perf_counter() - t0) * 1e3
        info.exact = {"drafted": k, "accepted": accepted, "takeover": accepted, "cached": False}
        self.accepted_avg = 0.8 * self.accepted_avg + 0.2 * accepted
        tokens = drafts[:accepted] + ([nxt] if nxt is not None else [])
        for i, t in enumerate(tokens):
            if t == self.eos_id:
                return finish("stop", i)
            lp = token_logprobs(logits[i], t, p.logprobs) if p.logprobs is not None else None
            if not emit(t, lp):
                return finish("stop", i + 1)
            if i + 1 >= p.max_tokens:
                return finish("length", i + 1)
        # the exact cache up to the last accepted draft: a row like any other, whose first step feeds the token
        # after them (already emitted) in the batch's forward pass
        keep = len(prefix_ids) + len(suffix_ids) + accepted
        rest = Row([layer.keys[:, :, :keep] for layer in c.layers], [layer.values[:, :, :keep] for layer in c.layers],
                   logits[0], p, emit, finish, row.generator, n_out=len(tokens), feed=nxt)
        self.decoder.submit(rest)

    def answer(self, req, put: Callable[[tuple], None], cancelled: threading.Event, payload=None,
               timings: dict | None = None) -> None:
        """engines.interface.AnsweringEngine.answer: `start` with the request's fields (`req.reason`: why the
        codes are missing, or "oracle")."""
        self.start(req.prefix_ids, req.suffix_ids, payload, req.reason, req.params, put,
                   req.timings if timings is None else timings, exact=req.exact, cancelled=cancelled)

    def status(self, name: str | None = None) -> dict:
        """The artifact version it serves from (or why none), its families' versions and its decode loop's."""
        return {"artifact": self.version, "unavailable_reason": None if self.art else self.unavailable_reason,
                "families": {fid: v for fid, (_, v) in self.families.items()}, "decode": self.decoder.stats()}

    def stop(self) -> None:
        self.decoder.stop()
        self.exact_pool.shutdown(wait=False, cancel_futures=True)
        self.block_pool.shutdown(wait=False, cancel_futures=True)

    def stream(self, prefix_ids: list[int], suffix_ids: list[int], payload: bytes | None, reason: str | None,
               params: GenParams, timings: dict | None = None, exact: bool = False) -> Iterator[tuple[str, object]]:
        """start() as a blocking generator of text: ("token", piece)..., then ("done", (info, finish_reason))."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        cancel = self.start(prefix_ids, suffix_ids, payload, reason, params, events.put, timings, exact)
        return events_as_text(events, cancel)

    @torch.no_grad()
    def _row(self, prefix_ids, suffix_ids, payload, reason, params: GenParams, timings: dict, own: list | None = None,
             codes_ok: Callable[[], None] | None = None):
        """(a Row for the batch, its ServedInfo, its TextStream): the prefix cache (rebuilt or prefilled, or `own`:
        the specialist's own, kept from an earlier exact request), the suffix run on top of it, the first
        next-token logits; start() gives the row its callbacks."""
        if own is not None:
            kv, info = own, ServedInfo("scd", None, self.version, 0, timings,
                                       exact={"drafted": 0, "accepted": 0, "takeover": 0, "cached": True})
        else:
            kv, info = self._prefix_kv(prefix_ids, payload, reason, timings, codes_ok, suffix_ids)
        suffix = torch.tensor([suffix_ids], device=self.device)
        fast = fast_decode.step_for(self.model)
        if fast is not None:
            logits, keys, values = fast.extend([k for k, _ in kv], [v for _, v in kv], suffix)
        else:
            c = cache.assemble(self.model, kv)
            mask = torch.ones(1, len(prefix_ids), dtype=torch.long, device=self.device)
            logits, _ = cache.extend(self.model, c, mask, suffix, last_only=True)
            logits, keys, values = logits[:, -1], [layer.keys for layer in c.layers], [layer.values for layer in c.layers]
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        row = Row(keys, values, logits[0], params, generator=gen)
        return row, info, TextStream(self.tok, params.stop)

    def complete(self, prefix_ids: list[int], suffix_ids: list[int], payload: bytes | None, reason: str | None,
                 params: GenParams, timings: dict | None = None, exact: bool = False) -> tuple[str, ServedInfo, str]:
        """(text, info, finish_reason) of a whole completion."""
        return collected(self.stream(prefix_ids, suffix_ids, payload, reason, params, timings, exact))
