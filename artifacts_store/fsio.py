"""A store root on any pyarrow filesystem (local, S3, GCS, HDFS) and the few byte-level operations we need.

Paths handed in are relative to the root and '/'-separated; they were built from validated names, and
`_abs` re-checks every segment anyway so that no bug elsewhere can reach outside the root.
Only whole-object reads and writes are used, plus `move`: on a local or HDFS filesystem it is an atomic
rename, on object stores a server-side copy whose result appears all at once, then a delete.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.fs as pafs

_CHUNK = 4 << 20
_LIST_TRIES = 20


def open_root(uri: "str | Path", filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path inside it). A plain path means the local disk; a URI goes through pyarrow."""
    if filesystem is not None:
        return filesystem, str(uri).rstrip("/")
    text = str(uri)
    if "://" in text:
        fs, root = pafs.FileSystem.from_uri(text)
        return fs, root.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text))


class Storage:
    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs, self.root = fs, root

    def __repr__(self) -> str:
        return f"Storage({self.fs.type_name}:{self.root or '/'})"

    def _abs(self, rel: str) -> str:
        parts = rel.split("/") if rel else []
        if any(p in ("", ".", "..") or "\\" in p for p in parts):
            raise ValueError(f"internal error: unsafe relative path {rel!r}")
        return "/".join([self.root, *parts]) if self.root else "/".join(parts)

    def read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._abs(rel)) as f:
            return f.read()

    def write(self, rel: str, data: bytes) -> None:
        parent = rel.rpartition("/")[0]
        self.fs.create_dir(self._abs(parent), recursive=True)
        with self.fs.open_output_stream(self._abs(rel)) as f:
            f.write(data)

    def sha256(self, rel: str) -> tuple[str, int]:
        """(hex digest, size) streamed, so verifying a large file does not hold it in memory."""
        h, n = hashlib.sha256(), 0
        with self.fs.open_input_stream(self._abs(rel)) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                n += len(chunk)
        return h.hexdigest(), n

    def move(self, src: str, dst: str) -> None:
        parent = dst.rpartition("/")[0]
        self.fs.create_dir(self._abs(parent), recursive=True)
        self.fs.move(self._abs(src), self._abs(dst))

    def is_file(self, rel: str) -> bool:
        return self.fs.get_file_info(self._abs(rel)).type == pafs.FileType.File

    def _listing(self, base: str, recursive: bool) -> list[pafs.FileInfo]:
        # A local recursive walk fails when a concurrent publish or gc removes a temp dir under it; walking
        # again gives a listing of what is there now. Object stores list keys and never fail this way.
        sel = pafs.FileSelector(base, recursive=recursive, allow_not_found=True)
        for attempt in range(_LIST_TRIES):
            try:
                return self.fs.get_file_info(sel)
            except FileNotFoundError:
                if attempt == _LIST_TRIES - 1:
                    raise
        return []

    def subdirs(self, rel: str) -> list[str]:
        """Names of the directories directly under rel ([] if rel does not exist)."""
        infos = self._listing(self._abs(rel), recursive=False)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def files(self, rel: str) -> list[str]:
        """Every file under rel, as paths relative to rel, in one recursive listing (one LIST on S3)."""
        base = self._abs(rel)
        infos = self._listing(base, recursive=True)
        return sorted(i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)

    def delete_file(self, rel: str) -> None:
        try:
            self.fs.delete_file(self._abs(rel))
        except FileNotFoundError:
            pass

    def delete_dir(self, rel: str) -> None:
        try:
            self.fs.delete_dir(self._abs(rel))
        except FileNotFoundError:
            pass
