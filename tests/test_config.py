"""ray_config.yaml validation: one error naming every problem by its path; transports resolved or refused."""
import pytest
import yaml

from cluster.config import ConfigError, load_config, parse
from serve_app.app import serve_deploy_config

GOOD = {"producer": {"name": "base", "path": "demo_models/base"},
        "specialists": [{"name": "qa", "path": "demo_models/qa"}]}


def test_repo_config_loads_and_resolves_paths_against_its_folder():
    cfg = load_config("ray_config.yaml")
    assert cfg.producer.path.endswith("demo_models/base") and cfg.producer.path.startswith("/")
    assert cfg.resolved_transport() == "object_store"          # auto on CPU


def test_a_bad_file_gets_one_error_listing_every_problem_with_its_path(tmp_path):
    bad = {"producer": {"name": "base", "path": "p", "num_gpus": -1},
           "specialists": [{"name": "qa", "path": "q", "autoscaling": {"min_replicas": 3, "max_replicas": 1}},
                           {"name": "bad name!", "path": "r"}],
           "transport": "carrier-pigeon", "http": {"port": 70000}, "surprise": 1}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    for where in ("producer.num_gpus", "specialists[0].autoscaling", "specialists[1].name", "transport",
                  "http.port", "surprise"):
        assert where in msg, f"{where!r} not named in:\n{msg}"
    assert msg.startswith("6 problem(s)"), msg


def test_nccl_needs_every_model_on_a_gpu_and_auto_stays_on_the_object_store_without():
    with pytest.raises(ConfigError) as e:
        parse({**GOOD, "transport": "nccl"})
    assert "num_gpus > 0" in str(e.value) and "base" in str(e.value) and "qa" in str(e.value)
    gpus = {"producer": {**GOOD["producer"], "num_gpus": 1},
            "specialists": [{**GOOD["specialists"][0], "num_gpus": 1}]}
    assert parse({**gpus, "transport": "nccl"}).resolved_transport() == "nccl"
    assert parse({**GOOD, "transport": "nccl_fake"}).resolved_transport() == "nccl_fake"
    assert parse(GOOD).resolved_transport() == "object_store"


def test_serve_deploy_config_carries_autoscaling_and_placement():
    cfg = parse({**GOOD, "specialists": [{**GOOD["specialists"][0], "num_gpus": 0.5,
                                          "autoscaling": {"min_replicas": 1, "max_replicas": 4}}]})
    out = serve_deploy_config(cfg, "/etc/scd.yaml")
    dep = out["applications"][0]["deployments"][0]
    assert dep["name"] == "specialist-qa" and dep["autoscaling_config"]["max_replicas"] == 4
    assert dep["ray_actor_options"]["num_gpus"] == 0.5
    assert out["applications"][0]["args"] == {"config": "/etc/scd.yaml"}
