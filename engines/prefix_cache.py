"""LRU cache keyed by prefix token ids, bounded in bytes: the producer's encoded payloads (keyed by prefix, pair
and artifact version), and a specialist's own K and V of the prefixes of its exact requests."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def prefix_digest(token_ids: list[int]) -> str:
    """A prefix's identity: its length and the SHA-256 of its ids as 64-bit integers."""
    return f"{len(token_ids)}:{hashlib.sha256(array('q', token_ids).tobytes()).hexdigest()}"


def prefix_key(token_ids: list[int], pair: str, version: str, digest: str | None = None) -> str:
    """The cache key of a prefix for a pair at a version. `digest`: prefix_digest(token_ids), where the caller
    has it already (one prefix, several keys)."""
    return f"{pair}@{version}:{digest or prefix_digest(token_ids)}"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class PrefixCodeCache:
    """`size(item)` is what an item counts against the budget (a payload's length; a cache's tensor bytes)."""

    def __init__(self, budget_bytes: int, size=len):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget, self.size = budget_bytes, size
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.stats = CacheStats()

    def get(self, key: str) -> bytes | None:
        hit = self.first([key])
        return hit[1] if hit else None

    def first(self, keys: list[str]) -> tuple[str, bytes] | None:
        """(key, payload) of the first of `keys` held (counted as one hit), or None (one miss)."""
        for key in keys:
            payload = self._items.get(key)
            if payload is not None:
                self._items.move_to_end(key)
                self.stats.hits += 1
                return key, payload
        self.stats.misses += 1
        return None

    def put(self, key: str, payload) -> None:
        """Insert (most recent); evict least recent entries until within budget. Oversized payloads are not kept."""
        n = self.size(payload)
        if n > self.budget:
            return
        if key in self._items:
            del self._items[key]
            self.stats.bytes -= self._sizes.pop(key)
        self._items[key], self._sizes[key] = payload, n
        self.stats.bytes += n
        while self.stats.bytes > self.budget:
            old, _ = self._items.popitem(last=False)
            self.stats.bytes -= self._sizes.pop(old)
            self.stats.evictions += 1
        self.stats.entries = len(self._items)
