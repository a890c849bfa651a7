"""`scd artifacts list | show PAIR[@VERSION] | verify PAIR[@VERSION] | gc`: the artifact registry."""
from __future__ import annotations

import argparse
import sys

from artifacts_store import ArtifactStore, ArtifactStoreError
from cluster.config import ConfigError, load_config


def _store(args) -> ArtifactStore:
    if args.store:
        return ArtifactStore(args.store)
    try:
        return ArtifactStore(load_config(args.config).artifacts.uri)
    except ConfigError as e:
        raise SystemExit(f"{e}\n(or pass --store URI)") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd artifacts", description=__doc__)
    p.add_argument("--store", help="store URI (default: artifacts.uri of --config)")
    p.add_argument("--config", default="ray_config.yaml")
    sub = p.add_subparsers(dest="op", required=True)
    ls = sub.add_parser("list", help="every complete version, newest last per pair")
    ls.add_argument("pair", nargs="?")
    for op in ("show", "verify"):
        sub.add_parser(op).add_argument("ref", help="PAIR[@VERSION]: VERSION = full id, index (1 = oldest) or latest")
    gc = sub.add_parser("gc", help="remove old versions (never the latest) and stale temporary files")
    gc.add_argument("--keep", type=int, default=3)
    gc.add_argument("pair", nargs="?")
    args = p.parse_args(argv)
    store = _store(args)
    try:
        if args.op == "list":
            rows = store.list(args.pair)
            if not rows:
                print("no artifacts")
            for v in rows:
                m = store.show(v.ref)
                kl = m.metrics.get("kl")
                print(f"{v.pair:<20} #{v.index:<3} {v.version}{'  (latest)' if v.latest else '':<10} "
                      f"patch={m.patch_layers} r_k={m.ranks.r_k} r_v={m.ranks.r_v}"
                      + (f" kl={kl:.4f}" if kl is not None else "")
                      + (f" f1={m.metrics['f1']:.3f}" if "f1" in m.metrics else ""))
        elif args.op == "show":
            print(store.show(args.ref).model_dump_json(indent=2))
        elif args.op == "verify":
            result = store.verify(args.ref)
            print(result)
            return 0 if result.ok else 1
        else:
            r = store.gc(keep=args.keep, pair=args.pair)
            for what, refs in (("removed", r.removed_versions), ("removed incomplete", r.removed_incomplete),
                               ("removed temporary", r.removed_temp)):
                for ref in refs:
                    print(f"{what}: {ref}")
            print(f"gc done: {len(r.removed_versions)} versions removed")
    except ArtifactStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
