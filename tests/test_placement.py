"""Placement by the machine's cores (no Ray started): autoscaling caps, compute threads per process, and how
`scd loadtest` tells the processes of a Ray cluster apart."""
from pathlib import Path

import pytest

from cli.processes import Proc, counts, cpu_by_role, role_of
from cluster.config import load_config, parse
from cluster.runtime import replica_caps, threads_for
from serve_app.app import embedded_cores, specialist_options

REPO = Path(__file__).resolve().parents[1]


def config(specialists: list[dict], producer: dict | None = None):
    return parse({"producer": {"name": "base", "path": "demo_models/base", **(producer or {})},
                  "specialists": [{"path": f"demo_models/{s['name']}", **s} for s in specialists]}, REPO)


def test_the_demo_config_scales_nowhere_on_two_cores_and_as_configured_on_sixteen():
    cfg = load_config(REPO / "ray_config.yaml")
    assert replica_caps(cfg, 2) == {"qa": 1, "prose": 1, "code": 1}      # producer + 3 engines > 2 cores
    assert replica_caps(cfg, 16) == {"qa": 2, "prose": 2, "code": 2}
    assert replica_caps(cfg, None) == {"qa": 2, "prose": 2, "code": 2}   # a cluster places by its resources
    assert embedded_cores(cfg) >= 1
    assert embedded_cores(cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"cores": 16})})) == 16
    assert embedded_cores(cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"address": "auto"})})) is None
    opts = specialist_options(cfg, "qa", replica_caps(cfg, 2)["qa"])["autoscaling_config"]
    assert (opts["min_replicas"], opts["max_replicas"], opts["initial_replicas"]) == (1, 1, 1)


