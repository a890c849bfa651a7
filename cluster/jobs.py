"""Calibration as Ray Jobs: one job per pair submitted through the Jobs API of a running cluster, their logs
followed side by side, the count of failures returned. `scd calibrate` and the demo both submit this way."""
from __future__ import annotations

import asyncio
import logging
import re
import shlex
import time
from pathlib import Path
from typing import Callable

from cluster.config import ConfigError, load_config
from cluster.runtime import drop_messages, use_token_auth

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


# What Ray's job client logs on each submission that says nothing to the person following the jobs: the package
# it builds of the working dir (INFO: ignore files read, uploading, already uploaded), that `.git` is now
# left out of it by default (a WARNING once a process; the submissions here exclude it themselves), and that the
# log stream of a job that ended closed (INFO).
QUIET_LOGGERS = ("ray._private.runtime_env.packaging", "ray.dashboard.modules.dashboard_sdk",
                 "ray.dashboard.modules.job.sdk")


def quiet_job_client_logs() -> None:
    """QUIET_LOGGERS at WARNING, and the working dir's default-excludes warning dropped (idempotent)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    drop_messages("ray._private.runtime_env.working_dir", "is now ignored by default")


def _client(address: str):
    use_token_auth()                  # Ray 2.60 clusters require a bearer token
    from ray.job_submission import JobSubmissionClient
    quiet_job_client_logs()
    return JobSubmissionClient(address)


# Ray lost the job's working-dir package: jobs submitted from one working dir share it (by its content hash), and
# on a busy cluster Ray has deleted it under a job that found it present, before the job started (error type
# RUNTIME_ENV_SETUP_FAILURE) or under the actors it starts (this line in its log). Nothing of the calibration is
# lost (it resumes from its checkpoints): submit it again, which uploads the package anew.
RESUBMIT = {"RUNTIME_ENV_SETUP_FAILURE"}
LOST_PACKAGE = "Failed to download runtime_env file package"
# what a job's copy of the working dir leaves out
EXCLUDES = ("/runs/", "/.git/", "__pycache__")


class JobLog:
    """What of one job's log is printed. A progress bar (tqdm's line: `desc: 40%|####| 4/10 [00:12<00:18, ...]`,
    or `desc: 7it [00:03, ...]` without a total) writes a line per update, which a job's log keeps one under the
    other: of each bar, a line is printed when its elapsed time crosses a multiple of `every_s`, and its last one
    (n = total) once, unless the bar ended within `every_s` (the log line that follows a stage says it is done).
    Lines with nothing but an actor's name (`(TraceActor pid=12)`, what remains of a bar it drew) are dropped, and
    the two Ray's job manager writes at the top of every job's log (its INFO line that the runtime env is being set
    up, and the entrypoint command it runs, which `ray job logs` still shows). Everything else passes unchanged."""

    BAR = re.compile(r"(?:\d+%\|[^|]*\| (?P<n>\d+)/(?P<total>\d+)|(?P<count>\d+)it) "
                     r"\[(?P<elapsed>(?:\d+:)?\d+:\d+)[<,\]]")
    COLOR = r"(?:\x1b\[[0-9;]*m)*"
    ACTOR_ONLY = re.compile(rf"^\s*{COLOR}\([A-Za-z_][\w.]* pid=\d+(?:, ip=[\d.]+)?\){COLOR}\s*$")
    RAY_INFO = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+INFO ")      # Ray's log format, at INFO
    ENTRYPOINT = "Running entrypoint for job "

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self.bars: dict[str, tuple[int, int, int]] = {}   # desc -> (its last line's n and elapsed s, mark printed)

    def keep(self, line: str) -> bool:
        if not line.strip() or self.ACTOR_ONLY.match(line) or self.RAY_INFO.match(line) or \
                line.startswith(self.ENTRYPOINT):
            return False
        bar = self.BAR.search(line)
        if not bar:
            return True
        desc = line[:bar.start()].rstrip(": ")
        n = int(bar["n"] or bar["count"])
        elapsed = sum(int(p) * 60 ** i for i, p in enumerate(reversed(bar["elapsed"].split(":"))))
        last_n, last_elapsed, printed = self.bars.get(desc, (-1, 0, 0))
        if n < last_n or elapsed < last_elapsed:          # a new bar under the same name
            last_n, printed = -1, 0
        if bar["total"] and n == int(bar["total"]):
            keep = n != last_n and elapsed >= self.every_s   # tqdm writes its last line again when the bar closes
        else:
            keep = elapsed // self.every_s > printed
        self.bars[desc] = (n, elapsed, int(elapsed // self.every_s) if keep else printed)
        return keep


async def _follow(client, job_id: str, pair: str) -> bool:
    """Print the job's log lines prefixed by its pair until it ends; whether Ray lost its package (LOST_PACKAGE)."""
    lost, log = False, JobLog()
    async for chunk in client.tail_job_logs(job_id):
        for line in chunk.splitlines():
            if log.keep(line):
                print(f"[{pair}] {line}", flush=True)
            lost |= LOST_PACKAGE in line
    return lost


async def _ended(client, job_id: str) -> str:
    """The job's terminal status, once it has one."""
    while True:
        status = client.get_job_status(job_id)
        name = str(getattr(status, "value", status))
        if name in TERMINAL:
            return name
        await asyncio.sleep(1)


