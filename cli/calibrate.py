"""`scd calibrate --pair base:qa --pair base:prose`: one Ray Job per pair, run concurrently, logs followed.

Wraps JobSubmissionClient against a running cluster (`ray start --head`); exits non-zero if any job fails.
Arguments after `--` go to every job (e.g. `-- --prefixes 32` for a quick run).
"""
from __future__ import annotations

import argparse
import os
import sys

from cluster.jobs import submit_and_follow


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="scd calibrate", description=__doc__)
    p.add_argument("--pair", action="append", required=True, help="PRODUCER:CONSUMER (repeatable)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265",
                   help="Ray dashboard address of the cluster")
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--working-dir", default=".")
    args = p.parse_args(argv)
    return 1 if submit_and_follow(args.address, args.pair, args.config, args.working_dir, extra) else 0
