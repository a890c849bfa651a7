"""ray_config.yaml validation: one error naming every problem by its path; transports resolved or refused."""
import re

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse
from serve_app.app import engine_options, serve_deploy_config
from tests.conftest import DEMO

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


def test_cuda_ipc_needs_every_model_on_a_gpu_and_auto_picks_nixl_on_gpus_only():
    with pytest.raises(ConfigError) as e:
        parse({**GOOD, "transport": "cuda_ipc"})
    assert "num_gpus > 0" in str(e.value) and "base" in str(e.value) and "qa" in str(e.value)
    gpus = {"producer": {**GOOD["producer"], "num_gpus": 0.5},
            "specialists": [{**GOOD["specialists"][0], "num_gpus": 0.5}]}
    assert parse({**gpus, "transport": "cuda_ipc"}).resolved_transport() == "cuda_ipc"
    assert parse(gpus).resolved_transport() == "nixl"
    assert parse({**GOOD, "transport": "nixl"}).resolved_transport() == "nixl"
    assert parse(GOOD).resolved_transport() == "object_store"
    with pytest.raises(ConfigError, match="transport"):
        parse({**GOOD, "transport": "nccl"})


def test_a_producers_code_cache_and_staging_default_by_its_device_and_reach_its_transport():
    from actors.producer_pool import producer_spec
    from actors.transport import make_transport
    mib = 1 << 20
    assert parse(GOOD).producer.memory_bytes() == (64 * mib, 256 * mib)
    on_gpu = parse({**GOOD, "producer": {**GOOD["producer"], "num_gpus": 0.5}})
    assert on_gpu.producer.memory_bytes() == (2048 * mib, 4096 * mib)
    set_ = parse({**GOOD, "producer": {**GOOD["producer"], "num_gpus": 0.5, "cache_mb": 0, "stage_mb": 512}})
    assert set_.producer.memory_bytes() == (0, 512 * mib)
    assert producer_spec(set_)["memory_bytes"] == [0, 512 * mib]
    assert make_transport("nixl", stage_bytes=512 * mib).stage.stage_bytes == 512 * mib
    with pytest.raises(ConfigError, match="stage_mb"):
        parse({**GOOD, "producer": {**GOOD["producer"], "stage_mb": 0}})


def test_serve_deploy_config_carries_autoscaling_and_placement():
    cfg = parse({**GOOD, "specialists": [{**GOOD["specialists"][0], "num_gpus": 0.5,
                                          "autoscaling": {"min_replicas": 1, "max_replicas": 4,
                                                          "look_back_period_s": 12}}]})
    out = serve_deploy_config(cfg, "/etc/scd.yaml")
    dep = out["applications"][0]["deployments"][0]
    assert dep["name"] == "specialist-qa" and dep["autoscaling_config"]["max_replicas"] == 4
    assert dep["autoscaling_config"]["look_back_period_s"] == 12
    assert dep["ray_actor_options"] == {"num_cpus": 0}            # a thin shim: the engine actor holds the GPU
    assert engine_options(cfg, "qa")["num_gpus"] == 0.5
    assert out["applications"][0]["args"] == {"config": "/etc/scd.yaml"}


def test_serves_own_lines_log_at_the_configured_level_and_an_access_log_at_info():
    """Serve's controller, proxy and our deployments log at ray.log_level (WARNING unless set); an access log's
    lines are INFO, so asking for one logs Serve at INFO, and a finer level than that is kept."""
    from serve_app.app import logging_config
    cases = [({}, {"enable_access_log": False, "log_level": "WARNING"}),
             ({"ray": {"log_level": "INFO"}}, {"enable_access_log": False, "log_level": "INFO"}),
             ({"telemetry": {"access_log": True}}, {"enable_access_log": True, "log_level": "INFO"}),
             ({"ray": {"log_level": "DEBUG"}, "telemetry": {"access_log": True}},
              {"enable_access_log": True, "log_level": "DEBUG"})]
    for extra, expected in cases:
        cfg = parse({**GOOD, **extra})
        assert logging_config(cfg) == expected, extra
        assert serve_deploy_config(cfg, "/c.yaml")["applications"][0]["deployments"][0]["logging_config"] == expected
    with pytest.raises(ConfigError, match="log_level"):
        parse({**GOOD, "ray": {"log_level": "LOUD"}})


