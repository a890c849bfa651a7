"""`scd artifacts list | show PAIR[@VERSION] | verify PAIR[@VERSION] | gc | leases`: the artifact registry.

`gc` keeps the newest --keep versions per pair, the one LATEST names, every version a specialist or family of
--config pins (its `artifact` is not `latest`) and every version a live lease holds (a producer or replica serving it);
it prints what it kept for a pin or a lease, and why.
"""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

from artifacts_store import ArtifactStore, ArtifactStoreError
from cluster.config import ConfigError, DeploymentConfig, load_config


def _open(args) -> tuple[ArtifactStore, DeploymentConfig | None, str]:
    """(store, the config or None, why there is no config). --store wins over the config's artifacts.uri; the
    config is still read when it can be, for its pins."""
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        if not args.store:
            raise SystemExit(f"{e}\n(or pass --store URI)") from None
        return ArtifactStore(args.store), None, str(e)
    return ArtifactStore(args.store or cfg.artifacts.uri), cfg, ""


def pins(cfg: DeploymentConfig) -> list[str]:
    """`producer:specialist@artifact` for every specialist (and `producer:family@artifact` for every family)
    whose artifact is not `latest`."""
    refs = {**{f"{cfg.producer.name}:{s.name}": s.artifact for s in cfg.specialists}, **cfg.family_refs()}
    return [f"{ref}@{version}" for ref, version in refs.items() if version != "latest"]


def _gc(store: ArtifactStore, cfg: DeploymentConfig | None, no_config: str, args) -> None:
    if cfg is None:
        print(f"no pins: no readable config ({no_config}); versions are kept only as the newest --keep, "
              "LATEST's, or leased")
        protect = []
    else:
        protect = pins(cfg)
        print(f"pins from {args.config}: {', '.join(protect)}" if protect else
              f"no pins: every specialist in {args.config} serves latest")
    r = store.gc(keep=args.keep, pair=args.pair, protect=protect)
    for note in r.notes:
        print(f"note: {note}")
    for k in r.kept:
        print(f"kept {k}")
    for what, refs in (("removed", r.removed_versions), ("removed incomplete", r.removed_incomplete),
                       ("removed temporary", r.removed_temp), ("removed expired lease", r.removed_leases)):
        for ref in refs:
            print(f"{what}: {ref}")
    print(f"gc done: {len(r.removed_versions)} versions removed, "
          f"{len({k.ref for k in r.kept})} kept for pins or leases")


def _leases(store: ArtifactStore, pair: str | None) -> None:
    rows = store.leases(pair)
    if not rows:
        print("no live leases")
    now = datetime.now(timezone.utc)
    for lease in rows:
        print(f"{lease}  ({(lease.expires - now).total_seconds():.0f}s left)")


def _list(store: ArtifactStore, pair: str | None) -> None:
    rows = store.list(pair)
    if not rows:
        print("no artifacts")
    for v in rows:
        m = store.show(v.ref)
        kl = m.metrics.get("kl")
        print(f"{v.pair:<20} #{v.index:<3} {v.version}{'  (latest)' if v.latest else '':<10} "
              + (f"family of {','.join(sorted(m.members))} " if m.kind == "family" else "")
              + f"patch={m.patch_layers} r_k={m.ranks.r_k} r_v={m.ranks.r_v}"
              + (f" kl={kl:.4f}" if kl is not None else "")
              + (f" f1={m.metrics['f1']:.3f}" if "f1" in m.metrics else ""))


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd artifacts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", help="store URI (default: artifacts.uri of --config)")
    p.add_argument("--config", default="ray_config.yaml", help="deployment config: the store and gc's pins")
    sub = p.add_subparsers(dest="op", required=True)
    sub.add_parser("list", help="every complete version, newest last per pair").add_argument("pair", nargs="?")
    for op in ("show", "verify"):
        sub.add_parser(op).add_argument("ref", help="PAIR[@VERSION]: VERSION = full id, index (1 = oldest) or latest")
    gc = sub.add_parser("gc", help="remove old versions (never the latest, a pinned or a leased one) and stale "
                                   "temporary files")
    gc.add_argument("--keep", type=_count, default=3, help="newest versions kept per pair (default 3)")
    gc.add_argument("pair", nargs="?")
    sub.add_parser("leases", help="live leases: which holder serves which version, until when").add_argument(
        "pair", nargs="?")
    args = p.parse_args(argv)
    try:
        store, cfg, no_config = _open(args)
        if args.op == "list":
            _list(store, args.pair)
        elif args.op == "show":
            print(store.show(args.ref).model_dump_json(indent=2))
        elif args.op == "verify":
            result = store.verify(args.ref)
            print(result)
            return 0 if result.ok else 1
        elif args.op == "leases":
            _leases(store, args.pair)
        else:
            _gc(store, cfg, no_config, args)
    except ArtifactStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
