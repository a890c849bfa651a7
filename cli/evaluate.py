"""`scd eval`: calibrate a pair (or load its artifacts) and compare every method on held-out prefixes.

    scd eval --pair base:qa                      # demo family, prints a Table-2-shaped table
    scd eval --producer P --consumer C --text F  # any local pair of Llama/Mistral/Qwen2 checkpoints
    scd eval --pair base:prose --json            # one JSON object per method

A calibrated pair's plan is chosen as the calibration job chooses it (codes, recompute blocks, tails, selective
recompute; --no-recompute-blocks: the codes alone). Exit status 3, with the reason in one line, when no plan
meets the quality bound (--max-kl-ratio, --max-consumer-prefill-ratio) on the validation prefixes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

import torch

from cluster.calibration_settings import CalibrationSettings
from jobs.plans import block_plan, exact_bound, quality_bound, selector_stage
from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.evaluate import Evaluator, profile_droidspeak, table
from scd.fitting import exact, points, structure
from scd.fitting.calibrate import Calibration
from scd.online import codec, selective
from scd.online.artifacts import PairArtifacts
from scd.online.model_files import is_adapter
from scd.online.models import load_pair
from scd.settings import CalibConfig

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo_models"


def add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", help="PRODUCER:CONSUMER names of models under --models-dir (demo family), or in "
                                  "--config")
    p.add_argument("--config", help="a deployment config (e.g. configs/smollm2.yaml): --pair names its models, and "
                                    "its calibration settings and work_dir are used, so the calibration job's "
                                    "checkpoints are resumed instead of calibrating again; a setting's flag given "
                                    "as well overrides the config's value")
    p.add_argument("--models-dir", default=str(DEMO_DIR))
    p.add_argument("--producer", help="local model folder (instead of --pair)")
    p.add_argument("--consumer", help="local model folder, or a PEFT adapter folder (instead of --pair)")
    p.add_argument("--consumer-base", help="the base model folder a --consumer adapter is merged into (default: "
                                           "the local folder its adapter_config.json names, else the producer)")
    p.add_argument("--text", help="text file for prefixes of a non-demo pair (paragraphs split on blank lines)")
    p.add_argument("--artifact", help="PRODUCER:CONSUMER[@VERSION] from --store: use that published artifact "
                                      "(fingerprints checked against the loaded models) instead of calibrating")
    p.add_argument("--store", default="~/.scd/artifacts", help="artifact store URI for --artifact")
    add_settings_flags(p)


# settings of the calibration job that are not flags of an evaluation (it has --samples and its own --work-dir)
# text_file: --text; diagnostics: the job's report only; entries, stops, tails, selective: the plan stages' lists,
# from --config or at their defaults (--selective is the probe's RULE@F rows)
PLAN_LISTS = ("entries", "stops", "tails", "selective")
NOT_FLAGS = {"heldout", "gate_vs_raw_kv", "work_dir", "text_file", "diagnostics", *PLAN_LISTS}
SETTING_FLAGS = set(CalibrationSettings.model_fields) - NOT_FLAGS     # the settings that are flags too


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """One flag per calibration setting (cluster.calibration_settings.CalibrationSettings): the same names
    (dashed), defaults, choices and help as a config's `calibration:` section. --calib is kept as another name
    for --prefixes."""
    for name, f in CalibrationSettings.model_fields.items():
        if name in NOT_FLAGS:
            continue
        flags = [f"--{name.replace('_', '-')}"] + (["--calib"] if name == "prefixes" else [])
        kw = {"default": f.default, "help": f.description}
        if f.annotation is bool or f.annotation == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif get_origin(f.annotation) is Literal:
            kw["choices"] = get_args(f.annotation)
        else:                                   # an optional number (`float | None`): its number type
            kw["type"] = type(f.default) if f.default is not None else next(
                t for t in get_args(f.annotation) if t is not type(None))
        p.add_argument(*flags, dest=name, **kw)


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """p.parse_args(argv), remembering which calibration settings were given on the command line
    (args.given_settings): with --config, those override the config's values and the others take them."""
    args = p.parse_args(argv)
    unset = object()
    probe = p.parse_args(argv, argparse.Namespace(**{n: unset for n in SETTING_FLAGS}))
    args.given_settings = {n for n in SETTING_FLAGS if getattr(probe, n) is not unset}
    return args


