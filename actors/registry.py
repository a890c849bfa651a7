"""ArtifactRegistry: reads each artifact version from the store once and shares it through the object store.

Many specialist replicas on a node then fetch the same object-store copy instead of each reading (and
verifying) the store. What travels is safetensors bytes plus JSON, never pickled Python objects.
The actor is a shim over `ArtifactCache`, which holds the logic and is tested without Ray. The module imports
no torch: the tensors are read (and the store opened) inside the calls, so processes that only name the
registry or start it stay light.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from actors.messages import FallbackReason
from artifacts_store.errors import ArtifactNotFound, ArtifactStoreError, StorageUnavailable
from artifacts_store.fingerprints import Fingerprints, check
from artifacts_store.manifest import Manifest

if TYPE_CHECKING:
    from artifacts_store.store import ArtifactStore
    from scd.online.artifacts import PairArtifacts
    from scd.online.family_artifacts import FamilyArtifacts

REGISTRY_NAME = "scd-artifact-registry"
MAX_ENTRIES = 8


def _open_store(uri: str) -> ArtifactStore:
    from artifacts_store.store import ArtifactStore
    return ArtifactStore(uri)


class ArtifactCache:
    """The registry's state: an LRU of at most `max_entries` resolved versions ("pair@version" -> (manifest
    JSON, [object ref of the blob])). Evicting an entry drops the registry's reference to its blob, so Ray
    frees it once no caller holds it either. Not thread-safe (the actor runs one call at a time).

    Every failure reaches the caller as an ArtifactStoreError subclass: the store's own (ArtifactNotFound,
    ChecksumMismatch, FingerprintMismatch, ManifestError, StorageUnavailable for filesystem errors), and
    anything else raised while reading becomes ArtifactStoreError naming the ref and the store. The store is
    opened (`open_store(uri)`) on first use, and again after a failed open, so an unreachable store never kills
    the actor."""

    def __init__(self, store_uri: str, max_entries: int = MAX_ENTRIES, put: Callable = ray.put,
                 open_store: Callable[[str], ArtifactStore] | None = None):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.store_uri, self.max_entries, self.put = store_uri, max_entries, put
        self.open_store = open_store or _open_store
        self._store: ArtifactStore | None = None
        self.entries: OrderedDict[str, tuple[str, list]] = OrderedDict()
        self.store_reads = self.evictions = 0

    def _call(self, what: str, ref: str, fn: Callable):
        try:
            if self._store is None:
                self._store = self.open_store(self.store_uri)
            return fn(self._store)
        except ArtifactStoreError:
            raise
        except OSError as e:                # the store translates these; a path that escaped it still counts
            raise StorageUnavailable(f"{what} {ref} from {self.store_uri}: {type(e).__name__}: {e}") from e
        except Exception as e:              # noqa: BLE001 - a replica must get a store error, never a crash
            raise ArtifactStoreError(f"{what} {ref} from {self.store_uri} failed: {type(e).__name__}: {e}") from e

    def resolve(self, ref: str) -> str:
        """The full reference ("base:qa@v...") that `ref` names now: which version `latest` is, without tensors."""
        return str(self._call("resolving", ref, lambda s: s.resolve(ref)))

    def get(self, ref: str) -> tuple[str, list]:
        """(manifest JSON, [ObjectRef of (artifact.json text, safetensors bytes)]) for a ref; `latest` and
        indexes resolve to the full version first, so a new version is picked up when it is published."""
        key = self.resolve(ref)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]

        def read(store: ArtifactStore) -> tuple[str, list]:
            from safetensors.torch import save as st_save
            art, manifest = store.load_any(key)                     # checksums verified here, once
            blob = self.put((json.dumps(art.description()), st_save(art.tensors())))
            return manifest.model_dump_json(), [blob]               # a list: callers get the ref, not the value

        entry = self._call("reading", key, read)
        self.store_reads += 1
        self.entries[key] = entry
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)                        # least recently used
            self.evictions += 1
        return entry

    def stats(self) -> dict:
        return {"store_reads": self.store_reads, "evictions": self.evictions, "max_entries": self.max_entries,
                "cached": list(self.entries)}


@ray.remote(num_cpus=0)
class ArtifactRegistry:
    """Ray shim over ArtifactCache: `get`, `resolve` and `stats` as above."""

    def __init__(self, store_uri: str, max_entries: int = MAX_ENTRIES):
        self.cache = ArtifactCache(store_uri, max_entries)

    def get(self, ref: str) -> tuple[str, list]:
        return self.cache.get(ref)

    def resolve(self, ref: str) -> str:
        return self.cache.resolve(ref)

    def stats(self) -> dict:
        return self.cache.stats()


def registry_name(store_uri: str) -> str:
    """The registry actor's name for a store: one registry per store and namespace (a deployment started again
    with another store, on the same cluster, reads that store)."""
    return f"{REGISTRY_NAME}-{hashlib.sha256(store_uri.encode()).hexdigest()[:12]}"


def registry(store_uri: str, namespace: str | None = None, max_entries: int = MAX_ENTRIES):
    """The cluster's registry actor of `store_uri`, created on first use (detached, named); `max_entries`
    applies when this call creates it."""
    return ArtifactRegistry.options(name=registry_name(store_uri), namespace=namespace, get_if_exists=True,
                                    lifetime="detached", max_restarts=-1).remote(store_uri, max_entries)


def stop_registry(store_uri: str, namespace: str | None = None) -> None:
    """Kill the registry actor of `store_uri` (undeploy: detached, it would outlive the deployment)."""
    try:
        ray.kill(ray.get_actor(registry_name(store_uri), namespace=namespace))
    except ValueError:                                  # none was started
        pass


def _get(reg, ref: str, kind: str, timeout_s: float | None) -> tuple[Manifest, object]:
    manifest_json, (blob,) = ray.get(reg.get.remote(ref), timeout=timeout_s)
    manifest = Manifest.model_validate_json(manifest_json)
    manifest.require(kind)
    return manifest, blob


def unavailable_reason(e: BaseException) -> FallbackReason:
    """The fallback reason a replica states for an artifact `fetch` (or the registry) could not give it: none
    published, one that does not fit (fingerprints, checksums, manifest), or the registry or store failing."""
    if isinstance(e, ArtifactNotFound):               # (a RayTaskError of one is an instance of it too)
        return FallbackReason.NO_ARTIFACT
    if isinstance(e, ArtifactStoreError):
        return FallbackReason.ARTIFACT_MISMATCH
    return FallbackReason.ARTIFACT_UNAVAILABLE


def fetch(reg, ref: str, expect: Fingerprints | None = None,
          timeout_s: float | None = None) -> tuple[PairArtifacts, Manifest]:
    """Artifacts for `ref` through the registry; refuses them when the fingerprints differ from `expect`.
    Raises ArtifactStoreError subclasses (through Ray they arrive as RayTaskError instances of them), and
    ray.exceptions.GetTimeoutError after `timeout_s` for each of the two reads."""
    from safetensors.torch import load as st_load

    from scd.online.artifacts import PairArtifacts
    manifest, blob = _get(reg, ref, "pair", timeout_s)
    if expect is not None:
        check(str(manifest.ref), manifest.fingerprints, expect)
    desc, tensors = ray.get(blob, timeout=timeout_s)
    return PairArtifacts.from_parts(json.loads(desc), st_load(tensors)), manifest


def fetch_family(reg, ref: str, expect: Fingerprints | None = None, member: str | None = None,
                 timeout_s: float | None = None) -> tuple[FamilyArtifacts, Manifest]:
    """A family artifact through the registry, as `fetch`. `expect` is checked against the family's producer
    and tokenizer, and with `member` (a consumer name) also against that member's consumer fingerprint."""
    from safetensors.torch import load as st_load

    from scd.online.family_artifacts import FamilyArtifacts
    manifest, blob = _get(reg, ref, "family", timeout_s)
    prints = manifest.member(member)
    if expect is not None:
        check(str(manifest.ref), prints, expect)
    desc, tensors = ray.get(blob, timeout=timeout_s)
    return FamilyArtifacts.from_parts(json.loads(desc), st_load(tensors)), manifest
