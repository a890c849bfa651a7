"""The benchmark tools run end to end on tiny settings (their figures are in docs/results/)."""
import pytest


def test_bench_decode_reports_every_batch_size(tmp_path, capsys):
    from tools.bench_decode import main
    rows = main(["--batches", "1,3", "--tokens", "3", "--lengths", "8,13", "--repeats", "1",
                 "--store", str(tmp_path / "no-store")])
    assert [r["batch"] for r in rows] == [1, 3] and rows[0]["vs_batch_1"] == 1.0, rows
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in rows), rows
    assert "caches prefilled (no published artifact" in capsys.readouterr().out


def test_bench_decode_refuses_bad_flags():
    from tools.bench_decode import main
    with pytest.raises(SystemExit, match="--batches"):
        main(["--batches", "1,x"])


def test_bench_transport_delivers_through_each_host_backend(ray_cluster):
    from tools.bench_transport import measure
    rows = measure([0.01], 1)
    assert {r["backend"] for r in rows} >= {"object_store", "nixl (host)"}, rows
    assert {r["backend"]: r["arrived"] for r in rows if "host" in r["backend"] or r["backend"] == "object_store"} \
        == {"object_store": "host bytes", "nixl (host)": "cpu"}, rows


def test_bench_exact_refuses_bad_flags_and_a_pair_without_an_artifact(tmp_path):
    import yaml
    from tools.bench_exact import main
    with pytest.raises(SystemExit, match="--answers"):
        main(["--answers", "16,x"])
    from tests.conftest import DEMO
    cfg = {"producer": {"name": "base", "path": str(DEMO / "base")},
           "specialists": [{"name": "qa", "path": str(DEMO / "qa")}], "artifacts": {"uri": str(tmp_path / "store")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="base:qa has no published artifact"):
        main(["--config", str(tmp_path / "c.yaml")])
