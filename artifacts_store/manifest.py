"""The manifest of one artifact version: what was calibrated, for which models, and the checksum of every file.

The manifest is written last; its presence is what makes a version visible. It is the only place that
knows schema versions: `upgrade` turns any older manifest dict into the current schema and refuses newer
ones, so the rest of the code only ever sees `SCHEMA_VERSION`.
"""
from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from artifacts_store.errors import ArtifactNotFound, InvalidReference, ManifestError
from artifacts_store.fingerprints import Fingerprints, ModelFingerprint
from artifacts_store.refs import Ref, check_file_name, check_name, check_version_id

SCHEMA_VERSION = 2


def _family_fields(d: dict) -> dict:
    """1 -> 2: versions are of a pair or of a family (one code for several consumers, `members`)."""
    return {**d, "kind": "pair", "members": {}, "schema_version": 2}


# Step n turns a schema-n dict into a schema-(n+1) dict. Add one entry per schema bump; never edit old ones.
_STEPS: dict[int, Callable[[dict], dict]] = {1: _family_fields}


def upgrade(raw: dict) -> dict:
    """Bring a manifest dict of any known schema to SCHEMA_VERSION; refuse unknown or newer schemas."""
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest must be a JSON object, got {type(raw).__name__}")
    v = raw.get("schema_version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ManifestError(f"manifest has no integer schema_version (got {v!r}); it was not written by this store")
    if v > SCHEMA_VERSION:
        raise ManifestError(f"manifest schema_version {v} is newer than this code understands ({SCHEMA_VERSION}); "
                            "upgrade scd-serve to read it")
    while v < SCHEMA_VERSION:
        if v not in _STEPS:
            raise ManifestError(f"manifest schema_version {v} is not supported (no upgrade from it to "
                                f"{SCHEMA_VERSION}); republish the artifact")
        raw = _STEPS[v](dict(raw))
        if raw.get("schema_version") != v + 1:
            raise ManifestError(f"upgrade step from schema {v} did not produce schema {v + 1}")
        v += 1
    return raw


def code_version() -> str:
    """The scd-serve version: installed metadata, else the project file next to a source checkout."""
    try:
        return metadata.version("scd-serve")
    except metadata.PackageNotFoundError:
        project = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(project.read_text())["project"]["version"] + "+src"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


class _Model(BaseModel):
    # NaN/inf metrics (e.g. a diverged KL) survive a round trip instead of becoming null
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class PairNames(_Model):
    producer: str = Field(description="name of the producer (base) model")
    consumer: str = Field(description="name of the consumer (specialist) model, or of the family")

    @field_validator("producer", "consumer")
    @classmethod
    def _names(cls, v: str) -> str:
        return check_name(v)


class Ranks(_Model):
    r_k: int = Field(ge=0, description="Reuse latent rank for keys")
    r_v: int = Field(ge=0, description="Reuse latent rank for values")
    r_h: int = Field(ge=0, description="Patch latent rank for the pre-attention hidden state")


class CalibrationData(_Model):
    digest: str = Field(description="calibration_digest() of the calibration prefixes' token ids")
    n_prefixes: int = Field(ge=0, description="number of calibration prefixes")
    rows: int = Field(ge=0, description="rows (batch x heads x tokens) the Reuse fit accumulated")


class FileEntry(_Model):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes, hex")
    size: int = Field(ge=0, description="file size in bytes")


class Manifest(_Model):
    schema_version: int = Field(default=SCHEMA_VERSION, description="manifest schema; older ones go through upgrade()")
    kind: Literal["pair", "family"] = Field("pair", description=(
        "pair: codes for one consumer; family: one code for several consumers (`members`), the name in "
        "pair.consumer being the family's"))
    pair: PairNames = Field(description="the calibrated producer->consumer pair, or producer->family")
    version: str = Field(description="version id: v<UTC yyyymmddTHHMMSSffffff>-<6 hex>, sorts by publication time")
    producer: ModelFingerprint = Field(description="fingerprint of the producer the pair was calibrated with")
    consumer: ModelFingerprint | None = Field(description="fingerprint of the consumer the pair was calibrated "
                                                          "with (None for a family: see members)")
    members: dict[str, ModelFingerprint] = Field(default_factory=dict, description=(
        "a family's consumers: name -> the fingerprint of the model it was calibrated with"))
    tokenizer: str = Field(description="tokenizer fingerprint shared by both models")
    ranks: Ranks = Field(description="latent ranks of the Reuse and Patch codecs")
    patch_layers: list[int] = Field(description="layers rebuilt by Patch (the rest: exact layer 0 and Reuse)")
    aligner_shapes: dict[int, list[list[int]]] = Field(
        description="per Patch layer, the shapes of its aligner's tensors in state_dict order")
    calibration: CalibrationData = Field(description="what the pair was calibrated on")
    metrics: dict[str, float] = Field(default_factory=dict,
                                      description="quality/cost measured at calibration, e.g. kl, payload_bytes, f1")
    code_version: str = Field(description="scd-serve version that wrote the artifact")
    created: datetime = Field(description="UTC time the manifest was made (ISO 8601)")
    files: dict[str, FileEntry] = Field(description="every file of the version except the manifest itself")

    @model_validator(mode="after")
    def _kind(self):
        if self.kind == "pair" and (self.consumer is None or self.members):
            raise ValueError("a pair's manifest has a consumer fingerprint and no members")
        if self.kind == "family":
            if self.consumer is not None or len(self.members) < 2:
                raise ValueError("a family's manifest has two or more members and no single consumer")
            for name in self.members:
                check_name(name, "family member")
        return self

    @field_validator("schema_version")
    @classmethod
    def _current(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION} after upgrade(), got {v}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_version_id(v)

    @field_validator("created")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("created must carry a timezone (UTC)")
        return v.astimezone(timezone.utc)

    @field_validator("files")
    @classmethod
    def _file_names(cls, v: dict[str, FileEntry]) -> dict[str, FileEntry]:
        # a manifest read back from storage is untrusted input: its file names become paths
        for name in v:
            check_file_name(name)
        if "manifest.json" in v:
            raise ValueError("the manifest cannot list itself")
        return v

    @property
    def ref(self) -> Ref:
        return Ref(self.pair.producer, self.pair.consumer, self.version)

    @property
    def fingerprints(self) -> Fingerprints:
        """The pair's fingerprints (a family's: the producer and tokenizer; see `member`)."""
        return Fingerprints(producer=self.producer, consumer=self.consumer, tokenizer=self.tokenizer)

    def require(self, kind: str) -> None:
        """Raise InvalidReference unless this is a `kind` ("pair" or "family") version."""
        if self.kind != kind:
            how = ("load_family (serving: a `families:` entry)" if self.kind == "family"
                   else "load (a specialist's pair)")
            raise InvalidReference(f"{self.ref} is a {self.kind} artifact, not a {kind}: read it with {how}")

    def member(self, consumer: str | None) -> Fingerprints:
        """What loading for `consumer` checks: a family member's fingerprints, as a pair's would be (None: the
        version's own, which for a family are the producer's and the tokenizer's). ArtifactNotFound when the
        family has no such member."""
        if consumer is None:
            return self.fingerprints
        if consumer not in self.members:
            raise ArtifactNotFound(f"{self.ref} has no member {consumer!r}; its members: {sorted(self.members)}")
        return Fingerprints(producer=self.producer, consumer=self.members[consumer], tokenizer=self.tokenizer)

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> "Manifest":
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{where} is not valid JSON: {e}") from None
        raw = upgrade(raw)
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ManifestError(f"{where} does not match manifest schema {SCHEMA_VERSION}: {e}") from None
