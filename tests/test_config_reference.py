"""docs/config-reference.md is what tools.config_reference writes from the schema now: a key added, removed or
redescribed in cluster/config.py, cluster/calibration_settings.py or scd/settings.py without regenerating fails
here, naming the key."""
import pytest
import yaml

from cluster.calibration_settings import CalibrationSettings
from cluster.config import DeploymentConfig, load_config
from tools.config_reference import OUT, first_difference, keys, main, render, rows


def test_the_config_reference_is_what_the_schema_generates():
    diff = first_difference(OUT.read_text(), render())
    assert diff is None, f"{OUT.name} is stale (regenerate: python -m tools.config_reference): {diff}"


def test_every_key_of_the_schema_has_a_row_with_a_description():
    documented = keys(OUT.read_text())
    assert {"calibration.text_file", "calibration.exact_step", "calibration.diagnostics", "artifacts.uri",
            "calibration.entry_train_epochs", "calibration.entry_train_lr", "calibration.work_dir",
            "specialists[].autoscaling.min_replicas", "calibration.seed"} <= set(documented)
    assert len(documented) == len(rows(DeploymentConfig)) and all(r.description for r in rows(DeploymentConfig))


def test_a_stale_reference_names_the_first_differing_key(monkeypatch, tmp_path, capsys):
    written = render()
    monkeypatch.setattr(CalibrationSettings.model_fields["work_dir"], "description", "somewhere else")
    assert first_difference(written, render()).startswith("calibration.work_dir: the file has")
    (tmp_path / "ref.md").write_text(written)
    assert main(["--check", "--out", str(tmp_path / "ref.md")]) == 1
    assert "calibration.work_dir" in capsys.readouterr().err
    monkeypatch.undo()
    new_key = "\n".join(line for line in written.splitlines() if not line.startswith("| `calibration.diagnostics`"))
    assert first_difference(new_key + "\n", written).startswith("calibration.diagnostics: in the schema, not in")


def test_a_key_without_a_description_is_refused(monkeypatch):
    monkeypatch.setattr(CalibrationSettings.model_fields["seed"], "description", None)
    with pytest.raises(ValueError, match=r"seed \(calibration.seed\) has no Field\(description"):
        render()


def test_default_paths_land_beside_the_config_file(tmp_path, monkeypatch):
    """What the reference says of paths: relative to the config file's folder, whatever the working dir."""
    tmp_path = tmp_path.resolve()
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text(yaml.safe_dump({"producer": {"name": "b", "path": "models/b"},
                                    "specialists": [{"name": "s", "path": "~/s"}]}))
    monkeypatch.chdir(tmp_path)
    cfg = load_config("cfg/c.yaml")
    assert cfg.artifacts.uri == str(tmp_path / "cfg" / "runs" / "artifacts")
    assert cfg.calibration.work_dir == str(tmp_path / "cfg" / "runs" / "calibrate")
    assert cfg.producer.path == str(tmp_path / "cfg" / "models" / "b")
    assert not cfg.specialists[0].path.startswith(str(tmp_path))          # ~ expanded, not joined
