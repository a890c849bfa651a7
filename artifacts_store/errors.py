"""Exceptions of the artifact store. Each message says what was wrong and what the user can do about it."""
from __future__ import annotations

import functools

import pyarrow as pa


class ArtifactStoreError(Exception):
    """Base class: catch this to handle any store failure."""


class InvalidReference(ArtifactStoreError, ValueError):
    """A pair name, version reference or file name that is malformed or could escape the store root."""


class ArtifactNotFound(ArtifactStoreError, LookupError):
    """No complete (manifest-bearing) version matches the reference."""


class ManifestError(ArtifactStoreError, ValueError):
    """A manifest that cannot be read: bad JSON, a schema this code does not know, or fields that disagree."""


class ChecksumMismatch(ArtifactStoreError):
    """Stored bytes differ from what the manifest recorded. `problems` names each file and what is wrong."""

    def __init__(self, message: str, problems: list | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class FingerprintMismatch(ArtifactStoreError):
    """Artifacts were calibrated for other models than the ones loaded. `differences` names each fingerprint."""

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = list(differences or [])


class StorageUnavailable(ArtifactStoreError):
    """The filesystem under the store failed (network, credentials, permissions, a missing bucket): an OSError
    or pyarrow error, with the operation and the store named. Often transient: retrying later may succeed."""


def storage_errors(method):
    """Decorates the store's public methods: a filesystem failure (OSError, pyarrow error) is re-raised as
    StorageUnavailable naming the store and the operation; ArtifactStoreErrors pass through unchanged."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ArtifactStoreError:
            raise
        except (OSError, pa.ArrowException) as e:
            where = getattr(self, "storage", None) or (args[0] if args else "?")
            op = "opening the store" if method.__name__ == "__init__" else method.__name__
            raise StorageUnavailable(f"artifact store {where}: {op} failed: {type(e).__name__}: {e}. "
                                     "Check the store URI, credentials, permissions and network; retrying later "
                                     "may succeed") from e
    return wrapped
