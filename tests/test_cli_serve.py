"""`scd serve` as a user runs it (a subprocess with its own embedded Ray): ready only once healthy, a second
server on the same port refused at once, SIGTERM stops everything it started, an open address refused."""
import os
import signal
import subprocess
import sys
import time

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


def _raylets() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_open_address_without_a_key_is_refused_before_anything_starts(tmp_path):
    cfg = _config(tmp_path, http={"host": "0.0.0.0", "port": free_port()})
    before = _raylets()
    p = _scd("serve", "--config", cfg)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "no API key is set" in err, (p.returncode, err)
    assert _raylets() <= before, "a refused start still started Ray"


def test_serve_ready_refuses_a_taken_port_and_stops_everything_on_sigterm(tmp_path):
    cfg = _config(tmp_path)
    port = yaml.safe_load(open(cfg))["http"]["port"]
    before = _raylets()
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
        assert any("ready on" in line and "health: ok" in line for line in lines), \
            f"never ready: rc={server.poll()} out={lines[-5:]} err={server.stderr.read() if server.poll() else ''}"
        started = _raylets() - before
        assert started, "scd serve did not start an embedded cluster"

        second = _scd("serve", "--config", cfg)                  # same port: refused at once, nothing started
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2 and f"port {port}" in err and "already taken" in err, (second.returncode, err)

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, server.stderr.read()[-2000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30                              # Ray's head processes exit with the driver
    while time.monotonic() < deadline and started & _raylets():
        time.sleep(0.5)
    assert not started & _raylets(), "the embedded cluster outlived scd serve"
    from cli.serve import port_taken
    assert not port_taken("127.0.0.1", port), f"port {port} still held after scd serve stopped"


def test_api_key_env_that_is_not_set_is_a_clear_error(tmp_path):
    key_env = "SCD_TEST_KEY_UNSET"
    cfg = _config(tmp_path, auth={"api_key_env": key_env})
    env = {k: v for k, v in os.environ.items() if k != key_env}
    p = _scd("serve", "--config", cfg, env=env)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and f"${key_env}" in err, (p.returncode, err)
