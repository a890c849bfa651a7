"""`scd serve`: run the Serve app until interrupted, or print a `serve deploy` config for a cluster."""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import yaml

from cluster.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd serve", description=__doc__)
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--print-serve-config", action="store_true",
                   help="print a `serve deploy` YAML for an existing cluster and exit")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from serve_app.app import deploy, serve_deploy_config
    if args.print_serve_config:
        print(yaml.safe_dump(serve_deploy_config(cfg, str(Path(args.config).resolve())), sort_keys=False))
        return 0
    deploy(cfg)
    print(f"SCD Serve on http://{cfg.http.host}:{cfg.http.port}  (models: "
          f"{', '.join(s.name for s in cfg.specialists)}; Ctrl-C stops)", flush=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        while not stopping:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    from ray import serve
    import ray
    serve.shutdown()
    ray.shutdown()
    return 0
