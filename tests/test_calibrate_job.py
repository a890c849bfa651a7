"""The calibration job end to end on a local Ray (trace actors), with a reduced budget."""
import re

import pytest

from artifacts_store import ArtifactNotFound, ArtifactStore, Fingerprints, FingerprintMismatch
from jobs.calibrate import main as calibrate
from scd.online.selective import POSITION_FEATURES
from scd.online.models import load
from tests.conftest import DEMO, write_config


@pytest.fixture(scope="module")
def job(ray_cluster, tmp_path_factory):
    """One reduced-budget calibration of base:qa through trace actors, shared by this module's tests."""
    import contextlib
    import io
    tmp = tmp_path_factory.mktemp("calib")
    cfg = write_config(tmp, diagnostics=True, selector_samples=32)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ref = calibrate(["--pair", "base:qa", "--config", str(cfg)])
    return tmp, cfg, ref, buf.getvalue()


def test_job_publishes_a_verified_artifact_with_report_and_resumes(job, capsys):
    tmp_path, cfg, ref, out = job
    assert "trace actors on cpu (producer) and cpu (consumer)" in out
    store = ArtifactStore(tmp_path / "store")
    assert store.verify(ref).ok
    m = store.show(ref)
    assert {"report/summary.md", "report/sensitivity.png", "report/greedy.png", "report/pareto.png",
            "report/tradeoff.png", "report/xnorm_error.png"} <= set(m.files), sorted(m.files)
    assert {"kl", "kl_raw_kv", "payload_ratio", "f1", "f1_oracle"} <= set(m.metrics), m.metrics
    summary = next((tmp_path / "store").rglob("summary.md")).read_text()
    assert "where the error lives" in summary and "own K at every layer" in summary, summary
    assert "| int4_kv |" in summary and "| droidspeak |" in summary and "| scd@r_k=" in summary, summary
    art, _ = store.load(ref)
    ladder = art.info["levels"]           # held-out KL and payload of every level the artifact serves
    assert [{k: v for k, v in e.items() if k.startswith("r_")} for e in ladder] == art.levels, ladder
    assert ladder[-1]["servable"] and art.servable_levels[-1] == art.levels[-1]     # the published code passed
    ratios = [e["payload_ratio"] for e in ladder]
    assert ratios == sorted(ratios) and ladder[-1]["kl"] == pytest.approx(m.metrics["kl"]), (ladder, m.metrics)
    # a selector of the positions to recompute, fitted on the fine-tuning samples, travels in the artifact
    assert art.selector is not None and art.info["selector"]["samples"] == 8, art.info.get("selector")
    assert art.selector.shape[0] == len(art.selector_layers) * art.spec.num_kv_heads * art.spec.head_dim + POSITION_FEATURES

    # resubmitting a finished pair publishes nothing new
    assert calibrate(["--pair", "base:qa", "--config", str(cfg)]) == ref
    assert "already published" in capsys.readouterr().out

    # a job killed after the policy stage resumes its checkpoints and publishes a new version
    record = next((tmp_path / "work" / "base__qa").rglob("published-*.json"))
    work = record.parent                                                              # the job's own folder
    for name in (record.name, "pareto.json"):
        (work / name).unlink()
    next(work.glob("eval*.json")).unlink()          # eval-<level>.json when served below its fitted ranks
    ref2 = calibrate(["--pair", "base:qa", "--config", str(cfg)])
    out = capsys.readouterr().out
    for line in ("stage traces: resumed", "stage linear: resumed", "stage policy: resumed",
                 r"stage xnorm(-\S+)?: resumed"):       # xnorm-<level> when served below its fitted ranks
        assert re.search(line, out), f"{line!r} missing from:\n{out}"
    assert ref2 != ref and [v.version for v in store.list("base:qa")][-1] == ref2.split("@")[1]


def test_loading_for_other_models_is_refused_naming_the_fingerprint(job):
    tmp_path, _, ref, _ = job
    base, tok, _ = load(DEMO / "base")
    prose, _, _ = load(DEMO / "prose")
    store = ArtifactStore(tmp_path / "store")
    art, _ = store.load(ref, Fingerprints.of(producer=base, consumer=load(DEMO / "qa")[0], tokenizer=tok))
    assert art.pair == "base:qa"
    with pytest.raises(FingerprintMismatch, match="consumer weights digest"):
        store.load(ref, Fingerprints.of(producer=base, consumer=prose, tokenizer=tok))


def test_unknown_pair_is_a_clear_error(tmp_path):
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit, match="no specialist 'nope'"):
        calibrate(["--pair", "base:nope", "--config", str(cfg)])
    with pytest.raises(SystemExit, match="not the config's producer"):
        calibrate(["--pair", "qa:prose", "--config", str(cfg)])
    # --adapter: a pair the config does not list, whose consumer is an adapter of the producer's model
    with pytest.raises(SystemExit, match="'qa' is a specialist of the config already"):
        calibrate(["--pair", "base:qa", "--config", str(cfg), "--adapter", str(DEMO / "qa")])
    with pytest.raises(SystemExit, match="--adapter: .* is not a PEFT adapter folder"):
        calibrate(["--pair", "base:sql", "--config", str(cfg), "--adapter", str(DEMO / "prose")])


