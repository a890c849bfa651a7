"""/healthz's report from the pool's and the specialists' statuses, without a cluster (serve_app.health)."""
import time

from serve_app.health import deployment_state, problem_lines, problems

UP = {"state": "up", "versions": {"base:qa": "v1", "base:code": "v1"}}


def test_a_healthy_deployment_has_no_problems():
    specialists = {"qa": {}, "code": {}}
    found = problems({"p0": UP}, specialists, "base", set())
    assert found == [] and deployment_state(specialists, found) == "ok", found


def test_each_reason_an_answer_is_not_served_by_scd_at_once_is_one_line():
    """A producer down (since it went down), a pair no producer holds an artifact for (not a group's member),
    a pair a producer reports a problem for (the earliest report among producers), a busy specialist, one that
    serves by its own prefill; a LoRA group's member needs no artifact."""
    now = time.time()
    producers = {"p0": {**UP, "problems": {"base:code": {"reason": "stale artifact", "since": now - 5}}},
                 "p1": {**UP, "problems": {"base:code": {"reason": "later report", "since": now - 1}}},
                 "p2": {"state": "restarting", "error": "actor died", "down_for_s": 30.0}}
    specialists = {"qa": {"unavailable_reason": "no codes"}, "code": {}, "prose": {"busy": "no status within 2 s"},
                   "member": {}}
    found = problems(producers, specialists, "base", {"member"})
    by_what = {what: (why, since) for what, why, since in found}
    assert set(by_what) == {"producer p2", "base:code", "base:prose", "specialist prose", "base:qa"}, found
    assert by_what["producer p2"][0] == "restarting: actor died" and abs(by_what["producer p2"][1] - (now - 30)) < 5
    assert by_what["base:code"] == ("stale artifact", now - 5), by_what["base:code"]
    assert "no artifact loaded" in by_what["base:prose"][0] and "own prefill: no codes" in by_what["base:qa"][0]
    assert deployment_state(specialists, found) == "degraded"
    assert all(line.count("(since ") == 1 and line.endswith("Z)") for line in problem_lines(found)), found


def test_no_producer_and_no_specialist_answering_is_down():
    specialists = {"qa": {"error": "actor died"}, "code": {"error": "actor died"}}
    found = problems({}, specialists, "base", set())
    assert ("producers", "the pool has no producer") in [(w, y) for w, y, _ in found], found
    assert deployment_state(specialists, found) == "down"
    assert deployment_state({"qa": {"error": "x"}, "code": {}}, found) == "degraded"
