"""The Ray processes serving on this machine, seen from outside: how many, their threads, their CPU time.

What `scd loadtest` and `tools.bench_concurrency` report beside their figures, so that a throughput figure comes
with what the machine was doing: every process of the local Ray cluster (its workers by the role Ray's process
title gives them, and Ray's own daemons), their thread counts, and the CPU seconds each role spent during a
run (per request, the profile of where the cores went). Read with psutil; nothing is asked of Ray.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent")


@dataclass(frozen=True)
class Proc:
    pid: int
    role: str
    threads: int
    cpu_s: float            # user + system CPU seconds since the process started


def role_of(cmdline: list[str], name: str) -> str | None:
    """The serving role of a process, or None when it is not part of a Ray cluster. A Ray worker's title is
    `ray::Class.method` (the method it runs now) or `ray::ServeReplica:app:deployment`: the role is the class or
    the deployment, `specialist-*` deployments under one role. Ray's daemons are named by their program."""
    title = " ".join(cmdline) if cmdline else name
    for daemon in DAEMONS:                  # first: a raylet's arguments name the worker program
        if daemon in name or any("/ray/" in a and daemon in a.rsplit("/", 1)[-1] for a in cmdline[:3]):
            return f"ray:{daemon}"
    if title.startswith("ray::"):
        role = title[5:].split(" ", 1)[0].split(".", 1)[0]
        if role.startswith("ServeReplica:"):
            deployment = role.rsplit(":", 1)[-1]
            return "replica:specialist" if deployment.startswith("specialist-") else f"replica:{deployment}"
        return "idle worker" if role in ("", "IDLE") else role
    if "default_worker.py" in title:
        return "idle worker"
    if "cli.main" in title or (cmdline and cmdline[0].endswith("/scd")):
        return "driver"                      # `scd serve` (or the demo) holding the embedded cluster
    if "ray-dashboard" in title:
        return "ray:dashboard"
    return None


def snapshot() -> dict[int, Proc]:
    """Every process of a Ray cluster on this machine now (but this process), by pid."""
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "num_threads", "cpu_times"]):
        info = p.info
        if info["pid"] == os.getpid() or info["cpu_times"] is None:
            continue
        role = role_of(info["cmdline"] or [], info["name"] or "")
        if role is not None:
            t = info["cpu_times"]
            out[info["pid"]] = Proc(info["pid"], role, info["num_threads"] or 0, t.user + t.system)
    return out


def counts(procs: dict[int, Proc]) -> dict:
    """{"processes", "threads", "by_role": {role: [processes, threads]}} of a snapshot."""
    by_role: dict[str, list[int]] = {}
    for p in procs.values():
        entry = by_role.setdefault(p.role, [0, 0])
        entry[0] += 1
        entry[1] += p.threads
    return {"processes": len(procs), "threads": sum(p.threads for p in procs.values()),
            "by_role": dict(sorted(by_role.items(), key=lambda kv: -kv[1][1]))}


def cpu_by_role(before: dict[int, Proc], after: dict[int, Proc]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots (a process started in between counts from zero; the
    role is the one it had in `before` when it was there: a worker's title names the method it runs now)."""
    spent: dict[str, float] = {}
    for pid, p in after.items():
        old = before.get(pid)
        role = old.role if old is not None and old.role != "idle worker" else p.role
        spent[role] = spent.get(role, 0.0) + max(0.0, p.cpu_s - (old.cpu_s if old else 0.0))
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


class Sampler:
    """Snapshots taken around a run: the processes and threads at its start and at its busiest (most threads),
    the highest 1-minute load average seen, and the CPU each role spent."""

    def __init__(self):
        self.first = self.peak = snapshot()
        self.load_max = os.getloadavg()[0]

    def sample(self) -> None:
        now = snapshot()
        if sum(p.threads for p in now.values()) > sum(p.threads for p in self.peak.values()):
            self.peak = now
        self.load_max = max(self.load_max, os.getloadavg()[0])

    def report(self, requests: int) -> dict:
        """What the run's report carries: counts at start and at peak, the load average (at the end and the
        highest), the cores' share of the run's CPU by role, and the CPU milliseconds per request by role."""
        last = snapshot()
        self.load_max = max(self.load_max, os.getloadavg()[0])
        spent = cpu_by_role(self.first, last)
        return {"at_start": counts(self.first), "at_peak": counts(self.peak),
                "load_avg_1m": {"end": round(os.getloadavg()[0], 2), "max": round(self.load_max, 2)},
                "cpu_s": round(sum(spent.values()), 2),
                "cpu_ms_per_request": {r: round(1e3 * s / max(1, requests), 1) for r, s in spent.items() if s >= 0.005}}
