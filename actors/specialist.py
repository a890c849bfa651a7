"""Specialist side of serving: rebuild the cache from codes (or prefill as a stated fallback) and decode.

SpecialistEngine is plain Python (tested without Ray); Serve replicas hold one. Every result says how it
was served: mode "scd", or "fallback" with the reason, plus the phase timings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from actors.messages import FallbackReason
from scd import cache, codec
from scd.artifacts import PairArtifacts
from scd.rebuild import prepare, rebuild
from scd.trace import capture


@dataclass
class GenParams:
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class ServedInfo:
    mode: str                                   # "scd" | "fallback" | "oracle" (prefill asked for)
    reason: str | None
    artifact: str | None
    payload_bytes: int
    timings: dict[str, float] = field(default_factory=dict)
    tokens: int = 0                             # generated tokens (usage), set when the answer is done

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "artifact": self.artifact,
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


class SpecialistEngine:
    def __init__(self, name: str, model, tokenizer, art: PairArtifacts | None = None, version: str | None = None,
                 unavailable_reason: str = FallbackReason.NO_ARTIFACT, device: str = "cpu"):
        self.name, self.model, self.tok, self.device = name, model, tokenizer, device
        self.set_artifact(art, version, unavailable_reason)

    def set_artifact(self, art: PairArtifacts | None, version: str | None,
                     reason: str = FallbackReason.NO_ARTIFACT) -> None:
        if art is not None:
            prepare(self.model, art)          # lookup tables and fused patches now, not on the first request
        self.art, self.version, self.unavailable_reason = art, version, reason

    @torch.no_grad()
    def _prefix_kv(self, prefix_ids: list[int], payload: bytes | None, reason: str | None, timings: dict):
        """(kv, ServedInfo). Uses the codes when it can; otherwise prefills and says why."""
        if not prefix_ids:                                      # nothing to cache: the suffix is the whole input
            return [], ServedInfo("fallback", FallbackReason.PREFIX_TOO_SHORT, self.version, 0, timings)
        ids = torch.tensor([prefix_ids], dtype=torch.long, device=self.device)
        if reason == FallbackReason.NO_ARTIFACT and self.art is None:   # the producer has none; this side may know why
            reason = self.unavailable_reason
        if payload is not None and reason is None:
            if self.art is None:
                reason = self.unavailable_reason
            else:
                t0 = time.perf_counter()
                try:
                    codes = codec.decode(payload, self.art.pair, self.version, self.art.plan,
                                         codec.artifact_dims(self.art))
                except codec.PayloadError:
                    reason = FallbackReason.CODEC_ERROR
                else:
                    codes.token_ids, codes.mask = codes.token_ids.to(self.device), codes.mask.to(self.device)
                    for fields_ in codes.layers.values():
                        for k in fields_:
                            fields_[k] = fields_[k].to(self.device)
                    if codes.token_ids.tolist() != [prefix_ids]:
                        reason = FallbackReason.CODEC_ERROR
                    else:
                        timings["decode"] = (time.perf_counter() - t0) * 1e3
                        kv, ph = rebuild(self.model, self.art, codes)
                        timings["rebuild"], timings["patch"] = ph["rebuild_ms"], ph["patch_ms"]
                        return kv, ServedInfo("scd", None, self.version, len(payload), timings)
        t0 = time.perf_counter()
        tr = capture(self.model, ids, torch.ones_like(ids), want_xnorm=False)
        timings["prefill"] = (time.perf_counter() - t0) * 1e3
        if reason == "oracle":                                   # asked for the reference path on purpose
            return list(zip(tr.keys, tr.values)), ServedInfo("oracle", None, None, 0, timings)
        return list(zip(tr.keys, tr.values)), ServedInfo("fallback", reason or FallbackReason.NO_ARTIFACT,
                                                         self.version, 0, timings)

    @torch.no_grad()
    def stream(self, prefix_ids: list[int], suffix_ids: list[int], payload: bytes | None, reason: str | None,
               params: GenParams, timings: dict | None = None) -> Iterator[tuple[str, object]]:
        """Events: ("token", text piece) per generated token, then one ("done", (info, finish_reason)).
        finish_reason is "stop" (stop string or EOS) or "length" (max_tokens)."""
        if not suffix_ids:
            raise ValueError("the suffix must hold at least one token")
        t_start = time.perf_counter()
        kv, info = self._prefix_kv(prefix_ids, payload, reason, dict(timings or {}))
        mask = torch.ones(1, len(prefix_ids), dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        steps = cache.decode_steps(self.model, cache.assemble(self.model, kv), mask,
                                   torch.tensor([suffix_ids], device=self.device), params.max_tokens,
                                   params.temperature, params.top_p, self.tok.eos_token_id, gen)
        detok, text, n_out, finish = IncrementalDetokenizer(self.tok), "", 0, "length"
        longest_stop = max((len(s) for s in params.stop), default=0)
        for nxt in steps:
            if n_out == 0:
                info.timings["first_token"] = (time.perf_counter() - t_start) * 1e3
            if int(nxt[0]) == self.tok.eos_token_id:
                finish = "stop"
                break
            n_out += 1
            piece = detok.add(int(nxt[0]))
            tail = max(0, len(text) - longest_stop + 1)          # a stop string can only end in the new piece
            text += piece
            hits = [i for i in (text.find(s, tail) for s in params.stop if s) if i >= 0]
            if hits:                                 # emit up to the stop string, never the string itself
                keep = len(piece) - (len(text) - min(hits))
                if keep > 0:
                    yield "token", piece[:keep]
                finish = "stop"
                break
            if piece:
                yield "token", piece
        else:
            if rest := detok.flush():                # bytes of an unfinished character at max_tokens
                yield "token", rest
        info.timings["total"] = (time.perf_counter() - t_start) * 1e3
        info.tokens = n_out
        yield "done", (info, finish)

    def complete(self, prefix_ids: list[int], suffix_ids: list[int], payload: bytes | None, reason: str | None,
                 params: GenParams, timings: dict | None = None) -> tuple[str, ServedInfo, str]:
        """(text, info, finish_reason) of a whole completion."""
        pieces = []
        for kind, value in self.stream(prefix_ids, suffix_ids, payload, reason, params, timings):
            if kind == "token":
                pieces.append(value)
            else:
                info, finish = value
        return "".join(pieces), info, finish
