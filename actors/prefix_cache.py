"""LRU cache of encoded payloads keyed by (prefix token ids, pair, artifact version), bounded in bytes."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def prefix_key(token_ids: list[int], pair: str, version: str) -> str:
    h = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()
    return f"{pair}@{version}:{len(token_ids)}:{h}"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class PrefixCodeCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget = budget_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
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

    def put(self, key: str, payload: bytes) -> None:
        """Insert (most recent); evict least recent entries until within budget. Oversized payloads are not kept."""
        if len(payload) > self.budget:
            return
        if key in self._items:
            self.stats.bytes -= len(self._items.pop(key))
        self._items[key] = payload
        self.stats.bytes += len(payload)
        while self.stats.bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self.stats.bytes -= len(old)
            self.stats.evictions += 1
        self.stats.entries = len(self._items)
