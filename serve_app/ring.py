"""Which producer owns a prefix: consistent hashing with bounded loads.

Each producer keeps a cache of the prefixes it encoded, keyed by the whole prefix (engines/prefix_cache.py), so a
request should reach the producer that saw its prefix before. A hash ring gives every prefix an owner that
stays put as producers come and go: adding or removing one moves only the prefixes it gains or loses (with
VNODES points per producer each owns close to 1/N of the ring). Bounded loads (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018; HAProxy's hash-balance-factor) keep one hot
prefix from pinning its owner while the others idle: a producer already holding more than `factor` times the
average of the requests in flight (counting this one), plus a slack, is passed over for the next one on the
ring, so no producer ever holds more than ceil(factor * average) + slack. The slack (default 2) keeps a handful
of requests from spilling: a cached prefix sent elsewhere costs a whole prefill there.

Compared with the routers that match token prefixes (Ray Serve LLM's PrefixCacheAffinityRouter, SGLang's and
vLLM's cache-aware routers, which keep a radix tree per replica and switch to least-loaded past an imbalance
threshold): the producer's cache hits on the whole prefix only, so the longest-match tree has nothing more to
find, and a ring needs no per-request state shared between router replicas: every router computes the same
owner from the same membership.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from array import array

VNODES = 64                 # points per producer on the ring: each owns 1/N of it within a few percent


def _point(text: str | bytes) -> int:
    data = text.encode() if isinstance(text, str) else text
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_hash(token_ids: list[int]) -> int:
    """A prefix's place on the ring (from its token ids: the same text tokenizes the same everywhere)."""
    return _point(array("q", token_ids).tobytes())


class HashRing:
    def __init__(self, members: list[str] | tuple[str, ...] = (), vnodes: int = VNODES):
        self.vnodes = vnodes
        self.members: tuple[str, ...] = ()
        self.points: list[int] = []
        self.owners: list[str] = []
        self.set(members)

    def set(self, members) -> None:
        """The ring of exactly these members (their points do not depend on who else is on it)."""
        self.members = tuple(sorted(set(members)))
        ring = sorted((_point(f"{m}#{i}"), m) for m in self.members for i in range(self.vnodes))
        self.points, self.owners = [p for p, _ in ring], [m for _, m in ring]

    def walk(self, key: int) -> list[str]:
        """Every member once, in ring order from `key`'s position: its owner first, then where its prefixes go
        when the owner is down or full."""
        if not self.points:
            return []
        start, seen, order = bisect.bisect(self.points, key), set(), []
        for i in range(len(self.points)):
            m = self.owners[(start + i) % len(self.points)]
            if m not in seen:
                seen.add(m)
                order.append(m)
                if len(order) == len(self.members):
                    break
        return order

    def choose(self, key: int, load: dict[str, int], factor: float, skip=frozenset(), slack: int = 0) -> list[str]:
        """Members to ask for `key`, in order: the first on the ring (past those in `skip`, e.g. down) whose
        load is under the bound, then the rest of the live ones in ring order (where a failed call goes next).
        The bound is ceil(factor * (requests in flight + this one) / live members) + slack, so one is always
        under it. `slack` keeps small numbers from spilling: passing a cached prefix over costs a prefill."""
        order = [m for m in self.walk(key) if m not in skip]
        if not order:
            return []
        cap = math.ceil(factor * (sum(load.get(m, 0) for m in order) + 1) / len(order)) + slack
        first = next(m for m in order if load.get(m, 0) < cap)
        return [first] + [m for m in order if m != first]

    def shares(self) -> dict[str, float]:
        """The fraction of the ring (of all prefixes, hashed evenly) each member owns."""
        out = dict.fromkeys(self.members, 0.0)
        n = len(self.points)
        for i, m in enumerate(self.owners):
            out[m] += ((self.points[i] - self.points[i - 1]) % (1 << 64) if n > 1 else 1 << 64) / (1 << 64)
        return out
