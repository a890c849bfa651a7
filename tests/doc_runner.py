"""Run a documentation section as written: every fenced block of it, in order (the README's quickstart,
docs/bring-your-own-models.md's walkthrough).

A block runs by its language: bash in a shell whose exports carry over to the next bash block, python in one
namespace shared by all python blocks (as one interpreter session), yaml marked `<!-- doc: config -->` is
validated as a deployment config. A comment before a block changes how it runs:
`<!-- doc: background until "TEXT" -->` starts it and waits for TEXT in its output (a server), and
`<!-- doc: not run (REASON) -->` skips it (a long job, or models a user brings). `text` blocks are what the
commands print; they are not compared (answers and timings vary): each test asserts what its steps show.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.config import DeploymentConfig

FENCE = re.compile(r"(?:<!-- doc: (?P<how>.*?) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.S)


def doc_blocks(path: Path, section: str) -> list[tuple[str, str, str]]:
    """(how, lang, code) of each fenced block of the `## {section}` section of a markdown file, in order; how
    is "" by default."""
    text = path.read_text()
    assert f"\n## {section}" in text, f"{path} lost its section {section!r}"
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return [(m["how"] or "", m["lang"], m["code"]) for m in FENCE.finditer(body)]


def stop(proc: subprocess.Popen) -> None:
    """Stop a server a step started as `kill PID` would: SIGTERM to it alone (`scd serve` takes it as Ctrl-C
    and stops its Ray cluster itself; SIGINT may be ignored in a background process); its whole process group
    if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _background(code: str, root: Path, env: dict, until: str, timeout_s: float = 400) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if until in line:
            return proc
    stop(proc)
    raise AssertionError(f"{code!r} never printed {until!r}:\n" + "".join(seen)[-3000:])


@dataclass
class Run:
    """What a section's steps left: the python namespace, the servers started (stopped by the end), and each
    step's code (as run, after the replacements) with its output."""
    namespace: dict = field(default_factory=dict)
    servers: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def output_of(self, needle: str) -> str:
        """The output of the first step whose code holds `needle`."""
        return next(out for code, out in self.steps if needle in code)


def run_blocks(blocks: list[tuple[str, str, str]], root: Path, replace: dict[str, str]) -> Run:
    """Run the blocks in `root`, each with every key of `replace` in its code replaced by its value (ports,
    the paths of the folders a user brings); the servers they start are stopped before this returns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    if os.environ.get("PYTEST_XDIST_WORKER"):       # two workers share the cores: one thread per process, as
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")    # tests/conftest.py sets torch's in-process
    state = root / ".exports"
    state.write_text("")
    run = Run()
    try:
        for how, lang, code in blocks:
            for old, new in replace.items():
                code = code.replace(old, new)
            if lang == "text" or how.startswith("not run"):
                continue
            out = ""
            if how.startswith("config"):
                DeploymentConfig.model_validate(yaml.safe_load(code))        # the schema, not the paths
            elif how.startswith("background"):
                run.servers.append(_background(code, root, env, re.search(r'until "(.*)"', how)[1]))
            elif lang == "bash":
                r = subprocess.run(["bash", "-euo", "pipefail", "-c", f"source {state}\n{code}\nexport -p > {state}"],
                                   cwd=root, env=env, capture_output=True, text=True, timeout=900)
                out = r.stdout + r.stderr
                assert r.returncode == 0, f"{code!r} failed ({r.returncode}):\n{out[-3000:]}"
            elif lang == "python":
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(code, "documentation step", "exec"), run.namespace)
                out = buf.getvalue()
            else:
                raise AssertionError(f"a {lang} block the runner does not know how to run:\n{code}")
            run.steps.append((code, out))
    finally:
        for proc in run.servers:
            stop(proc)
    return run
