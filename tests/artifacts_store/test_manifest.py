"""Manifest schema: round trip, one upgrade path for older schemas, newer schemas refused."""
from __future__ import annotations

import json

import pytest

from artifacts_store import SCHEMA_VERSION, Manifest, ManifestError, upgrade
from artifacts_store import manifest as manifest_mod
from tests.artifacts_store.conftest import publish


def test_every_field_is_described():
    from artifacts_store import Fingerprints, ModelFingerprint
    from artifacts_store.manifest import _Model
    models = [*_Model.__subclasses__(), Fingerprints, ModelFingerprint]
    assert Manifest in models
    for model in models:
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"


def test_round_trip_keeps_nan_metrics(store):
    m = publish(store)
    m2 = m.model_copy(update={"metrics": {"kl": float("nan"), "ppl": float("inf")}})
    back = Manifest.from_bytes(m2.to_bytes())
    assert back.metrics["ppl"] == float("inf") and back.metrics["kl"] != back.metrics["kl"]
    assert Manifest.from_bytes(m.to_bytes()) == m


def test_newer_and_unknown_schemas_are_refused(store, tmp_path):
    m = publish(store)
    raw = json.loads(m.to_bytes())
    with pytest.raises(ManifestError, match="newer than this code understands"):
        upgrade({**raw, "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(ManifestError, match="no integer schema_version"):
        upgrade({k: v for k, v in raw.items() if k != "schema_version"})
    with pytest.raises(ManifestError, match="not supported"):
        upgrade({**raw, "schema_version": 0})
    with pytest.raises(ManifestError, match="extra"):
        Manifest.from_bytes(json.dumps({**raw, "surprise": 1}).encode())
    path = tmp_path / "store" / "base__qa" / m.version / "manifest.json"
    path.write_text(json.dumps({**raw, "schema_version": 99}))
    with pytest.raises(ManifestError, match="schema_version 99 is newer"):
        store.load("base:qa")


def test_older_schema_goes_through_upgrade_steps(store, tmp_path, monkeypatch):
    m = publish(store)
    raw = json.loads(m.to_bytes())
    schema1 = {k: v for k, v in raw.items() if k not in ("kind", "members")} | {"schema_version": 1}
    # a hypothetical schema 0 that called the metrics "scores": one registered step renames it
    old = {**{k: v for k, v in schema1.items() if k != "metrics"}, "scores": raw["metrics"], "schema_version": 0}

    def step0(d):
        d["metrics"] = d.pop("scores")
        d["schema_version"] = 1
        return d

    monkeypatch.setattr(manifest_mod, "_STEPS", {0: step0, 1: manifest_mod._STEPS[1]})
    assert upgrade(old) == raw
    path = tmp_path / "store" / "base__qa" / m.version / "manifest.json"
    path.write_text(json.dumps(old))
    assert store.show("base:qa") == m
    monkeypatch.setattr(manifest_mod, "_STEPS", {0: lambda d: d})
    with pytest.raises(ManifestError, match="did not produce schema 1"):
        upgrade(old)


def test_a_manifest_written_before_families_reads_as_a_pair(store, tmp_path):
    """Stores written by schema 1 (no kind, no members) keep loading: every version in them is a pair."""
    m = publish(store)
    raw = json.loads(m.to_bytes())
    assert raw["schema_version"] == 2 and raw["kind"] == "pair" and raw["members"] == {}
    path = tmp_path / "store" / "base__qa" / m.version / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in raw.items() if k not in ("kind", "members")} | {"schema_version": 1}))
    art, back = store.load("base:qa")
    assert back == m and back.kind == "pair" and art.pair == "base:qa"


@pytest.mark.parametrize("change,msg", [({"consumer": None}, "has a consumer fingerprint"),
                                        ({"kind": "family"}, "two or more members"),
                                        ({"kind": "family", "consumer": None, "members": {"x": None}}, "members")])
def test_a_manifest_whose_kind_disagrees_with_its_fingerprints_is_refused(store, change, msg):
    raw = json.loads(publish(store).to_bytes())
    with pytest.raises(ManifestError, match=msg):
        Manifest.from_bytes(json.dumps({**raw, **change}).encode())
