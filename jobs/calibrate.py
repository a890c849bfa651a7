"""Ray Job: calibrate one producer->consumer pair and publish it to the artifact store.

    ray job submit --working-dir . -- python -m jobs.calibrate --pair base:qa
    python -m jobs.calibrate --pair base:qa          # same, on an embedded local Ray

Stages (each checkpointed under calibration.work_dir, so a killed job resubmitted for the same pair
resumes): paired traces from a producer and a consumer TraceActor pinned by num_gpus from the config ->
joint Gram matrices -> layer policy with Patch aligners -> held-out evaluation -> (r_K, r_V) Pareto sweep
-> x_norm layer errors -> report -> publish (manifest written last).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from artifacts_store import ArtifactStore, CalibrationData, Fingerprints, calibration_digest
from cluster.config import load_config
from cluster.runtime import actor_options, connect
from jobs import report
from jobs.plans import block_plan, exact_plan, quality_bound
from scd.data import samples
from scd.evaluation import methods
from scd.evaluation.diagnostics import xnorm_errors
from scd.evaluation.evaluate import Evaluator, profile_droidspeak
from scd.fitting import blocks, exact, points, structure
from scd.fitting.exact import LOSSLESS_KL
from scd.fitting.calibrate import LEVEL_RULE, CalibConfig, Calibration
from scd.fitting.scoring import PlanScorer
from scd.fitting.checkpoints import artifact_digest, load_record, samples_digest, save_record
from scd.online.artifacts import level_tag
from scd.online.models import is_adapter, load_pair
from scd.online.rebuild import encode, rebuild
from scd.online.reuse import LinearCodec
from scd.online.trace import capture

PARETO_GRID = [(4, 8), (8, 8), (8, 16), (16, 16), (8, 24), (16, 24), (24, 32)]
STRUCTURE_NOISE = 1e-3          # the most a shared layer's K, V or residual may differ, run by both models
HELD_OUT_CURVE = "each entry beside droidspeak@entry"   # what a block plan's held-out curve holds (a changed
                                                        # curve publishes again, from the checkpoints)


def log(msg: str) -> None:
    print(f"[calibrate] {msg}", flush=True)


def checkpointed(path: Path, compute, samples_, art_digest: str | None = None):
    """JSON stage checkpoint of a result computed on `samples_` (and, given its digest, of one artifact):
    loaded if present for the same inputs, else computed, written, returned."""
    inputs = {"samples": samples_digest(samples_), **({"artifact": art_digest} if art_digest else {})}
    record = load_record(path, inputs, log)
    if record is not None:
        log(f"stage {path.stem}: resumed from checkpoint")
        return record["value"]
    return save_record(path, {"value": compute()}, inputs)["value"]


def actor_capture(producer_path: str, consumer_path: str, gpus: tuple[float, float], consumer_base: str | None = None):
    """capture_pair backed by two TraceActors; both models run on each batch concurrently."""
    from actors.tracer import TraceActor
    a = TraceActor.options(**actor_options(gpus[0])).remote(producer_path, "a")
    b = TraceActor.options(**actor_options(gpus[1])).remote(consumer_path, "b", consumer_base)
    log(f"trace actors on {ray.get(a.where.remote())} (producer) and {ray.get(b.where.remote())} (consumer)")

    def capture_pair(ids, mask):
        return tuple(ray.get([a.rows.remote(ids, mask), b.rows.remote(ids, mask)]))
    return capture_pair


def pareto(cal: Calibration, val) -> list[dict]:
    """Reuse-only KL and payload ratio over a grid of ranks ((r_K, r_V), or r_X for hidden-state Reuse): the
    rank trade-off behind the chosen point."""
    if cal.cfg.reuse_source == "hidden":
        top = 2 * cal.spec.num_kv_heads * cal.spec.head_dim
        grid = [{"r_x": r} for r in (16, 32, 64, 96, 128, 192, 256) if r < top] + [{"r_x": top}]   # full rank: the floor
    else:
        grid = [{"r_k": k, "r_v": v} for k, v in PARETO_GRID if max(k, v) <= 2 * cal.spec.head_dim]
    scorer = PlanScorer(cal.producer, cal.consumer, val, cal.artifacts_for)
    out = []
    for ranks in grid:
        scorer.art_for = lambda plan, r=ranks: cal.artifacts_for(plan, **r)
        out.append({**ranks, "kl": scorer.kl(cal.base_plan), "payload_ratio": cal.payload_ratio(ranks)})
    return out


def tradeoff(cal: Calibration, art, tok, val, held) -> list[dict]:
    """Held-out rows of what the published code is weighed against: the INT4 and DroidSpeak baselines
    (DroidSpeak's recompute block chosen on the validation samples) and SCD at each lower level of its
    nested codes."""
    ds = methods.DroidSpeak()
    ds.start = profile_droidspeak(ds, cal.producer, cal.consumer, val)
    return Evaluator(cal.producer, cal.consumer, tok).run(held, [methods.Int4KV(), ds, *methods.at_levels(art)],
                                                          desc=f"held-out baselines and levels {cal.pair}")


def entry_curve(cal: Calibration, codes, entries: dict, tried: list[dict], tok, held, chosen: str | None) -> list[dict]:
    """Held-out rows of the block stage's curve: SCD at each plan of `tried` (the validation points the stage
    measured beyond the codes alone, named by scd.fitting.points.point_name: the published codes below an entry,
    the consumer's layers from there through its trained entry, from `entries` (the tensors of
    entry-aligners.safetensors), and the prefix's last tokens where the point has a tail), beside DroidSpeak
    entered at each entry tried (`droidspeak@<e>`: the producer's residual and K, V below), to compare at the
    same consumer compute. The chosen plan (named `chosen`) is the `scd` row already and is not run again."""
    n = cal.spec.num_layers
    of = codes.info.get("blocks", {}).get("prefix_tokens") or held[0].prefix.shape[-1]   # where tails were counted
    plans = {}
    for p in tried:
        e, k = p["entry"], p.get("tail", 0)
        art = codes if e == n else blocks.block_artifact(codes, e, LinearCodec.from_tensors(entries, f"entry.{e}"))
        plans[points.point_name(e, k, n)] = art.with_tail(k, of)
    ms = [methods.SCDMethod(a, name) for name, a in plans.items() if name != chosen] + [
        methods.DroidSpeak.entering(e, n) for e in sorted({p["entry"] for p in tried if p["entry"] < n})]
    return Evaluator(cal.producer, cal.consumer, tok).run(held, ms, desc=f"held-out curve {cal.pair}")


def curve_tried(blocks_info: dict, n: int) -> list[dict]:
    """The validation points a held-out curve measures again: every entry without a tail, and the tails on the
    validation curve's Pareto front (a tail no cheaper plan beats)."""
    pts = blocks_info.get("points", [])
    front = points.pareto(pts)
    return [p for p in pts if (p["entry"] < n and not p.get("tail")) or (p.get("tail") and p in front)]


def quality_gate(by: dict, c) -> dict:
    """The publish decision from the held-out rows: SCD's KL against raw KV reuse (which costs the consumer
    nothing either, at a payload at least SCD's) times calibration.gate_vs_raw_kv unless it is lossless
    (LOSSLESS_KL), and against the absolute calibration.max_kl. Returns the figures, `passed` and the reasons
    it failed."""
    kl, raw = by["scd"]["kl"], by["raw_kv"]["kl"]
    reasons = []
    # a lossless cache passes whatever raw KV scores (an aLoRA's prefix: raw KV is exact too; a compressed
    # plan is then held to max_kl alone, when set)
    if kl > LOSSLESS_KL and c.gate_vs_raw_kv and kl > c.gate_vs_raw_kv * raw and exact.ratio_applies(raw, c.max_kl):
        reasons.append(f"held-out KL {kl:.4f} is worse than {c.gate_vs_raw_kv:g} x raw KV reuse's {raw:.4f} "
                       f"(payload {by['scd']['payload_ratio']:.3f} vs {by['raw_kv']['payload_ratio']:.3f})")
    if c.max_kl is not None and kl > c.max_kl:
        reasons.append(f"held-out KL {kl:.4f} is above calibration.max_kl {c.max_kl:g}")
    return {"passed": not reasons, "reasons": reasons, "kl_scd": kl, "kl_raw_kv": raw,
            "kl_reuse_only": by.get("reuse_only", {}).get("kl"), "payload_ratio": by["scd"]["payload_ratio"],
            "gate_vs_raw_kv": c.gate_vs_raw_kv, "max_kl": c.max_kl}


def error_split(cal: Calibration, art, val) -> dict[str, float]:
    """Where the published plan's error lives: its validation KL as built, and with the consumer's own keys
    (or values) put back at every layer, or its own K and V in one half of the layers."""
    n, mid = cal.spec.num_layers, cal.spec.num_layers // 2
    scorer = PlanScorer(cal.producer, cal.consumer, val, lambda plan: art.with_plan(plan), hidden=art.needs_hidden)
    cases = {"as built": ((), "kv"), "own K at every layer": (range(n), "k"), "own V at every layer": (range(n), "v"),
             f"own K, V at layers 0-{mid - 1}": (range(mid), "kv"), f"own K, V at layers {mid}-{n - 1}": (range(mid, n), "kv")}
    return {name: scorer.kl(art.plan, layers, streams) for name, (layers, streams) in cases.items()}


def xnorm_profile(cal: Calibration, art, samples_) -> dict[str, list[float]]:
    """Mean relative x_norm error per layer on held-out continuations: Reuse-only vs SCD."""
    plans = {"reuse_only": art.with_plan(cal.base_plan), "scd": art}
    sums = {k: None for k in plans}
    for s in samples_:
        ids = s.prefix[None]
        mask = torch.ones_like(ids)
        ptrace = capture(cal.producer, ids, mask, want_hidden=art.needs_hidden)
        o = capture(cal.consumer, ids, mask, want_xnorm=False)
        oracle = list(zip(o.keys, o.values))
        for name, a in plans.items():
            kv, _ = rebuild(cal.consumer, a, encode(a, ptrace, ids))
            errs = torch.tensor(xnorm_errors(cal.consumer, kv, oracle, mask, s.cont[None]))
            sums[name] = errs if sums[name] is None else sums[name] + errs
    return {k: (v / len(samples_)).tolist() for k, v in sums.items()}


def publish_exact(args, cal: Calibration, tok, chosen: dict, found, shared: dict, held, val, store, store_uri: str,
                  c, t0: float, published: Path, klt_codes=None) -> str:
    """Evaluate the chosen exact plan on the held-out samples beside the oracle, the base alone, raw KV and
    DroidSpeak at its best block; gate, report (with the quality-against-compute curve) and publish it."""
    producer, consumer = cal.producer, cal.consumer
    digest = calibration_digest([v.prefix for v in val])           # what the plan was chosen on
    dtype = chosen["chosen"].get("dtype", c.exact_dtype)
    art = exact.artifact(args.pair, cal.spec, chosen["chosen"]["entry"], dtype,
                         {"structure": shared, "exact": chosen, "calibration": {
                             "prefixes": len(val), "rows": 0, "data_digest": digest, "config": c.model_dump()}},
                         whole_prefix=shared["invocation_tokens"] is not None, klt_codes=klt_codes)
    log(f"plan {art.plan}")
    ds = methods.DroidSpeak()

    def evaluate():
        ds.start = profile_droidspeak(ds, producer, consumer, val)
        ms = [methods.Oracle(), methods.BaseAlone(producer), methods.RawKV(), ds, methods.SCDMethod(art)]
        return Evaluator(producer, consumer, tok).run(held, ms, desc=f"held-out {args.pair}")
    entry = chosen["chosen"]["entry"]
    rows = checkpointed(cal.trace_dir / f"exact-{dtype}{c.exact_step:g}-e{entry}-eval.json", evaluate, held)
    by = {r["method"]: r for r in rows}
    log("held-out: " + ", ".join(f"{m} kl={r['kl']:.4f} ratio={r['payload_ratio']:.3f}" for m, r in by.items()))
    gate = quality_gate(by, c) | {"job": cost(t0)}
    if not gate["passed"]:
        store.refuse(args.pair, gate)
        log(f"quality gate: NOT published ({'; '.join(gate['reasons'])})")
        raise SystemExit(3)
    extra = {"plan": f"exact: the producer's K and V below layer {entry}" + (
                         f", entering at layer {entry}: the consumer runs {art.consumer_layers} of "
                         f"{cal.spec.num_layers} layers" if art.blocks else ", no consumer compute") +
                     f"; {dtype} on the wire" + (f" (step {c.exact_step:g})" if dtype == "klt" else ""),
             "quality bound": f"KL <= {c.max_kl_ratio:g} x raw KV, consumer <= {c.max_consumer_prefill_ratio:g} of a "
                              f"prefill; chosen at the least modeled TTFT at {chosen['gbps']:g} Gbps",
             "quality gate": f"passed: KL {gate['kl_scd']:.2e} <= {c.gate_vs_raw_kv:g} x raw KV "
                             f"{gate['kl_raw_kv']:.4f}",
             "shared with the producer": f"{found.describe()} (verified: max |difference| "
                                         f"{shared['verified_max_abs']:.2e})"}
    files = report.build_report(args.pair, None, rows, extra=extra, compute=chosen)
    metrics = {"kl": by["scd"]["kl"], "kl_raw_kv": by["raw_kv"]["kl"],
               "payload_bytes": float(by["scd"]["payload_bytes"]), "payload_ratio": by["scd"]["payload_ratio"],
               "top1": by["scd"]["top1"], "consumer_prefill_ratio": by["scd"]["prefill_ratio"],
               "gate_vs_raw_kv": c.gate_vs_raw_kv, **{f"job_{k}": v for k, v in cost(t0).items()}}
    if by["scd"].get("retained_gain") is not None:
        metrics["retained_gain"] = by["scd"]["retained_gain"]
    if by["scd"]["f1"] is not None:
        metrics.update(f1=by["scd"]["f1"], f1_oracle=by["oracle"]["f1"], f1_raw_kv=by["raw_kv"]["f1"])
    manifest = store.publish(art, Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok),
                             CalibrationData(digest=digest, n_prefixes=len(val), rows=0), metrics,
                             {f"report/{k}": v for k, v in files.items()})
    ref = f"{args.pair}@{manifest.version}"
    save_record(published, {"ref": ref}, {"store": store_uri, "heldout": samples_digest(held)})
    log(f"published {ref} (exact plan, {cost(t0)['wall_s']:.0f} s)")
    return ref


