"""jobs.family end to end on the demo family with a reduced budget: one shared code for three specialists."""
import dataclasses
import json

import pytest
import torch

from jobs.family import main as family_job
from scd.online.family_artifacts import FamilyArtifacts
from tests.conftest import write_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family")
    cfg = write_config(tmp, prefixes=4, heldout=2, reuse_source="hidden", r_x=16)
    return tmp, cfg, family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp / "out")])


def test_one_family_payload_serves_every_member_and_each_members_kl_is_reported(run):
    tmp, _, res = run
    assert res["members"] == ["base:qa", "base:prose", "base:code"] and res["ranks"] == {"r_x": 16}
    assert res["family"] == "base:family"
    cost = res["fanout"]
    # one payload instead of three of the same size (their headers differ only by the pair's name)
    assert cost["pairs_bytes"] == pytest.approx(3 * cost["family_bytes"], rel=0.01), cost
    for row in res["kl"]:
        assert row["pair"] > 0 and row["family"] > 0 and row["raw_kv"] > 0, row
    out = tmp / "out" / "base" / "family"
    assert json.loads((out / "figures.json").read_text())["kl"] == res["kl"]
    assert (out / "family.png").read_bytes()[:4] == b"\x89PNG"
    fam = FamilyArtifacts.load(out)
    assert list(fam.members) == res["members"] and fam.info["fanout"] == res["fanout"]
    arts = list(fam.members.values())
    for layer in arts[0].reuse_x:                       # the encoder is shared, the decoders are each member's
        assert all(torch.equal(a.reuse_x[layer].enc, arts[0].reuse_x[layer].enc) for a in arts)
        assert not torch.equal(arts[1].reuse_x[layer].dec, arts[0].reuse_x[layer].dec)


def test_a_second_run_resumes_the_family_grams(run, capsys):
    tmp, cfg, _ = run
    family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp / "out2"), "--members", "qa,code"])
    assert "grams accumulated" in capsys.readouterr().out            # other members: another family
    family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp / "out2"), "--members", "qa,code"])
    assert "grams resumed" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [(["--members", "qa"], "two or more"), (["--members", "qa,qa"], "two or more"),
                                      (["--members", "qa,nope"], "no specialist"), (["--name", "../x"], "not allowed"),
                                      (["--name", "qa"], "a model's name")])
def test_bad_members_and_names_are_refused_with_a_message(run, argv, msg):
    _, cfg, _ = run
    with pytest.raises(SystemExit, match=msg):
        family_job(["--config", str(cfg), *argv])


def test_publish_puts_the_family_in_the_store_with_every_members_fingerprint(run, capsys):
    from artifacts_store import ArtifactStore, Fingerprints
    from scd.online.models import load
    tmp, cfg, _ = run
    res = family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp / "out3"), "--members", "qa,prose",
                      "--name", "fam", "--publish"])
    store = ArtifactStore(tmp / "store")
    assert res["published"] == str(store.resolve("base:fam@latest"))
    prose, tok, _ = load(load_config_path(cfg, "prose"))
    fam, m = store.load_family("base:fam", Fingerprints.of(consumer=prose, tokenizer=tok), member="prose")
    assert m.kind == "family" and sorted(m.members) == ["prose", "qa"] and list(fam.members) == ["base:qa", "base:prose"]
    assert m.metrics["family.prose"] == res["kl"][1]["family"] and "report/family.png" in m.files
    assert "serve it with `families: [{name: fam}]`" in capsys.readouterr().out


def test_a_family_that_loses_to_raw_kv_reuse_is_refused_not_published(run, tmp_path):
    import yaml

    from artifacts_store import ArtifactStore
    _, cfg, _ = run
    raw = yaml.safe_load(cfg.read_text())
    raw["calibration"]["gate_vs_raw_kv"] = 1e-6                  # no code is that close to raw KV reuse's
    raw["artifacts"]["uri"] = str(tmp_path / "store")
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(raw))
    res = family_job(["--config", str(strict), "--repeats", "1", "--out", str(tmp_path / "o"), "--members",
                      "qa,code", "--name", "fam", "--publish"])
    store = ArtifactStore(tmp_path / "store")
    assert res["published"] is None and store.list() == []
    assert "family KL" in store.refusal("base:fam")["reasons"][0]


