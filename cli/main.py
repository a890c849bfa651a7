"""The `scd` command. Each subcommand lives with the package that owns the work and is imported lazily,
so `scd --help` stays instant and a subcommand pulls in only what it needs."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with main(argv), one-line help)
COMMANDS = {
    "eval": ("cli.evaluate", "calibrate a pair and compare SCD with the baselines on held-out prefixes"),
    "bench": ("cli.bench", "consumer rebuild vs prefill; --fanout compute; --bandwidth TTFT of every method"),
    "train-demo": ("jobs.train_family", "train the demo model family (base + specialists)"),
    "fetch-family": ("jobs.fetch_family", "build a real pretrained producer (smollm2) as a local HF folder, once"),
    "artifacts": ("cli.artifacts", "list | show | verify | leases | gc the artifact registry"),
    "serve": ("cli.serve", "run the Serve app (or print a `serve deploy` config)"),
    "demo": ("cli.demo", "the main job: calibrate if needed, serve, fan out, print TTFT vs oracle"),
    "calibrate": ("cli.calibrate", "submit one Ray Job per pair to calibrate and publish it, and follow them"),
    "loadtest": ("cli.loadtest", "N requests at C concurrent against a running service: ok/error/lost, modes, p50/p99"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="scd", description="Semantic Cache Distillation serving toolkit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        rc = module.main(argv[1:])
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"scd {argv[0]}: {e}", file=sys.stderr)        # a user's mistake: one line, no traceback
        return 2
    return rc if isinstance(rc, int) else 0


def _user_errors() -> tuple[type[Exception], ...]:
    """What a user's input can cause (a missing or wrong file, a pair that cannot be served together, a bad
    config): imported only when a command failed, so `scd --help` stays instant."""
    from cluster.config import ConfigError
    from scd.online.models import IncompatiblePairError
    return FileNotFoundError, NotADirectoryError, IncompatiblePairError, ConfigError


if __name__ == "__main__":
    sys.exit(main())
