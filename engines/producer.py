"""Producer side of serving: one prefill per prefix, codes for every requested pair, a prefix code cache.

ProducerEngine is plain Python (tested without Ray); the Ray actor that pins it to a device is a thin shim.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from actors.messages import FallbackReason
from engines.prefix_cache import PrefixCodeCache, prefix_digest, prefix_key
from scd.online import codec, e_first, links
from scd.online.artifacts import PairArtifacts, level_tag
from scd.online.cache import id_row
from scd.online.family_artifacts import FamilyArtifacts
from scd.online.rebuild import encode
from scd.online.trace import capture


@dataclass
class Encoded:
    """Codes for one pair, or why there are none."""
    payload: "bytes | codec.Wire | e_first.Parts | None"     # Parts: E-first (the entry part goes first)
    version: str | None
    error: str | None = None          # fallback reason for the specialist when payload is None
    cache_hit: bool = False
    level: dict[str, int] | None = None   # the Reuse ranks sent (links.choose)
    family: str | None = None             # the family whose one payload serves this pair with others


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
    request's prefill and encode (scd.online.links); without them, at the full ranks. `e_first`: a pair whose
    consumer runs a block of its own layers gets its codes as two payloads, the block's entry first
    (e_first.Parts), so that it starts the block while the rest arrives; a family's payload goes whole."""

    def __init__(self, model, tokenizer, artifacts: dict[str, tuple[PairArtifacts, str]],
                 cache_bytes: int = 64 << 20, device: str = "cpu", link_gbps: dict[str, float] | None = None,
                 ttft_target_ms: float | None = None, device_payloads: bool = False, e_first: bool = True):
        self.model, self.tok, self.device = model, tokenizer, device
        # payloads as `codec.Wire` (the body a tensor on this device, for a transport that moves tensors) instead
        # of bytes: on a GPU the codes then stay in device memory from encode to the consumer's rebuild
        self.device_payloads, self.e_first = device_payloads, e_first
        self.artifacts = dict(artifacts)          # pair -> (artifacts, version)
        self.cache = PrefixCodeCache(cache_bytes)
        self.prefills = 0
        self.link_gbps, self.ttft_target_ms = dict(link_gbps or {}), ttft_target_ms
        self.families: dict[str, tuple[FamilyArtifacts, str]] = {}   # family id -> (artifact, version)

    def _level(self, art: PairArtifacts, pairs: list[str], tokens: int, spent_ms: float) -> dict[str, int]:
        """The level of `art`'s codes that reaches every one of `pairs` in time: the smallest of their choices."""
        budget = None if self.ttft_target_ms is None else self.ttft_target_ms - spent_ms
        return min((links.choose(art, tokens, self.link_gbps.get(p), budget) for p in pairs), key=art.levels.index)

    def set_artifact(self, pair: str, art: PairArtifacts, version: str) -> None:
        self.artifacts[pair] = (art, version)

    def set_family(self, fam: FamilyArtifacts, version: str) -> None:
        """A fan-out whose pairs are all members of `fam` gets one encode and one payload for all of them."""
        self.families[fam.family] = (fam, version)

    def family_for(self, pairs: list[str]) -> str | None:
        """The family whose members include every one of `pairs` (two or more), if one is loaded."""
        if len(set(pairs)) < 2:
            return None
        return next((fid for fid, (fam, _) in self.families.items() if set(pairs) <= set(fam.members)), None)

    @torch.no_grad()
    def encode(self, prefix_ids: list[int], pairs: list[str]) -> EncodeResult:
        """Codes of one prefix for each pair; the prefix is prefilled at most once for all of them. A fan-out
        to members of one loaded family gets that family's one payload, encoded once, at the level that fits
        the slowest of their links; otherwise each pair gets its own."""
        res = EncodeResult({})
        fid = self.family_for(pairs)
        units = []                            # (the id its payload carries, artifact, version, the pairs it serves)
        if fid is not None:
            fam, version = self.families[fid]
            units.append((fid, fam.encoder, version, list(dict.fromkeys(pairs))))
        else:
            for pair in pairs:
                if pair not in self.artifacts:
                    res.per_pair[pair] = Encoded(None, None, FallbackReason.NO_ARTIFACT)
                else:
                    units.append((pair, *self.artifacts[pair], [pair]))
        digest = prefix_digest(prefix_ids)

        def key(uid: str, version: str, level) -> str:
            return prefix_key(prefix_ids, uid, f"{version}/{level_tag(level)}", digest)

        todo = []
        for uid, art, version, served in units:
            # a cached code is sent at once: the largest level that fits the whole target, or a smaller one
            # cached by a request whose prefill left less of it
            best, servable = self._level(art, served, len(prefix_ids), 0.0), art.servable_levels
            levels = servable[:servable.index(best) + 1][::-1]
            keys = [key(uid, version, lv) for lv in levels]
            hit = self.cache.first(keys)
            if hit is None:
                todo.append((uid, art, version, served))
                continue
            for p in served:
                res.per_pair[p] = Encoded(hit[1], version, cache_hit=True, level=levels[keys.index(hit[0])], family=fid)
        if not todo:
            return res
        ids = id_row(prefix_ids, self.device)
        t0 = time.perf_counter()
        trace = capture(self.model, ids, torch.ones_like(ids),   # residual streams when a plan enters from one
                        want_hidden=any(art.needs_hidden for _, art, _, _ in todo))
        t1 = time.perf_counter()
        self.prefills += 1
        for uid, art, version, served in todo:
            level = self._level(art, served, len(prefix_ids), (time.perf_counter() - t0) * 1e3)
            codes = encode(art, trace, ids if self.device_payloads else ids.cpu(), level)
            dims = codec.artifact_dims(art, level)
            if self.e_first and fid is None and e_first.part_plans(art.payload_plan) is not None:
                payload = e_first.encode_parts(codes, uid, version, dims, art.code_dtype, wire=self.device_payloads)
            elif self.device_payloads:
                payload = codec.encode_wire(codes, uid, version, dims, art.code_dtype)
            else:
                payload = codec.encode(codes, uid, version, dims, art.code_dtype)
            self.cache.put(key(uid, version, level), payload)
            for p in served:
                res.per_pair[p] = Encoded(payload, version, level=level, family=fid)
        res.prefilled, res.prefill_ms, res.encode_ms = True, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        return res

    def stats(self) -> dict:
        s = self.cache.stats
        return {"prefills": self.prefills, "cache_hits": s.hits, "cache_misses": s.misses,
                "cache_bytes": s.bytes, "cache_entries": s.entries, "pairs": sorted(self.artifacts),
                "families": sorted(self.families)}