def test_replicas_per_node_reach_serve_and_cap_a_one_machine_cluster():
    cfg = config([{"name": "qa", "autoscaling": {"min_replicas": 2, "max_replicas": 3, "max_replicas_per_node": 1}},
                  {"name": "code", "autoscaling": {"min_replicas": 1, "max_replicas": 3}}])
    assert replica_caps(cfg, 16) == {"qa": 1, "code": 3}                 # one machine is one node
    assert replica_caps(cfg, None) == {"qa": 3, "code": 3}               # a cluster's nodes take one each
    assert specialist_options(cfg, "qa")["max_replicas_per_node"] == 1
    assert "max_replicas_per_node" not in specialist_options(cfg, "code")
    auto = specialist_options(cfg, "qa", replica_caps(cfg, 16)["qa"])["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 1), auto


def test_spare_cores_go_round_robin_in_config_order_up_to_each_maximum():
    auto = lambda lo, hi: {"autoscaling": {"min_replicas": lo, "max_replicas": hi}}      # noqa: E731
    cfg = config([{"name": "qa", **auto(1, 4)}, {"name": "prose", **auto(1, 2)}, {"name": "code", **auto(1, 4)}])
    # 8 cores: producer 1 + three engines 3 = 4; the 4 left go qa, prose, code, qa
    assert replica_caps(cfg, 8) == {"qa": 3, "prose": 2, "code": 2}
    # a specialist of 2 CPUs an engine takes two cores a replica; a GPU specialist keeps its maximum
    cfg = config([{"name": "qa", "num_cpus": 2, **auto(1, 3)}, {"name": "code", "num_gpus": 1, **auto(1, 5)}])
    assert replica_caps(cfg, 6) == {"qa": 2, "code": 5}                  # 6 - 1 (producer) - 2 = 3: one more qa
    # min_replicas 0 still starts one replica (Serve's initial replica), which takes its core
    cfg = config([{"name": "qa", **auto(0, 3)}])
    assert replica_caps(cfg, 3) == {"qa": 2}


@pytest.mark.parametrize("assigned, node, cores, want", [
    (1, 8, 2, 1),        # the demo: 8 CPUs declared on 2 cores
    (4, 8, 2, 1),        # a quarter of the node is half a core: one thread, not four
    (4, 16, 16, 4),      # a node declaring its real cores: what was granted
    (8, 16, 32, 8),      # more cores than declared: still what was granted
    (0.5, 2, 2, 1),      # a fraction: at least one
    (2, 0, 2, 2),        # no node figure: what was granted
])
def test_threads_are_the_granted_share_of_the_real_cores(assigned, node, cores, want):
    assert threads_for(assigned, node, cores) == want


@pytest.mark.parametrize("cmdline, name, role", [
    (["ray::SpecialistActor.generate"], "ray::Specialist", "SpecialistActor"),
    (["ray::ServeReplica:scd:specialist-qa"], "ray::ServeRepli", "replica:specialist"),
    (["ray::ServeReplica:scd:Router.handle_request_with_rejection"], "ray::ServeRepli", "replica:Router"),
    (["ray::IDLE"], "ray::IDLE", "idle worker"),
    (["/x/site-packages/ray/core/src/ray/raylet/raylet", "--python_worker_command=default_worker.py"], "raylet",
     "ray:raylet"),
    (["/x/bin/python3", "-u", "/x/site-packages/ray/autoscaler/_private/monitor.py"], "python3", "ray:monitor.py"),
    (["/x/bin/python", "-m", "cli.main", "serve"], "python", "driver"),
    (["/usr/bin/vim", "notes.txt"], "vim", None),
    (["/x/bin/python", "-m", "pytest"], "python", None),
])
def test_processes_are_told_apart_by_their_title(cmdline, name, role):
    assert role_of(cmdline, name) == role


def test_cpu_is_counted_by_role_from_the_first_snapshot_and_new_processes_from_zero():
    before = {1: Proc(1, "SpecialistActor", 91, 10.0), 2: Proc(2, "replica:Router", 40, 3.0)}
    after = {1: Proc(1, "SpecialistActor", 91, 12.5), 2: Proc(2, "replica:Router", 41, 3.5),
             3: Proc(3, "SpecialistActor", 80, 4.0)}                # a replica started during the run
    assert cpu_by_role(before, after) == {"SpecialistActor": 6.5, "replica:Router": 0.5}
    assert counts(after) == {"processes": 3, "threads": 212,
                             "by_role": {"SpecialistActor": [2, 171], "replica:Router": [1, 41]}}


def test_a_local_cluster_whose_raylet_missed_rays_startup_deadline_is_started_again(monkeypatch, tmp_path, capsys):
    """Ray gives a new node's raylet 30 s to register; on a machine too busy for that, `connect` stops what the
    failed start left running (the newest session's processes) and starts the cluster again, up to
    LOCAL_STARTS times, and then raises Ray's error."""
    import subprocess
    import sys
    import time

    import ray

    from cluster import runtime
    from cluster.config import RaySettings
    session = tmp_path / "session_2026-01-01_00-00-00_000000_1"
    session.mkdir()
    (tmp_path / "session_latest").symlink_to(session)
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(session)])   # names the session
    while session.name not in (Path("/proc") / str(left.pid) / "cmdline").read_text(errors="replace"):
        time.sleep(0.01)                                  # until the child runs its own command line
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) < 2:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    try:
        assert runtime.connect(RaySettings(), _temp_dir=str(tmp_path)) == {"CPU": 2.0}
        assert len(calls) == 2 and all(c["address"] == "local" for c in calls), calls
        assert left.wait(timeout=10) == -9, "the failed start's process was left running"
        assert "try 1 of 3" in capsys.readouterr().err
        calls.clear()
        monkeypatch.setattr(runtime, "LOCAL_STARTS", 2)

        def always_late(**kwargs):
            calls.append(kwargs)
            raise Exception("The current node timed out during startup.")

        monkeypatch.setattr(ray, "init", always_late)
        with pytest.raises(Exception, match="timed out during startup"):
            runtime.connect(RaySettings(), _temp_dir=str(tmp_path))
        assert len(calls) == 2, calls
    finally:
        left.kill()


def test_an_embedded_clusters_processes_log_at_the_configs_level_and_the_drivers_environment_is_left_as_it_was(
        monkeypatch):
    """`ray.log_level` reaches ray.init (the driver's Ray logger) and, through the environment the cluster's
    processes inherit while it starts, Ray's loggers in its workers; the driver's own environment is as before."""
    import os

    import ray

    from cluster import runtime
    from cluster.config import RaySettings
    seen = []

    def init(**kwargs):
        seen.append((kwargs["logging_level"], os.environ.get("RAY_LOGGER_LEVEL")))

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.delenv("RAY_LOGGER_LEVEL", raising=False)
    runtime.connect(RaySettings(log_level="ERROR"))
    assert seen == [("ERROR", "error")] and "RAY_LOGGER_LEVEL" not in os.environ, seen
    monkeypatch.setenv("RAY_LOGGER_LEVEL", "debug")
    runtime.start_local(logging_level=30)                    # an int level, as ray.init takes too
    assert seen[-1] == (30, "warning") and os.environ["RAY_LOGGER_LEVEL"] == "debug", seen
