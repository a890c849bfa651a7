"""Node failure on a simulated 3-node cluster: the producer's node is killed under load, and the app heals.

The drill runs in its own process (tests/multinode_drill.py starts its own Ray Cluster, while this session's
other tests share one `ray.init`) and prints one JSON line of what it saw; this test asserts on that line.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 60          # the producer ALIVE elsewhere and answering scd, and qa back at 2 replicas, within this
TIMEOUT_S = 480       # the whole drill (3 nodes, Serve, load, recovery, teardown) on 2 cores


@pytest.fixture(scope="module")
def drill(demo_store):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}    # the drill starts its own cluster
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "multinode_drill.py"), "--bound-s", str(BOUND_S),
                             "--store", str(demo_store)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)             # its own process group: the Cluster's too
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)                     # the drill's finally tears its cluster down
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"the drill ran past {TIMEOUT_S} s; stderr tail:\n{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"drill exited {proc.returncode}: {lines[-1:]}\nstderr tail:\n{err[-3000:]}"
    seen = json.loads(lines[-1])
    print(json.dumps(seen, indent=1))                           # shown with -s, or next to a failure
    return seen


def test_models_run_only_where_the_config_places_them(drill):
    before = drill["placement_before"]
    assert before["producer"][0].startswith("worker"), before
    assert sorted(before["specialist-qa"]) == ["worker1", "worker2"], before    # label selector, one a node


def test_every_request_during_the_drill_is_answered(drill):
    req = drill["requests"]
    assert req["ended_after_kill"] > 0, req
    assert req["not_200"] == [], json.dumps(req, indent=1)
    for outcome in req["outcomes"]:
        status, mode, *reason = outcome.split()
        assert mode == "scd" or (mode == "fallback" and reason), outcome


def test_producer_comes_back_on_a_survivor_and_serves_scd_again(drill):
    back, after = drill["after_kill_s"], drill["placement_after"]
    assert "producer_alive" in back and "scd_again" in back, drill
    assert back["producer_alive"] <= BOUND_S and back["scd_again"] <= BOUND_S, back
    assert after["producer"] and after["producer"][0] != drill["killed"], after
    assert drill["producer_restarted_in_place"], "the producer came back as a new actor, not restarted by Ray"


def test_serve_replaces_the_replicas_of_the_dead_node(drill):
    back, after = drill["after_kill_s"], drill["placement_after"]
    assert drill["qa_running_min_after_kill"] < 2, "Serve never noticed that a replica died"
    assert back.get("replicas_running", BOUND_S + 1) <= BOUND_S, back
    assert drill["qa_running_after"] == 2 and drill["killed"] not in after["specialist-qa"], after