def test_registry_reads_the_store_once_for_many_replicas(job):
    import ray

    from actors.registry import ArtifactRegistry, fetch
    tmp_path, _, ref, _ = job
    reg = ArtifactRegistry.remote(str(tmp_path / "store"))

    @ray.remote(num_cpus=0)
    def replica(r, pair_ref):
        art, manifest = fetch(r, pair_ref)
        return art.plan, manifest.version

    results = ray.get([replica.remote(reg, "base:qa@latest") for _ in range(4)] + [replica.remote(reg, ref)])
    assert len({tuple(p) for p, _ in results}) == 1
    stats = ray.get(reg.stats.remote())
    assert stats["store_reads"] == len({v for _, v in results}), stats
    base, tok, _ = load(DEMO / "base")
    with pytest.raises(FingerprintMismatch, match="consumer weights digest"):
        fetch(reg, ref, Fingerprints.of(producer=base, consumer=load(DEMO / "prose")[0], tokenizer=tok))
    ray.kill(reg)


def test_each_store_has_its_own_registry_in_a_namespace_and_undeploy_stops_it(job, tmp_path):
    """A deployment started again with another store on the same cluster and namespace reads that store, not
    the registry the first one left."""
    import ray

    from actors.registry import fetch, registry, registry_name, stop_registry
    store_dir = job[0] / "store"
    empty = tmp_path / "empty-store"
    ArtifactStore(empty)                                  # a store with nothing published
    ns = "scd-test-registries"
    try:
        assert fetch(registry(str(store_dir), ns), "base:qa@latest")[1].version
        with pytest.raises(ArtifactNotFound):
            fetch(registry(str(empty), ns), "base:qa@latest")
    finally:
        for uri in (str(store_dir), str(empty)):
            stop_registry(uri, ns)
    with pytest.raises(ValueError):
        ray.get_actor(registry_name(str(store_dir)), namespace=ns)


def test_a_calibration_that_fails_the_quality_gate_is_not_published_and_says_why(job, capsys):
    """An absolute KL bound no real calibration meets: the job exits 3, publishes nothing new, records the
    refusal in the store (serving states quality_gate), and the refusal lapses once a version is newer."""
    import yaml
    tmp_path, cfg, ref, _ = job
    raw = yaml.safe_load(cfg.read_text())
    raw["calibration"]["max_kl"] = 1e-12
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(raw))
    store = ArtifactStore(tmp_path / "store")
    before = [v.version for v in store.list("base:qa")]
    for record in (tmp_path / "work" / "base__qa").rglob("published-*.json"):
        record.unlink()                                     # else the finished calibration is not looked at again
    with pytest.raises(SystemExit) as e:
        calibrate(["--pair", "base:qa", "--config", str(strict)])
    assert e.value.code == 3
    out = capsys.readouterr().out
    assert "quality gate: NOT published" in out and "above calibration.max_kl" in out, out
    assert [v.version for v in store.list("base:qa")] == before
    rec = store.refusal("base:qa")
    assert rec is not None and rec["passed"] is False and rec["kl_scd"] > 1e-12, rec
    assert {"kl_raw_kv", "kl_reuse_only", "payload_ratio", "reasons"} <= set(rec)
    art, manifest = store.load(ref)
    store.publish(art, manifest.fingerprints, manifest.calibration)   # a newer version supersedes the refusal
    assert store.refusal("base:qa") is None


def test_quality_gate_compares_with_raw_kv_and_the_absolute_bound():
    from types import SimpleNamespace
    from jobs.calibrate import quality_gate
    by = {"scd": {"kl": 0.2, "payload_ratio": 0.2}, "raw_kv": {"kl": 0.1, "payload_ratio": 1.0},
          "reuse_only": {"kl": 0.3}}
    worse = quality_gate(by, SimpleNamespace(gate_vs_raw_kv=1.0, max_kl=None))
    assert not worse["passed"] and "worse than 1 x raw KV" in worse["reasons"][0], worse
    assert quality_gate(by, SimpleNamespace(gate_vs_raw_kv=2.5, max_kl=None))["passed"]
    assert quality_gate(by, SimpleNamespace(gate_vs_raw_kv=0, max_kl=None))["passed"]       # gate off
    assert not quality_gate(by, SimpleNamespace(gate_vs_raw_kv=0, max_kl=0.15))["passed"]
    exact = {"scd": {"kl": 3e-6, "payload_ratio": 1.0}, "raw_kv": {"kl": 0.0, "payload_ratio": 1.0}}
    assert quality_gate(exact, SimpleNamespace(gate_vs_raw_kv=1.0, max_kl=None))["passed"], \
        "a lossless cache passes where raw KV is exact too (an aLoRA's prefix)"
    compressed = {"scd": {"kl": 0.0015, "payload_ratio": 0.2}, "raw_kv": {"kl": 2e-5, "payload_ratio": 1.0}}
    assert not quality_gate(compressed, SimpleNamespace(gate_vs_raw_kv=1.0, max_kl=None))["passed"]
    assert quality_gate(compressed, SimpleNamespace(gate_vs_raw_kv=1.0, max_kl=0.002))["passed"], \
        "where raw KV is exact, an absolute max_kl is the bound"
    assert not quality_gate(compressed, SimpleNamespace(gate_vs_raw_kv=1.0, max_kl=0.001))["passed"]


