"""References and file names are validated before any I/O; nothing reaches outside the store root."""
from __future__ import annotations

import json

import pytest

from artifacts_store import InvalidReference, ManifestError, Ref, new_version_id, parse_ref
from tests.artifacts_store.conftest import publish

BAD_REFS = ["../../etc:qa", "base:qa@../x", "base:qa@/etc/passwd", "/abs:qa", "a/b:qa", "base:q\\a", "base:..",
            ".hidden:qa", "base:qa@", ":qa", "base:", "a:b:c", "base__x:qa", "base:qa@0", "base:qa@-1",
            "base:qa@v123", "base:qa@LATEST/..", "base qa:x", "base:qa@@1", "", "base", "é:qa", "a" * 129 + ":qa"]


@pytest.mark.parametrize("ref", BAD_REFS)
def test_bad_references_are_refused(store, ref):
    with pytest.raises(InvalidReference):
        parse_ref(ref)
    with pytest.raises(InvalidReference):
        store.show(ref)


def test_good_references_parse():
    v = new_version_id()
    assert parse_ref("base:qa") == Ref("base", "qa", None)
    assert parse_ref("base-1.5:qa_v2@latest").version == "latest"
    assert parse_ref("base:qa@12").version == "12"
    assert str(parse_ref(f"base:qa@{v}")) == f"base:qa@{v}"
    assert Ref("base", "qa").pair_dir == "base__qa"


@pytest.mark.parametrize("name", ["../x", "/abs", "report/../../x", "a\\b", "report//x", "report/", ".env",
                                  "manifest.json", "tensors.safetensors", "artifact.json", "", "a/b/c/d/e"])
def test_bad_extra_file_names_are_refused_and_nothing_is_written(store, tmp_path, name):
    with pytest.raises(InvalidReference):
        publish(store, extra_files={name: b"x"})
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["store"])
    assert store.list() == []


def test_bad_pair_in_artifacts_is_refused(store, tmp_path):
    from tests.artifacts_store.conftest import tiny_artifacts
    for pair in ("../x:qa", "base:qa@1", "base"):
        with pytest.raises(InvalidReference):
            publish(store, tiny_artifacts(pair=pair))
    assert not (tmp_path / "x").exists() and store.list() == []


def test_a_tampered_manifest_cannot_point_outside_the_version(store, tmp_path):
    m = publish(store)
    path = tmp_path / "store" / "base__qa" / m.version / "manifest.json"
    raw = json.loads(path.read_text())
    raw["files"]["../../../../secret"] = raw["files"].pop("artifact.json")
    path.write_text(json.dumps(raw))
    for op in (store.show, store.verify, store.load):
        with pytest.raises(ManifestError, match="not allowed"):
            op("base:qa")


def test_a_manifest_moved_to_another_version_is_refused(store, tmp_path):
    m = publish(store)
    other = new_version_id()
    pair_dir = tmp_path / "store" / "base__qa"
    (pair_dir / m.version).rename(pair_dir / other)
    with pytest.raises(ManifestError, match="not the version it is stored as"):
        store.show(f"base:qa@{other}")
