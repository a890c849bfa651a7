"""Names, references and version ids: the only user text that ever becomes part of a storage path.

Invariant: every path segment the store builds comes out of `check_name`, `check_version_id`,
`check_file_name` or `check_holder`, so no reference can name anything outside the store root ('/', '\\', '..', absolute
paths and leading dots are all refused before any I/O happens).

Reference grammar:  producer:consumer[@version]  where version is a full version id, `latest`, or the
1-based index of a version in sorted (= publication-time) order, e.g. `base:qa@3`.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from artifacts_store.errors import InvalidReference

LATEST = "latest"
PAIR_SEP = "__"                 # producer__consumer in storage; hence "__" may not appear inside a name
MAX_NAME = 128
MAX_FILE_DEPTH = 4
RESERVED_FILES = ("manifest.json", "tensors.safetensors", "artifact.json", "family.json")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# v + UTC time to the microsecond + 24 random bits: fixed width, so string order == time order, and two
# publishers in the same microsecond still get distinct ids (collision odds 1 in 16.7M).
_VERSION = re.compile(r"v(\d{8}T\d{12})-[0-9a-f]{6}")
_TIME_FMT = "%Y%m%dT%H%M%S%f"
_HOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._#-]*")


def check_name(name: str, what: str = "name") -> str:
    """A producer/consumer name: letters, digits, '.', '_', '-'; no '..', no '__', no leading dot."""
    if not isinstance(name, str) or not name:
        raise InvalidReference(f"{what} must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidReference(f"{what} {name!r} is not allowed: use only letters, digits, '.', '_' and '-', "
                               f"start with a letter or digit, no '..', at most {MAX_NAME} characters")
    if PAIR_SEP in name:
        raise InvalidReference(f"{what} {name!r} contains {PAIR_SEP!r}, which separates producer and consumer "
                               "in storage; rename it without a double underscore")
    return name


def check_holder(holder: str) -> str:
    """A lease holder id, e.g. `producer-3fa2` or `qa#1`: a name that may also contain '#' (one file name)."""
    if not isinstance(holder, str) or len(holder) > MAX_NAME or not _HOLDER.fullmatch(holder) or ".." in holder:
        raise InvalidReference(f"lease holder {holder!r} is not allowed: use only letters, digits, '.', '_', '-' "
                               f"and '#', start with a letter or digit, no '..', at most {MAX_NAME} characters")
    return holder


def check_version_id(version: str) -> str:
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise InvalidReference(f"version id {version!r} is malformed; expected v<yyyymmddTHHMMSSffffff>-<6 hex>, "
                               f"e.g. {new_version_id()}")
    return version


def is_version_id(text: str) -> bool:
    return bool(_VERSION.fullmatch(text))


def version_time(version: str) -> datetime:
    """The UTC publication time encoded in a version id (used for grace periods: S3 has no directory mtime)."""
    m = _VERSION.fullmatch(check_version_id(version))
    return datetime.strptime(m.group(1), _TIME_FMT).replace(tzinfo=timezone.utc)


def new_version_id(now: datetime | None = None) -> str:
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return f"v{now.strftime(_TIME_FMT)}-{secrets.token_hex(3)}"


def check_file_name(name: str) -> str:
    """A file inside a version, e.g. `report/summary.md`: '/'-separated name segments, relative, shallow."""
    if not isinstance(name, str) or not name:
        raise InvalidReference(f"file name must be a non-empty string, got {name!r}")
    parts = name.split("/")
    for part in parts:
        if len(part) > MAX_NAME or not _NAME.fullmatch(part) or ".." in part:
            raise InvalidReference(f"file name {name!r} is not allowed: relative '/'-separated segments of "
                                   "letters, digits, '.', '_', '-', none empty, none starting with '.', no '..'")
    if len(parts) > MAX_FILE_DEPTH:
        raise InvalidReference(f"file name {name!r} is nested deeper than {MAX_FILE_DEPTH} levels")
    return name


@dataclass(frozen=True, slots=True)
class Ref:
    producer: str
    consumer: str
    version: str | None = None          # full id, "latest", a decimal index, or None (= latest)

    def __post_init__(self):
        check_name(self.producer, "producer name")
        check_name(self.consumer, "consumer name")
        if self.version is not None and self.version != LATEST and not self.version.isdigit():
            check_version_id(self.version)
        if self.version is not None and self.version.isdigit() and int(self.version) < 1:
            raise InvalidReference(f"version index must be 1 or more (1 = oldest), got {self.version!r}")

    @property
    def pair(self) -> str:
        return f"{self.producer}:{self.consumer}"

    @property
    def pair_dir(self) -> str:
        return f"{self.producer}{PAIR_SEP}{self.consumer}"

    def at(self, version: str | None) -> "Ref":
        return Ref(self.producer, self.consumer, version)

    def __str__(self) -> str:
        return self.pair if self.version is None else f"{self.pair}@{self.version}"


def parse_ref(text: "str | Ref") -> Ref:
    """`producer:consumer[@version]` -> Ref; refuses anything that is not exactly that shape."""
    if isinstance(text, Ref):
        return text
    if not isinstance(text, str):
        raise InvalidReference(f"reference must be a string like 'base:qa@latest', got {type(text).__name__}")
    pair, at, version = text.partition("@")
    producer, colon, consumer = pair.partition(":")
    if not colon or ":" in consumer or (at and not version):
        raise InvalidReference(f"reference {text!r} is malformed; expected producer:consumer[@version], "
                               "e.g. 'base:qa', 'base:qa@latest', 'base:qa@3' or 'base:qa@<version id>'")
    return Ref(producer, consumer, version if at else None)


def parse_pair_dir(dirname: str) -> Ref | None:
    """The Ref of a pair directory name, or None for anything else found under the root (ignored)."""
    producer, sep, consumer = dirname.partition(PAIR_SEP)
    try:
        return Ref(producer, consumer) if sep else None
    except InvalidReference:
        return None
