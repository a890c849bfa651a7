"""Leases and pins: what gc must keep while versions are served, and that lease files disturb nothing else."""
from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from artifacts_store import (ArtifactNotFound, ArtifactStore, InvalidReference, Kept, StorageUnavailable,
                             new_version_id)
from artifacts_store import leases as ls
from tests.artifacts_store.conftest import publish, tiny_artifacts


@pytest.fixture
def three(store):
    return [publish(store, tiny_artifacts(seed=i)).version for i in range(3)]


def _lease_dir(tmp_path):
    return tmp_path / "store" / "base__qa" / "leases"


def test_lease_resolves_renews_moves_and_releases(store, three, tmp_path):
    r = store.lease("base:qa@latest", "producer-ab12", ttl_s=60)
    assert (r.pair, r.version) == ("base:qa", three[-1])
    rec = json.loads((_lease_dir(tmp_path) / "producer-ab12.json").read_text())
    assert rec.keys() == {"version", "holder", "expires"} and rec["version"] == three[-1]
    [lease] = store.leases("base:qa")
    assert (lease.ref, lease.holder) == (f"base:qa@{three[-1]}", "producer-ab12")
    assert timedelta(seconds=55) < lease.expires - datetime.now(timezone.utc) <= timedelta(seconds=60)

    time.sleep(0.01)
    store.lease("base:qa@latest", "producer-ab12", ttl_s=60)                  # renew: same file, later expiry
    assert store.leases("base:qa")[0].expires > lease.expires
    store.lease("base:qa@1", "producer-ab12")                                 # switch version: one lease moves
    store.lease(f"base:qa@{three[1]}", "qa#2")
    assert [(l.version, l.holder) for l in store.leases("base:qa")] == [(three[0], "producer-ab12"),
                                                                        (three[1], "qa#2")]
    assert sorted(p.name for p in _lease_dir(tmp_path).iterdir()) == ["producer-ab12.json", "qa#2.json"]
    store.release("base:qa@latest", "producer-ab12")                          # a version in the ref is ignored
    store.release("base:qa", "never-leased")
    assert [l.holder for l in store.leases()] == ["qa#2"]


@pytest.mark.parametrize("holder", ["", "../x", "a/b", ".hidden", "a..b", "sp ace", "x" * 129, "back\\slash", None])
def test_bad_holders_are_refused_before_any_write(store, three, tmp_path, holder):
    with pytest.raises(InvalidReference, match="lease holder"):
        store.lease("base:qa", holder)
    with pytest.raises(InvalidReference):
        store.release("base:qa", holder)
    assert not _lease_dir(tmp_path).exists()


def test_lease_refuses_a_missing_version_and_a_bad_ttl(store, three):
    with pytest.raises(ArtifactNotFound):
        store.lease(f"base:qa@{new_version_id()}", "qa#1")
    with pytest.raises(ArtifactNotFound):
        store.lease("base:code@latest", "qa#1")
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        store.lease("base:qa", "qa#1", ttl_s=0)
    assert store.leases("base:qa") == []


def test_a_version_removed_while_leasing_is_reported_and_latest_is_resolved_again(store, three, tmp_path, monkeypatch):
    write = ls.write
    gone = []

    def write_then_gc_removes(storage, pair, version, holder, ttl_s):   # the race: gc deletes right after the write
        out = write(storage, pair, version, holder, ttl_s)
        if not gone:
            gone.append(version)
            (tmp_path / "store" / "base__qa" / version / "manifest.json").unlink()
        return out

    monkeypatch.setattr(ls, "write", write_then_gc_removes)
    with pytest.raises(ArtifactNotFound, match="was removed"):
        store.lease(f"base:qa@{three[0]}", "qa#1")
    assert store.leases("base:qa") == []                                # no lease left on a vanished version
    gone.clear()
    (tmp_path / "store" / "base__qa" / "LATEST").write_text(three[1])  # latest names three[1]; it vanishes
    r = store.lease("base:qa@latest", "qa#1")
    assert gone == [three[1]] and r.version == three[2]


def test_lease_files_disturb_no_listing_resolve_verify_load_or_gc(store, three, tmp_path):
    store.lease("base:qa@2", "qa#1")
    d = _lease_dir(tmp_path)
    (d / "junk.json").write_text("{not json")                          # unreadable
    (d / "README").write_text("not ours")                              # foreign: left alone
    lonely = tmp_path / "store" / "base__code" / "leases"              # a pair with leases and no versions
    lonely.mkdir(parents=True)
    (lonely / "qa#1.json").write_text("{}")
    assert [r.version for r in store.list("base:qa")] == three and len(store.list()) == 3
    assert store.resolve("base:qa").version == three[-1] and store.resolve("base:qa@3").version == three[-1]
    assert all(store.verify(f"base:qa@{v}").ok for v in three)
    assert store.load("base:qa@2")[1].version == three[1]
    with pytest.raises(ArtifactNotFound):
        store.resolve("base:code")
    report = store.gc(keep=5, grace=timedelta(0))
    assert (report.removed_versions, report.removed_incomplete, report.removed_temp) == ([], [], [])
    assert report.removed_leases == ["base:code/leases/qa#1.json", "base:qa/leases/junk.json"]
    assert sorted(p.name for p in d.iterdir()) == ["README", "qa#1.json"]
    assert [l.holder for l in store.leases()] == ["qa#1"]


