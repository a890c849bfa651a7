"""Family artifacts in the store: one version holds a shared encoder and each member's decoders, and its
manifest every member's fingerprint; versions, LATEST, verify and leases work as for a pair."""
from __future__ import annotations

import pytest
import torch

from artifacts_store import FingerprintMismatch, InvalidReference, ArtifactNotFound, ChecksumMismatch
from tests.artifacts_store.conftest import CALIB, METRICS, fingerprints, publish, tiny_family


def test_a_published_family_loads_with_every_member_and_records_their_fingerprints(store):
    fam, prints = tiny_family()
    m = store.publish_family(fam, prints, CALIB, METRICS)
    assert m.kind == "family" and str(m.ref).startswith("base:fam@") and m.consumer is None
    assert m.members == {"qa": prints["base:qa"].consumer, "prose": prints["base:prose"].consumer}
    back, m2 = store.load_family("base:fam@latest")
    assert m2 == m and back.family == "base:fam" and list(back.members) == ["base:qa", "base:prose"]
    for name, art in fam.members.items():
        got = back.members[name]
        for l in art.reuse_k:
            assert torch.equal(got.reuse_k[l].dec, art.reuse_k[l].dec) and torch.equal(got.reuse_k[l].enc, art.reuse_k[l].enc)
    assert store.verify("base:fam").ok
    assert [v.pair for v in store.list()] == ["base:fam"]
    assert store.lease("base:fam@latest", "producer-1").version == m.version


def test_each_member_is_checked_against_its_own_model_and_the_producer_against_the_family(store):
    fam, prints = tiny_family()
    store.publish_family(fam, prints, CALIB)
    qa = prints["base:qa"]
    store.load_family("base:fam", expect=qa.model_copy(update={"producer": None}), member="qa")
    with pytest.raises(FingerprintMismatch, match="consumer weights digest"):
        store.load_family("base:fam", expect=qa.model_copy(update={"producer": None}), member="prose")
    store.load_family("base:fam", expect=qa.model_copy(update={"consumer": None}))      # the producer's view
    with pytest.raises(FingerprintMismatch, match="producer weights digest"):
        store.load_family("base:fam", expect=fingerprints(7, 2).model_copy(update={"consumer": None}))
    with pytest.raises(ArtifactNotFound, match="no member 'code'"):
        store.load_family("base:fam", member="code")


def test_a_family_is_not_loaded_as_a_pair_nor_a_pair_as_a_family(store):
    fam, prints = tiny_family()
    store.publish_family(fam, prints, CALIB)
    publish(store)
    with pytest.raises(InvalidReference, match="is a family artifact.*load_family"):
        store.load("base:fam")
    with pytest.raises(InvalidReference, match="is a pair artifact"):
        store.load_family("base:qa")


@pytest.mark.parametrize("case,err,msg", [
    ("missing fingerprints", ValueError, "fingerprints are for"),
    ("another producer", FingerprintMismatch, "different producers"),
    ("member of another producer", InvalidReference, "must be base:"),
])
def test_a_family_that_does_not_hang_together_is_not_published(store, case, err, msg):
    if case == "member of another producer":
        fam, prints = tiny_family(members=("base:qa", "other:prose"))
    else:
        fam, prints = tiny_family()
    if case == "missing fingerprints":
        prints.pop("base:prose")
    if case == "another producer":
        prints["base:prose"] = fingerprints(5, 11)
    with pytest.raises(err, match=msg):
        store.publish_family(fam, prints, CALIB)
    assert store.list() == []


def test_a_damaged_family_is_refused_naming_the_file(store, tmp_path):
    fam, prints = tiny_family()
    m = store.publish_family(fam, prints, CALIB)
    path = tmp_path / "store" / "base__fam" / m.version / "family.json"
    path.write_bytes(path.read_bytes().replace(b'"family"', b'"famil_"', 1))
    with pytest.raises(ChecksumMismatch, match="family.json: bad"):
        store.load_family("base:fam")
