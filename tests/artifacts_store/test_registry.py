"""The registry's cache: a bounded LRU of resolved versions, and every failure as an ArtifactStoreError.
ArtifactCache runs without Ray (put = identity); one test drives the real actor through ray.get."""
from __future__ import annotations

import pytest
import torch

from actors.registry import ArtifactCache
from artifacts_store import (ArtifactNotFound, ArtifactStore, ArtifactStoreError, ChecksumMismatch, Manifest,
                             StorageUnavailable)
from tests.artifacts_store.conftest import publish, tiny_artifacts


def _cache(tmp_path, max_entries=2) -> ArtifactCache:
    return ArtifactCache(str(tmp_path / "store"), max_entries, put=lambda value: value)


def test_lru_holds_at_most_max_entries_and_drops_the_blob_with_the_entry(store, tmp_path):
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(3)]
    cache = _cache(tmp_path)
    refs = [f"base:qa@{x}" for x in v]
    manifest_json, [blob] = cache.get(refs[0])
    assert Manifest.model_validate_json(manifest_json).version == v[0] and isinstance(blob[1], bytes)
    cache.get(refs[1])
    assert cache.get("base:qa@1") == (manifest_json, [blob])          # a hit, through an index: no store read
    cache.get(refs[2])                                                 # evicts refs[1], the least recently used
    assert cache.stats() == {"store_reads": 3, "evictions": 1, "max_entries": 2, "cached": [refs[0], refs[2]]}
    cache.get(refs[1])                                                 # read again; now refs[0] goes
    s = cache.stats()
    assert (s["store_reads"], s["evictions"], s["cached"]) == (4, 2, [refs[2], refs[1]])
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        ArtifactCache(str(tmp_path / "store"), 0)


def test_resolve_names_the_version_latest_is_without_reading_tensors(store, tmp_path):
    m1 = publish(store)
    cache = _cache(tmp_path)
    assert cache.resolve("base:qa@latest") == cache.resolve("base:qa") == f"base:qa@{m1.version}"
    m2 = publish(store, tiny_artifacts(seed=1))
    assert cache.resolve("base:qa@latest") == f"base:qa@{m2.version}"
    assert cache.stats()["store_reads"] == 0
    assert Manifest.model_validate_json(cache.get("base:qa@latest")[0]).version == m2.version


def test_store_failures_reach_the_caller_as_store_errors(store, tmp_path, monkeypatch):
    m = publish(store)
    cache = _cache(tmp_path)
    with pytest.raises(ArtifactNotFound):
        cache.get("base:code@latest")

    def reset(*a, **k):
        raise OSError("connection reset by peer")

    with monkeypatch.context() as mp:                                  # an outage below the store
        mp.setattr(type(store.storage), "read", reset)
        with pytest.raises(StorageUnavailable, match="connection reset by peer"):
            cache.get("base:qa")
    with monkeypatch.context() as mp:                                  # an OSError the store did not translate
        mp.setattr(ArtifactStore, "load_any", reset)         # the registry's read
        with pytest.raises(StorageUnavailable, match=f"reading base:qa@{m.version} from .*connection reset"):
            cache.get("base:qa")
    with monkeypatch.context() as mp:                                  # anything else: still a store error
        mp.setattr(ArtifactStore, "load_any", lambda *a, **k: 1 / 0)
        with pytest.raises(ArtifactStoreError, match="ZeroDivisionError"):
            cache.get("base:qa")
    assert cache.stats()["cached"] == [] and cache.stats()["store_reads"] == 0

    path = tmp_path / "store" / "base__qa" / m.version / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="tensors.safetensors: bad"):
        cache.get("base:qa")
    publish(store, tiny_artifacts(seed=1))
    assert cache.get("base:qa")[0] and cache.stats()["store_reads"] == 1     # the cache still works


def test_an_unreachable_store_is_opened_again_on_the_next_call(store, tmp_path):
    m = publish(store)
    opened = []

    def flaky(uri):
        opened.append(uri)
        if len(opened) == 1:
            return ArtifactStore("nosuchscheme://bucket")
        return ArtifactStore(uri)

    cache = ArtifactCache(str(tmp_path / "store"), 2, put=lambda value: value, open_store=flaky)
    with pytest.raises(StorageUnavailable, match="opening the store failed"):
        cache.resolve("base:qa")
    assert cache.resolve("base:qa") == f"base:qa@{m.version}" and len(opened) == 2


def test_the_actor_survives_store_failures_and_reports_them_as_store_errors(ray_cluster, store, tmp_path):
    import ray

    from actors.registry import ArtifactRegistry, fetch
    v = [publish(store, tiny_artifacts(seed=i)).version for i in range(2)]
    broken = ArtifactRegistry.remote("nosuchscheme://bucket/x")        # the old actor died opening this
    good = ArtifactRegistry.remote(str(tmp_path / "store"), 1)
    try:
        with pytest.raises(StorageUnavailable, match="Unrecognized filesystem"):
            fetch(broken, "base:qa@latest")
        with pytest.raises(StorageUnavailable):
            ray.get(broken.resolve.remote("base:qa"))
        assert ray.get(broken.stats.remote())["store_reads"] == 0     # still alive
        with pytest.raises(ArtifactNotFound):
            fetch(good, "base:code@latest")
        assert fetch(good, "base:qa@1")[1].version == v[0]
        assert ray.get(good.resolve.remote("base:qa@latest")) == f"base:qa@{v[1]}"
        assert fetch(good, "base:qa@latest")[1].version == v[1]
        s = ray.get(good.stats.remote())
        assert (s["cached"], s["evictions"], s["store_reads"]) == ([f"base:qa@{v[1]}"], 1, 2)
    finally:
        ray.kill(broken)
        ray.kill(good)


def test_a_family_travels_through_the_registry_and_each_replica_checks_its_own_member(ray_cluster, store, tmp_path):
    import ray

    from actors.registry import ArtifactRegistry, fetch, fetch_family
    from artifacts_store import FingerprintMismatch, InvalidReference
    from tests.artifacts_store.conftest import CALIB, tiny_family
    fam, prints = tiny_family()
    store.publish_family(fam, prints, CALIB)
    publish(store)
    reg = ArtifactRegistry.remote(str(tmp_path / "store"))
    try:
        qa = prints["base:qa"]
        got, m = fetch_family(reg, "base:fam@latest", qa.model_copy(update={"producer": None}), member="qa")
        assert m.kind == "family" and list(got.members) == list(fam.members)
        assert all(torch.equal(got.members[n].reuse_v[1].dec, a.reuse_v[1].dec) for n, a in fam.members.items())
        with pytest.raises(FingerprintMismatch, match="consumer weights digest"):
            fetch_family(reg, "base:fam", qa, member="prose")
        with pytest.raises(ArtifactNotFound, match="no member 'code'"):
            fetch_family(reg, "base:fam", member="code")
        with pytest.raises(InvalidReference, match="is a family artifact, not a pair"):
            fetch(reg, "base:fam")
        with pytest.raises(InvalidReference, match="is a pair artifact, not a family"):
            fetch_family(reg, "base:qa")
        assert ray.get(reg.stats.remote())["store_reads"] == 2          # read once each, then from the cache
    finally:
        ray.kill(reg)