def test_the_autoscaling_window_is_longer_than_serves_metrics_interval(monkeypatch):
    """A window with no measurement in it is refused, in one line that says why; Serve's interval is its own
    setting (10 s unless its environment variable says otherwise)."""
    def with_window(s: float):
        return parse({**GOOD, "specialists": [{**GOOD["specialists"][0],
                                               "autoscaling": {"look_back_period_s": s}}]})
    monkeypatch.delenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", raising=False)
    with pytest.raises(ConfigError, match=r"look_back_period_s \(10\) must be longer than Serve's metrics interval"
                                          r" \(10 s\)"):
        with_window(10)
    assert with_window(11).specialists[0].autoscaling.look_back_period_s == 11
    monkeypatch.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    assert with_window(3).specialists[0].autoscaling.look_back_period_s == 3


PLACED = {"producer": {**GOOD["producer"], "resources": {"scd_producer": 1},
                       "node_labels": {"scd-role": "worker", "example.com/gpu": "in(A100, H100)"}},
          "specialists": [{**GOOD["specialists"][0], "num_gpus": 0.5, "resources": {"specialist_host": 0.25},
                           "node_labels": {"zone": "!spot"}},
                          {"name": "code", "path": "demo_models/code"}]}


def test_placement_keys_become_ray_resources_and_label_selector_for_producer_and_serve_replicas():
    from ray._common.ray_option_utils import validate_actor_options
    from ray.serve.schema import ServeDeploySchema

    from cluster.runtime import actor_options
    cfg = parse(PLACED)
    p = cfg.producer
    producer = actor_options(p.num_gpus, name="scd-producer", detached=True, num_cpus=p.num_cpus,
                             resources=p.resources, node_labels=p.node_labels)
    assert producer["resources"] == {"scd_producer": 1}
    assert producer["label_selector"] == {"scd-role": "worker", "example.com/gpu": "in(A100, H100)"}
    validate_actor_options(producer, in_options=True)              # what Ray's .options() checks
    out = serve_deploy_config(cfg, "/etc/scd.yaml")
    qa, code = out["applications"][0]["deployments"]
    # each replica's engine actor is placed as the specialist says; the replica itself follows its labels only
    assert engine_options(cfg, "qa") == {"num_gpus": 0.5, "num_cpus": 0, "resources": {"specialist_host": 0.25},
                                         "label_selector": {"zone": "!spot"}}
    assert engine_options(cfg, "code") == {"num_gpus": 0, "num_cpus": 1}    # no placement: no empty keys
    validate_actor_options(engine_options(cfg, "qa"), in_options=True)
    assert qa["ray_actor_options"] == {"num_cpus": 0, "label_selector": {"zone": "!spot"}}
    assert code["ray_actor_options"] == {"num_cpus": 0}
    ServeDeploySchema.model_validate(out)                          # what `serve deploy` checks


def test_bad_placement_is_one_config_error_naming_each_key():
    bad = {"producer": {**GOOD["producer"], "resources": {"CPU": 1, "node:10.0.0.1": 1, "gpu host": 1}},
           "specialists": [{**GOOD["specialists"][0], "resources": {"specialist_host": 0},
                            "node_labels": {"-zone": "a", "tier": "gold silver"}}]}
    with pytest.raises(ConfigError) as e:
        parse(bad)
    msg = str(e.value)
    assert msg.startswith("3 problem(s)"), msg
    for words in ("producer.resources", "use num_cpus", "use node_labels", "'gpu host' is not a resource name",
                  "specialists[0].resources", "must be positive", "specialists[0].node_labels",
                  "label key '-zone'", "'gold silver' is not a label selector value"):
        assert words in msg, f"{words!r} not in:\n{msg}"


