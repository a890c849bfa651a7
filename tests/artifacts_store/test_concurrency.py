"""Concurrent publishers of one pair, with a reader listing and verifying all the while."""
from __future__ import annotations

import threading

from artifacts_store import ArtifactStore
from tests.artifacts_store.conftest import publish, tiny_artifacts

PUBLISHERS, EACH = 4, 3


def run_concurrently(store: ArtifactStore, publishers: int = PUBLISHERS, each: int = EACH) -> None:
    """Reads overlap writes by construction: each publisher publishes once, then waits until the reader has
    listed and verified a version before it publishes the rest, so the reader's pass that lets them go ran
    while (publishers x (each - 1)) versions were still to come."""
    start, done, read_one = threading.Barrier(publishers + 1), threading.Event(), threading.Event()
    published, errors, seen, passes = [], [], set(), []

    def publisher(i):
        start.wait()
        try:
            for j in range(each):
                published.append(publish(store, tiny_artifacts(seed=10 * i + j),
                                          extra_files={"report/summary.md": f"publisher {i} #{j}".encode()}))
                if j == 0 and not read_one.wait(60):
                    errors.append(f"publisher {i}: the reader listed no version within 60 s")
                    return
        except Exception as e:          # noqa: BLE001 - reported below with the thread's identity
            errors.append(f"publisher {i}: {e!r}")

    def reader():
        start.wait()
        while not done.is_set():
            try:
                rows = store.list("base:qa")
                for row in rows:
                    result = store.verify(row.ref)      # a listed version is complete, never half-written
                    if not result.ok:
                        errors.append(f"reader saw a partial version: {result}")
                    seen.add(row.version)
                passes.append(len(rows))
                if rows:
                    read_one.set()
            except Exception as e:      # noqa: BLE001
                errors.append(f"reader: {e!r}")

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(publishers)]
    r = threading.Thread(target=reader)
    for t in [*threads, r]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    done.set()
    r.join(timeout=60)
    assert not errors, "\n".join(errors)

    versions = sorted(m.version for m in published)
    assert len(versions) == len(set(versions)) == publishers * each
    rows = store.list("base:qa")
    assert [row.version for row in rows] == versions
    assert all(store.verify(row.ref).ok for row in rows)
    assert rows[-1].latest and store.resolve("base:qa@latest").version == versions[-1]
    total = publishers * each
    partial = [n for n in passes if 0 < n < total]
    assert partial, f"no listing was taken while versions were still being published: {passes}"
    assert seen <= set(versions), (seen, versions)
    for m in published:
        art, m2 = store.load(f"base:qa@{m.version}")
        assert m2 == m


def test_concurrent_publishers_local(store):
    run_concurrently(store)