def test_eval_with_the_config_resumes_the_jobs_checkpoints_and_can_load_the_published_artifact(job, capsys):
    from cli.evaluate import main as evaluate
    tmp_path, cfg, ref, _ = job
    rows = evaluate(["--config", str(cfg), "--pair", "base:qa", "--samples", "2", "--methods", "oracle,raw_kv,scd"])
    err = capsys.readouterr().err
    for line in ("stage traces: resumed", "stage policy: resumed"):
        assert line in err, f"{line!r} missing: scd eval --config must reuse the job's checkpoints\n{err}"
    by = {r["method"]: r for r in rows}
    assert by["oracle"]["kl"] < 1e-9 and by["scd"]["payload_ratio"] < 1.0, by
    shared = by["scd"]["structure"]                       # the demo's qa fine-tuned every weight: nothing shared
    assert shared["first_adapted"] == 0 and shared["num_layers"] == 8 and shared["verified_on"] >= 1, shared
    art, manifest = ArtifactStore(tmp_path / "store").load(ref)
    assert art.info["structure"]["first_adapted"] == 0, art.info.get("structure")
    assert "retained_gain" in manifest.metrics, manifest.metrics           # scd's share of qa's gain over the base
    rows2 = evaluate(["--producer", str(DEMO / "base"), "--consumer", str(DEMO / "qa"), "--artifact", ref,
                      "--store", str(tmp_path / "store"), "--samples", "2", "--methods", "scd"])
    assert f"artifact {ref}" in capsys.readouterr().err
    assert abs(rows2[0]["payload_ratio"] - by["scd"]["payload_ratio"]) < 1e-9
    with pytest.raises(SystemExit, match="fingerprint|weights"):          # fitted for qa, not prose
        evaluate(["--producer", str(DEMO / "base"), "--consumer", str(DEMO / "prose"), "--artifact", ref,
                  "--store", str(tmp_path / "store"), "--samples", "1", "--methods", "scd"])
    with pytest.raises(SystemExit, match="not in"):
        evaluate(["--config", str(cfg), "--pair", "base:nope", "--samples", "1"])


def test_a_changed_quality_bound_chooses_the_plan_again_from_the_checkpoints(job, capsys):
    """The bound is part of what was published: a pair whose bound changed is chosen and published again,
    without fitting anything again."""
    tmp_path, _, ref, _ = job
    (tmp_path / "bound").mkdir()
    cfg = write_config(tmp_path / "bound", diagnostics=True, work_dir=str(tmp_path / "work"), min_retained_gain=0.5)
    store = str(tmp_path / "store")
    ref2 = calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", store])
    out = capsys.readouterr().out
    assert "already published" not in out and "stage policy: resumed" in out and ref2 != ref, out
    assert calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", store]) == ref2
    assert "already published" in capsys.readouterr().out


def test_a_finished_calibration_is_published_to_another_store_from_its_checkpoints(job, capsys):
    """Each store keeps its own record of the publication: publishing to one does not make the other's stale."""
    tmp_path, cfg, _, _ = job
    other, third = tmp_path / "store-other", tmp_path / "store-third"
    ref = calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(other)])
    out = capsys.readouterr().out
    assert "already published" not in out and "stage policy: resumed" in out, out
    assert ArtifactStore(other).verify(ref).ok
    assert calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(other)]) == ref
    assert "already published" in capsys.readouterr().out
    calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(third)])
    capsys.readouterr()
    assert calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(other)]) == ref
    assert f"already published as {ref}" in capsys.readouterr().out


def test_a_version_removed_from_its_store_is_published_again_from_the_checkpoints(job, capsys):
    """What the job published counts only while the store holds it: a version removed since (by hand, or a
    store emptied at the same URI) is published again, without fitting anything again."""
    import shutil
    tmp_path, cfg, _, _ = job
    store = tmp_path / "store-emptied"
    first = calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(store)])
    capsys.readouterr()
    shutil.rmtree(store)
    again = calibrate(["--pair", "base:qa", "--config", str(cfg), "--store", str(store)])
    out = capsys.readouterr().out
    assert f"published as {first}, which the store no longer holds: publishing again" in out, out[-2000:]
    assert "stage policy: resumed" in out and again != first and ArtifactStore(store).verify(again).ok, out[-2000:]
