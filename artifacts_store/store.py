"""ArtifactStore: publish, list, show, verify, load and gc versioned pair (and family) artifacts on any pyarrow
filesystem. A family (one code for several consumers of a producer, scd.online.family_artifacts.FamilyArtifacts) is
stored like a pair whose consumer is the family's name: family.json in place of artifact.json, and a manifest
of kind "family" with every member's fingerprint.

Layout under the root:
    <producer>__<consumer>/LATEST                      text: the newest complete version id
    <producer>__<consumer>/<version>/manifest.json     written last; its presence makes the version visible
    <producer>__<consumer>/<version>/tensors.safetensors, artifact.json, report/...
    <producer>__<consumer>/.tmp-<id>/...               a publish (or pointer write) in progress
    <producer>__<consumer>/leases/<holder>.json        who serves which version, until when (see leases.py)

Invariants, which hold without atomic rename or conditional writes (S3 has neither):
- a version is visible iff its manifest.json exists, and manifest.json only appears after every file it lists
  is in place and was verified; gc deletes manifest.json first, so a visible version is never partial;
- version ids are unique (time + random) and sort by commit time, so concurrent publishers never collide;
- LATEST is rewritten until a read-back equals the newest listed version: once publishers are quiet it names
  the newest complete version (a lagging pointer still names a complete one; the next publish or gc fixes it);
- gc never removes the newest `keep` versions, LATEST's, a pinned one (`protect`) or one with a live lease.

Every public method raises ArtifactStoreError subclasses (or ValueError for a bad argument): a filesystem
failure (OSError, pyarrow error) arrives as StorageUnavailable naming the operation and the store.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.fs as pafs
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from artifacts_store import fingerprints as fp
from artifacts_store import leases as ls
from artifacts_store.errors import ArtifactNotFound, ChecksumMismatch, InvalidReference, ManifestError, storage_errors
from artifacts_store.fsio import Storage, open_root
from artifacts_store.leases import GcReport, Kept
from artifacts_store.manifest import CalibrationData, FileEntry, Manifest, PairNames, Ranks, code_version
from artifacts_store.refs import (LATEST, RESERVED_FILES, Ref, check_file_name, is_version_id, new_version_id,
                                  parse_pair_dir, parse_ref, version_time)
from artifacts_store.results import FileProblem, VerifyResult, VersionInfo
from scd.online.artifacts import IncompatibleArtifact, PairArtifacts
from scd.online.family_artifacts import FamilyArtifacts

MANIFEST, TENSORS, DESCRIPTION = "manifest.json", "tensors.safetensors", "artifact.json"
FAMILY_DESCRIPTION = "family.json"   # a family version's description, in place of artifact.json
REFUSED = "refused.json"             # the last quality-gate refusal of a pair (see refuse())
POINTER, TMP = "LATEST", ".tmp-"
_POINTER_TRIES = 8


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArtifactStore:
    """Versioned pair artifacts under `uri`: a local path (default), or any pyarrow URI (s3://bucket/prefix,
    gs://..., hdfs://...). With `filesystem=` (e.g. a configured S3FileSystem), `uri` is the root path inside it."""

    @storage_errors
    def __init__(self, uri: "str | Path", filesystem: pafs.FileSystem | None = None):
        self.storage = Storage(*open_root(uri, filesystem))

    def __repr__(self) -> str:
        return f"ArtifactStore({self.storage})"

    # ---- publish -------------------------------------------------------------------------------------------

    @storage_errors
    def publish(self, art: PairArtifacts, fingerprints: fp.Fingerprints, calibration: CalibrationData,
                metrics: Mapping[str, float] | None = None, extra_files: Mapping[str, bytes] | None = None) -> Manifest:
        """Write a new version of art.pair and return its manifest. Safe to call concurrently from anywhere."""
        pair = self._unversioned(art.pair)
        fp.check_publishable(art.pair, art.spec.fingerprint(), fingerprints)
        files = {TENSORS: st_save(art.tensors()), DESCRIPTION: json.dumps(art.description(), indent=2).encode()}
        return self._commit(pair, files, extra_files, art, calibration, metrics, producer=fingerprints.producer,
                            consumer=fingerprints.consumer, tokenizer=fingerprints.tokenizer)

    @storage_errors
    def publish_family(self, fam: FamilyArtifacts, fingerprints: Mapping[str, fp.Fingerprints],
                       calibration: CalibrationData, metrics: Mapping[str, float] | None = None,
                       extra_files: Mapping[str, bytes] | None = None) -> Manifest:
        """Write a new version of a family (`fam.family`, "producer:name") whose manifest records every
        member's fingerprint (`fingerprints`: member pair id -> that pair's fingerprints; one producer and
        one tokenizer for all). Versions, LATEST, leases and gc work as for a pair."""
        ref = self._unversioned(fam.family)
        if set(fingerprints) != set(fam.members):
            raise ValueError(f"fingerprints are for {sorted(fingerprints)}, the family's members are "
                             f"{sorted(fam.members)}")
        family, members = fp.of_family(fam.family, fam.encoder.spec.fingerprint(), fingerprints)
        files = {TENSORS: st_save(fam.tensors()), FAMILY_DESCRIPTION: json.dumps(fam.description(), indent=2).encode()}
        return self._commit(ref, files, extra_files, fam.encoder, calibration, metrics, kind="family",
                            producer=family.producer, consumer=None, members=members, tokenizer=family.tokenizer)

    @staticmethod
    def _unversioned(text: str) -> Ref:
        ref = parse_ref(text)
        if ref.version is not None:
            raise InvalidReference(f"artifact pair {text!r} must be producer:consumer without a version")
        return ref

    def _commit(self, pair: Ref, files: dict[str, bytes], extra_files: Mapping[str, bytes] | None,
                art: PairArtifacts, calibration: CalibrationData, metrics: Mapping[str, float] | None,
                **who) -> Manifest:
        """Upload `files` (+ extra_files) under a temporary name, verify them, then make them a version (see the
        module's invariants). `art` gives the manifest's ranks and plan; `who` its kind and fingerprints."""
        for name, data in (extra_files or {}).items():
            if check_file_name(name) in RESERVED_FILES:
                raise InvalidReference(f"extra file {name!r} would overwrite a file the store writes itself")
            files[name] = bytes(data)
        entries = {name: FileEntry(sha256=_sha(data), size=len(data)) for name, data in files.items()}

        tmp = f"{pair.pair_dir}/{TMP}{new_version_id()}"
        try:
            for name, data in files.items():
                self.storage.write(f"{tmp}/{name}", data)
            for name, entry in entries.items():                 # what landed is what we meant to write
                sha, size = self.storage.sha256(f"{tmp}/{name}")
                if (sha, size) != (entry.sha256, entry.size):
                    raise ChecksumMismatch(f"publishing {pair.pair}: {name} read back as {size} bytes sha256 {sha}, "
                                           f"wrote {entry.size} bytes sha256 {entry.sha256}; storage is unreliable, "
                                           "retry the publish", [FileProblem(name, "bad", "read-back differs")])
            # the version id is taken only now, so its time is within seconds of the manifest appearing:
            # gc's grace period then protects a commit in progress however long the upload took
            version = self._fresh_version(pair)
            manifest = Manifest(
                pair=PairNames(producer=pair.producer, consumer=pair.consumer), version=version, **who,
                ranks=Ranks(r_k=art.r_k, r_v=art.r_v, r_h=art.r_h), patch_layers=art.patch_layers,
                aligner_shapes={l: [list(t.shape) for t in g.state_dict().values()]
                                for l, g in sorted(art.aligners.items())},
                calibration=calibration, metrics=dict(metrics or {}), code_version=code_version(),
                created=datetime.now(timezone.utc), files=entries)
            body = manifest.to_bytes()
            self.storage.write(f"{tmp}/{MANIFEST}", body)
            if self.storage.read(f"{tmp}/{MANIFEST}") != body:
                raise ChecksumMismatch(f"publishing {pair.pair}: the manifest read back differs from what was written; "
                                       "storage is unreliable, retry the publish", [FileProblem(MANIFEST, "bad", "")])
            final = f"{pair.pair_dir}/{version}"
            for name in files:                                   # data first ...
                self.storage.move(f"{tmp}/{name}", f"{final}/{name}")
            missing = [n for n in files if not self.storage.is_file(f"{final}/{n}")]
            if missing:
                raise ArtifactNotFound(f"publishing {pair.pair}@{version}: {missing} vanished before commit "
                                       "(a gc with a grace period shorter than the publish?); retry the publish")
            self.storage.move(f"{tmp}/{MANIFEST}", f"{final}/{MANIFEST}")   # ... manifest last: now visible
        finally:
            # on failure, data already moved into the version dir stays invisible (no manifest) until gc
            self.storage.delete_dir(tmp)
        self._advance_latest(pair)
        return manifest

    # ---- quality gate ----------------------------------------------------------------------------------

    @storage_errors
    def refuse(self, pair: "str | Ref", report: Mapping) -> None:
        """Record that a calibration of `pair` was not published because it failed the quality gate
        (`report`: the figures and the reason). Serving states it (fallback reason quality_gate) while the
        pair has no version; a later publish supersedes it."""
        p = self.resolve_pair(pair)
        body = json.dumps({"pair": p.pair, "refused": datetime.now(timezone.utc).isoformat(), **report}, indent=1)
        self.storage.write(f"{p.pair_dir}/{REFUSED}.tmp", body.encode())
        self.storage.move(f"{p.pair_dir}/{REFUSED}.tmp", f"{p.pair_dir}/{REFUSED}")

    @storage_errors
    def refusal(self, pair: "str | Ref") -> dict | None:
        """The last quality-gate refusal of `pair`, or None (never refused, or published since)."""
        p = self.resolve_pair(pair)
        if not self.storage.is_file(f"{p.pair_dir}/{REFUSED}"):
            return None
        rec = json.loads(self.storage.read(f"{p.pair_dir}/{REFUSED}"))
        versions = self._versions(p)
        if versions and version_time(versions[-1]) > datetime.fromisoformat(rec["refused"]):
            return None
        return rec

    def resolve_pair(self, pair: "str | Ref") -> Ref:
        p = parse_ref(pair) if isinstance(pair, str) else pair
        if p.version is not None:
            raise InvalidReference(f"{pair!r}: a quality-gate record belongs to a pair, not a version")
        return p

    def _fresh_version(self, pair: Ref) -> str:
        for _ in range(3):
            version = new_version_id()
            if not self.storage.files(f"{pair.pair_dir}/{version}"):
                return version
        raise ManifestError(f"could not find an unused version id for {pair.pair}; is the clock stuck?")

    # ---- LATEST pointer ------------------------------------------------------------------------------------

    def _pointer(self, pair: Ref) -> str | None:
        try:
            text = self.storage.read(f"{pair.pair_dir}/{POINTER}").decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):     # other errors propagate: gc must not guess
            return None
        return text if is_version_id(text) else None

    def _advance_latest(self, pair: Ref) -> None:
        # No compare-and-swap exists, so: write the newest listed version, read back, repeat until the pointer
        # equals the newest listed version. The last writer re-lists after its write and therefore sees every
        # manifest committed before it, so once publishers stop the pointer names the newest version.
        for _ in range(_POINTER_TRIES):
            versions = self._versions(pair)
            if not versions or self._pointer(pair) == versions[-1]:
                return
            tmp = f"{pair.pair_dir}/{TMP}{new_version_id()}"
            try:
                self.storage.write(f"{tmp}/{POINTER}", (versions[-1] + "\n").encode())
                # a move, not a write: readers never see a half-written pointer
                self.storage.move(f"{tmp}/{POINTER}", f"{pair.pair_dir}/{POINTER}")
            finally:
                self.storage.delete_dir(tmp)

    # ---- lookup --------------------------------------------------------------------------------------------

    def _versions(self, pair: Ref) -> list[str]:
        """Complete versions of a pair, oldest first (one recursive listing)."""
        found = set()
        for rel in self.storage.files(pair.pair_dir):
            head, _, tail = rel.partition("/")
            if tail == MANIFEST and is_version_id(head):
                found.add(head)
        return sorted(found)

    def _pairs(self) -> list[Ref]:
        return [r for r in map(parse_pair_dir, self.storage.subdirs("")) if r is not None]

    @storage_errors
    def resolve(self, ref: "str | Ref") -> Ref:
        """The same reference with a full version id; raises ArtifactNotFound if no complete version matches."""
        r = parse_ref(ref)
        if r.version is None or r.version == LATEST:
            pointer = self._pointer(r)
            if pointer is not None and self.storage.is_file(f"{r.pair_dir}/{pointer}/{MANIFEST}"):
                return r.at(pointer)
            versions = self._versions(r)
            if not versions:
                raise self._no_versions(r)
            return r.at(versions[-1])
        if r.version.isdigit():
            versions, i = self._versions(r), int(r.version)
            if not versions:
                raise self._no_versions(r)
            if i > len(versions):
                raise ArtifactNotFound(f"{r}: {r.pair} has {len(versions)} versions; use an index 1..{len(versions)} "
                                       "(1 = oldest), 'latest', or a full version id")
            return r.at(versions[i - 1])
        if not self.storage.is_file(f"{r.pair_dir}/{r.version}/{MANIFEST}"):
            raise ArtifactNotFound(f"{r}: no complete version {r.version} of {r.pair} in {self.storage} (removed by "
                                   "gc, never published, or still being published); `list` shows what exists")
        return r

    def _no_versions(self, r: Ref) -> ArtifactNotFound:
        pairs = ", ".join(p.pair for p in self._pairs()) or "none"
        return ArtifactNotFound(f"{r}: no published version of {r.pair} in {self.storage} (pairs present: {pairs}); "
                                "calibrate and publish it first")

    def _manifest(self, r: Ref) -> Manifest:
        where = f"manifest of {r}"
        try:
            data = self.storage.read(f"{r.pair_dir}/{r.version}/{MANIFEST}")
        except FileNotFoundError:
            raise ArtifactNotFound(f"{r}: manifest disappeared while reading (removed by gc?)") from None
        m = Manifest.from_bytes(data, where)
        if m.ref != r:
            raise ManifestError(f"{where} describes {m.ref}, not the version it is stored as; the store was edited "
                                "by hand: remove or republish this version")
        return m

    # ---- read operations -----------------------------------------------------------------------------------

    @storage_errors
    def list(self, pair: "str | Ref | None" = None) -> list[VersionInfo]:
        """Complete versions of one pair (or of all pairs), oldest first; `latest` marks what `@latest` resolves to."""
        pairs = [parse_ref(pair)] if pair is not None else self._pairs()
        out = []
        for p in pairs:
            p = p.at(None)
            versions = self._versions(p)
            if not versions:
                continue
            latest = self.resolve(p).version
            out += [VersionInfo(p.pair, v, i, v == latest) for i, v in enumerate(versions, 1)]
        return out

    @storage_errors
    def show(self, ref: "str | Ref") -> Manifest:
        return self._manifest(self.resolve(ref))

    @storage_errors
    def verify(self, ref: "str | Ref") -> VerifyResult:
        """Check every file against the manifest: names each missing, bad (checksum/size) and extra file."""
        r = self.resolve(ref)
        m = self._manifest(r)
        vdir = f"{r.pair_dir}/{r.version}"
        present = set(self.storage.files(vdir))
        problems = []
        for name, entry in sorted(m.files.items()):
            if name not in present:
                problems.append(FileProblem(name, "missing", f"manifest lists {entry.size} bytes"))
                continue
            try:
                sha, size = self.storage.sha256(f"{vdir}/{name}")
            except FileNotFoundError:
                problems.append(FileProblem(name, "missing", "removed while verifying"))
                continue
            if (sha, size) != (entry.sha256, entry.size):
                problems.append(FileProblem(name, "bad", f"sha256 manifest={entry.sha256[:16]} stored={sha[:16]}, "
                                                         f"size manifest={entry.size} stored={size}"))
        for name in sorted(present - set(m.files) - {MANIFEST}):
            problems.append(FileProblem(name, "extra", "not listed in the manifest"))
        return VerifyResult(str(r), problems)

    def _read(self, r: Ref, m: Manifest, names: tuple[str, ...]) -> dict[str, bytes]:
        """The files `names` of a version, each checked against the manifest's checksum on the very bytes
        returned; ChecksumMismatch names every missing or damaged one."""
        data, problems = {}, []
        for name in names:
            entry = m.files.get(name)
            if entry is None:
                raise ManifestError(f"manifest of {r} does not list {name}; republish this version")
            try:
                data[name] = self.storage.read(f"{r.pair_dir}/{r.version}/{name}")
            except FileNotFoundError:
                problems.append(FileProblem(name, "missing", f"manifest lists {entry.size} bytes"))
                continue
            sha = _sha(data[name])
            if (sha, len(data[name])) != (entry.sha256, entry.size):
                problems.append(FileProblem(name, "bad", f"sha256 manifest={entry.sha256[:16]} stored={sha[:16]}"))
        if problems:
            raise ChecksumMismatch(f"refusing to load {r}: " + "; ".join(map(str, problems)) + ". The stored copy is "
                                   "damaged: republish the pair or load another version", problems)
        return data

    @storage_errors
    def load(self, ref: "str | Ref", expect: fp.Fingerprints | None = None) -> tuple[PairArtifacts, Manifest]:
        """The artifacts and manifest of a version, after checking the files it needs against their checksums and,
        with `expect`, the recorded fingerprints against the models actually loaded (None fields are skipped)."""
        r = self.resolve(ref)
        m = self._manifest(r)
        m.require("pair")
        if expect is not None:          # before downloading tensors: a wrong model fails fast and cheaply
            fp.check(str(r), m.fingerprints, expect)
        return self._pair(r, m), m

    @storage_errors
    def load_family(self, ref: "str | Ref", expect: fp.Fingerprints | None = None,
                    member: str | None = None) -> tuple[FamilyArtifacts, Manifest]:
        """A family version and its manifest, checksums verified. With `expect`, its producer and tokenizer
        fingerprints are checked, and with `member` (a consumer name) also that member's consumer."""
        r = self.resolve(ref)
        m = self._manifest(r)
        m.require("family")
        prints = m.member(member)       # a family's own fingerprints have no consumer: only a member's are checked
        if expect is not None:
            fp.check(str(r), prints, expect)
        return self._family(r, m), m

    @storage_errors
    def load_any(self, ref: "str | Ref") -> tuple["PairArtifacts | FamilyArtifacts", Manifest]:
        """A version of either kind, as its manifest says (the registry's read), checksums verified."""
        r = self.resolve(ref)
        m = self._manifest(r)
        return (self._family if m.kind == "family" else self._pair)(r, m), m

    def _pair(self, r: Ref, m: Manifest) -> PairArtifacts:
        data = self._read(r, m, (TENSORS, DESCRIPTION))
        try:
            art = PairArtifacts.from_parts(json.loads(data[DESCRIPTION]), st_load(data[TENSORS]))
        except IncompatibleArtifact as e:
            raise ManifestError(f"{r}: {e}") from None
        if parse_ref(art.pair).pair != r.pair or art.spec.fingerprint() != m.producer.config_hash:
            raise ManifestError(f"{r}: artifact.json (pair {art.pair}, spec {art.spec.fingerprint()}) disagrees with "
                                f"its manifest (pair {r.pair}, spec {m.producer.config_hash}); republish this version")
        return art

    def _family(self, r: Ref, m: Manifest) -> FamilyArtifacts:
        data = self._read(r, m, (TENSORS, FAMILY_DESCRIPTION))
        try:
            fam = FamilyArtifacts.from_parts(json.loads(data[FAMILY_DESCRIPTION]), st_load(data[TENSORS]))
        except (IncompatibleArtifact, ValueError, KeyError) as e:
            raise ManifestError(f"{r}: {type(e).__name__}: {e}") from None
        names = {parse_ref(p).consumer for p in fam.members}
        if fam.family != r.pair or names != set(m.members):
            raise ManifestError(f"{r}: family.json (family {fam.family}, members {sorted(names)}) disagrees with its "
                                f"manifest (members {sorted(m.members)}); republish this version")
        return fam

    # ---- leases --------------------------------------------------------------------------------------------

    @storage_errors
    def lease(self, ref: "str | Ref", holder: str, ttl_s: float = 300) -> Ref:
        """Resolve `ref` (e.g. `base:qa@latest`) and record that `holder` serves that version for `ttl_s` seconds;
        returns the resolved Ref. gc keeps a version while any lease on it is live. Renew by calling again
        (every ttl_s / 3, say); a holder has one lease per pair, so leasing another version moves it.

        `holder` is a short id unique to the process (`producer-<hex>`, `qa#<replica>`): letters, digits,
        '.', '_', '-', '#'. Cost: the resolve (`@latest`: read LATEST + one existence check; a full version
        id: the check alone), one small file written under a temp name and moved into place (local disk: a
        write and a rename; S3: a PUT, a server-side copy and a delete), and one existence check after it.
        The check after the write means the version was still there once the lease became visible, so a gc
        that starts from then on keeps it; a `@latest` ref whose version a concurrent gc removed is
        resolved again. Raises ArtifactNotFound, InvalidReference, StorageUnavailable."""
        r = parse_ref(ref)
        for _ in range(3):
            v = self.resolve(r)
            ls.write(self.storage, v, v.version, holder, ttl_s)
            if self.storage.is_file(f"{v.pair_dir}/{v.version}/{MANIFEST}"):
                return v
            ls.remove(self.storage, v, holder)
            if r.version not in (None, LATEST):
                break
        raise ArtifactNotFound(f"{r}: version {v.version} was removed (by gc) while {holder} leased it; "
                               "lease another version")

    @storage_errors
    def release(self, pair: "str | Ref", holder: str) -> None:
        """Drop `holder`'s lease on `pair` (a version in the reference is ignored); no error if it has none."""
        ls.remove(self.storage, parse_ref(pair).at(None), holder)

    @storage_errors
    def leases(self, pair: "str | Ref | None" = None) -> list[ls.Lease]:
        """Live leases of one pair (or of every pair), by pair, version, holder. Expired and unreadable lease
        files are skipped here and removed by gc. One listing plus one small read per lease file."""
        pairs = [parse_ref(pair).at(None)] if pair is not None else self._pairs()
        return [lease for p in pairs for lease in ls.scan(self.storage, p)[0]]

    # ---- gc ------------------------------------------------------------------------------------------------

    @storage_errors
    def gc(self, keep: int = 3, pair: "str | Ref | None" = None, grace: timedelta = timedelta(hours=1),
           protect: Iterable[str] = ()) -> GcReport:
        """Remove complete versions of each pair except: the newest `keep`, the one LATEST names, any version a
        `protect` reference resolves to (pins, e.g. `base:qa@<version id>`; one that resolves to nothing is
        ignored with a note), and any version with a live lease. Also removes version or temp dirs without a
        manifest older than `grace` (younger ones may be publishes in progress) and expired lease files.
        `report.kept` says which versions survived only because pinned or leased, and by whom.

        Leases are read per pair just before its deletions. A lease written after that read can still lose its
        version to this gc; lease() checks the version after writing, so only a check that runs between gc's
        read and its delete is fooled (milliseconds; holders of a loaded artifact then keep serving it)."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        report, cutoff = GcReport(), datetime.now(timezone.utc) - grace
        pins: dict[str, list[tuple[str, str]]] = {}         # pair -> [(version, pinning ref)]
        for text in protect:
            try:
                r = self.resolve(text)
            except (ArtifactNotFound, InvalidReference) as e:
                report.notes.append(f"pin {text} ignored: {e}")
                continue
            pins.setdefault(r.pair, []).append((r.version, str(text)))
        for p in ([parse_ref(pair).at(None)] if pair is not None else self._pairs()):
            self._advance_latest(p)     # repair a lagging or dangling pointer before deciding what it protects
            versions = self._versions(p)
            protected = set(versions[max(0, len(versions) - keep):] if keep else []) | {self._pointer(p)}
            held = [Kept(f"{p.pair}@{v}", "pinned", by) for v, by in pins.get(p.pair, [])]
            held += [Kept(l.ref, "leased", l.holder, l.expires) for l in ls.scan(self.storage, p)[0]]
            report.kept += [k for k in held if k.version in versions and k.version not in protected]
            protected |= {k.version for k in held}
            for v in versions:
                if v not in protected:
                    self.storage.delete_file(f"{p.pair_dir}/{v}/{MANIFEST}")   # invisible first, then removed
                    self.storage.delete_dir(f"{p.pair_dir}/{v}")
                    report.removed_versions.append(f"{p.pair}@{v}")
            complete = set(versions)
            for d in self.storage.subdirs(p.pair_dir):
                stamp = d[len(TMP):] if d.startswith(TMP) else d
                if d in complete or not is_version_id(stamp) or version_time(stamp) >= cutoff:
                    continue
                if self.storage.is_file(f"{p.pair_dir}/{d}/{MANIFEST}"):
                    continue            # committed since we listed: not stale
                self.storage.delete_dir(f"{p.pair_dir}/{d}")
                (report.removed_temp if d.startswith(TMP) else report.removed_incomplete).append(f"{p.pair}/{d}")
            removed_leases, removed_tmp = ls.sweep(self.storage, p, cutoff)
            report.removed_leases += removed_leases
            report.removed_temp += removed_tmp
        return report
