"""The calibration job end to end on a local Ray (trace actors), with a reduced budget."""
import pytest

from artifacts_store import ArtifactStore, Fingerprints, FingerprintMismatch
from jobs.calibrate import main as calibrate
from scd.models import load
from tests.conftest import DEMO, write_config


@pytest.fixture(scope="module")
def job(ray_cluster, tmp_path_factory):
    """One reduced-budget calibration of base:qa through trace actors, shared by this module's tests."""
    import contextlib
    import io
    tmp = tmp_path_factory.mktemp("calib")
    cfg = write_config(tmp)
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
            "report/xnorm_error.png"} <= set(m.files), sorted(m.files)
    assert {"kl", "kl_raw_kv", "payload_ratio", "f1", "f1_oracle"} <= set(m.metrics), m.metrics

    # resubmitting a finished pair publishes nothing new
    assert calibrate(["--pair", "base:qa", "--config", str(cfg)]) == ref
    assert "already published" in capsys.readouterr().out

    # a job killed after the policy stage resumes its checkpoints and publishes a new version
    work = next((tmp_path / "work" / "base__qa").iterdir())
    for name in ("published.json", "eval.json", "pareto.json"):
        (work / name).unlink()
    ref2 = calibrate(["--pair", "base:qa", "--config", str(cfg)])
    out = capsys.readouterr().out
    for line in ("stage traces: resumed", "stage linear: resumed", "stage policy: resumed", "stage xnorm: resumed"):
        assert line in out, f"{line!r} missing from:\n{out}"
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
