"""`scd calibrate` submits one Ray Job per pair through the Jobs API and follows them to completion."""
from pathlib import Path

from artifacts_store import ArtifactStore
from cli.main import main as scd
from tests.conftest import SERVE_BUDGET, write_config

REPO = Path(__file__).resolve().parents[1]


def test_two_pairs_calibrated_as_concurrent_jobs(ray_cluster, tmp_path, capsys, demo_work_dir):
    # the session's checkpoints: the jobs resume the fits the serving tests made, and evaluate and publish here
    cfg = write_config(tmp_path, **SERVE_BUDGET, work_dir=demo_work_dir)
    rc = scd(["calibrate", "--pair", "base:qa", "--pair", "base:prose", "--address", ray_cluster,
              "--config", str(cfg), "--working-dir", str(REPO)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "base:qa: SUCCEEDED" in out and "base:prose: SUCCEEDED" in out, out[-3000:]
    assert "[base:qa] [calibrate] published" in out and "[base:prose] [calibrate] published" in out
    store = ArtifactStore(tmp_path / "store")
    assert {v.pair for v in store.list()} == {"base:qa", "base:prose"}
    assert all(store.verify(v.ref).ok for v in store.list())
    m = store.show("base:qa")                  # write_config turns the report's diagnostics off
    assert "report/pareto.png" not in m.files and "report/sensitivity.png" in m.files, sorted(m.files)
    summary = next(p for p in (tmp_path / "store").rglob("summary.md") if "qa" in str(p)).read_text()
    assert "not measured (calibration.diagnostics off)" in summary, summary


def test_a_failing_job_makes_the_command_fail(ray_cluster, tmp_path, capsys):
    cfg = write_config(tmp_path, prefixes=8, val=2, heldout=1)
    rc = scd(["calibrate", "--pair", "base:qa", "--address", ray_cluster, "--config", str(cfg),
              "--working-dir", str(REPO), "--", "--prefixes", "-3"])
    out = capsys.readouterr().out
    assert rc == 1 and "base:qa: FAILED" in out, out[-2000:]