def resolve_pair(args) -> tuple[str, str, str, str]:
    """(producer path, consumer path, producer name, consumer name), validated. With --config, also sets
    every calibration flag and --work-dir from its `calibration:` section."""
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
    settings = cfg.calibration_for(b)                                   # what the calibration job fits with
    for name in SETTING_FLAGS - getattr(args, "given_settings", set()):
        setattr(args, name, getattr(settings, name))
    args.plan_lists = {n: getattr(settings, n) for n in PLAN_LISTS}
    args.work_dir = cfg.calibration.work_dir
    args.consumer_base = cfg.specialist(b).base
    args.text = args.text or settings.text_file                         # the text the job calibrates on
    return cfg.producer.path, cfg.specialist(b).path, a, b


def exact_artifact(args, producer, consumer, spec, tok, pair: str, found, val) -> PairArtifacts | None:
    """The exact plan the pair's calibration would publish (scd.fitting.exact, chosen on `val` under the
    settings' bound for a 25 Gbps link), when the consumer shares layers with the producer, --exact-plans is on
    and no --artifact is given; else None."""
    if not (args.exact_plans and found.exact_plan and not args.artifact):
        return None
    codes = klt_codes(args, producer, spec, tok, pair) if "klt" in exact.wire_forms(args.exact_dtype) else None
    chosen = exact.select(producer, consumer, tok, pair, spec, found, val, args.exact_dtype,
                          exact_bound(args), 25.0,
                          lambda line: print(line, file=sys.stderr), klt_codes=codes)["chosen"]
    return None if chosen is None else exact.artifact(pair, spec, chosen["entry"], chosen["dtype"],
                                                      whole_prefix=found.invocation_tokens is not None,
                                                      klt_codes=codes)


def klt_codes(args, producer, spec, tok, pair: str) -> tuple[dict, dict]:
    """The producer's transform codes at --exact-step (scd.fitting.exact.klt_codecs), fitted on the pair's
    calibration prefixes."""
    calib, _, _ = samples.pair_data(pair.split(":")[1], tok, exact.KLT_PREFIXES, 0, 0, args.prefix_tokens,
                                    text_file=args.text, seed=args.seed)
    return exact.klt_codecs(producer, calib, spec.num_layers, args.exact_step)


def plan_settings(args) -> CalibrationSettings:
    """The settings the plan stages read: the flags, and the config's entries, stops, tails and selective shares
    (or their defaults)."""
    return CalibrationSettings(**{n: getattr(args, n) for n in SETTING_FLAGS}, **getattr(args, "plan_lists", {}))


def calibrated(args, producer, consumer, spec, tok, pair: str) -> PairArtifacts:
    """Calibrate the pair under --work-dir, then (--recompute-blocks, the default) choose its plan as the
    calibration job does: the codes alone where they meet the quality bound, else the recompute block, tail or
    selective recompute over them that meets it at the least modeled TTFT (jobs.plans.block_plan); a finished
    (or partly finished) calibration is resumed; its selector of positions to recompute is fitted as the job
    fits it (--selector-samples). With --artifact, load that published artifact instead
    (refused if it was fitted for other models)."""
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
    try:
        cfg = CalibConfig(**{name: getattr(args, name) for name in CalibConfig.model_fields})
    except ValueError as e:
        raise SystemExit(f"calibration settings: {e}") from None
    calib, val, _ = samples.pair_data(pair.split(":")[1], tok, args.prefixes, args.val, 0, args.prefix_tokens,
                                      text_file=args.text, seed=args.seed)
    tune = samples.tune_samples(pair.split(":")[1], tok, cfg.finetune_samples, args.prefix_tokens,
                                cfg.finetune_tokens, text_file=args.text, seed=args.seed)
    log = lambda line: print(line, file=sys.stderr)                   # noqa: E731
    cal = Calibration(producer, consumer, spec, pair, calib, args.work_dir, cfg, pad_id=tok.pad_token_id, log=log)
    art = cal.run(val, tune_samples=tune)
    settings = plan_settings(args)
    art = selector_stage(cal, art, tok, settings, tune, log, args.text)
    if not args.recompute_blocks:
        return art
    return block_plan(cal, art, tok, calib, val, settings, None, log, tune)


