"""`scd serve`: run the Serve app until Ctrl-C or SIGTERM, or print a `serve deploy` config for a cluster.

Startup refuses, before starting anything, a port that is already taken (another `scd serve`?), an address
reachable from other machines without an API key, and (on an embedded cluster) a model path that is not a model
or adapter folder. "ready" is printed only once /healthz answers.
Ctrl-C and SIGTERM (what supervisors send) stop Serve, the producer and the embedded Ray cluster; a SIGKILL
takes the embedded cluster down with the process (Ray's head processes share the driver's fate).
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from cluster.config import ConfigError, DeploymentConfig, load_config


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _dashboard_url() -> str | None:
    """The connected cluster's dashboard (where `ray job submit` sends jobs), when it runs one."""
    try:
        from ray._private.worker import get_dashboard_url       # what ray.init's context reports, after the fact
        url = get_dashboard_url()
    except Exception:                                           # a Ray without it: the line is left out
        return None
    return f"http://{url}" if url else None


def _interrupt(*_):
    raise KeyboardInterrupt


def run(cfg: DeploymentConfig, ready_timeout_s: float = 300) -> int:
    from cluster.runtime import connect, shutdown
    from serve_app.app import build, deploy, health, undeploy, wait_healthy
    if not cfg.ray.address and port_taken(cfg.http.host, cfg.http.port):
        print(f"port {cfg.http.port} on {cfg.http.host} is already taken (another `scd serve`?); stop it or set "
              "http.port", file=sys.stderr)
        return 2
    previous = signal.getsignal(signal.SIGTERM)
    try:
        app = build(cfg)                                      # refuses a bad setup before anything starts
        connect(cfg.ray)
        # after ray.init, which installs a SIGTERM handler of its own that aborts the driver
        signal.signal(signal.SIGTERM, _interrupt)             # a supervisor's stop = Ctrl-C
        deploy(cfg, app)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        local = url.replace("0.0.0.0", "127.0.0.1")
        wait_healthy(local, ready_timeout_s)
        state = health(local)
        if state is None:
            print(f"the service never answered {url}/healthz within {ready_timeout_s:.0f} s; stopping",
                  file=sys.stderr)
            return 1
        auth = "API key required" if cfg.auth.key() else "no API key"
        print(f"SCD Serve ready on {url}  (health: {state}; {auth}; models: "
              f"{', '.join(s.name for s in cfg.specialists)}; Ctrl-C stops)", flush=True)
        if dashboard := _dashboard_url():
            print(f"Ray Jobs API (ray job submit --address): {dashboard}", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)          # a second SIGTERM must not cut the cleanup
        try:
            undeploy(cfg)
        finally:
            shutdown()
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--print-serve-config", action="store_true",
                   help="print a `serve deploy` YAML for an existing cluster and exit")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for /healthz at startup")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.print_serve_config:
        from serve_app.app import serve_deploy_config
        print(yaml.safe_dump(serve_deploy_config(cfg, str(Path(args.config).resolve())), sort_keys=False))
        return 0
    return run(cfg, args.ready_timeout)