def test_a_family_much_worse_than_a_members_published_pair_code_is_refused(run, tmp_path):
    """A fan-out to the family would swap each member's published pair code for the family's: a member whose
    pair artifact recorded a far lower KL keeps its pair code (the family is refused, saying which)."""
    import yaml

    from artifacts_store import ArtifactStore
    from tests.artifacts_store.conftest import CALIB, fingerprints, tiny_artifacts
    _, cfg, _ = run
    raw = yaml.safe_load(cfg.read_text())
    raw["calibration"]["family_vs_pair"] = 1.25
    raw["artifacts"]["uri"] = str(tmp_path / "store")
    path = tmp_path / "gated.yaml"
    path.write_text(yaml.safe_dump(raw))
    store = ArtifactStore(tmp_path / "store")
    store.publish(tiny_artifacts(pair="base:qa"), fingerprints(), CALIB, {"kl": 1e-6})   # a near-perfect pair code
    res = family_job(["--config", str(path), "--repeats", "1", "--out", str(tmp_path / "o"), "--members",
                      "qa,code", "--name", "fam", "--publish"])
    assert res["published"] is None
    reasons = store.refusal("base:fam")["reasons"]
    assert len(reasons) == 1 and reasons[0].startswith("qa: family KL") and "published pair artifact" in reasons[0]
    assert res["kl"][0]["served_pair"] == 1e-6 and res["kl"][1]["served_pair"] is None       # code has none


def _with_published_qa(cfg, tmp_path, member, metrics):
    """jobs.family on qa and code after publishing `member` (a family member's tensors) as base:qa's pair
    artifact for the demo models, to a store of its own."""

    import yaml

    from artifacts_store import ArtifactStore, CalibrationData, Fingerprints
    from scd.online.models import load
    producer, tok, _ = load(load_config_path(cfg, "qa").replace("/qa", "/base"))
    qa, _, _ = load(load_config_path(cfg, "qa"))
    ArtifactStore(tmp_path / "store").publish(
        dataclasses.replace(member, pair="base:qa", wire_plan=[], wire_x_codes=None, derived={}),
        Fingerprints.of(producer=producer, consumer=qa, tokenizer=tok), CalibrationData(digest="d", n_prefixes=1, rows=1),
        metrics)
    raw = yaml.safe_load(cfg.read_text())
    raw["artifacts"]["uri"] = str(tmp_path / "store")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return family_job(["--config", str(path), "--repeats", "1", "--out", str(tmp_path / "o"), "--members", "qa,code"])


def load_config_path(cfg, name):
    from cluster.config import load_config
    return load_config(cfg).specialist(name).path


def test_members_train_their_own_aligners_on_one_shared_patch_code(run, capsys, monkeypatch):
    """--patch-layers: the family's plan Patches layer 3 for every member; the producer-side Patch encoder is one
    for the family (so one payload serves every member, byte for byte), and each member has its own aligner."""
    from scd.online import codec
    from scd.online.models import load
    from scd.online.rebuild import encode
    from scd.online.trace import capture
    tmp, cfg, _ = run
    argv = ["--config", str(cfg), "--repeats", "1", "--out", str(tmp / "out4"), "--members", "qa,code",
            "--name", "famp", "--patch-layers", "3"]
    res = family_job(argv)
    assert res["patch_layers"] == {"qa": [3], "code": [3]}
    for row in res["kl"]:
        assert row["family"] > 0 and row["family_reuse"] > 0, row
    fam = FamilyArtifacts.load(tmp / "out4" / "base" / "famp")
    qa, code = fam.members["base:qa"], fam.members["base:code"]
    assert qa.plan[3] == code.plan[3] == "patch" and qa.patch_layers == [3]
    assert torch.equal(qa.patch_enc[3].enc, code.patch_enc[3].enc)
    assert not torch.equal(qa.aligners[3].out.weight, code.aligners[3].out.weight)
    producer, tok, _ = load(load_config_path(cfg, "qa").replace("/qa", "/base"))
    ids = torch.tensor([tok("a shared prefix for every member of the family").input_ids])
    trace = capture(producer, ids, torch.ones_like(ids))
    payload = lambda a: codec.encode(encode(a, trace, ids), a.pair, "v", codec.artifact_dims(a), a.code_dtype)  # noqa: E731
    assert payload(qa) == payload(code)
    capsys.readouterr()
    family_job(argv)
    out = capsys.readouterr().out
    assert "qa: aligner for layer 3 resumed" in out and "code: fine-tuned member resumed" in out
    # a member fine-tuned from other Reuse decoders is not resumed (here: the refit moved by 1 %)
    from scd.fitting import family
    refit = family.refit_decoder
    monkeypatch.setattr(family, "refit_decoder", lambda *a: dataclasses.replace(refit(*a), dec=refit(*a).dec * 1.01))
    family_job(argv)
    out = capsys.readouterr().out
    assert "qa: aligner for layer 3 resumed" in out and "code: fine-tuned member resumed" not in out, out
    assert "code: fine-tuned, validation KL" in out, out


