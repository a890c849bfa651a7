"""Calibration as Ray Jobs: one job per pair submitted through the Jobs API of a running cluster, their logs
followed side by side, the count of failures returned. `scd calibrate` and the demo both submit this way."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cluster.config import ConfigError, load_config
from cluster.runtime import use_token_auth

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _client(address: str):
    use_token_auth()                  # Ray 2.60 clusters require a bearer token
    from ray.job_submission import JobSubmissionClient
    return JobSubmissionClient(address)


async def _follow(client, job_id: str, pair: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        for line in chunk.splitlines():
            if line.strip():
                print(f"[{pair}] {line}", flush=True)


async def _follow_all(client, jobs: dict[str, str]) -> None:
    await asyncio.gather(*(_follow(client, job_id, pair) for pair, job_id in jobs.items()))


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
    client = _client(address)
    env = {"working_dir": working_dir, "excludes": ["/runs/", "/.git/", "__pycache__"]}
    jobs = {}
    for pair in pairs:
        entry = " ".join(["python -m jobs.calibrate --pair", pair, *common])
        jobs[pair] = _submit(client, entry, env, f"calibrate-{pair.replace(':', '-')}-{int(time.time())}")
        print(f"submitted {jobs[pair]} for {pair}", flush=True)
    asyncio.run(_follow_all(client, jobs))
    failed = 0
    for pair, job_id in jobs.items():
        status = client.get_job_status(job_id)
        while str(getattr(status, "value", status)) not in TERMINAL:
            time.sleep(1)
            status = client.get_job_status(job_id)
        name = str(getattr(status, "value", status))
        print(f"{pair}: {name}", flush=True)
        failed += name != "SUCCEEDED"
    return failed