@pytest.mark.parametrize("key,value", [("zone", "a"), ("zone", "!a"), ("zone", "in(a,b)"), ("zone", "!in(a, b)"),
                                       ("example.com/gpu", "H100"), ("ray.io/node-id", "ab12"), ("z", "a-b.c_d"),
                                       ("-zone", "a"), ("zone", "a b"), ("zone", "in()"), ("zone", "!!a"),
                                       ("a/b/c", "x"), ("zone", "-a"), ("zone", "x" * 64), ("k" * 64, "v")])
def test_label_checks_agree_with_rays_own(key, value):
    from ray._private.label_utils import validate_label_selector
    ray_ok = validate_label_selector({key: value}) is None
    try:
        parse({"producer": {**GOOD["producer"], "node_labels": {key: value}}, "specialists": GOOD["specialists"]})
        ours = True
    except ConfigError:
        ours = False
    assert ours == ray_ok, f"{key}: {value!r}: ours {ours}, Ray's {ray_ok}"


def test_the_example_cluster_file_passes_rays_checks_and_offers_what_placed_models_ask_for():
    from pathlib import Path

    from ray.autoscaler._private.util import prepare_config, validate_config
    example = Path(__file__).resolve().parents[1] / "cluster" / "ray-cluster.example.yaml"
    cluster = prepare_config(yaml.safe_load(example.read_text()))     # what `ray up` does before launching
    validate_config(cluster)                                          # ray-schema.json and node-type checks
    types = cluster["available_node_types"]
    cfg = parse({"producer": {**GOOD["producer"], "num_gpus": 1, "resources": {"scd_producer": 1},
                              "node_labels": {"scd-role": "producer"}},
                 "specialists": [{**GOOD["specialists"][0], "num_gpus": 1, "resources": {"scd_specialist": 1},
                                  "node_labels": {"scd-gpu": "a10g"}}]})           # README "Several machines"
    for m in (cfg.producer, *cfg.specialists):
        hosts = [name for name, t in types.items()
                 if all(t["resources"].get(k, 0) >= v for k, v in m.resources.items())
                 and all(t.get("labels", {}).get(k) == v for k, v in m.node_labels.items())]
        assert hosts and "head" not in hosts, f"{m.name}: no node type offers {m.resources} {m.node_labels}"


def _other_value(name, field):
    """A valid value of a calibration setting that differs from its default."""
    from typing import Literal, get_args, get_origin
    if get_origin(field.annotation) is Literal:
        return next(v for v in get_args(field.annotation) if v != field.default)
    if isinstance(field.default, bool):
        return not field.default
    if field.default is None or field.default == []:
        return [2] if "list" in str(field.annotation) else 0.5
    if isinstance(field.default, list):
        return field.default[:1]
    return field.default + 1 if not isinstance(field.default, float) else min(field.default * 0.5 + 0.01, 1.0)


def test_every_calibration_setting_is_settable_from_the_config_and_is_a_scd_eval_flag_with_its_default():
    import argparse

    from cluster.calibration_settings import CalibrationSettings
    from cli.evaluate import NOT_FLAGS, add_pair_args
    from scd.settings import CalibConfig
    changed = {n: _other_value(n, f) for n, f in CalibrationSettings.model_fields.items()
               if n not in ("work_dir", "text_file")}                  # paths: checked by the tests of each
    cfg = parse({**GOOD, "calibration": changed})
    for name, value in changed.items():
        assert getattr(cfg.calibration, name) == value, name
    fit = CalibConfig.of(cfg.calibration)
    assert set(CalibConfig.model_fields) <= set(CalibrationSettings.model_fields)
    assert fit.model_dump() == {n: changed[n] for n in CalibConfig.model_fields}     # the fit sees every change
    p = argparse.ArgumentParser()
    add_pair_args(p)
    defaults = vars(p.parse_args([]))
    for name, field in CalibrationSettings.model_fields.items():
        if name not in NOT_FLAGS:
            assert defaults[name] == field.default, f"--{name} default {defaults[name]!r} != {field.default!r}"
    flip = "--no-finetune-encoders" if CalibConfig().finetune_encoders else "--finetune-encoders"
    args = p.parse_args(["--calib", "7", "--ridge", "0.5", "--code-dtype", "int8", flip])
    assert (args.prefixes, args.ridge, args.code_dtype) == (7, 0.5, "int8")
    assert args.finetune_encoders != CalibConfig().finetune_encoders
    with pytest.raises(SystemExit):                                    # choices come from the schema
        p.parse_args(["--reuse-source", "telepathy"])


