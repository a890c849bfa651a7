"""Versioned, checksummed, fingerprinted storage of per-pair SCD artifacts on any pyarrow filesystem.

    store = ArtifactStore("s3://bucket/scd")          # or a local path, or ArtifactStore(root, filesystem=fs)
    m = store.publish(art, Fingerprints.of(producer, consumer, tok), CalibrationData(...), metrics, extra_files)
    art, m = store.load("base:qa@latest", expect=Fingerprints.of(consumer=specialist, tokenizer=tok))
    ref = store.lease("base:qa@latest", holder="qa#1", ttl_s=300)   # gc keeps ref.version while renewed
    store.gc(keep=3, protect=["base:qa@<version id>"])                # pins, leases and LATEST survive
"""
from artifacts_store.errors import (ArtifactNotFound, ArtifactStoreError, ChecksumMismatch, FingerprintMismatch,
                                    InvalidReference, ManifestError, StorageUnavailable)
from artifacts_store.fingerprints import Fingerprints, ModelFingerprint, calibration_digest, weights_digest
from artifacts_store.leases import GcReport, Kept, Lease
from artifacts_store.manifest import SCHEMA_VERSION, CalibrationData, FileEntry, Manifest, upgrade
from artifacts_store.refs import Ref, new_version_id, parse_ref
from artifacts_store.results import FileProblem, VerifyResult, VersionInfo
from artifacts_store.store import ArtifactStore

__all__ = [
    "ArtifactNotFound", "ArtifactStore", "ArtifactStoreError", "CalibrationData", "ChecksumMismatch", "FileEntry",
    "FileProblem", "FingerprintMismatch", "Fingerprints", "GcReport", "InvalidReference", "Kept", "Lease", "Manifest",
    "ManifestError", "ModelFingerprint", "Ref", "SCHEMA_VERSION", "StorageUnavailable", "VerifyResult", "VersionInfo",
    "calibration_digest",
    "new_version_id", "parse_ref", "upgrade", "weights_digest",
]
