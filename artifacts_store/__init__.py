"""Versioned, checksummed, fingerprinted storage of per-pair SCD artifacts on any pyarrow filesystem.

    store = ArtifactStore("s3://bucket/scd")          # or a local path, or ArtifactStore(root, filesystem=fs)
    m = store.publish(art, Fingerprints.of(producer, consumer, tok), CalibrationData(...), metrics, extra_files)
    art, m = store.load("base:qa@latest", expect=Fingerprints.of(consumer=specialist, tokenizer=tok))
    ref = store.lease("base:qa@latest", holder="qa#1", ttl_s=300)   # gc keeps ref.version while renewed
    store.gc(keep=3, protect=["base:qa@<version id>"])                # pins, leases and LATEST survive
"""
import importlib

# name -> the module that defines it, imported at first use: `from artifacts_store import ArtifactStoreError`
# loads the errors alone, and the router and Serve replicas that only name errors and fingerprints stay free
# of torch (which the store's tensor files and the digests of loaded models need)
_WHERE = {
    **dict.fromkeys(["ArtifactNotFound", "ArtifactStoreError", "ChecksumMismatch", "FingerprintMismatch",
                     "InvalidReference", "ManifestError", "StorageUnavailable"], "artifacts_store.errors"),
    **dict.fromkeys(["Fingerprints", "ModelFingerprint"], "artifacts_store.fingerprints"),
    **dict.fromkeys(["GcReport", "Kept", "Lease"], "artifacts_store.leases"),
    **dict.fromkeys(["SCHEMA_VERSION", "CalibrationData", "FileEntry", "Manifest", "upgrade"],
                    "artifacts_store.manifest"),
    **dict.fromkeys(["Ref", "new_version_id", "parse_ref"], "artifacts_store.refs"),
    **dict.fromkeys(["FileProblem", "VerifyResult", "VersionInfo"], "artifacts_store.results"),
    "ArtifactStore": "artifacts_store.store",
    "weights_digest": "scd.online.models",
}
_RENAMED = {"calibration_digest": ("scd.online.models", "data_digest")}     # one digest for data and weights

__all__ = sorted([*_WHERE, *_RENAMED])


def __getattr__(name: str):
    if name in _RENAMED:
        module, attr = _RENAMED[name]
    elif name in _WHERE:
        module, attr = _WHERE[name], name
    else:
        raise AttributeError(f"module 'artifacts_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