def test_with_a_config_an_explicit_settings_flag_overrides_the_config_and_the_others_come_from_it():
    import argparse
    from cli.evaluate import add_pair_args, parse as parse_args, resolve_pair
    cfg = load_config("configs/smollm2.yaml")
    assert cfg.calibration.finetune_samples != 0 and cfg.calibration.r_h != 32
    p = argparse.ArgumentParser()
    add_pair_args(p)
    args = parse_args(p, ["--config", "configs/smollm2.yaml", "--pair", "smollm2:qa", "--finetune-samples", "0"])
    resolve_pair(args)
    assert args.finetune_samples == 0, "an explicit flag must win over the config"
    qa = cfg.calibration_for("qa")
    assert args.r_h == qa.r_h and args.reuse_source == qa.reuse_source
    assert args.work_dir == cfg.calibration.work_dir
    from cli.evaluate import PLAN_LISTS, plan_settings
    stages = plan_settings(args)              # the plan stages read the pair's lists (entries, stops, ...) as the job
    assert {n: getattr(stages, n) for n in PLAN_LISTS} == {n: getattr(qa, n) for n in PLAN_LISTS}
    assert (stages.entries, stages.stops) == ([17], [25, 27]), (stages.entries, stages.stops)


def test_links_default_to_the_global_bandwidth_a_specialist_overrides_and_bad_values_are_named():
    two = {**GOOD, "specialists": [{"name": "qa", "path": "q"}, {"name": "code", "path": "c", "link_gbps": 10}]}
    assert parse(two).link_gbps() == {"base:code": 10}                          # qa's bandwidth is not known
    cfg = parse({**two, "link": {"bandwidth_gbps": 100, "ttft_target_ms": 50}})
    assert cfg.link_gbps() == {"base:qa": 100, "base:code": 10} and cfg.link.ttft_target_ms == 50
    with pytest.raises(ConfigError) as e:
        parse({**two, "link": {"bandwidth_gbps": 0, "ttft_target_ms": -1}})
    assert "link.bandwidth_gbps" in str(e.value) and "link.ttft_target_ms" in str(e.value)


def test_families_are_named_apart_from_every_model_and_pinned_versions_are_gc_pins():
    from cli.artifacts import pins
    two = {**GOOD, "specialists": [{"name": "qa", "path": "q"}, {"name": "code", "path": "c"}]}
    cfg = parse({**two, "families": [{"name": "fam"}, {"name": "old", "artifact": "3"}]})
    assert cfg.family_refs() == {"base:fam": "latest", "base:old": "3"}
    assert pins(cfg) == ["base:old@3"]
    for bad, msg in (([{"name": "qa"}], "differ from every model's name: ['qa']"),
                     ([{"name": "f"}, {"name": "f"}], "unique"), ([{"name": "../x"}], "families[0].name")):
        with pytest.raises(ConfigError) as e:
            parse({**two, "families": bad})
        assert msg in str(e.value), str(e.value)


def test_a_bigram_table_without_a_token_table_is_refused_by_name(tmp_path):
    from scd.settings import CalibConfig
    raw = yaml.safe_load(open("ray_config.yaml"))
    raw["calibration"]["token_table"] = 0
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="bigram_table needs token_table") as e:
        load_config(path)
    assert "calibration" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="bigram_table needs token_table"):
        CalibConfig(bigram_table=8)
    assert CalibConfig(bigram_table=8, token_table=4).bigram_table == 8


