"""What the store's read operations return: a version in a listing, and what verify found."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VersionInfo:
    pair: str
    version: str
    index: int                  # 1-based position in sorted order; shifts when gc removes older versions
    latest: bool

    @property
    def ref(self) -> str:
        return f"{self.pair}@{self.version}"


@dataclass(frozen=True, slots=True)
class FileProblem:
    name: str
    kind: str                   # "missing" | "bad" | "extra"
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.kind} ({self.detail})"


@dataclass(frozen=True, slots=True)
class VerifyResult:
    ref: str
    problems: list[FileProblem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        return f"{self.ref}: ok" if self.ok else f"{self.ref}: " + "; ".join(map(str, self.problems))
