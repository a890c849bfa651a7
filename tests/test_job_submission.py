"""Calibration jobs as submitted through the Jobs API (cluster.jobs), against a stand-in client: a job for which
Ray lost its working-dir package (before it started, or under its actors, as its log says) is submitted again;
any other failure is not."""
import logging
from types import SimpleNamespace

import pytest

from cluster import jobs
from tests.conftest import write_config

LOST = "OSError: Failed to download runtime_env file package gcs://_ray_pkg_8f62.zip from the GCS to the Ray worker"


class FakeClient:
    """Scripted outcomes per pair, one per submission: (status, error_type, log lines...)."""

    def __init__(self, outcomes: dict[str, list[tuple]]):
        self.outcomes, self.submitted, self.jobs = outcomes, [], {}

    def submit_job(self, entrypoint, runtime_env, submission_id):
        pair = entrypoint.split("--pair ")[1].split()[0]
        self.jobs[submission_id] = self.outcomes[pair].pop(0)
        self.submitted.append((pair, submission_id))
        return submission_id

    async def tail_job_logs(self, job_id):
        yield "".join(line + "\n" for line in (f"log of {job_id}", *self.jobs[job_id][2:]))

    def get_job_status(self, job_id):
        return self.jobs[job_id][0]

    def get_job_info(self, job_id):
        return SimpleNamespace(status=self.jobs[job_id][0], error_type=self.jobs[job_id][1])


def _run(tmp_path, monkeypatch, outcomes):
    client = FakeClient(outcomes)
    monkeypatch.setattr(jobs, "_client", lambda address: client)
    failed = jobs.submit_and_follow("http://x", list(outcomes), str(write_config(tmp_path)))
    return failed, [p for p, _ in client.submitted], client


def test_a_job_whose_package_ray_lost_is_submitted_again_and_other_failures_are_not(tmp_path, monkeypatch, capsys):
    failed, pairs, client = _run(tmp_path, monkeypatch, {
        "base:qa": [("FAILED", "RUNTIME_ENV_SETUP_FAILURE"), ("SUCCEEDED", None)],          # before it started
        "base:prose": [("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", LOST), ("SUCCEEDED", None)],  # under its actors
        "base:code": [("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", "ValueError: a bad setting")]})
    assert (pairs.count("base:qa"), pairs.count("base:prose"), pairs.count("base:code")) == (2, 2, 1), pairs
    assert len({job for _, job in client.submitted}) == len(pairs), "a resubmission reused a submission id"
    assert failed == 1, f"{failed} failures counted (only code's own error)"
    out = capsys.readouterr().out
    assert "base:qa: SUCCEEDED" in out and "base:prose: SUCCEEDED" in out and "base:code: FAILED" in out, out
    assert out.count("submitting it again") == 2, out


def test_a_job_is_submitted_again_once_at_most(tmp_path, monkeypatch):
    failed, pairs, _ = _run(tmp_path, monkeypatch, {"base:qa": [("FAILED", "RUNTIME_ENV_SETUP_FAILURE")] * 2})
    assert pairs == ["base:qa", "base:qa"] and failed == 1, (pairs, failed)


def test_the_job_clients_package_chatter_is_quiet_and_other_warnings_pass(caplog):
    """What Ray's job client logs about building the working dir's package (INFO) and the `.git` default exclude
    (a WARNING) stays out of the jobs' output; a warning of the same loggers about anything else does not."""
    jobs.quiet_job_client_logs()
    jobs.quiet_job_client_logs()                            # idempotent: one filter, not two
    packaging = logging.getLogger("ray._private.runtime_env.packaging")
    working_dir = logging.getLogger("ray._private.runtime_env.working_dir")
    assert len(working_dir.filters) == 1, working_dir.filters
    ray_logger = logging.getLogger("ray")                   # Ray's loggers do not propagate to the root one
    ray_logger.addHandler(caplog.handler)
    try:
        packaging.info("Ignoring upload to cluster for these files: [PosixPath('.gitignore')]")
        logging.getLogger("ray.dashboard.modules.dashboard_sdk").info("Uploading package gcs://_ray_pkg_1.zip.")
        working_dir.warning("Directory %r is now ignored by default when packaging the working directory.", ".git")
        working_dir.warning("working_dir is too large")
        packaging.warning("a package could not be read")
    finally:
        ray_logger.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records] == ["working_dir is too large", "a package could not be read"]