def test_patch_codes_at_the_default_rank_are_capped_at_a_small_models_hidden_size(tmp_path):
    from scd.fitting.calibrate import CalibConfig, Calibration
    from scd.online.models import ModelSpec
    from tests.conftest import tiny_llama
    wide = CalibConfig()
    assert wide.r_h > 32 and wide.for_hidden(32).r_h == 32 and wide.for_hidden(32).x_group == wide.x_group
    assert CalibConfig(r_h=16).for_hidden(32).r_h == 16
    a = tiny_llama(0)                                                    # hidden size 32
    cal = Calibration(a, a, ModelSpec.from_config(a.config), "a:a", [], tmp_path, wide, log=lambda s: None)
    assert cal.cfg.r_h == 32, cal.cfg.r_h


def test_a_specialist_overrides_fit_settings_for_its_own_pair_only_and_bad_overrides_are_named():
    two = {**GOOD, "calibration": {"pool": 4, "patch_cost": 0.1},
           "specialists": [{"name": "qa", "path": "q", "calibration": {"pool": 6, "patch_cost": 0.02}},
                           {"name": "code", "path": "c"}]}
    cfg = parse(two)
    qa, code = cfg.calibration_for("qa"), cfg.calibration_for("code")
    assert (qa.pool, qa.patch_cost) == (6, 0.02) and (code.pool, code.patch_cost) == (4, 0.1)
    assert qa.work_dir == code.work_dir == cfg.calibration.work_dir and qa.r_h == code.r_h
    assert (cfg.calibration.pool, cfg.calibration.patch_cost) == (4, 0.1), "the section itself must not change"
    own = parse({**two, "specialists": [{"name": "qa", "path": "q", "calibration": {
        "exact_dtype": "auto", "exact_step": 0.2, "max_kl": 0.002, "val": 24}}]}).calibration_for("qa")
    assert (own.exact_dtype, own.exact_step, own.max_kl) == ("auto", 0.2, 0.002), "a pair's own bound and wire form"
    assert (own.val, cfg.calibration_for("code").val) == (24, cfg.calibration.val), "a pair's own validation samples"
    for bad, msg in (({"pool": 0}, "specialists[0].calibration.pool"),
                     ({"exact_dtype": "int3"}, "specialists[0].calibration.exact_dtype"),
                     ({"prefixes": 64, "colour": 1}, "['colour', 'prefixes'] are not fit settings"),
                     ({"bigram_table": 8, "token_table": 0}, "bigram_table needs token_table")):
        with pytest.raises(ConfigError) as e:
            parse({**two, "specialists": [{"name": "qa", "path": "q", "calibration": bad}]})
        assert msg in str(e.value), str(e.value)


def test_scd_eval_with_a_config_fits_a_pair_with_its_specialists_own_settings(tmp_path):
    import argparse
    from cli.evaluate import add_pair_args, parse as parse_args, resolve_pair
    raw = yaml.safe_load(open("configs/smollm2.yaml"))
    raw["specialists"][0]["calibration"] = {"pool": 6}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = argparse.ArgumentParser()
    add_pair_args(p)
    got = {}
    for name in ("qa", "code"):
        args = parse_args(p, ["--config", str(path), "--pair", f"smollm2:{name}"])
        resolve_pair(args)
        got[name] = args.pool
    assert got == {"qa": 6, "code": load_config(path).calibration.pool}, got


