"""Publish/list/show/verify/load/gc on a local-disk store."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import torch

from artifacts_store import (ArtifactNotFound, ArtifactStore, ChecksumMismatch, FingerprintMismatch, Fingerprints,
                             InvalidReference,
                             ModelFingerprint, SCHEMA_VERSION, new_version_id, weights_digest)
from scd.online.models import ModelSpec
from tests.artifacts_store.conftest import CALIB, METRICS, fingerprints, publish, tiny_artifacts


def _assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max():.2e}"


@pytest.mark.parametrize("patch", [False, True])
def test_publish_load_round_trip(store, patch):
    art = tiny_artifacts(patch=patch)
    m = publish(store, art, extra_files={"report/summary.md": b"# tiny\n", "report/kl.png": b"\x89PNG fake"})
    loaded, m2 = store.load("base:qa", expect=fingerprints())
    assert m2 == m
    _assert_same_tensors(art.tensors(), loaded.tensors())
    assert loaded.description() == art.description() and loaded.plan == art.plan
    assert m.schema_version == SCHEMA_VERSION and m.pair.producer == "base" and m.pair.consumer == "qa"
    assert (m.ranks.r_k, m.ranks.r_v, m.ranks.r_h) == (3, 4, 6)
    assert m.patch_layers == ([1] if patch else [])
    assert m.aligner_shapes == ({1: [[32, 6], [32], [5, 6], [5], [32, 5], [32]]} if patch else {})
    assert m.metrics == METRICS and m.calibration == CALIB and m.created.tzinfo is not None
    assert set(m.files) == {"tensors.safetensors", "artifact.json", "report/summary.md", "report/kl.png"}
    assert m.code_version


def test_list_show_and_version_references(store):
    ms = [publish(store, tiny_artifacts(seed=i)) for i in range(3)]
    publish(store, tiny_artifacts(pair="base:code"))
    versions = [m.version for m in ms]
    assert versions == sorted(versions) and len(set(versions)) == 3
    rows = store.list("base:qa")
    assert [r.version for r in rows] == versions and [r.index for r in rows] == [1, 2, 3]
    assert [r.latest for r in rows] == [False, False, True]
    assert {r.pair for r in store.list()} == {"base:qa", "base:code"} and len(store.list()) == 4
    assert store.show("base:qa@2") == ms[1]
    assert store.show(f"base:qa@{versions[0]}") == ms[0]
    assert store.show("base:qa@latest") == store.show("base:qa") == ms[2]
    assert store.resolve("base:qa@1").version == versions[0]
    with pytest.raises(ArtifactNotFound, match=r"has 3 versions; use an index 1\.\.3"):
        store.show("base:qa@4")
    with pytest.raises(ArtifactNotFound, match="no complete version"):
        store.show(f"base:qa@{new_version_id()}")
    with pytest.raises(ArtifactNotFound, match="pairs present: base:code, base:qa"):
        store.show("base:math")


def test_verify_names_a_flipped_byte_and_load_refuses_it(store, tmp_path):
    m = publish(store, extra_files={"report/summary.md": b"ok"})
    assert store.verify("base:qa").ok
    path = tmp_path / "store" / "base__qa" / m.version / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0x01                                # inside the tensor data: still parses
    path.write_bytes(bytes(data))
    result = store.verify("base:qa")
    assert not result.ok and [(p.name, p.kind) for p in result.problems] == [("tensors.safetensors", "bad")]
    assert "tensors.safetensors: bad" in str(result)
    with pytest.raises(ChecksumMismatch, match="refusing to load base:qa@v.*tensors.safetensors: bad") as e:
        store.load("base:qa")
    assert [p.name for p in e.value.problems] == ["tensors.safetensors"]


def test_verify_names_missing_and_extra_files(store, tmp_path):
    m = publish(store, extra_files={"report/summary.md": b"ok"})
    vdir = tmp_path / "store" / "base__qa" / m.version
    (vdir / "report" / "summary.md").unlink()
    (vdir / "stray.txt").write_text("?")
    problems = {(p.name, p.kind) for p in store.verify(f"base:qa@{m.version}").problems}
    assert problems == {("report/summary.md", "missing"), ("stray.txt", "extra")}
    store.load("base:qa")                                       # load needs neither file
    (vdir / "artifact.json").unlink()
    with pytest.raises(ChecksumMismatch, match="artifact.json: missing"):
        store.load("base:qa")


def test_load_refuses_other_models_naming_the_fingerprint(store):
    publish(store)
    with pytest.raises(FingerprintMismatch) as e:
        store.load("base:qa", expect=fingerprints(consumer_seed=9))
    recorded, loaded = fingerprints().consumer.weights_digest, fingerprints(consumer_seed=9).consumer.weights_digest
    assert e.value.differences == [f"consumer weights digest: artifact={recorded} loaded={loaded}"]
    assert "consumer weights digest: artifact=" in str(e.value)
    with pytest.raises(FingerprintMismatch, match=r"^((?!weights).)*tokenizer fingerprint: artifact="):
        store.load("base:qa", expect=fingerprints(tok="x"))
    other_spec = ModelFingerprint(config_hash=ModelSpec("llama", 3, 4, 2, 8, 32, 64, 1e4).fingerprint(),
                                  weights_digest=fingerprints().producer.weights_digest)
    with pytest.raises(FingerprintMismatch, match="producer config hash"):
        store.load("base:qa", expect=Fingerprints(producer=other_spec))
    # a consumer replica that holds only its own model checks only that side
    store.load("base:qa", expect=Fingerprints(consumer=fingerprints().consumer))


def test_publish_refuses_fingerprints_of_another_architecture(store):
    f = fingerprints()
    wrong = f.model_copy(update={"consumer": ModelFingerprint(config_hash="feedfacefeedface", weights_digest="00")})
    with pytest.raises(FingerprintMismatch, match="consumer config hash"):
        store.publish(tiny_artifacts(), wrong, CALIB)
    assert store.list() == []


def test_fingerprints_of_a_real_model_and_weights_digest():
    from tests.conftest import perturbed, tiny_llama
    a = tiny_llama(0)
    f = ModelFingerprint.of(a)
    assert f.config_hash == ModelSpec.from_config(a.config).fingerprint() and len(f.weights_digest) >= 16
    assert weights_digest(tiny_llama(0)) == f.weights_digest != weights_digest(perturbed(a, 1e-3))
    bf16 = {"w": torch.ones(2, 3, dtype=torch.bfloat16)}
    assert weights_digest(bf16) != weights_digest({"w": torch.ones(2, 3)}) != weights_digest({"w": torch.ones(3, 2)})


def test_half_written_versions_are_invisible_and_gc_removes_stale_ones(store, tmp_path):
    m = publish(store)
    old = datetime.now(timezone.utc) - timedelta(hours=2)
    pair_dir = tmp_path / "store" / "base__qa"
    stale, fresh, stale_tmp = new_version_id(old), new_version_id(), ".tmp-" + new_version_id(old)
    for d in (stale, fresh, stale_tmp):
        (pair_dir / d).mkdir()
        (pair_dir / d / "tensors.safetensors").write_bytes(b"partial")
    assert [r.version for r in store.list("base:qa")] == [m.version]
    with pytest.raises(ArtifactNotFound):
        store.load(f"base:qa@{stale}")
    report = store.gc(keep=5, grace=timedelta(hours=1))
    assert report.removed_versions == [] and report.removed_incomplete == [f"base:qa/{stale}"]
    assert report.removed_temp == [f"base:qa/{stale_tmp}"]
    assert sorted(p.name for p in pair_dir.iterdir()) == sorted(["LATEST", m.version, fresh])


def test_gc_keeps_newest_n_and_never_latest(store, tmp_path):
    ms = [publish(store, tiny_artifacts(seed=i)) for i in range(4)]
    report = store.gc(keep=2)
    assert report.removed_versions == [f"base:qa@{m.version}" for m in ms[:2]]
    assert [r.version for r in store.list("base:qa")] == [m.version for m in ms[2:]]
    # a lagging LATEST (as after racing publishers) is repaired to the newest version before gc decides
    (tmp_path / "store" / "base__qa" / "LATEST").write_text(ms[2].version)
    store.gc(keep=0)
    assert [(r.version, r.latest) for r in store.list("base:qa")] == [(ms[3].version, True)]
    assert store.verify("base:qa").ok


def test_store_accepts_file_uri_and_explicit_filesystem(tmp_path):
    import pyarrow.fs as pafs
    a = ArtifactStore((tmp_path / "s").as_uri())
    m = publish(a)
    b = ArtifactStore(str(tmp_path / "s"), filesystem=pafs.LocalFileSystem())
    assert b.show("base:qa") == m and b.verify("base:qa").ok


def test_publish_needs_every_fingerprint(store):
    with pytest.raises(ValueError, match="publish needs producer, consumer and tokenizer"):
        store.publish(tiny_artifacts(), Fingerprints(consumer=fingerprints().consumer), CALIB)


def test_the_package_imports_without_ray():
    import subprocess
    import sys
    code = "import sys, artifacts_store; assert 'ray' not in sys.modules, 'artifacts_store imported ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_artifact_of_another_format_is_refused_with_a_recalibrate_message(store, monkeypatch):
    import scd.online.artifacts
    from artifacts_store import ManifestError
    from cli.demo import usable
    with monkeypatch.context() as m:
        m.setattr(scd.online.artifacts, "FORMAT_VERSION", 1)         # as an older build wrote it
        publish(store, tiny_artifacts(patch=True))
    with pytest.raises(ManifestError) as e:
        store.load("base:qa")
    assert "format 1" in str(e.value) and "recalibrate" in str(e.value)
    assert not usable(store, "base:qa") and not usable(store, "base:prose")
    publish(store, tiny_artifacts(patch=True))                 # recalibrated: latest loads again
    assert usable(store, "base:qa")


def test_a_quality_gate_refusal_is_recorded_until_a_newer_version_is_published(store):
    import time
    assert store.refusal("base:qa") is None
    publish(store)
    time.sleep(0.01)
    store.refuse("base:qa", {"passed": False, "reasons": ["KL 2.0 is worse than raw KV's 1.0"], "kl_scd": 2.0})
    rec = store.refusal("base:qa")
    assert rec["pair"] == "base:qa" and rec["kl_scd"] == 2.0 and rec["reasons"], rec
    assert [v.version for v in store.list("base:qa")], "a refusal does not remove the versions already there"
    time.sleep(0.01)
    publish(store)
    assert store.refusal("base:qa") is None, "a version newer than the refusal supersedes it"
    with pytest.raises(InvalidReference):
        store.refusal("base:qa@latest")