def positives(text: str, flag: str, kind: type = int) -> list:
    """A flag's comma-separated positive integers (or numbers, kind=float); a clear exit otherwise."""
    try:
        values = [kind(t) for t in text.split(",")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise SystemExit(f"{flag} takes {what} separated by commas, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise SystemExit(f"{flag} must be positive, got {text!r}")
    return values


def selector_of(m: methods.Method) -> tuple | None:
    """A method's learned selector (weights, layers): its artifact's, where it has one."""
    art = getattr(m, "art", None)
    return (art.selector, art.selector_layers) if art is not None and art.selector is not None else None


def selective_flags(text: str) -> list[tuple[str, float]]:
    """--selective's RULE@F items; a clear exit otherwise."""
    out = []
    for item in text.split(","):
        rule, _, f = item.partition("@")
        try:
            share = float(f)
        except ValueError:
            share = -1.0
        if rule not in selective.RULES or not 0 < share <= 1:
            raise SystemExit(f"--selective: {item!r} is not RULE@F with RULE one of {selective.RULES} and F in (0, 1]")
        out.append((rule, share))
    return out


def counted_compute(m: methods.Method, config, t: int) -> float:
    """The consumer's compute the bound's ceiling counts for method `m` over a prefix of t positions: the share
    of its layers it runs over the prefix, plus a selective repair's counted share (a count, not a timing: the
    same on a busy machine as on a quiet one)."""
    n = config.num_hidden_layers
    if isinstance(m, methods.Selective):
        return counted_compute(m.inner, config, t) + m.counted(config, t)
    if isinstance(m, methods.SCDMethod):                        # its block's layers, and its tail's tokens
        a = m.art
        return points.consumer_ratio(n - a.consumer_layers, a.tail_for(t), n, t, a.tail_rule)
    return (m.n if isinstance(m, methods.DroidSpeak) else 0) / n


def mark_bound(rows: list[dict], ms: list[methods.Method], bound: exact.Bound, config, t: int) -> float | None:
    """Set each row's "meets_bound" (None for the oracle and the base alone, or without a raw_kv row to
    measure against); returns raw KV's KL."""
    compute = {m.name: counted_compute(m, config, t) for m in ms}
    raw = next((r for r in rows if r["method"] == "raw_kv"), None)
    for r in rows:
        r["meets_bound"] = None if raw is None or r["method"] in ("oracle", "base") else bound.meets(
            {"kl": r["kl"], "kls": r.get("kls"), "consumer_ratio": compute[r["method"]],
             "retained_gain": r.get("retained_gain")}, raw["kl"], raw.get("kls"))
    return raw["kl"] if raw is not None else None


def no_plan(art: PairArtifacts | None, pair: str, bound: exact.Bound) -> str | None:
    """The one line `scd eval` exits with when its plan stages found no plan within the quality bound on the
    validation prefixes (as the calibration job would publish the codes alone for its gate to judge); else None."""
    blocks = (art.info.get("blocks") if art is not None else None) or {}
    if not blocks or blocks.get("chosen") is not None:
        return None
    raw = blocks["raw_kv"]["kl"]
    within = [p for p in blocks["points"] if p["consumer_ratio"] <= bound.max_consumer_ratio + 1e-9]
    best = min(within, key=lambda p: p["kl"])
    noise = (f"; the KL by {bound.noise_z:g} standard error{'' if bound.noise_z == 1 else 's'} of the samples"
             if bound.noise_z else "")
    return (f"no plan of {pair} meets the quality bound (KL <= {bound.max_kl_ratio:g} x raw KV's, consumer <= "
            f"{bound.max_consumer_ratio:g} of a prefill{noise}) on {len(blocks['points'])} plans measured: the best, "
            f"{points.name_of(best, blocks['num_layers'])}"
            f", reads {best['kl'] / max(raw, 1e-12):.3f} x raw KV at {best['consumer_ratio']:.2f} of a prefill")


def parser() -> argparse.ArgumentParser:
    """scd eval's arguments."""
    p = argparse.ArgumentParser(prog="scd eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p)
    p.add_argument("--samples", type=int, default=48, help="held-out evaluation samples")
    p.add_argument("--methods", default=",".join(methods.METHODS))
    p.add_argument("--dtype", choices=codec.DTYPES,
                   help="code precision on the wire (default: the one the artifact was calibrated for)")
    p.add_argument("--droidspeak-layers", type=int, default=2)
    p.add_argument("--droidspeak-entries", metavar="E,E,...", help=(
        "also DroidSpeak entered at each layer E: the consumer runs its layers E..L-1 from the producer's residual "
        "over the producer's K and V below (rows droidspeak@E; its curve against the consumer's compute)"))
    p.add_argument("--selective", metavar="RULE@F,...", help=(
        "also each of raw_kv and scd repaired by selective token recompute at a share F of the prefix's positions "
        "chosen by RULE (attention, structural, deviation, suffix: the question's reads, QA pairs; "
        "scd.online.selective): rows raw_kv+RULE@F, scd+RULE@F; learned (the artifact's selector) repairs scd alone"))
    p.add_argument("--work-dir", default="runs/eval", help="traces and the calibrated artifact are kept here")
    p.add_argument("--cost-tokens", type=int, default=0, metavar="N",
                   help="also time each method's consumer compute over the consumer's own prefill on one prefix "
                        "of N tokens, side by side (Table 2 reads 2048; 0: only at the held-out prefixes' length)")
    p.add_argument("--report", metavar="DIR", help=(
        "also write the calibration job's report of the pair there: summary.md (the rows, and each plan kind's "
        "least KL within 0.1, 0.2, 0.35 and 0.5 of a prefill) and its figures (compute.png: every plan measured "
        "against the consumer's compute, the chosen one marked); written when no plan meets the bound too"))
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser()
    args = parse(p, argv)
    if args.cost_tokens < 0:
        p.error("--cost-tokens must be >= 0")
    try:
        report_dir = output_folder("--report", args.report) if args.report else None
    except ValueError as e:
        p.error(str(e))
    entries = positives(args.droidspeak_entries, "--droidspeak-entries") if args.droidspeak_entries else []
    repairs = selective_flags(args.selective) if args.selective else []
    wanted = args.methods.split(",")
    unknown = [m for m in wanted if m not in methods.METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(methods.METHODS)}")
    torch.manual_seed(args.seed)
    pa, pb, na, nb = resolve_pair(args)
    producer, consumer, tok, spec = load_pair(pa, pb, consumer_base=getattr(args, "consumer_base", None))
    pair = f"{na}:{nb}"
    if any(e >= spec.num_layers for e in entries):
        raise SystemExit(f"--droidspeak-entries must be below {pair}'s {spec.num_layers} layers, got "
                         f"{args.droidspeak_entries!r}")
    context = getattr(consumer.config, "max_position_embeddings", None)
    if context and args.cost_tokens > context:       # refused before any fitting or profiling
        raise SystemExit(f"--cost-tokens {args.cost_tokens} is longer than {pair}'s context of {context} tokens")
    _, val, held = samples.pair_data(nb, tok, 0, args.val, args.samples, args.prefix_tokens, text_file=args.text,
                                     seed=args.seed)
    if any(rule == "suffix" for rule, _ in repairs) and held[0].question is None:
        raise SystemExit(f"--selective suffix@F reads the question after each prefix: {pair}'s samples are text "
                         f"windows, with none")
    found, shared = structure.measured(producer, consumer, [v.prefix for v in val], tok.pad_token_id,
                                       pb if is_adapter(pb) else None)
    bound = quality_bound(args)
    art = None
    if "scd" in wanted:
        art = exact_artifact(args, producer, consumer, spec, tok, pair, found, val)
        if art is not None:                      # no codes fitted: nothing for reuse_only to use
            wanted = [m for m in wanted if m != "reuse_only"]
    if art is None and {"reuse_only", "scd"} & set(wanted):
        art = calibrated(args, producer, consumer, spec, tok, pair)
    ds = methods.DroidSpeak(args.droidspeak_layers)
    if "droidspeak" in wanted:                   # its profile runs every start over the validation samples
        ds.start = profile_droidspeak(ds, producer, consumer, val)
    if not found.exact_plan and {"exact", "exact_int8", "exact_kivi4", "exact_klt"} & set(wanted):
        print(f"no exact plan for {pair}: {found.describe()}", file=sys.stderr)
        wanted = [m for m in wanted if not m.startswith("exact")]
    make = {"oracle": methods.Oracle, "base": lambda: methods.BaseAlone(producer), "raw_kv": methods.RawKV,
            "int4_kv": methods.Int4KV, "droidspeak": lambda: ds,
            "reuse_only": lambda: methods.reuse_only(art), "scd": lambda: methods.SCDMethod(art, dtype=args.dtype),
            **{name: lambda d=dtype: methods.exact(pair, spec, found.first_adapted, d,
                                                   found.invocation_tokens is not None,
                                                   klt_codes(args, producer, spec, tok, pair) if d == "klt" else None)
               for name, dtype in (("exact", "bf16"), ("exact_int8", "int8"), ("exact_kivi4", "kivi4"),
                                   ("exact_klt", "klt"))}}
    ms = [make[m]() for m in wanted] + [methods.DroidSpeak.entering(e, spec.num_layers) for e in entries]
    ms += [methods.Selective(m, rule, f, tok, selector=selector_of(m)) for m in ms if m.name in ("raw_kv", "scd")
           for rule, f in repairs if rule != "learned" or selector_of(m)]
    if any(rule == "learned" for rule, _ in repairs) and not any(m.name.startswith("scd+learned") for m in ms):
        raise SystemExit("--selective learned@F repairs the scd row by its artifact's selector: there is no scd row "
                         "(--methods) or its artifact has no selector (--selector-samples > 0 fits one)")
    rows = Evaluator(producer, consumer, tok).run(held, ms, desc=f"eval {pair}", cost_tokens=args.cost_tokens)
    raw = mark_bound(rows, ms, bound, consumer.config, held[0].prefix.shape[-1])
    for r in rows:
        r["pair"], r["structure"] = pair, shared
    if args.json:                       # each sample's KL ("kls", what the bound's noise margin reads) on one line
        print(json.dumps(rows, indent=1).replace("\n   ", " ").replace("\n  ]", " ]"))
    else:
        plan = f", plan {art.plan}, codes {args.dtype or art.code_dtype}" if art is not None else ""
        print(report(rows, f"{pair}: {len(held)} held-out prefixes{plan}", found, len(val), shared, bound, raw))
    if report_dir is not None:
        write_report(report_dir, pair, rows, art)
    if not args.artifact and (line := no_plan(art, pair, bound)):
        print(line, file=sys.stderr)
        raise SystemExit(3)
    return rows


def output_folder(flag: str, given: str) -> Path:
    """The folder a flag names for output files (scd eval --report, scd bench --plot-dir), made if missing.
    ValueError, in one line naming the flag, where it cannot be: a file there, or no permission."""
    d = Path(given).expanduser()
    if d.exists() and not d.is_dir():
        raise ValueError(f"{flag} {given}: exists and is not a folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {given}: cannot make that folder ({e.strerror or e})") from None
    if not os.access(d, os.W_OK):
        raise ValueError(f"{flag} {given}: the folder is not writable")
    return d


def write_report(d: Path, pair: str, rows: list[dict], art: PairArtifacts | None) -> None:
    """The calibration job's report of the pair (jobs.report) in `d`: the rows, the layer policy's figures and
    the plan curve where the pair was calibrated here."""
    from jobs.report import build_report
    info = art.info if art is not None else {}
    files = build_report(pair, info.get("policy"), rows, compute=info.get("blocks"))
    for name, data in files.items():
        (d / name).write_bytes(data)
    print(f"report: {', '.join(sorted(files))} in {d}", file=sys.stderr)


def report(rows: list[dict], title: str, found, n_val: int, shared: dict, bound: exact.Bound, raw: float) -> str:
    """The rows as a table, what the pair shares, and the rows outside the quality bound."""
    lines = [table(rows, title), f"shared with the producer: {found.describe()}; verified on {n_val} validation "
             f"prefixes, max |difference| {shared['verified_max_abs']:.2e}"]
    failing = [r["method"] for r in rows if r["meets_bound"] is False]
    if failing:
        lines.append(f"outside the quality bound (KL <= {bound.max_kl_ratio:g} x raw KV {raw:.4f}, consumer <= "
                     f"{bound.max_consumer_ratio:g} of a prefill): {', '.join(failing)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