def test_a_pair_calibrates_on_its_own_text_file_resolved_against_the_config_and_checked(tmp_path, monkeypatch):
    """calibration.text_file (the section's, or a specialist's own) is resolved like the model paths, refused
    by name when missing, and is what the calibration job draws its prefixes from."""
    import yaml
    from cluster.config import ConfigError
    (tmp_path / "support.txt").write_text("First paragraph of my own text.\n\nSecond one.\n")
    (tmp_path / "legal.txt").write_text("A clause.\n\nAnother clause.\n")
    raw = {"producer": {"name": "base", "path": str(DEMO / "base")},
           "specialists": [{"name": "support", "path": str(DEMO / "qa")},
                           {"name": "legal", "path": str(DEMO / "prose"), "calibration": {"text_file": "legal.txt"}}],
           "calibration": {"text_file": "support.txt"}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    assert cfg.calibration_for("support").text_file == str(tmp_path / "support.txt")
    assert cfg.calibration_for("legal").text_file == str(tmp_path / "legal.txt")
    raw["specialists"][1]["calibration"]["text_file"] = "gone.txt"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"specialists.legal.calibration.text_file: .*gone.txt is not a file"):
        load_config(path)

    raw["specialists"][1]["calibration"]["text_file"] = "legal.txt"
    path.write_text(yaml.safe_dump(raw))
    from jobs import calibrate
    seen = []

    def stop(*args, text_file=None, **kw):
        seen.append(text_file)
        raise SystemExit("stopped after choosing the data")
    monkeypatch.setattr(calibrate.samples, "pair_data", stop)
    with pytest.raises(SystemExit, match="stopped"):
        calibrate.main(["--pair", "base:legal", "--config", str(path), "--no-actors", "--work-dir", str(tmp_path)])
    assert seen == [str(tmp_path / "legal.txt")]


def test_producer_pool_settings_are_checked_and_autoscaling_starts_within_its_range():
    cfg = parse({**GOOD, "producer": {**GOOD["producer"], "replicas": 3,
                                      "autoscaling": {"min_replicas": 1, "max_replicas": 2}}})
    assert cfg.producer.initial_replicas() == 2, "replicas is clamped into autoscaling's range"
    assert parse(GOOD).producer.initial_replicas() == 1 and parse(GOOD).producer.autoscaling is None
    bad = {**GOOD, "producer": {**GOOD["producer"], "replicas": 0, "load_bound": 1.0, "load_slack": -1,
                                "autoscaling": {"min_replicas": 3, "max_replicas": 2, "target_busy": 1.5}}}
    with pytest.raises(ConfigError) as e:
        parse(bad)
    for where in ("producer.replicas", "producer.load_bound", "producer.load_slack", "producer.autoscaling"):
        assert where in str(e.value), (where, str(e.value))


def test_a_lora_group_is_one_deployment_placed_and_capped_as_its_first_member():
    from cluster.runtime import replica_caps
    grow = {"min_replicas": 1, "max_replicas": 3}
    members = [{"name": n, "path": str(DEMO / "qa"), "group": "g", "autoscaling": grow} for n in ("a", "b", "c")]
    cfg = parse({**GOOD, "specialists": [*members, {"name": "solo", "path": str(DEMO / "qa"), "autoscaling": grow}]})
    assert [(s.name, [m.name for m in ms]) for s, ms in cfg.engines()] == [("a", ["a", "b", "c"]), ("solo", [])]
    names = [d["name"] for d in serve_deploy_config(cfg, "ray_config.yaml")["applications"][0]["deployments"]]
    assert names == ["group-g", "specialist-solo"]
    # 6 cores: the producer one, the group's first replica one and solo's one; the three left grow the group
    # and solo by turns, and the group's members count once
    assert replica_caps(cfg, 6) == {"a": 3, "b": 3, "c": 3, "solo": 2}


@pytest.mark.parametrize("change, says", [
    ({"group": "base"}, "must differ from every model's name"),
    ({"num_gpus": 0.5}, "b's num_gpus (0.5) differs from a's (0)"),
    ({"path": "shape://tiny"}, "are timing shapes"),
])
def test_a_lora_group_whose_members_cannot_share_an_engine_is_refused_in_one_line(change, says):
    members = [{"name": "a", "path": str(DEMO / "qa"), "group": change.get("group", "g")},
               {"name": "b", "path": str(DEMO / "qa"), "group": "g", **change}]
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse({**GOOD, "specialists": members})