def test_a_published_pair_artifact_for_these_models_is_scored_on_the_same_samples(run, tmp_path):
    """The gate compares a member's family KL with its published pair artifact scored side by side on the same
    held-out samples (here: the qa member of the first family, published as base:qa, must score as it did)."""
    tmp, cfg, first = run
    art = FamilyArtifacts.load(tmp / "out" / "base" / "family").members["base:qa"]
    res = _with_published_qa(cfg, tmp_path, art, {"kl": 123.0})
    row = res["kl"][0]
    assert row["served_pair_source"] == "measured" and res["kl"][1]["served_pair_source"] is None
    assert abs(row["served_pair"] - first["kl"][0]["family"]) < 1e-5, (row["served_pair"], first["kl"][0]["family"])
    assert res["fanout"]["pairs_are"] == "Reuse-only pair fits"              # code has no published pair artifact


def test_patch_plan_auto_gives_each_member_its_published_patch_layers():
    from jobs.family import patch_plan
    served = [{"patch_layers": [5, 2]}, {"patch_layers": [5, 6]}, {"patch_layers": []}]
    assert patch_plan("auto", served, 8) == [[2, 5], [5, 6], []]
    assert patch_plan("none", served, 8) == [[], [], []] and patch_plan("6,2", served, 8) == [[2, 6]] * 3
    assert patch_plan("auto", served, 8, hidden=False) == [[2, 5, 6]] * 3        # per-head codes: one plan
    for bad, msg in (("0", "within 1..7"), ("8", "within 1..7"), ("x", "layer numbers")):
        with pytest.raises(SystemExit, match=msg):
            patch_plan(bad, served, 8)


def test_a_family_code_may_serve_groups_of_layers(tmp_path):
    """x_group 3: one family code per three adjacent layers (layers 1..7: codes at 1, 4 and 7), shared by
    every member, each member decoding its own K and V of every layer of the group; with the config's token
    and bigram tables, each member's decoders carry its own."""
    cfg = write_config(tmp_path, prefixes=4, heldout=2, reuse_source="hidden", r_x=24, x_group=3,
                       finetune_samples=0, token_table=16, bigram_table=32)
    res = family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp_path / "out"), "--members", "qa,code",
                      "--patch-layers", "none"])
    fam = FamilyArtifacts.load(tmp_path / "out" / "base" / "family")
    qa, code = fam.members.values()
    assert qa.x_groups == [[1, 2, 3], [4, 5, 6], [7]] and sorted(qa.reuse_x) == [1, 4, 7] and qa.x_codes == [1, 4, 7]
    assert torch.equal(qa.reuse_x[4].enc, code.reuse_x[4].enc) and not torch.equal(qa.reuse_x[4].dec, code.reuse_x[4].dec)
    assert qa.reuse_x[4].dec.shape[1] == 3 * 2 * qa.spec.num_kv_heads * qa.spec.head_dim
    assert len(qa.reuse_x[4].table_ids) == 16 and len(qa.reuse_x[4].bigram_ids) == 32
    assert qa.reuse_x[4].bigram.shape == (32, qa.reuse_x[4].dec.shape[1])
    assert not torch.equal(qa.reuse_x[4].bigram_ids, code.reuse_x[4].bigram_ids)     # each member's own pairs
    cost = res["fanout"]
    assert cost["pairs_bytes"] == pytest.approx(2 * cost["family_bytes"], rel=0.01), cost
    for row in res["kl"]:
        assert 0 < row["family_reuse"] and 0 < row["pair"], row