async def _run(client, pair: str, entry: str, env: dict, watch: Callable | None = None, attempts: int = 2) -> str:
    """Submit one pair's job, follow it to its end (`watch(job_id)`, awaited: by default its log printed,
    `_follow`; it says whether Ray lost its package), and submit it again (up to `attempts` in all) when Ray
    lost its working-dir package (RESUBMIT, LOST_PACKAGE). Returns its last status."""
    watch = watch or (lambda job_id: _follow(client, job_id, pair))
    for attempt in range(attempts):
        job_id = _submit(client, entry, env, f"calibrate-{pair.replace(':', '-')}-{int(time.time())}"
                                             + (f"-{attempt}" if attempt else ""))
        print(f"submitted {job_id} for {pair}", flush=True)
        lost = await watch(job_id)
        status = await _ended(client, job_id)
        if status != "FAILED" or attempt == attempts - 1:
            return status
        kind = str(getattr(client.get_job_info(job_id), "error_type", None) or "")
        if kind not in RESUBMIT and not lost:
            return status
        print(f"[{pair}] Ray lost the job's working-dir package ({kind or LOST_PACKAGE}); submitting it again "
              f"(it resumes from its checkpoints)", flush=True)
    return status


async def _run_all(client, entries: dict[str, str], env: dict) -> dict[str, str]:
    statuses = await asyncio.gather(*(_run(client, pair, entry, env) for pair, entry in entries.items()))
    return dict(zip(entries, statuses))


def _submit(client, entry: str, env: dict, submission_id: str, wait_s: float = 120.0) -> str:
    """Submit, retrying while a freshly started cluster's job agent is not up yet."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entry, runtime_env=env, submission_id=submission_id)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def submit_and_follow(address: str, pairs: list[str], config_path: str, working_dir: str = ".",
                      extra: list[str] | None = None) -> int:
    """Submit one calibration job per pair, stream their logs prefixed by pair, return the failure count."""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    for pair in pairs:
        if pair not in cfg.pairs():
            raise SystemExit(f"unknown pair {pair!r}; the config has {cfg.pairs()}")
    # absolute paths: the job runs from a copy of the working dir, results must land in this one
    common = ["--config", str(Path(config_path).resolve()), "--store", cfg.artifacts.uri,
              "--work-dir", cfg.calibration.work_dir, *(extra or [])]
    try:
        client = _client(address)
    except ConnectionError as e:
        raise SystemExit(f"cannot reach a Ray Jobs API at {address} ({str(e).splitlines()[0]}): is the cluster "
                         "running? `scd serve` prints its address") from None
    env = {"working_dir": working_dir, "excludes": list(EXCLUDES)}
    entries = {pair: shlex.join(["python", "-m", "jobs.calibrate", "--pair", pair, *common]) for pair in pairs}
    failed = 0
    for pair, status in asyncio.run(_run_all(client, entries, env)).items():
        print(f"{pair}: {status}", flush=True)
        failed += status != "SUCCEEDED"
    return failed


class NoJobsApi(RuntimeError):
    """The connected cluster runs no dashboard, so it takes no Ray Jobs (`ray.dashboard_port`)."""


def calibrate_adapter(cfg, name: str, adapter_path: str, report: Callable[[str], None], poll_s: float = 5.0) -> str:
    """Calibrate the pair producer -> `name`, a PEFT adapter of the producer's model loaded at run time (a LoRA
    group's), as a Ray Job on the connected cluster, and follow it to its end: `report` gets "Ray Job ID:
    STATUS" whenever its status changes, and a job whose runtime environment Ray lost is submitted once more
    (RESUBMIT: it resumes from its checkpoints). It publishes into the config's store, where the group's
    replicas find it. The job reads the deployment's config as this process holds it, its API key left out
    (written beside its checkpoints), with the adapter named by `--adapter`. Returns the last status.
    NoJobsApi: the cluster has no Jobs API to take it."""
    import yaml
    from ray._private.services import get_webui_url_from_internal_kv
    address = get_webui_url_from_internal_kv()
    if not address:
        raise NoJobsApi("the cluster runs no dashboard, so no Ray Job can calibrate it (set ray.dashboard_port)")
    work = Path(cfg.calibration.work_dir) / "loaded-adapters"
    work.mkdir(parents=True, exist_ok=True)
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"auth"})))   # no API key on disk
    pair = f"{cfg.producer.name}:{name}"
    entry = shlex.join(["python", "-m", "jobs.calibrate", "--pair", pair, "--config", str(config), "--adapter",
                        adapter_path, "--store", cfg.artifacts.uri, "--work-dir", cfg.calibration.work_dir])
    root = Path(__file__).resolve().parents[1]
    env = {"working_dir": str(root), "excludes": list(EXCLUDES)}
    client = _client(address if address.startswith("http") else f"http://{address}")

    async def watch(job_id: str) -> bool:             # its status, not its log: the router has no one to print to
        last = None
        while last not in TERMINAL:
            status = str(getattr(st := client.get_job_status(job_id), "value", st))
            if status != last:
                report(f"Ray Job {job_id}: {status}")
                last = status
            if last not in TERMINAL:
                await asyncio.sleep(poll_s)
        return False
    return asyncio.run(_run(client, pair, entry, env, watch))