def cost(t0: float) -> dict:
    """Wall time of this job so far and the peak resident memory of its process (trace actors, when used,
    hold their models in their own processes and are not counted)."""
    return {"wall_s": round(time.time() - t0, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: list[str] | None = None) -> str:
    t0 = time.time()
    p = argparse.ArgumentParser(prog="jobs.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", required=True, help="PRODUCER:CONSUMER, names from the config")
    p.add_argument("--config", default="ray_config.yaml")
    p.add_argument("--store", help="artifact store URI (default: the config's artifacts.uri)")
    p.add_argument("--work-dir", help="checkpoint folder (default: the config's calibration.work_dir)")
    p.add_argument("--prefixes", type=int, help="override calibration.prefixes (e.g. a reduced test budget)")
    p.add_argument("--heldout", type=int, help="override calibration.heldout")
    p.add_argument("--no-actors", action="store_true", help="trace in this process instead of two Ray actors")
    args = p.parse_args(argv)

    for flag in ("prefixes", "heldout"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    cfg = load_config(args.config)
    if args.pair.count(":") != 1:
        raise SystemExit(f"--pair must look like PRODUCER:CONSUMER, got {args.pair!r}")
    prod_name, cons_name = args.pair.split(":")
    if prod_name != cfg.producer.name:
        raise SystemExit(f"producer {prod_name!r} is not the config's producer {cfg.producer.name!r}")
    try:
        spec_cfg = cfg.specialist(cons_name)
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    c = cfg.calibration_for(cons_name)
    n_prefixes, n_held = args.prefixes or c.prefixes, args.heldout or c.heldout
    work = args.work_dir or c.work_dir
    store = ArtifactStore(args.store or cfg.artifacts.uri)

    torch.manual_seed(0)
    producer, consumer, tok, spec = load_pair(cfg.producer.path, spec_cfg.path, consumer_base=spec_cfg.base)
    calib, val, held = samples.pair_data(cons_name, tok, n_prefixes, c.val, n_held, c.prefix_tokens,
                                         text_file=c.text_file)
    ccfg = CalibConfig.of(c)
    cal = Calibration(producer, consumer, spec, args.pair, calib, work, ccfg, pad_id=tok.pad_token_id, log=log)
    log(f"pair {args.pair}: {len(calib)} calibration prefixes, {len(val)} validation, {len(held)} held-out; "
        f"checkpoints in {cal.dir}")

    published = cal.dir / "published.json"
    store_uri = args.store or cfg.artifacts.uri
    # published to this store after an evaluation on these held-out samples: nothing left (another store or
    # other held-out samples: evaluate and publish again, from the checkpoints)
    # (and served at the level the level stage chooses now: a changed rule publishes again; a changed quality
    # bound chooses the plan again from the checkpointed curves and publishes what it chooses)
    publish_key = {"store": store_uri, "heldout": samples_digest(held), "level": ccfg.choose_level and LEVEL_RULE,
                   "bound": vars(quality_bound(c)), "curve": HELD_OUT_CURVE,
                   **({"entries": c.entries} if c.entries else {}), **({"tails": c.tails} if c.tails else {})}
    done = load_record(published, publish_key) or {}
    ref = done.get("ref")
    if ref:
        log(f"already published as {ref}; nothing to do")
        return ref

    if args.no_actors:
        capture_pair = None
    else:
        connect(cfg.ray)
        capture_pair = actor_capture(cfg.producer.path, spec_cfg.path, (cfg.producer.num_gpus, spec_cfg.num_gpus),
                                     spec_cfg.base)
    found, shared = structure.measured(producer, consumer, [v.prefix for v in val], tok.pad_token_id,
                                       spec_cfg.path if is_adapter(spec_cfg.path) else None)
    log(f"structure: {found.describe()}; verified on {len(val)} validation prefixes, max |difference| "
        f"{shared['verified_max_abs']:.2e}")
    if c.exact_plans and found.exact_plan and shared["verified_max_abs"] <= STRUCTURE_NOISE:
        codes = exact.klt_codecs(producer, cal.prefixes, spec.num_layers, c.exact_step) \
            if "klt" in exact.wire_forms(c.exact_dtype) else None
        chosen = exact_plan(cal, tok, found, val, c, cfg.link_gbps().get(args.pair), log, codes)
        if chosen is None:
            log("fitting codes instead")
        else:
            return publish_exact(args, cal, tok, chosen, found, shared, held, val, store, store_uri, c, t0, published,
                                 codes)
    tune = samples.tune_samples(cons_name, tok, c.finetune_samples, c.prefix_tokens, c.finetune_tokens,
                                text_file=c.text_file)
    art = codes = cal.run(val, capture_pair, tune)
    art.info["structure"] = shared
    if c.recompute_blocks:
        art = block_plan(cal, art, tok, calib, val, c, cfg.link_gbps().get(args.pair), log, tune)
    log(f"plan {art.plan}")
    # the held-out checkpoints of a plan with a block or a tail, or served at a level below its fitted ranks
    tag = "".join(f"-e{s}" for s, _ in art.blocks) + (f"-t{art.tail_tokens}" if art.tail_tokens else "")
    level = art.info.get("level")
    if level and level["chosen"] != {k: level["tried"][-1][k] for k in level["chosen"]}:
        tag += "-" + level_tag(level["chosen"])

    def evaluate():
        ms = [methods.Oracle(), methods.BaseAlone(producer), methods.RawKV(), methods.reuse_only(art),
              methods.SCDMethod(art)]
        return Evaluator(producer, consumer, tok).run(held, ms, desc=f"held-out {args.pair}")
    digest = artifact_digest(art)                       # a plan refitted under the same tag is evaluated again
    rows = checkpointed(cal.dir / f"eval{tag}.json", evaluate, held, digest)
    by = {r["method"]: r for r in rows}
    log("held-out: " + ", ".join(f"{m} kl={r['kl']:.4f} ratio={r['payload_ratio']:.3f}"
                                 + (f" f1={r['f1']:.3f}" if r["f1"] is not None else "") for m, r in by.items()))
    gate = quality_gate(by, c) | {"job": cost(t0)}
    (cal.dir / "gate.json").write_text(json.dumps(gate, indent=1))
    if not gate["passed"]:
        store.refuse(args.pair, gate)
        log(f"quality gate: NOT published ({'; '.join(gate['reasons'])}); serving falls back with reason "
            f"quality_gate. Figures in {cal.dir / 'gate.json'}")
        raise SystemExit(3)
    log(f"quality gate: passed (KL {gate['kl_scd']:.4f} vs raw KV {gate['kl_raw_kv']:.4f})")
    rows += checkpointed(cal.dir / f"tradeoff{tag}.json", lambda: tradeoff(cal, art, tok, val, held), held, digest)
    n = cal.spec.num_layers
    chosen = points.chosen_name(art.info.get("blocks", {}).get("chosen"), n)
    tried = curve_tried(art.info.get("blocks", {}), n)
    vs_ds = {}
    if tried:                                          # the curve held out, beside DroidSpeak at the same compute
        entries = load_file(str(cal.dir / "entry-aligners.safetensors")) if any(p["entry"] < n for p in tried) else {}
        rows += checkpointed(cal.dir / f"curve{tag}.json",
                             lambda: entry_curve(cal, codes, entries, tried, tok, held, chosen),
                             held, artifact_digest(codes, entries) + "".join(
                                 f"-{p['entry']}+{p['tail']}" for p in tried if p.get("tail")))
        vs_ds = report.against_droidspeak(rows, chosen, n, c.prefix_tokens)
        log("held-out curve, SCD's KL over DroidSpeak's at the same consumer compute: "
            + ", ".join(f"{name} {v:.2f}" for name, v in vs_ds.items()))
    # every level's held-out figures, and whether it passes the same quality gate (a link never gets a level
    # known to be worse than raw KV reuse; the full code passed it to be published)
    by.update((r["method"], r) for r in rows)
    art.info["levels"] = [{**level, "payload_ratio": r["payload_ratio"], "kl": r["kl"],
                           "servable": quality_gate({**by, "scd": r}, c)["passed"]}
                          for level, r in ((lv, by[methods.level_name(art, lv)]) for lv in art.levels)]
    grid = xn = None
    split = {}
    if c.diagnostics:
        grid = checkpointed(cal.dir / "pareto.json", lambda: pareto(cal, val), val)
        xn = checkpointed(cal.dir / f"xnorm{tag}.json", lambda: xnorm_profile(cal, art, held[:8]), held[:8], digest)
        split = checkpointed(cal.dir / f"split{tag}.json", lambda: error_split(cal, art, val), val, digest)

    info = art.info["calibration"]
    ranks = {"r_x": art.r_x} if art.reuse_x else {"r_k": art.r_k, "r_v": art.r_v}
    extra = {"reuse": "hidden-state (x_norm -> K, V of every head)" if art.reuse_x else "per-head K, V", **ranks,
             "r_h": art.r_h, "calibration prefixes": info["prefixes"],
             "trace rows": info["rows"], "data digest": info["data_digest"],
             "quality gate": f"passed: KL {gate['kl_scd']:.4f} <= {c.gate_vs_raw_kv:g} x raw KV {gate['kl_raw_kv']:.4f}"
             + (f" and <= max_kl {c.max_kl:g}" if c.max_kl is not None else ""),
             "where the error lives (validation KL)": "; ".join(f"{k}: {v:.4f}" for k, v in split.items())
             or "not measured (calibration.diagnostics off)",
             "shared with the producer": f"{found.describe()} (verified: max |difference| "
                                         f"{shared['verified_max_abs']:.2e})"}
    if "ranks" in art.info:
        extra["ranks tried"] = "; ".join(
            ", ".join(f"{k} {v}" for k, v in t.items() if k.startswith("r_")) + f": KL {t['kl']:.4f} @ "
            f"{t['payload_ratio']:.3f}" for t in art.info["ranks"]["tried"])
        if "wire_factor" in art.info["ranks"]:
            extra["wire"] = f"sends {art.info['ranks']['wire_factor']:.3f} of the code bytes (zstd), counted in the budget"
    if vs_ds:
        extra["against DroidSpeak at the same compute (held out)"] = "; ".join(
            f"{name}: {v:.2f} x DroidSpeak's KL" for name, v in vs_ds.items())
    if art.blocks:
        s, _ = art.blocks[0]
        extra["plan"] = (f"codes below layer {s}, the consumer's own layers {s}-{cal.spec.num_layers - 1} from the "
                         f"producer's residual through an aligner (a recompute block)")
    if art.tail_tokens:
        extra["plan"] = extra.get("plan", "the codes") + (
            f"; the consumer runs the prefix's last {art.tail_tokens} tokens itself through every layer"
            + (f" (that share of a prefix of {art.tail_of}: {art.tail_tokens / art.tail_of:.3g} of its tokens at "
               f"every length)" if art.tail_of else ""))
    files = report.build_report(args.pair, art.info["policy"], rows, grid, xn, extra, compute=art.info.get("blocks"))
    metrics = {"kl": by["scd"]["kl"], "kl_reuse_only": by["reuse_only"]["kl"], "kl_raw_kv": by["raw_kv"]["kl"],
               "payload_bytes": float(by["scd"]["payload_bytes"]), "payload_ratio": by["scd"]["payload_ratio"],
               "top1": by["scd"]["top1"], "gate_vs_raw_kv": c.gate_vs_raw_kv, **{f"job_{k}": v for k, v in cost(t0).items()}}
    if by["scd"]["f1"] is not None:
        metrics.update(f1=by["scd"]["f1"], f1_oracle=by["oracle"]["f1"], f1_raw_kv=by["raw_kv"]["f1"])
    if by["scd"].get("retained_gain") is not None:            # of the specialist's gain over the base alone
        metrics["retained_gain"] = by["scd"]["retained_gain"]
    manifest = store.publish(
        art, Fingerprints.of(producer=producer, consumer=consumer, tokenizer=tok),
        CalibrationData(digest=calibration_digest(calib), n_prefixes=len(calib), rows=info["rows"]),
        metrics, {f"report/{k}": v for k, v in files.items()})
    ref = f"{args.pair}@{manifest.version}"
    save_record(published, {"ref": ref}, publish_key)
    job = cost(t0)
    log(f"published {ref} to {args.store or cfg.artifacts.uri} ({job['wall_s']:.0f} s, peak memory "
        f"{job['peak_rss_gib']:.2f} GiB in this process)")
    return ref


if __name__ == "__main__":
    main()
    sys.exit(0)
