"""`scd serve` as a user runs it (a subprocess with its own embedded Ray): ready only once healthy, a second
server on the same port refused at once, SIGTERM stops everything it started, an open address refused."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.conftest import DEMO, REPO, free_port


def _config(tmp_path, **extra) -> str:
    raw = {"producer": {"name": "base", "path": str(DEMO / "base"), "num_cpus": 0.25},
           "specialists": [{"name": "qa", "path": str(DEMO / "qa"), "num_cpus": 0.25}],
           "ray": {"namespace": "scd-test-cli", "num_cpus": 2}, "http": {"port": free_port()},
           "artifacts": {"uri": str(tmp_path / "store")}, **extra}
    path = tmp_path / "ray_config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _scd(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def _processes(name: str) -> set[int]:
    """Ids of the running processes whose command name is `name`, read from /proc (no pgrep needed)."""
    pids = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().strip() == name:
                pids.add(int(d.name))
        except OSError:                                          # gone while we looked
            pass
    return pids


def _session(pid: int) -> int | None:
    """The session id of a process (field 6 of /proc/PID/stat), None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _raylets(session: int) -> set[int]:
    """The raylets of a process session: `_scd` starts `scd serve` as a session of its own (its id the server's
    pid), and the cluster it starts stays in it, so other tests' clusters running meanwhile are not counted."""
    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert os.getpid() in _processes(me), "cannot list processes here: every raylet check would pass unseen"
    return {pid for pid in _processes("raylet") if _session(pid) == session}


# `scd serve` with ray.init replaced by a refusal: a start that reaches Ray exits 1 saying so, even when it
# would have shut its cluster down again before exiting (which no later look at the processes could see)
NO_RAY = ("import sys, ray\n"
          "def refused(*args, **kwargs):\n"
          "    raise SystemExit('RAY WAS STARTED: ray.init called')\n"
          "ray.init = refused\n"
          "from cli.main import main\n"
          "sys.exit(main(sys.argv[1:]))\n")


def test_open_address_without_a_key_is_refused_before_anything_starts(tmp_path):
    cfg = _config(tmp_path, http={"host": "0.0.0.0", "port": free_port()})
    p = subprocess.Popen([sys.executable, "-c", NO_RAY, "serve", "--config", cfg], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = p.communicate(timeout=120)
    assert "RAY WAS STARTED" not in err, f"a refused start still started Ray: {err[-2000:]}"
    assert p.returncode == 2 and "no API key is set" in err, (p.returncode, err)
    assert not _raylets(p.pid), "a refused start left a raylet running"


# a job's driver prints what it joined: scd serve's cluster has 3 logical CPUs (no other test's cluster has)
JOB = "import ray; ray.init(); print('JOINED', ray.cluster_resources()['CPU'], ray.get_runtime_context().gcs_address)"


def _submit(dashboard: int, code: str) -> str:
    """`ray job submit` of `python -c code` to the Jobs API on `dashboard`, as a user types it: its output."""
    from cluster.runtime import use_token_auth
    env = dict(os.environ)
    use_token_auth(env)
    ray_cli = Path(sys.executable).parent / "ray"
    out = subprocess.run([str(ray_cli), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--",
                          sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_serve_ready_refuses_a_taken_port_and_stops_everything_on_sigterm(tmp_path):
    """Also: a Ray Job submitted to its Jobs API runs on its cluster (the one its address file names), whatever
    other clusters run on the machine, and the name is gone once it stops."""
    from ray._common.utils import get_ray_address_file
    dashboard = free_port()
    cfg = _config(tmp_path, ray={"namespace": "scd-test-cli", "num_cpus": 3, "dashboard_port": dashboard})
    port = yaml.safe_load(open(cfg))["http"]["port"]
    server = _scd("serve", "--config", cfg)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            lines.append(line)
            if "ready on" in line:
                break
        # ready once the producer and qa answer; degraded, as this store holds no artifact for base:qa
        assert any("ready on" in line and "health: degraded" in line for line in lines), \
            f"never ready: rc={server.poll()} out={lines[-5:]} err={server.stderr.read() if server.poll() else ''}"
        started = _raylets(server.pid)
        assert started, "scd serve did not start an embedded cluster"

        joined = next(line.split() for line in _submit(dashboard, JOB).splitlines() if line.startswith("JOINED"))
        assert joined[1] == "3.0", f"the job joined another cluster: {joined}"
        assert Path(get_ray_address_file(None)).read_text().strip() == joined[2]

        second = _scd("serve", "--config", cfg)                  # same port: refused at once, nothing started
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2 and f"port {port}" in err and "already taken" in err, (second.returncode, err)

        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=120)
        err = server.stderr.read()
        assert rc == 0, err[-2000:]
        # Ray's and Serve's INFO lines (the cluster's start, each deployment step) are left out at the default
        # ray.log_level, WARNING
        assert not [line for line in err.splitlines() if re.search(r"\sINFO\s", line)], err[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30                              # Ray's head processes exit with the driver
    while time.monotonic() < deadline and _raylets(server.pid):
        time.sleep(0.5)
    assert not _raylets(server.pid), "the embedded cluster outlived scd serve"
    named = Path(get_ray_address_file(None))
    assert not (named.is_file() and named.read_text().strip() == joined[2]), "a stopped cluster is still named"
    from cli.serve import port_taken
    assert not port_taken("127.0.0.1", port), f"port {port} still held after scd serve stopped"


def test_api_key_env_that_is_not_set_is_a_clear_error(tmp_path):
    key_env = "SCD_TEST_KEY_UNSET"
    cfg = _config(tmp_path, auth={"api_key_env": key_env})
    env = {k: v for k, v in os.environ.items() if k != key_env}
    p = _scd("serve", "--config", cfg, env=env)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and f"${key_env}" in err, (p.returncode, err)


def test_model_folders_that_are_not_there_are_refused_in_one_line_each_before_anything_starts(tmp_path):
    """A model path that does not exist (here: relative paths read from the config file's folder, where the demo
    models are not) and an adapter whose base is no local folder are refused by name, before Ray starts."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "org/not-here"}')
    cfg = _config(tmp_path, specialists=[{"name": "qa", "path": "demo_models/qa"},
                                         {"name": "prose", "path": str(DEMO / "prose")},
                                         {"name": "code", "path": "adapter"}])
    p = subprocess.Popen([sys.executable, "-c", NO_RAY, "serve", "--config", cfg], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = p.communicate(timeout=120)
    assert "RAY WAS STARTED" not in err, f"a refused start still started Ray: {err[-2000:]}"
    assert p.returncode == 2 and "Traceback" not in err, (p.returncode, err)
    assert f"qa.path: {tmp_path / 'demo_models' / 'qa'} does not exist" in err, err
    assert "code.path: the base model of adapter" in err and "org/not-here" in err, err
    assert "prose.path" not in err and "base.path" not in err, err
