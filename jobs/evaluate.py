"""`scd eval`: calibrate a pair (or load its artifacts) and compare every method on held-out prefixes.

    scd eval --pair base:qa                      # demo family, prints a Table-2-shaped table
    scd eval --producer P --consumer C --text F  # any local pair of Llama/Mistral/Qwen2 checkpoints
    scd eval --pair base:prose --json            # one JSON object per method
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import torch

from jobs import samples
from scd import codec, methods
from scd.artifacts import PairArtifacts
from scd.calibrate import CalibConfig, Calibration
from scd.evaluate import Evaluator, table
from scd.models import load_pair

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo_models"


def add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", help="PRODUCER:CONSUMER names of models under --models-dir (demo family), or in "
                                  "--config")
    p.add_argument("--config", help="a deployment config (e.g. configs/smollm2.yaml): --pair names its models, and "
                                    "its calibration settings and work_dir are used, so the calibration job's "
                                    "checkpoints are resumed instead of calibrating again")
    p.add_argument("--models-dir", default=str(DEMO_DIR))
    p.add_argument("--producer", help="local model folder (instead of --pair)")
    p.add_argument("--consumer", help="local model folder (instead of --pair)")
    p.add_argument("--text", help="text file for prefixes of a non-demo pair (paragraphs split on blank lines)")
    p.add_argument("--artifact", help="PRODUCER:CONSUMER[@VERSION] from --store: use that published artifact "
                                      "(fingerprints checked against the loaded models) instead of calibrating")
    p.add_argument("--store", default="~/.scd/artifacts", help="artifact store URI for --artifact")
    p.add_argument("--calib", type=int, default=128, help="calibration prefixes")
    p.add_argument("--val", type=int, default=12, help="validation samples for the layer policy")
    p.add_argument("--prefix-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    for f in fields(CalibConfig):
        if f.name == "seed":
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)


def resolve_pair(args) -> tuple[str, str, str, str]:
    """(producer path, consumer path, producer name, consumer name), validated. With --config, also sets
    the calibration flags (--calib, --val, --prefix-tokens, every CalibConfig field, --work-dir) from it."""
    if args.config:
        return _from_config(args)
    if args.pair:
        if args.producer or args.consumer:
            raise SystemExit("give either --pair or --producer/--consumer, not both")
        if args.pair.count(":") != 1:
            raise SystemExit(f"--pair must look like PRODUCER:CONSUMER, got {args.pair!r}")
        a, b = args.pair.split(":")
        root = Path(args.models_dir).expanduser().resolve()
        paths = []
        for name in (a, b):
            path = (root / name).resolve()
            if root not in path.parents or not (path / "config.json").is_file():
                have = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []
                raise SystemExit(f"no model {name!r} under {root} (have: {', '.join(have) or 'none'})")
            paths.append(str(path))
        return paths[0], paths[1], a, b
    if not (args.producer and args.consumer):
        raise SystemExit("give --pair PRODUCER:CONSUMER or both --producer and --consumer")
    return args.producer, args.consumer, Path(args.producer).name, Path(args.consumer).name


def _from_config(args) -> tuple[str, str, str, str]:
    from cluster.config import ConfigError, load_config
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    if not args.pair or args.pair.count(":") != 1:
        raise SystemExit(f"with --config, give --pair PRODUCER:CONSUMER from it ({', '.join(cfg.pairs())})")
    a, b = args.pair.split(":")
    if a != cfg.producer.name or b not in {s.name for s in cfg.specialists}:
        raise SystemExit(f"--pair {args.pair} is not in {args.config} (it has {', '.join(cfg.pairs())})")
    c = cfg.calibration
    args.calib, args.val, args.prefix_tokens, args.work_dir = c.prefixes, c.val, c.prefix_tokens, c.work_dir
    job = CalibConfig.of(c)                               # what the calibration job fits with
    for f in fields(CalibConfig):
        if f.name != "seed":
            setattr(args, f.name, getattr(job, f.name))
    args.consumer_base = cfg.specialist(b).base
    return cfg.producer.path, cfg.specialist(b).path, a, b


def calibrated(args, producer, consumer, spec, tok, pair: str) -> PairArtifacts:
    """Calibrate the pair under --work-dir; a finished (or partly finished) calibration is resumed. With
    --artifact, load that published artifact instead (refused if it was fitted for other models)."""
    if args.artifact:
        from artifacts_store import ArtifactStore, ArtifactStoreError, Fingerprints
        store_uri = args.store if "://" in args.store else str(Path(args.store).expanduser())
        try:
            art, manifest = ArtifactStore(store_uri).load(
                args.artifact, expect=Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok))
        except ArtifactStoreError as e:
            raise SystemExit(f"--artifact {args.artifact}: {e}") from None
        print(f"artifact {args.artifact} -> {manifest.version} (ranks {art.r_k}/{art.r_v}/{art.r_h}, patch layers "
              f"{art.patch_layers})", file=sys.stderr)
        return art
    cfg = CalibConfig(**{f.name: getattr(args, f.name) for f in fields(CalibConfig) if f.name != "seed"},
                      seed=args.seed)
    calib, val, _ = samples.pair_data(pair.split(":")[1], tok, args.calib, args.val, 0, args.prefix_tokens,
                                      text_file=args.text, seed=args.seed)
    tune = samples.tune_samples(pair.split(":")[1], tok, cfg.finetune_samples, args.prefix_tokens,
                                text_file=args.text, seed=args.seed)
    return Calibration(producer, consumer, spec, pair, calib, args.work_dir, cfg, pad_id=tok.pad_token_id,
                       log=lambda line: print(line, file=sys.stderr)).run(val, tune_samples=tune)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="scd eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p)
    p.add_argument("--samples", type=int, default=48, help="held-out evaluation samples")
    p.add_argument("--methods", default=",".join(methods.METHODS))
    p.add_argument("--dtype", choices=codec.DTYPES,
                   help="code precision on the wire (default: the one the artifact was calibrated for)")
    p.add_argument("--droidspeak-layers", type=int, default=2)
    p.add_argument("--work-dir", default="runs/eval", help="traces and the calibrated artifact are kept here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    wanted = args.methods.split(",")
    unknown = [m for m in wanted if m not in methods.METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(methods.METHODS)}")
    torch.manual_seed(args.seed)
    pa, pb, na, nb = resolve_pair(args)
    producer, consumer, tok, spec = load_pair(pa, pb, consumer_base=getattr(args, "consumer_base", None))
    pair = f"{na}:{nb}"
    art = calibrated(args, producer, consumer, spec, tok, pair)
    _, val, held = samples.pair_data(nb, tok, 0, args.val, args.samples, args.prefix_tokens, text_file=args.text,
                                     seed=args.seed)
    ds = methods.DroidSpeak(args.droidspeak_layers)
    ds.start = profile_droidspeak(ds, producer, consumer, val)
    make = {"oracle": methods.Oracle, "raw_kv": methods.RawKV, "int4_kv": methods.Int4KV, "droidspeak": lambda: ds,
            "reuse_only": lambda: methods.reuse_only(art), "scd": lambda: methods.SCDMethod(art, dtype=args.dtype)}
    rows = Evaluator(producer, consumer, tok).run(held, [make[m]() for m in wanted], desc=f"eval {pair}")
    for r in rows:
        r["pair"] = pair
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(table(rows, f"{pair}: {len(held)} held-out prefixes, plan {art.plan}, codes {args.dtype or art.code_dtype}"))
    return rows


def profile_droidspeak(ds: methods.DroidSpeak, producer, consumer, val) -> int:
    """DroidSpeak picks its own recompute block: the start with the lowest KL on validation samples."""
    ev = Evaluator(producer, consumer)
    refs = [ev.reference(v) for v in val]                 # one oracle run per sample, shared by every start
    best = None
    for s in range(1, producer.config.num_hidden_layers - ds.n + 1):
        ds.start = s
        kl = sum(ev.kl(v, ds, ref) for v, ref in zip(val, refs)) / len(val)
        ds.profile[s] = kl
        best = s if best is None or kl < ds.profile[best] else best
    return best


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