def test_a_jobs_api_that_does_not_answer_is_one_line_not_a_traceback(tmp_path):
    from cli.serve import port_taken
    from tests.conftest import free_port
    port = free_port()
    assert not port_taken("127.0.0.1", port)
    with pytest.raises(SystemExit) as e:
        jobs.submit_and_follow(f"http://127.0.0.1:{port}", ["base:qa"], str(write_config(tmp_path)))
    msg = str(e.value)
    assert msg.startswith(f"cannot reach a Ray Jobs API at http://127.0.0.1:{port}") and "\n" not in msg, msg


def _bar(desc: str, n: int, total: int | None, elapsed: float) -> str:
    from tqdm import tqdm
    return tqdm.format_meter(n, total, elapsed, prefix=desc)


def test_a_jobs_progress_bars_print_a_line_per_ten_seconds_and_their_end_once():
    """A bar's line per update (one under the other in a job's log) is thinned to the lines that cross a multiple
    of 10 s of its elapsed time, and its last line printed once (tqdm writes it again on close); a bar that ends
    within 10 s prints nothing, another bar of the same name after it is a new bar; lines that are nothing but an
    actor's name, and Ray's job manager's INFO and entrypoint lines, are dropped and every other line passes."""
    log = jobs.JobLog(every_s=10)
    traces = [_bar("traces", n, 16, 24 + 0.5 * n) for n in range(1, 17)] + [_bar("traces", 16, 16, 32.1)]
    kept = [line for line in traces if log.keep(line)]
    assert kept == [traces[0], traces[11], traces[15]], kept    # 24.5 s crosses 20 s, 30 s; the end at 32 s
    quick = [_bar("levels", n, 4, n) for n in range(5)] + [_bar("levels", 4, 4, 4.1)]
    assert not any(log.keep(line) for line in quick), "a bar that ended within 10 s printed"
    again = [_bar("traces", n, 4, 7 * n) for n in range(5)]
    assert [line for line in again if log.keep(line)] == [again[2], again[3], again[4]]   # 14, 21, 28 s
    gram = [_bar("gram", n, None, 4 * n) for n in range(8)]          # no total: `gram: 3it [00:12, ...]`
    assert [line for line in gram if log.keep(line)] == [gram[3], gram[5]], gram     # 12 s and 20 s
    assert not log.keep("\x1b[36m(TraceActor pid=2852)\x1b[0m ") and not log.keep("   ")
    ray_lines = ("2026-12-02 04:56:47,353\tINFO job_manager.py:581 -- Runtime env is setting up.",
                 "Running entrypoint for job calibrate-base-qa-1796187406: python -m jobs.calibrate --pair base:qa")
    assert not any(log.keep(line) for line in ray_lines), "Ray's job manager lines printed"
    assert log.keep("2026-12-02 04:56:47,353\tWARNING job_manager.py:581 -- something to see")
    for line in ("[calibrate] stage traces: done (20480 rows in 16 chunks)", LOST, "(TraceActor pid=12) loaded"):
        assert log.keep(line), line


def test_a_followed_jobs_log_is_thinned_and_its_lost_package_still_seen(tmp_path, monkeypatch, capsys):
    bars = [_bar("traces", n, 16, 2.5 * n) for n in range(17)]
    failed, pairs, client = _run(tmp_path, monkeypatch, {
        "base:qa": [("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", *bars, "\x1b[36m(TraceActor pid=9)\x1b[0m", LOST),
                    ("SUCCEEDED", None)]})
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[base:qa]")]
    printed = [line for line in out if "traces" in line]
    assert len(printed) == 4 and printed[-1].endswith(bars[-1]), printed    # at 10, 20, 30 s and its end (40 s)
    assert pairs == ["base:qa", "base:qa"] and failed == 0, (pairs, failed)
    assert not any("TraceActor" in line for line in out), out
