"""Leases ("holder H serves version V of this pair until T", one small JSON file per (pair, holder)) and what
gc reports about the versions it kept because of them or of pins.

Layout:  <producer>__<consumer>/leases/<holder>.json     {"version": ..., "holder": ..., "expires": ISO-8601 UTC}
         <producer>__<consumer>/leases/.tmp-<id>          a lease write in progress

A lease file is written under a temporary name and moved into place, so a reader sees the old record or the
new one, never half of one. "leases" is not a version id and is never a pair directory's name, so the
version listing, gc's sweep of incomplete versions and the pair listing all pass over it.
Expiry compares the writer's clock with the reader's: hosts need clocks within a small fraction of the TTL.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from artifacts_store.fsio import Storage
from artifacts_store.refs import Ref, check_holder, check_version_id, is_version_id, new_version_id, version_time

LEASES, SUFFIX, TMP = "leases", ".json", ".tmp-"


@dataclass(frozen=True, slots=True)
class Lease:
    pair: str                   # producer:consumer
    version: str                # full version id
    holder: str
    expires: datetime           # UTC

    @property
    def ref(self) -> str:
        return f"{self.pair}@{self.version}"

    def live(self, now: datetime | None = None) -> bool:
        return self.expires > (now or datetime.now(timezone.utc))

    def __str__(self) -> str:
        return f"{self.ref}: leased by {self.holder} until {self.expires:%Y-%m-%dT%H:%M:%SZ}"


@dataclass(frozen=True, slots=True)
class Kept:
    """A version gc kept only because of a pin or a lease (the newest `keep` and LATEST are not listed)."""
    ref: str
    why: str                    # "pinned" | "leased"
    by: str                     # the pinning reference, or the lease holder
    until: datetime | None = None       # lease expiry

    @property
    def version(self) -> str:
        return self.ref.partition("@")[2]

    def __str__(self) -> str:
        if self.why == "leased":
            return f"{self.ref}: leased by {self.by} until {self.until:%Y-%m-%dT%H:%M:%SZ}"
        return f"{self.ref}: pinned by {self.by}"


@dataclass(slots=True)
class GcReport:
    removed_versions: list[str] = field(default_factory=list)     # refs of complete versions removed
    removed_incomplete: list[str] = field(default_factory=list)   # stale version dirs without a manifest
    removed_temp: list[str] = field(default_factory=list)         # stale .tmp-* dirs and lease temp files
    removed_leases: list[str] = field(default_factory=list)       # expired or unreadable lease files
    kept: list[Kept] = field(default_factory=list)                # kept because pinned or leased
    notes: list[str] = field(default_factory=list)                # e.g. pins that resolve to no version


def _path(pair: Ref, name: str) -> str:
    return f"{pair.pair_dir}/{LEASES}/{name}"


def write(storage: Storage, pair: Ref, version: str, holder: str, ttl_s: float) -> Lease:
    """Record (or renew, or move to another version) `holder`'s one lease on `pair`: one small file."""
    if not ttl_s > 0:
        raise ValueError(f"lease ttl_s must be > 0 seconds, got {ttl_s}")
    lease = Lease(pair.pair, check_version_id(version), check_holder(holder),
                  datetime.now(timezone.utc) + timedelta(seconds=ttl_s))
    body = json.dumps({"version": lease.version, "holder": lease.holder, "expires": lease.expires.isoformat()})
    tmp = _path(pair, TMP + new_version_id())
    try:
        storage.write(tmp, body.encode())
        storage.move(tmp, _path(pair, holder + SUFFIX))     # readers never see a half-written record
    finally:
        storage.delete_file(tmp)                            # gone after a move; left over only on failure
    return lease


def remove(storage: Storage, pair: Ref, holder: str) -> None:
    storage.delete_file(_path(pair, check_holder(holder) + SUFFIX))


def read(storage: Storage, pair: Ref, name: str) -> Lease | None:
    """The lease stored as `name` (a file directly under the leases dir), or None when missing or unreadable.
    Other storage errors propagate: a lease that cannot be read now must not count as expired."""
    holder = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    try:
        data = storage.read(_path(pair, check_holder(holder) + SUFFIX))
    except FileNotFoundError:                               # released (or swept) since it was listed
        return None
    try:
        rec = json.loads(data)
        expires = datetime.fromisoformat(rec["expires"])
        if rec["holder"] != holder or not is_version_id(rec["version"]) or expires.tzinfo is None:
            return None
        return Lease(pair.pair, rec["version"], holder, expires.astimezone(timezone.utc))
    except (ValueError, KeyError, TypeError):               # bad JSON or fields, a foreign file
        return None


def scan(storage: Storage, pair: Ref) -> tuple[list[Lease], list[str], list[str]]:
    """(live leases sorted by version then holder, names of expired or unreadable lease files, names of temp
    files) directly under the pair's leases dir. Other names are not ours and are left alone."""
    now, live, stale, temps = datetime.now(timezone.utc), [], [], []
    for name in storage.files(f"{pair.pair_dir}/{LEASES}"):
        if "/" in name:
            continue
        if name.startswith(TMP):
            temps.append(name)
        elif name.endswith(SUFFIX) and _is_holder(name[:-len(SUFFIX)]):
            lease = read(storage, pair, name)
            if lease is not None and lease.live(now):
                live.append(lease)
            else:
                stale.append(name)
    return sorted(live, key=lambda l: (l.version, l.holder)), stale, temps


def sweep(storage: Storage, pair: Ref, cutoff: datetime) -> tuple[list[str], list[str]]:
    """Remove expired and unreadable lease files, and temp files older than `cutoff`; returns (removed lease
    files, removed temp files) as `pair/leases/<name>`. Each lease file is read again just before removal, so
    a holder renewing meanwhile keeps its fresh record (the window left is one read to one delete)."""
    _, stale, temps = scan(storage, pair)
    removed, removed_tmp = [], []
    for name in stale:
        lease = read(storage, pair, name)
        if lease is None or not lease.live():
            storage.delete_file(_path(pair, name))
            removed.append(f"{pair.pair}/{LEASES}/{name}")
    for name in temps:
        stamp = name[len(TMP):]
        if is_version_id(stamp) and version_time(stamp) < cutoff:
            storage.delete_file(_path(pair, name))
            removed_tmp.append(f"{pair.pair}/{LEASES}/{name}")
    return removed, removed_tmp


def _is_holder(text: str) -> bool:
    try:
        check_holder(text)
    except ValueError:
        return False
    return True
