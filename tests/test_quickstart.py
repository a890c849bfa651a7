"""The README's quickstart, run as written: every fenced block of its "## Quickstart" section, in order.

A block runs by its language: bash in a shell whose exports carry over to the next bash block, python in one
namespace shared by all python blocks (as one interpreter session), yaml marked `<!-- quickstart: config -->`
is validated as a deployment config. A comment before a block changes how it runs:
`<!-- quickstart: background until "TEXT" -->` starts it and waits for TEXT in its output (a server), and
`<!-- quickstart: not run (REASON) -->` skips it (a long job, or models a user brings). `text` blocks are
what the commands print; they are not compared (answers and timings vary).

The commands run in a folder of their own holding a ray_config.yaml for the demo family whose artifacts are
calibrated beforehand (a reduced budget) into a temporary store, on free ports: the README's ports 8000 and
8265 are replaced by those, and nothing else of the text is changed.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from cluster.config import DeploymentConfig
from tests.conftest import DEMO, REPO, free_port, write_config

FENCE = re.compile(r"(?:<!-- quickstart: (?P<how>.*?) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)


def quickstart_blocks(readme: str) -> list[tuple[str, str, str]]:
    """(how, lang, code) of each fenced block of the Quickstart section, in order; how is "" by default."""
    section = readme.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [(m["how"] or "", m["lang"], m["code"]) for m in FENCE.finditer(section)]


def test_the_quickstart_has_every_step_the_readme_promises():
    blocks = quickstart_blocks((REPO / "README.md").read_text())
    code = "\n".join(c for _, lang, c in blocks if lang != "text")
    for step in ("scd serve", "client.completions.create", "client.chat.completions.create", "/v1/fanout",
                 "ray job submit", "jobs.calibrate", "producer:", "scd serve --config"):
        assert step in code, f"the quickstart lost its step {step!r}"
    assert all(how.startswith(("background", "not run", "config")) for how, _, _ in blocks if how), blocks


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, demo_work_dir):
    """A folder with the demo family's ray_config.yaml (free ports, a temporary store holding the three demo
    pairs' artifacts, calibrated here on a reduced budget), as the repository root is after `make demo`."""
    from jobs.calibrate import main as calibrate
    tmp = tmp_path_factory.mktemp("quickstart")
    cfg_path = write_config(tmp, prefixes=8, val=2, heldout=1, aligner_epochs=2, pool=1, work_dir=demo_work_dir)
    raw = yaml.safe_load(cfg_path.read_text())
    http, dashboard = free_port(), free_port()
    raw["ray"] = {"namespace": "scd-quickstart", "num_cpus": 4, "dashboard_port": dashboard}
    raw["http"] = {"port": http}
    raw["producer"]["num_cpus"] = 0.5
    raw["specialists"] = [{"name": n, "path": str(DEMO / n), "num_cpus": 0.5,
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1}} for n in ("qa", "prose", "code")]
    cfg_path.write_text(yaml.safe_dump(raw))
    for pair in ("base:qa", "base:prose", "base:code"):
        calibrate(["--pair", pair, "--config", str(cfg_path), "--no-actors"])
    root = tmp / "repo"                      # the commands' folder: small, as `ray job submit` uploads it
    root.mkdir()
    (root / "ray_config.yaml").write_text(cfg_path.read_text())
    return root, {"127.0.0.1:8000": f"127.0.0.1:{http}", "127.0.0.1:8265": f"127.0.0.1:{dashboard}"}


def _stop(proc: subprocess.Popen) -> None:
    """Stop a server the quickstart started as `kill PID` would: SIGTERM to it alone (`scd serve` takes it as
    Ctrl-C and stops its Ray cluster itself; SIGINT may be ignored in a background process); its whole process
    group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _background(code: str, root, env, until: str, timeout_s: float = 400) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(["bash", "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if until in line:
            return proc, "".join(seen)
    _stop(proc)
    raise AssertionError(f"{code!r} never printed {until!r}:\n" + "".join(seen)[-3000:])


def test_the_readme_quickstart_runs_as_written(workspace):
    root, ports = workspace
    blocks = quickstart_blocks((REPO / "README.md").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    state = root / ".exports"
    state.write_text("")
    namespace: dict = {}
    servers, ran = [], []
    try:
        for how, lang, code in blocks:
            for readme_port, ours in ports.items():
                code = code.replace(readme_port, ours)
            if lang == "text" or how.startswith("not run"):
                continue
            if how.startswith("config"):
                DeploymentConfig.model_validate(yaml.safe_load(code))        # the schema, not the paths
            elif how.startswith("background"):
                until = re.search(r'until "(.*)"', how)[1]
                proc, out = _background(code, root, env, until)
                servers.append(proc)
            elif lang == "bash":
                r = subprocess.run(["bash", "-euo", "pipefail", "-c", f"source {state}\n{code}\nexport -p > {state}"],
                                   cwd=root, env=env, capture_output=True, text=True, timeout=900)
                out = r.stdout + r.stderr
                assert r.returncode == 0, f"{code!r} failed ({r.returncode}):\n{out[-3000:]}"
            elif lang == "python":
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(code, "README quickstart", "exec"), namespace)
                out = buf.getvalue()
            else:
                raise AssertionError(f"a {lang} block the quickstart test does not know how to run:\n{code}")
            ran.append((code, out))
    finally:
        for proc in servers:
            _stop(proc)
    assert len(servers) == 1, servers
    assert servers[0].returncode == 0, f"scd serve did not stop cleanly:\n{servers[0].stdout.read()[-3000:]}"
    # what the steps say they show: answers from codes, one prefill for the fan-out, the job left qa alone
    assert namespace["r"].model_extra["scd"]["mode"] == "scd", namespace["r"]
    assert namespace["chat"].model_extra["scd"]["mode"] == "scd" and namespace["chat"].choices[0].message.content
    fan = namespace["fan"]
    assert fan["prefilled"] is True and [x["scd"]["mode"] for x in fan["results"]] == ["scd"] * 3, fan
    job = next(out for code, out in ran if "ray job submit" in code)
    assert "already published as base:qa@" in job and "succeeded" in job, job[-2000:]
