"""Producer side of serving: one prefill per prefix, codes for every requested pair, a prefix code cache.

ProducerEngine is plain Python (tested without Ray); the Ray actor that pins it to a device is a thin shim.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from actors.messages import FallbackReason
from actors.prefix_cache import PrefixCodeCache, prefix_key
from scd.online import codec, links
from scd.online.artifacts import PairArtifacts
from scd.online.rebuild import encode
from scd.online.trace import capture


@dataclass
class Encoded:
    """Codes for one pair, or why there are none."""
    payload: bytes | None
    version: str | None
    error: str | None = None          # fallback reason for the specialist when payload is None
    cache_hit: bool = False
    level: dict[str, int] | None = None   # the Reuse ranks sent (links.choose)


@dataclass
class EncodeResult:
    per_pair: dict[str, Encoded]
    prefill_ms: float = 0.0
    encode_ms: float = 0.0
    prefilled: bool = False           # False when every pair was served from the prefix code cache
    timings: dict = field(default_factory=dict)


class ProducerEngine:
    """`link_gbps` (pair -> the bandwidth to its consumer, Gbps) and `ttft_target_ms`: each pair's codes are
    sent at the largest level of its artifact that reaches the consumer within the target, counting this
    request's prefill and encode (scd.online.links); without them, at the full ranks."""

    def __init__(self, model, tokenizer, artifacts: dict[str, tuple[PairArtifacts, str]],
                 cache_bytes: int = 64 << 20, device: str = "cpu", link_gbps: dict[str, float] | None = None,
                 ttft_target_ms: float | None = None):
        self.model, self.tok, self.device = model, tokenizer, device
        self.artifacts = dict(artifacts)          # pair -> (artifacts, version)
        self.cache = PrefixCodeCache(cache_bytes)
        self.prefills = 0
        self.link_gbps, self.ttft_target_ms = dict(link_gbps or {}), ttft_target_ms

    def _level(self, pair: str, tokens: int, spent_ms: float) -> dict[str, int]:
        art, _ = self.artifacts[pair]
        budget = None if self.ttft_target_ms is None else self.ttft_target_ms - spent_ms
        return links.choose(art, tokens, self.link_gbps.get(pair), budget)

    def set_artifact(self, pair: str, art: PairArtifacts, version: str) -> None:
        self.artifacts[pair] = (art, version)

    @torch.no_grad()
    def encode(self, prefix_ids: list[int], pairs: list[str]) -> EncodeResult:
        """Codes of one prefix for each pair; the prefix is prefilled at most once for all of them."""
        res = EncodeResult({})
        todo = []
        for pair in pairs:
            if pair not in self.artifacts:
                res.per_pair[pair] = Encoded(None, None, FallbackReason.NO_ARTIFACT)
                continue
            art, version = self.artifacts[pair]
            # a cached code is sent at once: the largest level that fits the whole target, or a smaller one
            # cached by a request whose prefill left less of it
            best = self._level(pair, len(prefix_ids), 0.0)
            levels = art.levels[:art.levels.index(best) + 1][::-1]
            keys = [prefix_key(prefix_ids, pair, f"{version}/{_level_tag(lv)}") for lv in levels]
            hit = self.cache.first(keys)
            if hit is not None:
                res.per_pair[pair] = Encoded(hit[1], version, cache_hit=True, level=levels[keys.index(hit[0])])
            else:
                todo.append(pair)
        if not todo:
            return res
        ids = torch.tensor([prefix_ids], device=self.device)
        t0 = time.perf_counter()
        trace = capture(self.model, ids, torch.ones_like(ids))
        t1 = time.perf_counter()
        self.prefills += 1
        for pair in todo:
            art, version = self.artifacts[pair]
            level = self._level(pair, len(prefix_ids), (time.perf_counter() - t0) * 1e3)
            payload = codec.encode(encode(art, trace, ids.cpu(), level), pair, version,
                                   codec.artifact_dims(art, level), art.code_dtype)
            self.cache.put(prefix_key(prefix_ids, pair, f"{version}/{_level_tag(level)}"), payload)
            res.per_pair[pair] = Encoded(payload, version, level=level)
        res.prefilled, res.prefill_ms, res.encode_ms = True, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        return res

    def stats(self) -> dict:
        s = self.cache.stats
        return {"prefills": self.prefills, "cache_hits": s.hits, "cache_misses": s.misses,
                "cache_bytes": s.bytes, "cache_entries": s.entries, "pairs": sorted(self.artifacts)}



def _level_tag(level: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(level.items()))