def test_expired_leases_do_not_protect_and_gc_removes_them_and_stale_temp_files(store, three, tmp_path):
    store.lease("base:qa@1", "old-holder", ttl_s=0.05)
    d = _lease_dir(tmp_path)
    stale_tmp, fresh_tmp = ".tmp-" + new_version_id(datetime.now(timezone.utc) - timedelta(hours=2)), \
        ".tmp-" + new_version_id()
    (d / stale_tmp).write_text("half")
    (d / fresh_tmp).write_text("in progress")
    time.sleep(0.1)
    assert store.leases("base:qa") == []
    report = store.gc(keep=0)
    assert report.removed_versions == [f"base:qa@{v}" for v in three[:2]] and report.kept == []
    assert report.removed_leases == ["base:qa/leases/old-holder.json"]
    assert report.removed_temp == [f"base:qa/leases/{stale_tmp}"]
    assert sorted(p.name for p in d.iterdir()) == [fresh_tmp]


def test_gc_keeps_pinned_leased_newest_and_latest(store, tmp_path):
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(6)]
    store.lease(f"base:qa@{v[0]}", "producer-ab12")
    store.lease(f"base:qa@{v[1]}", "qa#1")
    store.lease(f"base:qa@{v[1]}", "qa#2")
    store.lease(f"base:qa@{v[5]}", "qa#3")                             # latest anyway: not reported as kept
    pins = [f"base:qa@{v[2]}", f"base:qa@{new_version_id()}", "base:nope@latest", "bad ref"]
    report = store.gc(keep=0, protect=pins)
    assert report.removed_versions == [f"base:qa@{v[3]}", f"base:qa@{v[4]}"]
    assert [r.version for r in store.list("base:qa")] == [v[0], v[1], v[2], v[5]]
    assert [(k.version, k.why, k.by) for k in report.kept] == [
        (v[2], "pinned", pins[0]), (v[0], "leased", "producer-ab12"), (v[1], "leased", "qa#1"),
        (v[1], "leased", "qa#2")]
    assert str(report.kept[0]) == f"base:qa@{v[2]}: pinned by {pins[0]}"
    assert str(report.kept[1]).startswith(f"base:qa@{v[0]}: leased by producer-ab12 until 20")
    assert len(report.notes) == 3 and all(n.startswith("pin ") and "ignored" in n for n in report.notes)
    assert report.kept[1].until == store.leases("base:qa")[0].expires

    store.release("base:qa", "qa#1")
    assert store.gc(keep=0, protect=pins).removed_versions == []           # qa#2 still holds v[1]
    store.release("base:qa", "qa#2")
    report = store.gc(keep=1, protect=pins)
    assert report.removed_versions == [f"base:qa@{v[1]}"]
    assert [k.version for k in report.kept] == [v[2], v[0]]
    assert [r.version for r in store.list("base:qa")] == [v[0], v[2], v[5]]


def test_gc_keep_larger_than_the_number_of_versions_removes_none(store, three):
    assert store.gc(keep=5).removed_versions == [] and store.gc(keep=3).removed_versions == []
    assert store.gc(keep=2).removed_versions == [f"base:qa@{three[0]}"]


def test_gc_keep_counts_before_pins_and_pair_filter_ignores_other_pins(store):
    qa = [publish(store, tiny_artifacts(seed=i)).version for i in range(3)]
    code = [publish(store, tiny_artifacts(seed=i, pair="base:code")).version for i in range(2)]
    report = store.gc(keep=2, pair="base:qa", protect=[f"base:qa@{qa[1]}", f"base:code@{code[0]}"])
    assert report.removed_versions == [f"base:qa@{qa[0]}"] and report.kept == []     # qa[1] is within keep=2
    assert len(store.list("base:code")) == 2


def test_gc_never_removes_a_version_renewed_by_holders_meanwhile(store):
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(5)]
    held = {f"h{i}": v[i] for i in range(3)}
    for h, ver in held.items():
        store.lease(f"base:qa@{ver}", h, ttl_s=5)
    stop, errors, renewals, gcs = threading.Event(), [], {h: 0 for h in held}, 0

    def renew(holder, version):
        while not stop.is_set():
            try:
                store.lease(f"base:qa@{version}", holder, ttl_s=5)
                renewals[holder] += 1
            except Exception as e:      # noqa: BLE001 - reported below
                errors.append(f"{holder}: {e!r}")

    threads = [threading.Thread(target=renew, args=item) for item in held.items()]
    for t in threads:
        t.start()
    try:
        while gcs < 20 or min(renewals.values()) < 20:                  # gc runs while every holder renews
            store.gc(keep=0)
            gcs += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    assert [r.version for r in store.list("base:qa")] == [v[0], v[1], v[2], v[4]]


def test_storage_failures_arrive_as_storage_unavailable(store, three, monkeypatch):
    def broken(*a, **k):
        raise OSError("connection reset by peer")

    monkeypatch.setattr(type(store.storage), "read", broken)
    with pytest.raises(StorageUnavailable, match="load failed: OSError: connection reset by peer"):
        store.load(f"base:qa@{three[0]}")
    store.lease(f"base:qa@{three[0]}", "qa#1")                          # writes need no read
    with pytest.raises(StorageUnavailable, match="gc failed"):        # an unreadable lease is no expired lease
        store.gc(keep=0)
    monkeypatch.undo()
    assert [r.version for r in store.list("base:qa")] == three
    with pytest.raises(StorageUnavailable, match="nosuchscheme://bucket/x: opening the store failed"):
        ArtifactStore("nosuchscheme://bucket/x")


def test_kept_is_exported_with_its_fields():
    k = Kept("base:qa@v1", "pinned", "config")
    assert (k.version, str(k)) == ("v1", "base:qa@v1: pinned by config")