def test_members_with_different_patch_layers_share_one_payload_that_carries_every_code(run, tmp_path):
    """auto: qa Patches layer 3 as its published pair artifact does, code (nothing published) Patches nothing.
    The payload carries qa's Patch code at 3 and code's hidden-state code there too; each member rebuilds from
    it exactly what its own artifact rebuilds from its own payload."""

    from scd.online import codec
    from scd.online.models import load
    from scd.online.rebuild import encode, rebuild
    from scd.online.trace import capture
    tmp, cfg, _ = run
    patched = FamilyArtifacts.load(tmp / "out4" / "base" / "famp").members["base:qa"]     # Patch at 3
    res = _with_published_qa(cfg, tmp_path, patched, {"kl": 1.0})
    producer, tok, _ = load(load_config_path(cfg, "qa").replace("/qa", "/base"))
    qa_model, _, _ = load(load_config_path(cfg, "qa"))
    assert res["patch_layers"] == {"qa": [3], "code": []}
    fam = FamilyArtifacts.load(tmp_path / "o" / "base" / "family")
    qa, code = fam.members["base:qa"], fam.members["base:code"]
    assert qa.plan[3] == "patch" and code.plan[3] == "hidden" and fam.encoder.plan[3] == "patch"
    assert fam.encoder.x_codes == list(range(1, 8))            # code reads a hidden-state code at layer 3
    ids = torch.tensor([tok("one payload for members that Patch different layers").input_ids])
    trace = capture(producer, ids, torch.ones_like(ids))
    enc = fam.encoder
    payload = codec.encode(encode(enc, trace, ids), enc.pair, "v", codec.artifact_dims(enc), enc.code_dtype)
    for member, model in ((qa, qa_model), (code, load(load_config_path(cfg, "code"))[0])):
        got, _ = rebuild(model, member, codec.decode(payload, member.pair, "v", member.payload_plan,
                                                     codec.artifact_dims(member), member.x_codes))
        alone = dataclasses.replace(member, wire_plan=[], wire_x_codes=None, derived={})
        want, _ = rebuild(model, alone, codec.as_received(encode(alone, trace, ids), alone.code_dtype))
        err = max((x - y).abs().max().item() for a, b in zip(got, want) for x, y in zip(a, b))
        assert err < 1e-4, f"{member.plan}: family payload rebuilds differ from the member's own by {err:.2e}"


def test_the_family_rank_leaves_room_in_the_budget_for_its_patch_codes():
    from jobs.family import budget_ranks
    from scd.online import codec
    from scd.online.models import ModelSpec
    spec = ModelSpec("llama", num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128, vocab_size=100,
                     rope_theta=1e4)
    given = {"r_k": 8, "r_v": 12, "r_x": 64, "x_group": 0, "r_h": 32}
    alone = budget_ranks(spec, True, 0.15, "mixed", given)["r_x"]
    patched = budget_ranks(spec, True, 0.15, "mixed", given, patched=3)["r_x"]
    room = 0.15 * spec.kv_bytes_per_token
    assert codec.code_bytes_per_row(alone, "mixed") <= room
    patch_bytes = 3 * codec.code_bytes_per_row(32, "mixed")
    assert codec.code_bytes_per_row(patched, "mixed") + patch_bytes <= room
    assert codec.code_bytes_per_row(patched + 8, "mixed") + patch_bytes > room
    assert patched < alone
    sent = budget_ranks(spec, True, 0.15, "mixed", given, patched=3, wire=0.8)["r_x"]  # the wire sends 0.8 of the bytes
    assert 0.8 * (codec.code_bytes_per_row(sent, "mixed") + patch_bytes) <= room
    assert 0.8 * (codec.code_bytes_per_row(sent + 8, "mixed") + patch_bytes) > room
    assert sent > patched


def test_with_compressed_codes_the_family_rank_counts_the_bytes_the_wire_sends(tmp_path, capsys):
    from jobs.family import budget_ranks
    from scd.online import codec
    from scd.online.models import load
    from tests.conftest import DEMO
    cfg = write_config(tmp_path, prefixes=16, heldout=2, reuse_source="hidden", payload_budget=0.15, x_group=0,
                       code_dtype="int4", finetune_samples=0)
    res = family_job(["--config", str(cfg), "--repeats", "1", "--out", str(tmp_path / "out"), "--members", "qa,code",
                      "--patch-layers", "none"])
    spec = load(str(DEMO / "base"))[2]
    in_code_bytes = budget_ranks(spec, True, 0.15, "int4", {"r_x": 0, "x_group": 0})["r_x"]
    assert 0.5 < res["wire_factor"] < 1, res["wire_factor"]
    assert res["ranks"]["r_x"] > in_code_bytes, (res["ranks"], in_code_bytes)
    code_ratio = codec.code_bytes_per_row(res["ranks"]["r_x"], "int4") / spec.kv_bytes_per_token
    assert code_ratio > 0.15, code_ratio                # the chosen code would not fit uncompressed...
    for row in res["kl"]:                               # ...and does as sent, within what the factor predicts
        assert row["payload_ratio"] <= 0.15 + 0.01, row
        assert abs(row["payload_ratio"] - res["wire_factor"] * code_ratio) < 0.02, (row, res["wire_factor"], code_ratio)
    assert "the wire sends" in capsys.readouterr().out
