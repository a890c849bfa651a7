"""ArtifactRegistry: reads each artifact version from the store once and shares it through the object store.

Many specialist replicas on a node then fetch the same object-store copy instead of each reading (and
verifying) the store. What travels is safetensors bytes plus JSON, never pickled Python objects.
"""
from __future__ import annotations

import json

import ray
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from artifacts_store import ArtifactStore, Fingerprints, Manifest
from artifacts_store.fingerprints import check
from scd.artifacts import PairArtifacts

REGISTRY_NAME = "scd-artifact-registry"


@ray.remote(num_cpus=0)
class ArtifactRegistry:
    def __init__(self, store_uri: str):
        self.store = ArtifactStore(store_uri)
        self.entries: dict[str, tuple[str, list]] = {}     # "pair@version" -> (manifest json, [ref])
        self.store_reads = 0

    def get(self, ref: str) -> tuple[str, list]:
        """(manifest JSON, [ObjectRef of (artifact.json text, safetensors bytes)]) for a ref; `latest` and
        indexes resolve to the full version first, so a new version is picked up when it is published."""
        key = str(self.store.resolve(ref))
        if key not in self.entries:
            art, manifest = self.store.load(key)                 # checksums verified here, once
            self.store_reads += 1
            blob = ray.put((json.dumps(art.description()), st_save(art.tensors())))
            self.entries[key] = (manifest.model_dump_json(), [blob])   # a list: callers get the ref, not the value
        return self.entries[key]

    def stats(self) -> dict:
        return {"store_reads": self.store_reads, "cached": sorted(self.entries)}


def registry(store_uri: str, namespace: str | None = None):
    """The cluster's registry actor, created on first use (detached, named)."""
    return ArtifactRegistry.options(name=REGISTRY_NAME, namespace=namespace, get_if_exists=True,
                                    lifetime="detached").remote(store_uri)


def fetch(reg, ref: str, expect: Fingerprints | None = None) -> tuple[PairArtifacts, Manifest]:
    """Artifacts for `ref` through the registry; refuses them when the fingerprints differ from `expect`."""
    manifest_json, (blob,) = ray.get(reg.get.remote(ref))
    manifest = Manifest.model_validate_json(manifest_json)
    if expect is not None:
        check(str(manifest.ref), manifest.fingerprints, expect)
    desc, tensors = ray.get(blob)
    return PairArtifacts.from_parts(json.loads(desc), st_load(tensors)), manifest
